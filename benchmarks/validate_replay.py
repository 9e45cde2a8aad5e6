"""Validate the replay against real runs on this machine (benchmarks/results/replay_validation.md).

(a) N = 2, one thread per rank: every softmax and linear method's measured wall-clock step against
    the replay of the same repeats' traces (their CPU times) on a ping-pong-calibrated link, each
    collective kind on the link fitted from timing it (``calibrate_collectives``: gloo's all-gather
    and reduce-scatter move a chunk 2-4x slower than a message), the CPU that a transfer takes from the
    ranks it runs on measured in the ping-pong (``calibrate_transfer_cpu``: gloo's threads copy the bytes
    over TCP on the cores the ranks compute on), in each of ``--runs`` runs (target: within 10%).
(b) N = 4 and 8 on this machine's cores: the replayed efficiency of every method (replayed
    one-rank step / N / replayed step) in each run; its spread across runs (target: <= 3%). The
    ranks compute one at a time (``seqpar.Trace(exclusive=...)``: each kernel's CPU time is its own
    on a core, not inflated by the other ranks' kernels), all on the same core (``one_core``: unpinned,
    the efficiency moved from one set of rank processes to the next, likely with which of this VM's
    two cores each rank's kernels landed on); every N-rank step is followed by the one-rank step of
    the same method in rank 0's process (``run_case(paired=True)``), so that both
    see the machine at the same speed; the repeats are taken in ``--rounds-b`` rounds over the
    methods (``round_robin``: each method's repeats spread over the run's minutes, not one stretch of
    them; benchmarks/results/b_spread.md); and the efficiency is taken from each segment's least
    disturbed time over the ``--repeats-b`` repeats (``--repeats-b-linear`` for the linear methods,
    whose memory-bound kernels vary more from one minute to the next) (``floor_traces``). The softmax
    methods run at ``--seq-len``; the linear methods are judged at the first of ``--linear-seq-lens-b`` (32768:
    every rank's inputs at N <= 8 are larger than this machine's 32 MB L3 cache, as the one-rank
    step's are; at 16384 and N = 8 a rank's inputs are 21 MB, and how fast its kernels run then
    depends on how much of the L3, shared with other tenants, is free, which the one-rank step does
    not) and shown at the others (the sixth validation, at 8 repeats each, ran 32768 and 16384).
(c) the tracing overhead: traced and untraced steps interleaved (target: <= 5%).

Needs an idle machine (the wall clocks of (a) are meaningless when other jobs share the cores):
it refuses to start while the 1-minute load average is above ``--max-load`` (default 0.5). The rank
processes run with glibc's malloc keeping freed memory (``STEADY_MALLOC``: no page faults per fresh
tensor, as with a GPU's caching allocator).

    python benchmarks/validate_replay.py --runs 3 --out benchmarks/results/replay_validation.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from seqpar import __version__
from seqpar.bench.core import BenchCase
from seqpar.bench.local_cores import STEADY_MALLOC, MachineLock
from seqpar.bench.replay_validate import (
    LATENCY_REPEATS,
    calibrate_machine,
    tracing_overhead,
    validate,
)
from seqpar.comm.pool import LocalRanks
from seqpar.methods import LINEAR_METHODS, METHODS


def _load() -> float:
    return os.getloadavg()[0]


def _wait_idle(max_load: float, wait: float) -> bool:
    """Wait (up to ``wait`` s) until the 1-minute load average is below ``max_load``: this script's own
    ranks just raised it, and other jobs may run."""
    end = time.time() + wait
    while time.time() < end:
        if _load() <= max_load:
            return True
        time.sleep(15)
    return _load() <= max_load


def _groups_b(methods, shape: dict, linear_seq_lens: str) -> list[tuple[list, dict]]:
    """(methods, shape) of (b): the softmax methods at ``shape``; the linear methods at every T of
    ``linear_seq_lens``, the first of which is judged (about the softmax methods' one-rank work)."""
    soft = [m for m in methods if m not in LINEAR_METHODS]
    lin = [m for m in methods if m in LINEAR_METHODS]
    out = [(soft, shape)] if soft else []
    if lin:
        out += [(lin, dict(shape, seq_len=int(t))) for t in linear_seq_lens.split(",")]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--repeats-b", type=int, default=12,
                   help="repeats of (b), each an N-rank step and a one-rank step (its floor is over all of them)")
    p.add_argument("--repeats-b-linear", type=int, default=16,
                   help="repeats of (b) for the linear methods (one length by default, so the run takes as long "
                        "as the two lengths of 8 repeats that the sixth validation ran)")
    p.add_argument("--rounds-b", type=int, default=4,
                   help="(b)'s repeats are taken in this many rounds over the methods (round_robin), so that every "
                        "method's floor is over the same minutes of the run")
    p.add_argument("--warmup-b", type=int, default=3,
                   help="untimed steps before (b)'s repeats (until the allocator's heap stops growing)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world-sizes-b", default="4,8")
    p.add_argument("--linear-seq-lens-b", default="32768",
                   help="the linear methods' T in (b); the target is judged on the first (see the docstring)")
    p.add_argument("--methods", default=",".join(METHODS + LINEAR_METHODS))
    p.add_argument("--max-load", type=float, default=0.5)
    p.add_argument("--wait", type=float, default=1800, help="seconds to wait for an idle machine before runs 2, 3")
    p.add_argument("--out", default="benchmarks/results/replay_validation.json")
    args = p.parse_args(argv)
    for flag, reps in (("--repeats-b", args.repeats_b), ("--repeats-b-linear", args.repeats_b_linear)):
        if args.rounds_b < 1 or reps % args.rounds_b:  # before the calibration and (a), not minutes later
            p.error(f"--rounds-b {args.rounds_b} must be >= 1 and divide {flag} {reps}")
    if _load() > args.max_load:
        print(f"load average {_load():.2f} > --max-load {args.max_load}: the machine is not idle; wait, or pass a "
              f"higher --max-load knowingly", file=sys.stderr)
        return 2
    methods = args.methods.split(",")
    shape = {"seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.heads, "head_dim": args.head_dim}
    result = {"command": " ".join(["python", "benchmarks/validate_replay.py"] + (argv or sys.argv[1:])),
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "platform": platform.platform()},
              "versions": {"python": platform.python_version(), "torch": torch.__version__, "seqpar": __version__},
              "shape": shape, "linear_seq_len_b": int(args.linear_seq_lens_b.split(",")[0]), "malloc": STEADY_MALLOC,
              "runs": []}
    os.environ.update(STEADY_MALLOC)  # read by the rank processes when they start
    lock = MachineLock(os.path.join(tempfile.mkdtemp(prefix="seqpar-validate-"), "compute.lock"))
    with LocalRanks() as ranks:
        m = calibrate_machine(ranks)  # once, on the idle machine: a property of the machine
        result["link"] = {"bandwidth": m.intra_bw, "latency": m.intra_lat, "latency_repeats": LATENCY_REPEATS,
                          "transfer_cpu": m.transfer_cpu}
        result["collectives"] = {k: {"bandwidth": b, "latency": lt} for k, (b, lt) in m.collectives.items()}
        for run in range(args.runs):
            if run and not _wait_idle(args.max_load, args.wait):
                print(f"run {run}: the machine did not become idle within --wait {args.wait} s; running anyway "
                      f"(load {_load():.2f}; recorded)", file=sys.stderr)
            entry = {"run": run, "load_before": _load(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "repeats_b": args.repeats_b, "repeats_b_linear": args.repeats_b_linear,
                     "warmup_b": args.warmup_b, "rounds_b": args.rounds_b, "paired_b": True,
                     "one_core_b": True}
            entry["n2"] = validate(methods, 2, shape, m=m, ranks=ranks, repeats=args.repeats)
            for n in (int(x) for x in args.world_sizes_b.split(",")):
                entry[f"n{n}"] = []
                for group, sh in _groups_b(methods, shape, args.linear_seq_lens_b):
                    reps = args.repeats_b_linear if group[0] in LINEAR_METHODS else args.repeats_b
                    entry[f"n{n}"] += validate(group, n, sh, m=m, ranks=ranks, repeats=reps,
                                               warmup=args.warmup_b, ideal=True, exclusive=lock,
                                               rounds=args.rounds_b)
            entry["overhead"] = tracing_overhead(ranks, BenchCase("zigzag_ring", world_size=2, **shape))
            entry["load_after"] = _load()
            result["runs"].append(entry)
            for row in entry["n2"]:
                print(f"run {run} N=2 {row['method']:13s} measured {row['measured_s'] * 1e3:8.1f} ms  replayed "
                      f"{row['replayed_s'] * 1e3:8.1f} ms  error {row['error']:+.1%}  off-CPU {row['off_cpu']:.1%}",
                      flush=True)
    result["summary"] = summarize(result, [int(x) for x in args.world_sizes_b.split(",")])
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1, default=float)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as fh:
        fh.write(markdown(result, methods, [int(x) for x in args.world_sizes_b.split(",")]))
    print(json.dumps(result["summary"], indent=1, default=float))
    return 0


# The estimators of (b), each a key of validate's rows: the target is judged on the first (see the docstring).
ESTIMATORS = (("efficiency_floor", "floor"), ("efficiency", "median"), ("efficiency_class", "class"),
              ("efficiency_own", "own"))


def _key(row: dict) -> str:
    return f"{row['method']} T={row['seq_len']} N={row['world_size']}"


def summarize(result: dict, sizes) -> dict:
    runs = result["runs"]
    worst = max(abs(r["error"]) for run in runs for r in run["n2"])
    spreads: dict = {name: {} for _, name in ESTIMATORS}
    judged = []  # the softmax methods at --seq-len, the linear methods at the first --linear-seq-lens-b
    for n in sizes:
        for row in runs[0][f"n{n}"]:
            same = [next(r for r in run[f"n{n}"] if _key(r) == _key(row)) for run in runs]
            for key, name in ESTIMATORS:
                effs = [r.get(key, float("nan")) for r in same]
                spreads[name][_key(row)] = (max(effs) - min(effs)) / statistics.mean(effs)
            linear = row["method"] in LINEAR_METHODS
            if row["seq_len"] == (result["linear_seq_len_b"] if linear else result["shape"]["seq_len"]):
                judged.append(_key(row))
    floor = {k: spreads["floor"][k] for k in judged}
    return {"n2_max_abs_error": worst, "n2_within_10pct": worst <= 0.10,
            "n2_max_abs_error_per_run": [max(abs(r["error"]) for r in run["n2"]) for run in runs],
            "efficiency_max_spread": max(floor.values()), "spread_within_3pct": max(floor.values()) <= 0.03,
            "judged": sorted(floor), "spreads": spreads,
            "max_spread": {name: max(v.values()) for name, v in spreads.items()},
            "loads": [(run["load_before"], run["load_after"]) for run in runs],
            "tracing_overhead_wall": [run["overhead"]["overhead_wall"] for run in runs],
            "tracing_overhead_cpu": [run["overhead"]["overhead_cpu"] for run in runs]}


def markdown(result: dict, methods, sizes) -> str:
    """The results page: (a) errors per run, (b) efficiencies per run and spreads, (c) overhead."""
    runs, summ, sh = result["runs"], result["summary"], result["shape"]
    lines = ["# The replay against real runs on this machine", "",
             f"`{result['command']}`; {result['machine']['cpus']} cores, {result['machine']['platform']}, "
             f"torch {result['versions']['torch']}, seqpar {result['versions']['seqpar']}. Shape: T = "
             f"{sh['seq_len']}, {sh['heads']} heads, D = {sh['head_dim']}, fp32, causal, forward+backward, one "
             f"thread per rank; glibc malloc keeps freed memory ("
             + ", ".join(f"`{k}={v}`" for k, v in result.get("malloc", {}).items())
             + f"). Link (ping-pong, once): {result['link']['bandwidth'] / 1e9:.2f} GB/s, "
             f"{result['link']['latency'] * 1e6:.0f} us (the mean of "
             f"{result['link'].get('latency_repeats', LATENCY_REPEATS)} small exchanges), a transfer takes "
             f"{result['link'].get('transfer_cpu', 0.0):.2f} core at each end; collectives (timed once, the link each "
             "runs on): "
             + ", ".join(f"{k} {v['bandwidth'] / 1e9:.2f} GB/s, {v['latency'] * 1e6:.0f} us"
                         for k, v in result.get("collectives", {}).items())
             + ". Loads (1-min average) before/after each run: "
             + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in summ["loads"]) + ".", "",
             "## (a) N = 2: replayed (traced CPU times, ping-pong link, timed collectives, transfer CPU) against "
             "measured wall-clock steps", "",
             "`off-CPU`: the compute segments' wall time beyond their thread CPU time, the most of any rank, over "
             "the measured step (median over the repeats): what a replay of CPU times cannot see.", "",
             "| method | " + " | ".join(f"run {r['run']}: measured ms / replayed ms / error / off-CPU" for r in runs)
             + " |",
             "|---|" + "---|" * len(runs)]
    for meth in methods:
        cells = []
        for run in runs:
            row = next(r for r in run["n2"] if r["method"] == meth)
            off = f"{row['off_cpu']:.1%}" if "off_cpu" in row else "-"
            cells.append(f"{row['measured_s'] * 1e3:.0f} / {row['replayed_s'] * 1e3:.0f} / {row['error']:+.1%} / {off}")
        lines.append(f"| {meth} | " + " | ".join(cells) + " |")
    lines += ["", f"Largest |error|: {summ['n2_max_abs_error']:.1%} (per run: "
              + ", ".join(f"{e:.1%}" for e in summ["n2_max_abs_error_per_run"]) + "; target 10%).", "",
              "## (b) N = 4 and 8 on 2 cores: replayed efficiency per run and its spread", "",
              "The ranks compute one at a time (`Trace(exclusive=...)`)"
              + (", all on one core (`one_core`)" if runs[0].get("one_core_b") else "")
              + f"; per run {runs[0]['repeats_b']} repeats ({runs[0].get('repeats_b_linear', runs[0]['repeats_b'])} "
              "for the linear methods) "
              f"after {runs[0]['warmup_b']} untimed steps, each an N-rank step followed by the one-rank step in "
              f"rank 0's process, taken in {runs[0].get('rounds_b', 1)} round(s) over the methods (`round_robin`). "
              f"The softmax methods at T = {sh['seq_len']}; the linear methods are judged at "
              f"T = {result['linear_seq_len_b']}, where every rank's inputs are larger than the 32 MB L3 cache at "
              "N <= 8, and shown at the other lengths too. "
              "`floor` (the target's estimator): the replayed one-rank step / N / the replayed step, both from each "
              "segment's least disturbed time over the repeats (`floor_traces`); `median`: the same from each "
              "repeat's traces as recorded (median over the repeats); `class`: one median time per kernel class "
              "over all ranks and repeats (`kernel_class_traces`); `own`: the ranks' mean traced busy time over "
              "the replayed step. Spread = (max - min) / mean over the runs.", "",
              "| method | T | N | floor per run | spread | median per run | spread | class per run | spread | "
              "own per run | spread |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        for row in runs[0][f"n{n}"]:
            key = _key(row)
            rows = [next(r for r in run[f"n{n}"] if _key(r) == key) for run in runs]
            cols = []
            for field, name in ESTIMATORS:
                spread = summ["spreads"][name]
                cols.append(" / ".join(f"{r.get(field, float('nan')):.3f}" for r in rows))
                cols.append(f"{spread[key]:.1%}")
            judged = "" if key in summ["judged"] else " (not judged)"
            lines.append(f"| {row['method']}{judged} | {row['seq_len']} | {n} | " + " | ".join(cols) + " |")
    lines += ["", f"Largest `floor` spread of the judged rows: {summ['efficiency_max_spread']:.1%} (target 3%). "
              "Largest spread of all rows: " + ", ".join(f"{name} {summ['max_spread'][name]:.1%}"
                                                         for _, name in ESTIMATORS) + ".", "",
              "## (c) Tracing overhead (zigzag_ring, N = 2, traced and untraced steps interleaved)", "",
              "Wall clock: " + ", ".join(f"{x:+.1%}" for x in summ["tracing_overhead_wall"]) + "; thread CPU time: "
              + ", ".join(f"{x:+.1%}" for x in summ["tracing_overhead_cpu"]) + " (target 5%).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
