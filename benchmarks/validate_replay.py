"""Validate the replay against real runs on this machine (benchmarks/results/replay_validation.md).

(a) N = 2, one thread per rank: every softmax and linear method's measured wall-clock step against
    the replay of the same repeats' traces (their CPU times) on a ping-pong-calibrated link, in
    each of ``--runs`` runs (target: within 10%).
(b) N = 4 and 8 on this machine's cores: the replayed efficiency of every method (replayed
    one-rank step / N / replayed step) in each run; its spread across runs (target: <= 3%).
(c) the tracing overhead: traced and untraced steps interleaved (target: <= 5%).

Needs an idle machine (the wall clocks of (a) are meaningless when other jobs share the cores):
it refuses to start while the 1-minute load average is above ``--max-load`` (default 0.5).

    python benchmarks/validate_replay.py --runs 3 --out benchmarks/results/replay_validation.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from seqpar import __version__
from seqpar.bench.core import BenchCase
from seqpar.bench.replay_validate import calibrate_link, cpu_machine, tracing_overhead, validate
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world-sizes-b", default="4,8")
    p.add_argument("--methods", default=",".join(METHODS + LINEAR_METHODS))
    p.add_argument("--max-load", type=float, default=0.5)
    p.add_argument("--wait", type=float, default=1800, help="seconds to wait for an idle machine before runs 2, 3")
    p.add_argument("--out", default="benchmarks/results/replay_validation.json")
    args = p.parse_args(argv)
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
              "shape": shape, "runs": []}
    with LocalRanks() as ranks:
        bw, lat = calibrate_link(ranks)  # once, on the idle machine: a property of the machine
        m = cpu_machine(bw, lat)
        result["link"] = {"bandwidth": bw, "latency": lat}
        for run in range(args.runs):
            if run and not _wait_idle(args.max_load, args.wait):
                print(f"run {run}: the machine did not become idle within --wait {args.wait} s; running anyway "
                      f"(load {_load():.2f}; recorded)", file=sys.stderr)
            entry = {"run": run, "load_before": _load(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            entry["n2"] = validate(methods, 2, shape, m=m, ranks=ranks, repeats=args.repeats)
            for n in (int(x) for x in args.world_sizes_b.split(",")):
                entry[f"n{n}"] = validate(methods, n, shape, m=m, ranks=ranks, repeats=args.repeats, ideal=True)
            entry["overhead"] = tracing_overhead(ranks, BenchCase("zigzag_ring", world_size=2, **shape))
            entry["load_after"] = _load()
            result["runs"].append(entry)
            for row in entry["n2"]:
                print(f"run {run} N=2 {row['method']:13s} measured {row['measured_s'] * 1e3:8.1f} ms  replayed "
                      f"{row['replayed_s'] * 1e3:8.1f} ms  error {row['error']:+.1%}", flush=True)
    result["summary"] = summarize(result, methods, [int(x) for x in args.world_sizes_b.split(",")])
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1, default=float)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as fh:
        fh.write(markdown(result, methods, [int(x) for x in args.world_sizes_b.split(",")]))
    print(json.dumps(result["summary"], indent=1, default=float))
    return 0


def summarize(result: dict, methods, sizes) -> dict:
    runs = result["runs"]
    worst = max(abs(r["error"]) for run in runs for r in run["n2"])
    spread, spread_one, spread_floor, spread_class = {}, {}, {}, {}
    for n in sizes:
        for meth in methods:
            for key, into in (("efficiency_own", spread), ("efficiency", spread_one),
                              ("efficiency_floor", spread_floor), ("efficiency_class", spread_class)):
                effs = [next(r.get(key, float("nan")) for r in run[f"n{n}"] if r["method"] == meth) for run in runs]
                into[f"{meth} N={n}"] = (max(effs) - min(effs)) / statistics.mean(effs)
    return {"n2_max_abs_error": worst, "n2_within_10pct": worst <= 0.10,
            "n2_max_abs_error_per_run": [max(abs(r["error"]) for r in run["n2"]) for run in runs],
            "efficiency_max_spread": max(spread.values()), "spread_within_3pct": max(spread.values()) <= 0.03,
            "spread": spread, "one_rank_efficiency_max_spread": max(spread_one.values()),
            "spread_against_one_rank": spread_one, "floor_efficiency_max_spread": max(spread_floor.values()),
            "spread_floor": spread_floor, "class_efficiency_max_spread": max(spread_class.values()),
            "spread_class": spread_class, "loads": [(run["load_before"], run["load_after"]) for run in runs],
            "tracing_overhead_wall": [run["overhead"]["overhead_wall"] for run in runs],
            "tracing_overhead_cpu": [run["overhead"]["overhead_cpu"] for run in runs]}


def markdown(result: dict, methods, sizes) -> str:
    """The results page: (a) errors per run, (b) efficiencies per run and spreads, (c) overhead."""
    runs, summ, sh = result["runs"], result["summary"], result["shape"]
    lines = ["# The replay against real runs on this machine", "",
             f"`{result['command']}`; {result['machine']['cpus']} cores, {result['machine']['platform']}, "
             f"torch {result['versions']['torch']}, seqpar {result['versions']['seqpar']}. Shape: T = "
             f"{sh['seq_len']}, {sh['heads']} heads, D = {sh['head_dim']}, fp32, causal, forward+backward, one "
             f"thread per rank. Link (ping-pong, once): {result['link']['bandwidth'] / 1e9:.2f} GB/s, "
             f"{result['link']['latency'] * 1e6:.0f} us. Loads (1-min average) before/after each run: "
             + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in summ["loads"]) + ".", "",
             "## (a) N = 2: replayed (traced CPU times, ping-pong link) against measured wall-clock steps", "",
             "| method | " + " | ".join(f"run {r['run']}: measured ms / replayed ms / error" for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for meth in methods:
        cells = []
        for run in runs:
            row = next(r for r in run["n2"] if r["method"] == meth)
            cells.append(f"{row['measured_s'] * 1e3:.0f} / {row['replayed_s'] * 1e3:.0f} / {row['error']:+.1%}")
        lines.append(f"| {meth} | " + " | ".join(cells) + " |")
    lines += ["", f"Largest |error|: {summ['n2_max_abs_error']:.1%} (per run: "
              + ", ".join(f"{e:.1%}" for e in summ["n2_max_abs_error_per_run"]) + "; target 10%).", "",
              "## (b) N = 4 and 8 on 2 cores: replayed efficiency per run and its spread", "",
              "`efficiency`: the replayed one-rank step / N / the replayed step (each repeat's traces, median); "
              "`floor`: the same from the per-segment minimum over the repeats (`floor_traces`); `class`: the same "
              "with one median time per kernel class over all ranks and repeats (`kernel_class_traces`); `own`: the "
              "ranks' mean traced busy time over the replayed step. Spread = (max - min) / mean over the runs.", "",
              "| method | N | efficiency per run | spread | floor per run | spread | class per run | spread | "
              "own per run | spread |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        for meth in methods:
            rows = [next(r for r in run[f"n{n}"] if r["method"] == meth) for run in runs]
            key = f"{meth} N={n}"
            cols = []
            for field, spread in (("efficiency", summ["spread_against_one_rank"]), ("efficiency_floor",
                                  summ["spread_floor"]), ("efficiency_class", summ["spread_class"]),
                                  ("efficiency_own", summ["spread"])):
                cols.append(" / ".join(f"{r.get(field, float('nan')):.3f}" for r in rows))
                cols.append(f"{spread[key]:.1%}")
            lines.append(f"| {meth} | {n} | " + " | ".join(cols) + " |")
    lines += ["", f"Largest spread: efficiency {summ['one_rank_efficiency_max_spread']:.1%}, floor "
              f"{summ['floor_efficiency_max_spread']:.1%}, class {summ['class_efficiency_max_spread']:.1%}, own "
              f"{summ['efficiency_max_spread']:.1%} (target 3%).", "",
              "## (c) Tracing overhead (zigzag_ring, N = 2, traced and untraced steps interleaved)", "",
              "Wall clock: " + ", ".join(f"{x:+.1%}" for x in summ["tracing_overhead_wall"]) + "; thread CPU time: "
              + ", ".join(f"{x:+.1%}" for x in summ["tracing_overhead_cpu"]) + " (target 5%).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
