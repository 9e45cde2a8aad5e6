"""``seqpar calibrate`` on the command line: argument parsing and the summary tables of a calibration
(the measurements themselves are in :mod:`.calibrate` and :mod:`.measure`)."""

from __future__ import annotations

import os
import sys

from seqpar.schedulers.cluster import ClusterSpec
from seqpar.schedulers.cost import CostModel

from .calibrate import DEFAULT_SEQ_LENS, QUICK_SEQ_LENS, calibrate


def print_calibration(cluster: ClusterSpec, cost: CostModel, title: str = "seqpar calibrate") -> None:
    """Summary tables (rich): per-method compute fit, per-size links, core sharing, overlap, memory."""
    rows = [[n, f"{c.alpha1 * 1e9:.3g}", f"{c.alpha2 * 1e9:.3g}", f"{c.beta1 * 1e3:.3g}",
             f"{c.m_token / 1e3:.3g}", f"{c.m_token_full / 1e3:.3g}"] for n, c in cost.methods]
    links = [[str(g), kind, f"{bw / 1e9:.3g}", f"{lat * 1e6:.4g}"] for g, kind, bw, lat in cluster.measured_links]
    slow = ", ".join(f"{k}: {f:.2f}x" for k, f in cluster.compute_slowdown_by_ranks)
    notes = (f"world {cluster.world_size} ranks, {cluster.ranks_per_node} per node, cores {cluster.cores:g} "
             f"(0 = a device per rank); compute slowdown with k ranks at once: {slow or 'n/a'}; "
             f"overlap factor {cluster.overlap_factor:.2f}; memory per rank {cluster.memory_per_rank / 1e9:.3g} GB; "
             f"shape Hq={cost.n_heads}, d={cost.hidden}, d_kv={cost.kv_hidden}, layers={cost.layers}, "
             f"{cost.bytes_per_element} bytes/element")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title, *("  ".join(r) for r in rows + links), notes, sep="\n")
        return
    console = Console(width=110)
    t = Table(title=f"{title}: compute t(s) = alpha1 s^2 + alpha2 s + beta1 (fwd+bwd, all layers, one rank alone)")
    for c in ("method", "alpha1 ns/tok^2", "alpha2 ns/tok", "beta1 ms", "KB/token (split)", "KB/token (full)"):
        t.add_column(c, justify="left" if c == "method" else "right")
    for r in rows:
        t.add_row(*r)
    console.print(t)
    if links:
        t = Table(title="links: t = latency + bytes / bandwidth, every aligned group of the size at once")
        for c in ("group size", "kind", "GB/s per rank", "latency us"):
            t.add_column(c, justify="right")
        for r in links:
            t.add_row(*r)
        console.print(t)
    scaled = [(n, c.group_scale) for n, c in cost.methods if c.group_scale]
    if scaled:
        sizes = sorted({e[0] for _, t in scaled for e in t})
        t = Table(title="group scale k_attn / k_rest per group size: measured packed steps = k_attn x modelled "
                  "attention part + k_rest x the rest")
        t.add_column("method")
        for g in sizes:
            t.add_column(f"g={g}", justify="right")
        for n, table in scaled:
            k = {d: (ka, kr) for d, ka, kr in table}
            t.add_row(n, *(f"{k[g][0]:.2f} / {k[g][1]:.2f}" if g in k else "-" for g in sizes))
        console.print(t)
    console.print(notes)


def calibrate_main(argv: list[str] | None = None) -> int:
    """Entry point of ``seqpar calibrate``; returns the exit status (2 for bad arguments)."""
    import argparse

    p = argparse.ArgumentParser(prog="seqpar calibrate", description="Measure the scheduler's cost model on this "
                                "machine (compute fit per method, links per group size, core sharing, overlap, "
                                "memory) and save it as JSON for 'seqpar plan --cost-model' / 'seqpar simulate "
                                "--calibration'. Local CPU gloo ranks by default; the launched ranks under torchrun.")
    p.add_argument("--out", default="seqpar_calibration.json", help="JSON file to write")
    p.add_argument("--methods", default=None, help="comma-separated softmax methods (default: all)")
    p.add_argument("--nproc", "-n", type=int, default=4, help="local CPU ranks to spawn (ignored under torchrun)")
    p.add_argument("--seq-lens", default=None, help="lengths of the compute fit, e.g. 1k,2k,4k "
                   f"(default {','.join(map(str, DEFAULT_SEQ_LENS))}; --quick {','.join(map(str, QUICK_SEQ_LENS))})")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=1, help="coefficients are per attention layer times this")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per point (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="short lengths and messages, one method's compute fit "
                   "shared by all (seconds; for tests)")
    p.add_argument("--share-compute", action="store_true", help="time one method's single-rank kernel and share "
                   "its fit (they run the same kernel on one rank)")
    p.add_argument("--no-groups", action="store_true", help="skip the last phase (real packed steps of every "
                   "method and group size, whose measured/modelled ratio scales the model)")
    p.add_argument("--group-tokens", default=None, help="tokens per rank of those steps, e.g. 2k,4k "
                   "(default: the two largest --seq-lens)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        from seqpar.schedulers.data import parse_lengths

        methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
        lens = parse_lengths(args.seq_lens, "--seq-lens") if args.seq_lens else None
        cluster, cost = calibrate(nproc=args.nproc, methods=methods, seq_lens=lens, heads=args.heads,
                                  kv_heads=args.kv_heads, head_dim=args.head_dim, layers=args.layers,
                                  quick=args.quick, repeats=args.repeats, out=args.out,
                                  progress=not args.no_progress, share_compute=args.share_compute,
                                  groups=not args.no_groups,
                                  group_tokens=parse_lengths(args.group_tokens, "--group-tokens") if args.group_tokens else None)
    except ValueError as exc:
        print(f"seqpar calibrate: error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print_calibration(cluster, cost)
        print(f"wrote {args.out}")
    return 0
