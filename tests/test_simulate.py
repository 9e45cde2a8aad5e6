"""seqpar simulate: the replay of the methods' traced schedules on machine models: consistent rows,
physical sanity (one rank is the ideal, more bandwidth never slows a method, forward-only is
cheaper), the published kernel rates, the flags, outputs and bad input; recorded traces replay."""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import replace

import pytest

from seqpar.bench.machine import machine
from seqpar.bench.schedule_trace import Shape, schedule_traces
from seqpar.bench.simulate import simulate, step
from seqpar.bench.simulate_cli import main

H100 = machine("h100-nvlink-ib")
LLAMA = Shape(8192 * 8, heads=32, kv_heads=8, head_dim=128, esize=2)
RING = ("ring", "zigzag_ring", "striped_ring", "token_ring", "lightseq", "allgather_kv")


def test_rows_are_consistent_and_one_rank_is_the_ideal():
    rows = simulate(RING + ("ulysses", "usp"), [1, 8, 64], Shape(65536), H100)
    for r in rows:
        if r["world_size"] == 1:
            assert r["efficiency"] == pytest.approx(1.0) and r["exposed_comm_s"] == 0
        if r["method"] == "ulysses" and r["world_size"] == 64:
            assert "heads=32" in r["error"] and math.isnan(r["step_time_s"])
            continue
        assert not r["error"] and 0 < r["efficiency"] <= 1.2
        assert r["ideal_s"] * r["world_size"] == pytest.approx(rows[0]["ideal_s"], rel=0.05) or r["world_size"] > 1
        assert 0 <= r["exposed_comm_s"] <= r["step_time_s"] and r["compute_s"] <= r["step_time_s"] + 1e-12


def test_contiguous_ring_is_capped_by_its_imbalance_and_zigzag_is_not():
    rows = {r["method"]: r for r in simulate(["ring", "zigzag_ring"], [8], LLAMA, H100)}
    # the last rank computes its diagonal and 7 full blocks: 15 half-blocks where the average is 8
    assert rows["ring"]["efficiency"] == pytest.approx(8 / 15, abs=0.04)
    assert rows["zigzag_ring"]["efficiency"] >= 0.9
    assert rows["zigzag_ring"]["exposed_comm_s"] < 0.02 * rows["zigzag_ring"]["step_time_s"]


def test_more_bandwidth_never_slows_a_method_and_starved_links_expose_communication():
    fast = replace(H100, intra_bw=2 * H100.intra_bw, inter_bw=2 * H100.inter_bw)
    slow = replace(H100, intra_bw=H100.intra_bw / 100, inter_bw=H100.inter_bw / 100)
    s = Shape(65536)
    for meth in RING:
        base, quick, starved = (step(meth, 16, s, m).step_s for m in (H100, fast, slow))
        assert quick <= base * (1 + 1e-9) <= starved
    z = step("zigzag_ring", 16, s, slow)
    assert max(r.exposed_comm_s for r in z.ranks) > 0.5 * z.step_s


def test_forward_only_is_part_of_the_step():
    for meth in ("zigzag_ring", "ulysses", "zeco", "lasp2"):
        s = replace(LLAMA, kv_heads=32) if meth in ("zeco", "lasp2") else LLAMA
        assert step(meth, 8, s, H100, forward_only=True).step_s < step(meth, 8, s, H100).step_s


def test_zeco_beats_lasp2_at_scale_and_sends_one_state():
    s = Shape(1 << 20, heads=16, kv_heads=16, head_dim=128)
    rows = {(r["method"], r["world_size"]): r for r in simulate(["zeco", "lasp2"], [8, 64], s, H100)}
    assert rows["zeco", 64]["step_time_s"] <= rows["lasp2", 64]["step_time_s"]
    assert rows["zeco", 8]["bytes_sent"] == pytest.approx(2 * 16 * 128 * 128 * 4)  # one fp32 state each way


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ValueError, match="--world-sizes: N=3 cannot tile --seq-len 65536 for zigzag_ring"):
        simulate(["zigzag_ring"], [3], Shape(65536), H100)
    assert main(["--profile", "tpu"]) == 2 and "neither a known profile" in capsys.readouterr().err
    bad = tmp_path / "cal.json"
    bad.write_text("{ not json")
    assert main(["--profile", str(bad)]) == 2 and "cal.json" in capsys.readouterr().err
    assert main(["--methods", "warp_ring"]) == 2 and "--methods: unknown warp_ring" in capsys.readouterr().err
    assert main(["--world-sizes", "6", "--seq-len", "1000"]) == 2
    assert main(["--traces", str(tmp_path), "--world-sizes", "2", "--seq-len", "64", "--methods", "ring"]) == 2
    assert "ring_n2_t64_rank0.json is missing" in capsys.readouterr().err


def test_cli_flags_and_outputs(tmp_path, capsys):
    js, png, out = tmp_path / "rows.json", tmp_path / "eff.png", tmp_path / "traces"
    args = ["--profile", "a100-nvlink-ib", "--world-sizes", "2,4", "--seq-len", "8k", "--batch", "1", "--heads", "8",
            "--kv-heads", "2", "--head-dim", "64", "--methods", "zigzag_ring,ulysses", "--causal", "yes",
            "--json", str(js), "--plot", str(png), "--trace", str(out)]
    assert main(args) == 0
    rows = json.loads(js.read_text())["rows"]
    for r in rows:
        assert {"method", "world_size", "seq_len", "batch", "forward_only", "step_time_s", "efficiency",
                "exposed_comm_s"} <= set(r)
    assert png.read_bytes()[:4] == b"\x89PNG"
    perfetto = json.loads((out / "zigzag_ring_n4_t8192.perfetto.json").read_text())
    assert {e["pid"] for e in perfetto["traceEvents"]} == {0, 1, 2, 3}
    assert (out / "zigzag_ring_n4_t8192.png").exists() and (out / "ulysses_n2_t8192_rank1.json").exists()
    assert main(["--world-sizes", "8", "--tokens-per-rank", "1k", "--methods", "zigzag_ring", "--forward-only",
                 "--causal", "no"]) == 0
    assert "T=8192" in capsys.readouterr().out


def test_softmax_and_linear_methods_together(tmp_path):
    """Without --kv-heads, softmax methods take GQA (8 K,V heads) and linear ones kv heads = heads;
    an explicit --kv-heads that linear attention cannot take stays an error."""
    js = tmp_path / "rows.json"
    assert main(["--world-sizes", "8", "--seq-len", "64k", "--methods", "zigzag_ring,zeco", "--json", str(js)]) == 0
    kv = {r["method"]: r["kv_heads"] for r in json.loads(js.read_text())["rows"]}
    assert kv == {"zigzag_ring": 8, "zeco": 32}
    assert main(["--world-sizes", "8", "--methods", "zigzag_ring,zeco", "--kv-heads", "8"]) == 2


def _bench_traces(path: str) -> None:
    from seqpar.bench.core import BenchCase, run_case_on_rank

    run_case_on_rank(BenchCase("zigzag_ring", 64, 2, heads=4, kv_heads=2, head_dim=8, repeats=1, warmup=0), path)


def test_recorded_traces_replay_on_a_profile(tmp_path):
    from seqpar.testing import run_distributed

    run_distributed(_bench_traces, 2, str(tmp_path), timeout=120)
    s = Shape(64, heads=4, kv_heads=2, head_dim=8, esize=4)
    (row,) = simulate(["zigzag_ring"], [2], s, H100, traces_dir=str(tmp_path))
    assert row["source"] == "recorded" and row["step_time_s"] > 0 and not row["error"]
    # same events (the recorded run checked its ranks' agreement: its gather is in the trace), same GPU model
    built = step("zigzag_ring", 2, s, H100, traces=schedule_traces("zigzag_ring", 2, s, agreement=True))
    assert row["step_time_s"] == pytest.approx(built.step_s)
    assert simulate(["zigzag_ring"], [2], s, H100)[0]["step_time_s"] < built.step_s  # projections leave it out


def test_validation_against_runs_on_this_machine_works_end_to_end():
    """The machinery of benchmarks/validate_replay.py at a tiny size (its numbers need an idle machine)."""
    from seqpar.bench.replay_validate import (calibrate_collectives, calibrate_link, calibrate_transfer_cpu,
                                              cpu_machine, tracing_overhead, validate)
    from seqpar.bench.core import BenchCase
    from seqpar.comm.pool import LocalRanks

    shape = {"seq_len": 64, "heads": 2, "kv_heads": 2, "head_dim": 8}
    with LocalRanks() as ranks:
        bw, lat = calibrate_link(ranks, sizes=(1 << 10, 1 << 14, 1 << 18), repeats=2)
        assert bw > 0 and lat >= 0
        colls = calibrate_collectives(ranks, sizes=(1 << 10, 1 << 14, 1 << 18), repeats=2)
        kinds = {"all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast", "reduce"}
        assert set(colls) == kinds and all(b > 0 and lt >= 0 for b, lt in colls.values())
        share = calibrate_transfer_cpu(ranks, sizes=(1 << 16, 1 << 18), repeats=2)
        assert 0.0 <= share < 4.0  # cores per end: the process's threads other than the waiting main one
        m = cpu_machine(bw, lat, collectives=colls, transfer_cpu=share)
        assert m.transfer_cpu == share
        rows = validate(["allgather_kv", "zeco"], 2, shape, m=m, ranks=ranks, repeats=1, warmup=0, ideal=True)
        over = tracing_overhead(ranks, BenchCase("zigzag_ring", world_size=2, **shape), repeats=1)
    for r in rows:
        assert r["measured_s"] > 0 and r["replayed_s"] > 0 and r["efficiency"] > 0
    assert {"overhead_wall", "overhead_cpu"} <= set(over)


def test_every_method_traces_with_its_ranks_computing_one_at_a_time(tmp_path):
    """(b) of benchmarks/validate_replay.py: with the machine lock no method deadlocks (a compute segment
    holds the lock and never waits on a message), no two ranks' segments overlap in time, and the
    traces replay."""
    from seqpar.bench.core import BenchCase
    from seqpar.bench.local_cores import MachineLock
    from seqpar.bench.replay_validate import cpu_machine, floor_traces, run_case, validate
    from seqpar.comm.pool import LocalRanks
    from seqpar.methods import LINEAR_METHODS, METHODS

    shape = {"seq_len": 96, "heads": 4, "kv_heads": 2, "head_dim": 8}
    lock = MachineLock(str(tmp_path / "compute.lock"))
    with LocalRanks() as ranks:
        rows = validate(METHODS + LINEAR_METHODS, 4, shape, m=cpu_machine(1e9, 1e-5), ranks=ranks, repeats=2,
                        warmup=0, ideal=True, exclusive=lock, rounds=2)
        _, traces, one = run_case(ranks, BenchCase("allgather_kv", world_size=4, **shape), 1, 0, lock, paired=True)
    for r in rows:
        assert r["exclusive"] and "error" not in r  # its wall clock says nothing: no error is claimed
        assert r["replayed_s"] > 0 and r["efficiency_floor"] > 0, r["method"]
    # every rank's compute segments, on one wall clock (perf_counter is system-wide): pairwise disjoint
    # (the one-rank run of the repeat included: it follows the N-rank step in rank 0's process)
    spans = sorted(_spans(traces[0] + one[0]))
    assert len(spans) > 4 and all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert one[0][0]["world_size"] == 1 and min(s for s, _ in spans) < one[0][0]["wall_origin_ns"]
    assert floor_traces(traces) is not None
    # every rank's kernels and the one-rank step's ran on the same single core (one_core)
    cpus = {tuple(t["meta"]["cpus"]) for t in traces[0] + one[0]}
    assert len(cpus) == 1 and len(next(iter(cpus))) == 1, cpus


def test_the_repeats_of_b_are_taken_round_robin_over_the_methods(tmp_path):
    """(b)'s ``rounds``: each method's repeats spread over the whole call (method after method, round
    after round), every repeat kept in order with its one-rank step; a round count that does not
    divide the repeats is refused before anything runs."""
    from seqpar.bench.local_cores import MachineLock
    from seqpar.bench.replay_validate import round_robin
    from seqpar.comm.pool import LocalRanks

    shape = {"seq_len": 32, "heads": 2, "kv_heads": 2, "head_dim": 8}
    lock = MachineLock(str(tmp_path / "compute.lock"))
    with LocalRanks() as ranks:
        got = round_robin(ranks, ["ring", "zeco"], 2, shape, repeats=4, warmup=0, exclusive=lock, paired=True,
                          rounds=2)
        with pytest.raises(ValueError, match="rounds: must divide repeats"):
            round_robin(ranks, ["ring"], 2, shape, repeats=3, warmup=0, exclusive=lock, paired=True, rounds=2)
        with pytest.raises(ValueError, match="methods: .* names a method twice"):
            round_robin(ranks, ["ring", "ring"], 2, shape, repeats=2, warmup=0, exclusive=lock, paired=True,
                        rounds=2)
    starts = {m: [tr[0]["wall_origin_ns"] for tr in got[m][1]] for m in got}
    assert all(len(got[m][i]) == 4 for m in got for i in range(3))  # steps, traces, one-rank traces
    assert all(a < b for m in starts for a, b in itertools.pairwise(starts[m]))
    # each one-rank step follows its own N-rank repeat, before the method's next repeat
    for m in got:
        ones = [tr[0]["wall_origin_ns"] for tr in got[m][2]]
        assert all(s < o for s, o in zip(starts[m], ones)), m
        assert all(o < s for o, s in zip(ones, starts[m][1:])), m
    # ring's rounds 1, 2 and zeco's: ring 0-1 < zeco 0-1 < ring 2-3 < zeco 2-3
    order = sorted((t, m, i) for m in starts for i, t in enumerate(starts[m]))
    assert [(m, i) for _, m, i in order] == [("ring", 0), ("ring", 1), ("zeco", 0), ("zeco", 1),
                                             ("ring", 2), ("ring", 3), ("zeco", 2), ("zeco", 3)]


def test_one_core_pins_the_thread_and_restores_it():
    """The ranks of (b) compute on one core; the pool's workers get their affinity back afterwards."""
    import os

    from seqpar.bench.local_cores import one_core

    before = os.sched_getaffinity(0)
    with one_core() as cpu:
        assert os.sched_getaffinity(0) == {cpu} and cpu == min(before)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), one_core():
        raise RuntimeError("a failing case")
    assert os.sched_getaffinity(0) == before



@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning 2 ranks needs 2 CPUs")
def test_own_core_puts_each_rank_of_a_validation_on_a_cpu_of_its_own(tmp_path):
    """(a) of benchmarks/validate_replay.py: rank r computes on the r-th CPU (each repeat's trace
    records its affinity), and gets its affinity back; a pin that cannot be kept raises up front."""
    from seqpar.bench.core import BenchCase
    from seqpar.bench.local_cores import MachineLock, own_core
    from seqpar.bench.replay_validate import cpu_machine, run_case, validate
    from seqpar.comm.pool import LocalRanks

    cpus = sorted(os.sched_getaffinity(0))
    shape = {"seq_len": 64, "heads": 2, "kv_heads": 2, "head_dim": 8}
    with LocalRanks() as ranks:
        _, traces, _ = run_case(ranks, BenchCase("zigzag_ring", world_size=2, **shape), 2, 0, pin=True)
        rows = validate(["lasp2"], 2, shape, m=cpu_machine(1e9, 1e-5), ranks=ranks, repeats=1, warmup=0, pin=True)
        _, free, _ = run_case(ranks, BenchCase("zigzag_ring", world_size=2, **shape), 1, 0)
    for rep in traces:
        assert [t["meta"]["cpus"] for t in rep] == [[cpus[0]], [cpus[1]]]
    assert [t["meta"]["cpus"] for t in free[0]] == [cpus, cpus]  # the same workers, their affinity restored
    assert 0.0 <= rows[0]["off_cpu"] < 1.0 and rows[0]["error"] > -1.0
    with pytest.raises(ValueError, match=f"pin: {len(cpus) + 1} ranks cannot have a CPU each"):
        run_case(None, BenchCase("ring", world_size=len(cpus) + 1, **shape), 1, 0, pin=True)  # before any rank starts
    with pytest.raises(ValueError, match="pin: the ranks of an exclusive run share one core"):
        run_case(None, BenchCase("ring", world_size=2, **shape), 1, 0, MachineLock(str(tmp_path / "l")), pin=True)
    with pytest.raises(ValueError, match=f"pin: {len(cpus) + 1} ranks"), own_core(0, len(cpus) + 1):
        pass
    before = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError), own_core(1, 2) as cpu:
        assert os.sched_getaffinity(0) == {cpu} == {cpus[1]}
        raise RuntimeError("a failing case")
    assert os.sched_getaffinity(0) == before


def test_off_cpu_share_is_the_busiest_ranks_compute_time_off_its_cpu():
    """A compute segment's wall time beyond its thread CPU time, the most of any rank, over the
    measured step; the median over repeats."""
    from seqpar.bench.replay_validate import off_cpu_share

    def rank(*segs):
        return {"events": [{"type": "compute", "wall": w, "cpu": c} for w, c in segs] + [{"type": "wait"}]}

    ms = 1_000_000
    reps = [[rank((10 * ms, 8 * ms), (5 * ms, 5 * ms)), rank((20 * ms, 19 * ms))],  # 2 ms off of 0.1 s
            [rank((10 * ms, 10 * ms)), rank((10 * ms, 4 * ms))],  # 6 ms of 0.1 s
            [rank((10 * ms, 9 * ms)), rank((10 * ms, 10 * ms))]]  # 1 ms of 0.05 s
    assert off_cpu_share(reps, [0.1, 0.1, 0.05]) == pytest.approx(0.02)
    assert off_cpu_share(reps[1:2], [0.1]) == pytest.approx(0.06)

def _spans(traces: list[dict]) -> list[tuple[int, int]]:
    """(start, end) of every compute segment of some ranks' traces, on one wall clock (perf_counter)."""
    return [(t["wall_origin_ns"] + e["w"], t["wall_origin_ns"] + e["w"] + e["wall"])
            for t in traces for e in t["events"] if e["type"] == "compute"]


def _compute_span(traces: list[dict]) -> tuple[int, int]:
    """(first start, last end) of the compute segments of some ranks' traces."""
    spans = _spans(traces)
    return min(a for a, _ in spans), max(b for _, b in spans)


def test_validation_pairs_every_n_rank_step_with_a_one_rank_step():
    """(b): the one-rank reference of each repeat runs right after that repeat's N-rank step, in rank 0's
    process on a group of its own, so that both see the machine at the same speed; and it computes the
    same attention as a one-device run."""
    from seqpar.bench.core import BenchCase
    from seqpar.bench.replay_validate import run_case
    from seqpar.comm.pool import LocalRanks

    shape = {"seq_len": 96, "heads": 2, "kv_heads": 2, "head_dim": 8}
    with LocalRanks() as ranks:
        for meth in ("token_ring", "usp", "zeco"):
            steps, traces, one = run_case(ranks, BenchCase(meth, world_size=3 if meth == "zeco" else 2, **shape),
                                          3, 1, paired=True)
            _, _, single = run_case(ranks, BenchCase(meth, world_size=1, **shape), 1, 0, paired=True)
            assert len(steps) == len(traces) == len(one) == 3 and all(len(o) == 1 for o in one)
            for i, (n_rank, o) in enumerate(zip(traces, one)):
                t = o[0]
                assert t["world_size"] == 1 and t["rank"] == 0 and t["meta"]["world_size"] == 1
                # its compute after this repeat's N-rank step (every rank's), before the next one's
                assert _compute_span(o)[0] > _compute_span(n_rank)[1]
                if i + 1 < len(traces):
                    assert _compute_span(o)[1] < _compute_span(traces[i + 1])[0]
                # the same kernels as a one-device run of the whole sequence
                assert [(e["name"], e.get("shape")) for e in t["events"] if e["type"] == "compute"] == \
                    [(e["name"], e.get("shape")) for e in single[0][0]["events"] if e["type"] == "compute"], meth


def _project_replay(monkeypatch):
    """benchmarks/project_replay.py as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "project_replay.py"
    spec = importlib.util.spec_from_file_location("project_replay", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "project_replay", mod)  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


def test_measured_block_times_replace_the_kernel_model(tmp_path, monkeypatch):
    """benchmarks/project_replay.py --kernel-times: a block in the file takes its measured time (plus
    the modelled epilogue and launch), the others keep the model; a file without rows is a clear error."""
    mod = _project_replay(monkeypatch)
    shape = [1, 8192, 8192, 32, 8, 128]
    rows = [{"event": "block_fwd", "shape": shape, "mask": "causal", "flash": {"median_ms": 7.0}}]
    good = tmp_path / "t.json"
    good.write_text(json.dumps({"rows": rows}))
    km = mod.measured_kernels(str(good), H100.kernels)
    ev = {"name": "block_fwd", "shape": shape, "mask": "causal", "flops": 5.5e11}
    epilogue = H100.kernels.seconds(ev) - 5.5e11 / H100.kernels.rate("fwd", "causal", 8192, 128)
    assert km.seconds(ev) == pytest.approx(7e-3 + epilogue)
    other = {**ev, "mask": "none", "flops": 1.1e12}
    assert km.seconds(other) == H100.kernels.seconds(other)
    slow = simulate(["zigzag_ring"], [8], LLAMA, replace(H100, kernels=km))[0]
    assert slow["step_time_s"] > simulate(["zigzag_ring"], [8], LLAMA, H100)[0]["step_time_s"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"event": "block_fwd"}]}))
    for f in (bad, tmp_path / "missing.json"):
        with pytest.raises(ValueError, match=f.name):
            mod.measured_kernels(str(f), H100.kernels)


def test_ringflash_sensitivity_moves_only_with_its_two_inputs(tmp_path, monkeypatch):
    """project_replay.sensitivity: its point at the profile's own bandwidth and the default slowdown is
    the committed comparison row (ring-flash-attention's epilogue, model and measured kernels); a
    slower send/recv link or a larger overlap slowdown never raises a row's efficiency, and each of
    the two alone lowers zigzag_ring's forward+backward."""
    mod = _project_replay(monkeypatch)
    times = tmp_path / "t.json"  # one measured block: the H800 rows get a "measured" variant
    times.write_text(json.dumps({"rows": [{"event": "block_bwd", "shape": [1, 8192, 4096, 32, 8, 128], "mask": "none",
                                           "flash": {"median_ms": 5.0}}]}))
    rows = mod.sensitivity(str(times))
    base = {(r["profile"], r["kernels"], r["forward_only"], r["method"]): r["replayed_pct"]
            for r in mod.ringflash(str(times)) if r["epilogue"] == "ring-flash-attention"}
    assert {k[1] for k in base} == {"model", "measured"}
    own = {p: machine(p).intra_bw for p, _ in mod.PUBLISHED}
    grid = {(r["profile"], r["kernels"], r["forward_only"], r["method"], r["p2p_bw"], r["overlap_slowdown"]):
            r["replayed_pct"] for r in rows}
    assert len(grid) == len(rows) == len(base) * len(mod.SENSITIVITY_BW) * len(mod.SENSITIVITY_SLOWDOWN)
    for (p, kern, fwd, meth), pct in base.items():
        key = (p, kern, fwd, meth)
        assert grid[(*key, own[p], 0.189)] == pytest.approx(pct)
        bws = sorted({b or own[p] for b in mod.SENSITIVITY_BW}, reverse=True)
        for slow in mod.SENSITIVITY_SLOWDOWN:
            pcts = [grid[(*key, b, slow)] for b in bws]
            assert all(a >= b - 1e-9 for a, b in zip(pcts, pcts[1:])), (key, slow, pcts)
        for b in bws:
            assert grid[(*key, b, 0.40)] <= grid[(*key, b, 0.189)] + 1e-9
        if meth == "zigzag_ring" and not fwd:  # each input alone moves it
            assert grid[(*key, own[p], 0.40)] < pct - 0.5 and grid[(*key, min(bws), 0.189)] < pct - 0.5
