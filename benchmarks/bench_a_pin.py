"""Validation (a) with each rank on a core of its own against unpinned ranks (benchmarks/results/a_pin.md).

Validation (a) (``validate_replay.py``) replays every method's N = 2 steps with their traced thread
CPU times and compares with the measured wall-clock step. Up to the ninth validation the replay fell
short in 29 of 33 rows, by up to 9.6% (lasp2), the linear methods the most. A rank's compute thread
that is runnable but not running loses wall time its CPU time does not count: unpinned, the
scheduler at times wakes a rank that waited for a message on the core where the other rank computes
(``local_cores.own_core``). This script runs (a)'s cases with and without ``own_core``, alternated
pass by pass on the same calibration, and writes the errors and each row's off-CPU share:

    python benchmarks/bench_a_pin.py --passes 3 --out benchmarks/results/a_pin

Needs an idle machine, as (a) does (``--max-load``). Outcome (a_pin.md, 2026-11-25): the mean error
was -2.7% pinned and unpinned, the largest 8.5% and 7.6%, so (a) stays unpinned; docs/tracing.md
says where the rest of the shortfall accrues.
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
from seqpar.bench.local_cores import STEADY_MALLOC
from seqpar.bench.replay_validate import calibrate_machine, validate
from seqpar.comm.pool import LocalRanks
from seqpar.methods import LINEAR_METHODS, METHODS


def collect(args) -> dict:
    shape = {"seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.heads, "head_dim": args.head_dim}
    methods = args.methods.split(",")
    out = {"command": " ".join(["python", "benchmarks/bench_a_pin.py"] + sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "versions": {"python": platform.python_version(), "torch": torch.__version__, "seqpar": __version__},
           "shape": shape, "repeats": args.repeats, "passes": []}
    os.environ.update(STEADY_MALLOC)  # read by the rank processes when they start
    with LocalRanks() as ranks:
        m = calibrate_machine(ranks)
        out["link"] = {"bandwidth": m.intra_bw, "latency": m.intra_lat, "transfer_cpu": m.transfer_cpu}
        for i in range(args.passes):
            for pin in (True, False) if i % 2 == 0 else (False, True):  # alternate which goes first
                load = os.getloadavg()[0]
                rows = validate(methods, 2, shape, m=m, ranks=ranks, repeats=args.repeats, pin=pin)
                out["passes"].append({"pass": i, "pin": pin, "load": load, "time": time.strftime("%H:%M:%S"),
                                      "rows": [{k: r[k] for k in ("method", "measured_s", "replayed_s", "error",
                                                                  "off_cpu")} for r in rows]})
                worst = max(rows, key=lambda r: abs(r["error"]))
                print(f"pass {i} pin={pin}: worst {worst['method']} {worst['error']:+.1%}", flush=True)
    return out


def markdown(res: dict) -> str:
    methods = [r["method"] for r in res["passes"][0]["rows"]]
    lines = ["# Validation (a): ranks pinned to a core each against unpinned", "",
             f"`{res['command']}`; {res['machine']['cpus']} cores, {res['machine']['platform']}, torch "
             f"{res['versions']['torch']}, seqpar {res['versions']['seqpar']}; (a)'s shape "
             f"(T = {res['shape']['seq_len']}, {res['shape']['heads']} heads, D = {res['shape']['head_dim']}, fp32, "
             f"causal, forward+backward, N = 2, {res['repeats']} repeats per pass). One calibration for all "
             f"passes: link {res['link']['bandwidth'] / 1e9:.2f} GB/s, {res['link']['latency'] * 1e6:.0f} us, "
             f"transfer CPU {res['link']['transfer_cpu']:.2f}. Pinned and unpinned passes alternate. Cells: the "
             "replay's error against the measured step / the off-CPU share (the busiest rank's compute wall time "
             "beyond its thread CPU time, over the measured step; medians over the repeats).", "",
             "| method | pinned, per pass | unpinned, per pass | pinned mean error | unpinned mean error |",
             "|---|---|---|---|---|"]
    summary = {}
    for meth in methods:
        cells, means = [], []
        for pin in (True, False):
            rows = [next(r for r in p["rows"] if r["method"] == meth) for p in res["passes"] if p["pin"] == pin]
            cells.append(", ".join(f"{r['error']:+.1%} / {r['off_cpu']:.1%}" for r in rows))
            means.append(statistics.mean(r["error"] for r in rows))
            summary.setdefault(pin, []).extend(r["error"] for r in rows)
        lines.append(f"| {meth} | {cells[0]} | {cells[1]} | {means[0]:+.1%} | {means[1]:+.1%} |")
    lines.append("")
    for pin, name in ((True, "Pinned"), (False, "Unpinned")):
        errs = summary[pin]
        lines.append(f"{name}: largest |error| {max(map(abs, errs)):.1%}, mean {statistics.mean(errs):+.1%}, "
                     f"{sum(e < 0 for e in errs)} of {len(errs)} negative.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=3, help="pairs of passes (pinned and unpinned) over the methods")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS + LINEAR_METHODS))
    p.add_argument("--max-load", type=float, default=0.8)
    p.add_argument("--out", default="benchmarks/results/a_pin")
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error("--passes must be >= 1")
    if os.getloadavg()[0] > args.max_load:
        print(f"load average {os.getloadavg()[0]:.2f} > --max-load {args.max_load}: the machine is not idle",
              file=sys.stderr)
        return 2
    res = collect(args)
    with open(args.out + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    with open(args.out + ".md", "w") as fh:
        fh.write(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
