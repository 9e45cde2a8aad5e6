"""The torchrun paths of the command line: ``seqpar bench``, ``seqpar calibrate`` and ``seqpar train``
launched by ``torch.distributed.run`` (2 CPU ranks, gloo) instead of spawning their own ranks.

These are the paths a GPU cluster uses; here they run on CPU so that they are exercised on every CI
run. Each launch takes ~10 s (two fresh interpreters importing torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed.run")


def _torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "seqpar",
           *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def test_bench_under_torchrun(tmp_path):
    out = tmp_path / "bench.json"
    _torchrun("bench", "--methods", "zigzag_ring,ulysses,zeco", "--seq-lens", "256", "--heads", "4", "--head-dim",
              "16", "--repeats", "1", "--no-progress", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["zigzag_ring", "ulysses", "zeco"]
    for r in rows:
        assert r["error"] == "" and r["world_size"] == 2 and r["step_ms"] > 0
        # fp32 against the single-rank run of the same inputs: merged blockwise softmax, ~1e-7
        assert r["max_error"] < 1e-4 and r["bytes_fwd"] > 0


def test_calibrate_under_torchrun_writes_a_usable_file(tmp_path):
    from seqpar.schedulers import plan_batch
    from seqpar.schedulers.calibration import load_calibration

    out = tmp_path / "cal.json"
    _torchrun("calibrate", "--quick", "--methods", "zigzag_ring,ulysses", "--no-progress", "--out", str(out))
    cluster, cost = load_calibration(out)  # only rank 0 wrote it; it parses and plans
    assert cluster.world_size == 2 and cost.method_names == ("zigzag_ring", "ulysses")
    assert all(len(c.group_scale) == 2 for _, c in cost.methods)  # the groups phase ran on 1 and 2 ranks
    plan = plan_batch([700, 300, 100], cluster, cost, time_limit=1.0)
    assert sorted(i for g in plan.groups for i in g.seqs) == [0, 1, 2]


def test_train_under_torchrun_matches_one_process(tmp_path):
    """Context parallel over 2 torchrun ranks gives the losses of the same run in one process."""
    pytest.importorskip("transformers")
    from seqpar.integrations.train import train

    args = ["--steps", "2", "--seq-len", "128", "--no-progress", "--log-every", "1000"]
    log = tmp_path / "log.jsonl"
    _torchrun("train", *args, "--context-parallel", "2", "--json", str(log))
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    launched = {r["step"]: r["loss"] for r in steps if "step" in r and "loss" in r}
    assert all(r.get("world", 2) == 2 for r in steps if "step" in r)
    one = train(args).losses
    assert set(launched) == set(one) == {1, 2}
    for s in one:  # fp32 rounding of reordered sums only (see test_trainer.LOSS_RTOL)
        assert abs(launched[s] - one[s]) <= 2e-5 * abs(one[s]), (s, launched[s], one[s])
