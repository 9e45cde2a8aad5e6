"""Sliding windows: bytes sent and step time against the window W, on local CPU gloo ranks.

For each method (zigzag_ring, token_ring, ulysses by default) and W = T/16 .. T, one causal
forward+backward of ``[1, T, H, D]`` fp32 over N ranks (1 torch thread each): the step time is the
median over ``--repeats`` (after one warm-up) of the slowest rank; bytes are what each rank sent
(``seqpar.CommStats``, forward and backward, the largest over ranks). ``W = T`` covers every pair,
so it runs exactly as the windowless call. Writes a CSV, a Markdown table and a plot::

    python benchmarks/bench_window.py --seq-len 8192 --nproc 2 --repeats 3 \\
        --out benchmarks/results/window_cpu_n2_t8k
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

import seqpar
from seqpar.comm.pool import LocalRanks

METHODS = ("zigzag_ring", "token_ring", "ulysses")


def _step(method: str, window: int | None, T: int, heads: int, dim: int, repeats: int) -> dict:
    """On every rank: the timed steps of one case; returns this rank's times and bytes."""
    gen = torch.Generator().manual_seed(0)
    glob = [torch.randn(1, T, heads, dim, generator=gen) for _ in range(4)]
    q, k, v, dout = (seqpar.shard(x, method=method) for x in glob)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    times, stats = [], seqpar.CommStats()
    for i in range(repeats + 1):
        stats.reset()
        dist.barrier()
        start = time.perf_counter()
        out = seqpar.attention(q, k, v, method=method, causal=True, window=window, stats=stats)
        out.backward(dout)
        dist.barrier()  # the slowest rank's step
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return {"ms": 1e3 * statistics.median(times), "fwd": stats.total("fwd"), "bwd": stats.total("bwd")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--fractions", default="16,8,4,2,1", help="W = T / f for each f")
    ap.add_argument("--out", default="benchmarks/results/window_cpu")
    args = ap.parse_args()
    T = args.seq_len
    rows = []
    with LocalRanks(threads_per_rank=1) as ranks:
        for method in args.methods.split(","):
            for f in (int(x) for x in args.fractions.split(",")):
                window = T // f
                res = ranks.run(_step, args.nproc, method, window, T, args.heads, args.head_dim, args.repeats,
                                timeout=1800)
                row = {"method": method, "T": T, "W": window, "W/T": 1 / f, "N": args.nproc,
                       "step_ms": max(r["ms"] for r in res), "fwd_bytes": max(r["fwd"] for r in res),
                       "bwd_bytes": max(r["bwd"] for r in res)}
                rows.append(row)
                print(row, flush=True)
    for row in rows:  # against the windowless run (W = T) of the same method
        full = next(r for r in rows if r["method"] == row["method"] and r["W"] == T)
        row["time_ratio"] = row["step_ms"] / full["step_ms"]
        row["bytes_ratio"] = (row["fwd_bytes"] + row["bwd_bytes"]) / max(1, full["fwd_bytes"] + full["bwd_bytes"])
    _write(rows, args)


def _write(rows: list[dict], args) -> None:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
               f"torch {torch.__version__}, seqpar {seqpar.__version__}")
    with open(args.out + ".md", "w") as fh:
        fh.write(f"# Sliding window, CPU gloo, N = {args.nproc}, T = {args.seq_len}, causal\n\n{machine}; B=1, "
                 f"H={args.heads}, D={args.head_dim}, fp32, 1 thread per rank, median of {args.repeats} after 1 "
                 "warm-up, slowest rank. Bytes: sent by one rank in one forward+backward (largest over ranks).\n\n"
                 "| method | W | W/T | step ms | time / windowless | MB sent fwd | MB sent bwd | bytes / windowless |\n"
                 "|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            fh.write(f"| {r['method']} | {r['W']} | 1/{round(1 / r['W/T'])} | {r['step_ms']:.0f} | "
                     f"{r['time_ratio']:.3f} | {r['fwd_bytes'] / 1e6:.2f} | {r['bwd_bytes'] / 1e6:.2f} | "
                     f"{r['bytes_ratio']:.3f} |\n")
    _plot(rows, args.out + ".png")


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["W"])
        ws = [r["W/T"] for r in mine]
        ax_t.plot(ws, [r["step_ms"] for r in mine], marker="o", label=method)
        ax_b.plot(ws, [(r["fwd_bytes"] + r["bwd_bytes"]) / 1e6 for r in mine], marker="o", label=method)
    for ax, label in ((ax_t, "step time (ms, fwd+bwd)"), (ax_b, "MB sent per rank (fwd+bwd)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("window W / T")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"Sliding window, CPU gloo, N = {rows[0]['N']}, T = {rows[0]['T']}, causal")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
