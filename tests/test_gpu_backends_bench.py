"""The GPU backend benchmark's logic on the CPU (``benchmarks/gpu_backends.py``): the blocks it
times, its correctness check against float64, the dispatch table it writes (from a synthetic
measurement JSON and from the committed H100 ``gpu_kernel_times.json``), its command line."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from seqpar.kernels.dispatch_table import DispatchTable, TableKey

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    for folder in (ROOT / "benchmarks", ROOT):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    return importlib.import_module("gpu_backends")


def test_blocks_are_the_schedules_blocks(bench):
    """Ring (full and causal 8K x 8K), zigzag / token_ring (half blocks both ways, causal diagonal),
    striped (causal_strict), and the non-square causal probe."""
    assert bench.blocks(8, 8192, 32, 8, 128) == [
        (4096, 8192, "none"), (8192, 4096, "causal"), (8192, 4096, "none"),
        (8192, 8192, "causal"), (8192, 8192, "causal_strict"), (8192, 8192, "none")]


@pytest.mark.parametrize("backend", ["torch_cpu", "reference"])
def test_correctness_check_passes_exact_backends(bench, backend):
    """The two-step merge check against float64, run on the CPU (bf16, GQA 8/2, D = 64)."""
    result = bench.check_backend(backend, 64, t=48, device="cpu")
    assert result["ok"], result
    assert set(result["errors"]) == {"out", "dq", "dk", "dv", "lse_abs"}


def test_correctness_check_fails_a_wrong_kernel(bench, monkeypatch):
    """A kernel that drops the causal mask of the second step fails the check (it can fail)."""
    from seqpar.kernels import dispatch

    real = dispatch.block_forward

    def unmasked(q, k, v, *, scale, mask="none", backend=None):
        return real(q, k, v, scale=scale, mask="none", backend=backend)

    monkeypatch.setattr(bench, "block_forward", unmasked)
    result = bench.check_backend("torch_cpu", 64, t=48, device="cpu")
    assert not result["ok"] and result["errors"]["out"] > 0.05, result


def test_check_records_refusals(bench):
    assert "error" in bench.check_backend("cudnn", 64, t=16, device="cpu")  # runs on CUDA only


def _synthetic(tmp_path: Path) -> Path:
    """A measurement JSON in this script's format: two 8K blocks, cudnn fastest forward, torch_cuda
    backward; flash4 failed everywhere."""
    rows = []
    for rows_, keys, mask, fwd, bwd in [(8192, 8192, "none", {"cudnn": 1.0, "triton": 2.0}, {"cudnn": 9.0, "torch_cuda": 8.0}),
                                        (4096, 8192, "none", {"cudnn": 0.6, "triton": 1.0}, {"cudnn": 4.0, "torch_cuda": 3.0})]:
        shape = "square" if rows_ == keys else "wide"
        row = {"tokens_per_rank": 8192, "rows": rows_, "keys": keys, "mask": mask, "heads": 32, "kv_heads": 8,
               "head_dim": 128, "dtype": "bf16", "kind": "none", "shape": shape}
        for p, times in (("forward", fwd), ("backward", bwd)):
            backends = {n: {"median_ms": t} for n, t in times.items()}
            backends["flash4"] = {"error": "ValueError: flash-attn-4 is not installed"}
            row[p] = {"chosen": "triton", "flops": 1e12, "backends": backends}
        rows.append(row)
    path = tmp_path / "gpu_backends.json"
    path.write_text(json.dumps({"machine": {"capability": [9, 0]}, "rows": rows}))
    return path


def test_table_from_synthetic_measurements(bench, tmp_path):
    out = tmp_path / "table.json"
    assert bench.main(["--table-from", str(_synthetic(tmp_path)), "--table", str(out)]) == 0
    table = DispatchTable.load(out)
    assert table.command.startswith("python benchmarks/gpu_backends.py --table-from")
    key = TableKey("sm90", "forward", "none", "square", "bf16", 128)
    assert table.order(key) == ("cudnn", "triton")
    assert table.order(TableKey("sm90", "backward", "none", "wide", "bf16", 128)) == ("torch_cuda", "cudnn")
    assert all("flash4" not in order for order in table.orders.values())


@pytest.mark.parametrize("drop", ["machine", "rows[0].head_dim", "rows[1].kind", "rows[0].backward", "dtype"])
def test_table_refuses_a_json_that_lacks_a_case_field(bench, tmp_path, drop):
    """A measurement JSON missing a field of a case is refused (never guessed, e.g. a dtype)."""
    doc = json.loads(_synthetic(tmp_path).read_text())
    if drop == "dtype":  # gpu_kernel_times.py's format keeps the dtype at the top
        doc["rows"][0] = {"event": "block_fwd", "shape": [1, 64, 64, 4, 2, 64], "mask": "none",
                          "forced_triton": {"median_ms": 1.0}}
    elif "." in drop:
        where, field = drop.split(".")
        del doc["rows"][int(where[5])][field]
    else:
        del doc[drop]
    with pytest.raises(ValueError, match=f"has no {drop.split('.')[-1]}"):
        bench.measurements(doc)


def test_run_keeps_what_it_timed(bench, tmp_path, monkeypatch):
    """The JSON is rewritten after every block (a run stopped from outside keeps its rows), a block
    whose set-up fails is listed and the run goes on, the budget skips the rest."""
    import gpu_kernel_times

    seen = []

    def time_block(block, cfg, backends, args, gen):
        if block[2] == "causal":
            raise RuntimeError("CUDA error: an illegal memory access")
        seen.append(json.loads((tmp_path / "gpu_backends.json").read_text())["rows"])
        return {"block": list(block), "forward": {"backends": {}}, "backward": {"backends": {}}}

    monkeypatch.setattr(gpu_kernel_times, "_machine", lambda: {"capability": [9, 0]})
    monkeypatch.setattr(bench, "check_backend", lambda b, d: {"backend": b, "head_dim": d, "ok": True})
    monkeypatch.setattr(bench, "time_block", time_block)
    monkeypatch.setattr(bench, "CONFIGS", ((64, 4, 2, 64),))
    monkeypatch.setattr(bench, "blocks", lambda *a: [(64, 64, "causal"), (64, 64, "none"), (64, 32, "none")])
    args = bench.argparse.Namespace(backends="triton", world_size=2, warmup=1, reps=1, budget_s=1e9)
    doc = bench.run(args, "cmd", tmp_path)
    assert seen == [[], [{"block": [64, 64, "none"], "forward": {"backends": {}}, "backward": {"backends": {}}}]]
    assert doc["complete"] and [f[4:7] for f in doc["failed"]] == [[64, 64, "causal"]] and len(doc["rows"]) == 2
    assert json.loads((tmp_path / "gpu_backends.json").read_text()) == doc
    args.budget_s = -1.0
    assert len(bench.run(args, "cmd", tmp_path)["skipped"]) == 3


def test_committed_table_is_the_committed_measurement(bench, tmp_path):
    """seqpar/kernels/dispatch_table.json is what its stored command gives from the committed JSON."""
    committed = json.loads((ROOT / "seqpar/kernels/dispatch_table.json").read_text())
    source = committed["command"].split("--table-from ")[1].split()[0]
    out = tmp_path / "table.json"
    bench.main(["--table-from", str(ROOT / source), "--table", str(out)])
    assert json.loads(out.read_text())["cases"] == committed["cases"]


def test_command_line(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main([])  # neither --out nor --table-from
    with pytest.raises(SystemExit):
        bench.main(["--table-from", "x.json"])  # no --table
    if not torch.cuda.is_available():
        assert bench.main(["--out", "/nonexistent/never-written"]) == 0
        assert "no CUDA device" in capsys.readouterr().out
