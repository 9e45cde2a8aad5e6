"""Sliding windows: bytes sent and step time against the window W, on local CPU gloo ranks.

For each method (zigzag_ring, token_ring, ulysses by default) and W = T/16 .. T, one causal
forward+backward of ``[1, T, H, D]`` fp32 over N ranks (1 torch thread each): the step time is the
median over ``--repeats`` (after one warm-up) of the slowest rank; bytes are what each rank sent
(``seqpar.CommStats``, forward and backward, the largest over ranks). ``W = T`` covers every pair,
so it runs exactly as the windowless call. Every measured byte count is checked against
docs/methods.md's formula ("Sliding windows": K(a, b) and Q(a, b) rows, counted here with
intervals) and the run stops if one differs. Writes a CSV, a Markdown table and a plot::

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
from seqpar.methods import method as declared

METHODS = ("zigzag_ring", "token_ring", "ulysses")


def _intervals(method: str, T: int, n: int, r: int) -> list[tuple[int, int]]:
    """Global positions ``[lo, hi)`` member r holds in the method's layout: zigzag chunks r and
    2N-1-r (zigzag_ring, token_ring), else one contiguous shard."""
    layout = declared(method).layout
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"{method}: the byte formula here covers zigzag and contiguous layouts, not {layout}")
    if layout == "zigzag":
        h = T // (2 * n)
        return [(r * h, (r + 1) * h), ((2 * n - 1 - r) * h, (2 * n - r) * h)]
    c = T // n
    return [(r * c, (r + 1) * c)]


def _seen_rows(method: str, T: int, n: int, a: int, b: int, window: int, keys: bool) -> int:
    """Causal: K(a, b) (keys of b that a query of a sees, ``keys``) or Q(a, b) (queries of a that
    see a key of b): the union over a's and b's intervals of the rows within W - 1 before (keys) or
    after (queries) the other side's rows."""
    spans = []
    for qlo, qhi in _intervals(method, T, n, a):
        for klo, khi in _intervals(method, T, n, b):
            if keys:  # key x is seen iff some p in [qlo, qhi) has 0 <= p - x < W
                lo, hi = max(klo, qlo - window + 1), min(khi, qhi)
            else:  # query p sees a key iff some x in [klo, khi) has 0 <= p - x < W
                lo, hi = max(qlo, klo), min(qhi, khi + window - 1)
            if lo < hi:
                spans.append((lo, hi))
    total, end = 0, -1
    for lo, hi in sorted(spans):
        lo = max(lo, end)
        if hi > lo:
            total, end = total + hi - lo, hi
    return total


def formula_bytes(method: str, n: int, r: int, T: int, heads: int, dim: int, window: int, full: tuple) -> tuple:
    """(forward, backward) bytes rank r sends by docs/methods.md (B = 1, Hkv = Hq, fp32 everywhere);
    ``full``: the same method's measured windowless bytes (Ulysses sends them whatever W)."""
    if method == "ulysses" or window >= T:
        return full
    kv, q, stat = 2 * heads * dim * 4, heads * dim * 4, heads * 4
    fwd = bwd = 0
    for o in range(n):
        if o == r:
            continue
        if method == "token_ring":  # my queries to o and o's results back; the reverse in backward
            mine, theirs = _seen_rows(method, T, n, r, o, window, False), _seen_rows(method, T, n, o, r, window, False)
            fwd += mine * q + theirs * (q + stat)
            bwd += mine * (2 * q + 2 * stat) + theirs * q
        else:  # my K,V rows o's queries see; the dK,dV I computed for o's rows go back
            sent, back = _seen_rows(method, T, n, o, r, window, True), _seen_rows(method, T, n, r, o, window, True)
            fwd += sent * kv
            bwd += sent * kv + back * kv
    return fwd, bwd


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
    return {"ms": 1e3 * statistics.median(times), "fwd": stats.total("fwd"), "bwd": stats.total("bwd"),
            "rank": dist.get_rank()}


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
            per_rank_full = None
            for f in sorted((int(x) for x in args.fractions.split(",")), key=lambda f: f != 1):  # W = T first
                window = T // f
                res = ranks.run(_step, args.nproc, method, window, T, args.heads, args.head_dim, args.repeats,
                                timeout=1800)
                if window == T:
                    per_rank_full = {r["rank"]: (r["fwd"], r["bwd"]) for r in res}
                for r in res:
                    want = formula_bytes(method, args.nproc, r["rank"], T, args.heads, args.head_dim, window,
                                         per_rank_full[r["rank"]])
                    if (r["fwd"], r["bwd"]) != want:
                        raise SystemExit(f"{method} W={window} rank {r['rank']}: sent {(r['fwd'], r['bwd'])} bytes, "
                                         f"the formula says {want}")
                row = {"method": method, "T": T, "W": window, "W/T": 1 / f, "N": args.nproc,
                       "step_ms": max(r["ms"] for r in res), "fwd_bytes": max(r["fwd"] for r in res),
                       "bwd_bytes": max(r["bwd"] for r in res), "formula": "equal"}
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
                 "warm-up, slowest rank. Bytes: sent by one rank in one forward+backward (largest over ranks); every "
                 "rank's bytes equal docs/methods.md's formula (checked by the script).\n\n"
                 "| method | W | W/T | step ms | time / windowless | MB sent fwd | MB sent bwd | bytes / windowless |\n"
                 "|---|---|---|---|---|---|---|---|\n")
        fh.writelines(f"| {r['method']} | {r['W']} | 1/{round(1 / r['W/T'])} | {r['step_ms']:.0f} | "
                     f"{r['time_ratio']:.3f} | {r['fwd_bytes'] / 1e6:.2f} | {r['bwd_bytes'] / 1e6:.2f} | "
                     f"{r['bytes_ratio']:.3f} |\n" for r in rows)
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
