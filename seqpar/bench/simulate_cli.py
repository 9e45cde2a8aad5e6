"""Command line of ``seqpar simulate`` (:mod:`.simulate`): flags, the table, JSON / CSV / plot, and
``--trace DIR``: every (method, N)'s Perfetto trace JSON and PNG timeline (and, up to 16 ranks,
the per-rank traces it replayed)."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace

from seqpar.methods import ALL_METHODS, LINEAR_METHODS, METHODS
from seqpar.schedulers.data import parse_lengths

from .machine import KERNELS, PROFILES, machine
from .report import write_rows
from .schedule_trace import Shape, schedule_traces
from .simulate import DEFAULT_WORLD_SIZES, simulate, ulysses_degree

_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqpar simulate", description="Trace the real schedules of every method "
                                "at the requested shape and replay them on a machine model: step time, efficiency "
                                "against the ideal and exposed communication per method and N.")
    p.add_argument("--profile", default="h100-nvlink-ib", help=f"{', '.join(PROFILES)}, or a 'seqpar calibrate' / "
                   "machine JSON file (default h100-nvlink-ib)")
    p.add_argument("--kernels", choices=sorted(KERNELS), help="override the profile's GPU kernel model")
    p.add_argument("--world-sizes", default=None, help="comma-separated N (default 8,16,...,256; 512 and 1024 "
                   "take minutes each: a million events)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--seq-len", default=None, help="global tokens, e.g. 128k (default 128k)")
    group.add_argument("--tokens-per-rank", default=None, help="instead of --seq-len: T/N tokens on every rank")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32, Llama-3-8B)")
    p.add_argument("--kv-heads", type=int, default=None, help="K,V heads (default 8; linear methods: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="of activations on the wire")
    p.add_argument("--grad-comm", choices=("fp32", "input"), default="fp32", help="dK,dV/dq on the wire "
                   "(seqpar's default fp32)")
    p.add_argument("--methods", default="softmax", help=f"names, or softmax | linear | all (from "
                   f"{', '.join(ALL_METHODS)})")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--traces", metavar="DIR", help="replay the traces 'seqpar bench --trace DIR' recorded instead of "
                   "building them from the schedules")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--csv", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="efficiency against N, one line per method")
    p.add_argument("--trace", metavar="DIR", help="write each replay's Perfetto JSON and PNG timeline into DIR")
    return p


def _methods(text: str) -> list[str]:
    groups = {"softmax": list(METHODS), "linear": list(LINEAR_METHODS), "all": list(ALL_METHODS)}
    names = groups.get(text) or [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in ALL_METHODS]
    if bad or not names:
        raise ValueError(f"--methods: unknown {', '.join(bad) or repr(text)}; choose from {', '.join(ALL_METHODS)} "
                         f"or softmax | linear | all")
    return names


def _shape(args, methods) -> tuple[Shape, list[int]]:
    sizes = parse_lengths(args.world_sizes, "--world-sizes") if args.world_sizes else list(DEFAULT_WORLD_SIZES)
    linear = all(m in LINEAR_METHODS for m in methods)
    kv = args.kv_heads if args.kv_heads is not None else (args.heads if linear else 8)  # 0 is an error, not "default"
    for name, v in (("--batch", args.batch), ("--heads", args.heads), ("--kv-heads", kv),
                    ("--head-dim", args.head_dim)):
        if v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v}")
    if args.heads % kv:
        raise ValueError(f"--kv-heads={kv} must divide --heads={args.heads}")
    if args.tokens_per_rank:
        per = _one_length(args.tokens_per_rank, "--tokens-per-rank")
        if len(sizes) != 1:
            raise ValueError("--tokens-per-rank: give one --world-sizes value (or use --seq-len)")
        seq = per * sizes[0]
    else:
        seq = _one_length(args.seq_len or "128k", "--seq-len")
    e = _DTYPES[args.dtype]
    return Shape(seq, args.batch, args.heads, kv, args.head_dim, args.causal == "yes", e, 4,
                 4 if args.grad_comm == "fp32" else e), sizes


def _one_length(text: str, flag: str) -> int:
    lengths = parse_lengths(text, flag)
    if len(lengths) != 1:
        raise ValueError(f"{flag}: one length, got {text!r} ({len(lengths)} lengths)")
    return lengths[0]


def print_table(rows: list[dict], title: str) -> None:
    """Methods x N: step time, efficiency (bench definition), exposed communication."""
    from rich.console import Console
    from rich.table import Table

    sizes = sorted({r["world_size"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["world_size"]): r for r in rows}
    table = Table(title=title, show_lines=True)
    table.add_column("method", no_wrap=True)
    for n in sizes:
        table.add_column(f"N={n}", justify="right", no_wrap=True)

    def text(r):
        if r["error"]:
            return "n/a"
        t = r["step_time_s"]
        return f"{t * 1e3:.3g} ms\n{r['efficiency']:.3f}\n{r['exposed_comm_s'] * 1e3:.2g} ms exp."

    for m in methods:
        table.add_row(m, *(text(cell[m, n]) for n in sizes))
    Console(width=max(100, 16 + 13 * len(sizes))).print(table)
    print("cell: step time / efficiency = (one rank's time / N) / step / communication time not hidden (last rank)")


def plot_efficiency(rows: list[dict], path: str, title: str, key: str = "efficiency") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["world_size"], r[key]) for r in rows if r["method"] == m and not r["error"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("efficiency vs ideal")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _exporter(directory: str, s: Shape, m, forward_only: bool):
    from pathlib import Path

    from .trace_export import write_chrome_trace, write_timeline_png

    Path(directory).mkdir(parents=True, exist_ok=True)

    def on_result(method, n, res):
        stem = Path(directory) / f"{method}_n{n}_t{s.seq_len}"
        title = f"{method}, N={n}, T={s.seq_len}, {m.name}"
        write_chrome_trace(res, f"{stem}.perfetto.json", title=title)
        write_timeline_png(res, f"{stem}.png", title=title)
        if n <= 16:
            u = ulysses_degree(n, s.heads, m.ranks_per_node) if method == "usp" else None
            for t in schedule_traces(method, n, s, forward_only=forward_only, ulysses_degree=u):
                t.save(f"{stem}_rank{t.rank}.json")
    return on_result


def _shapes(args, methods, s: Shape) -> list[tuple[list[str], Shape]]:
    """The methods with the shape each runs: softmax ones with ``s``; linear ones, when mixed with
    softmax ones and no --kv-heads was given, with kv heads = heads (linear attention has no GQA)."""
    linear = [m for m in methods if m in LINEAR_METHODS]
    if not linear or len(linear) == len(methods) or args.kv_heads is not None:
        return [(methods, s)]
    return [([m for m in methods if m not in LINEAR_METHODS], s), (linear, replace(s, kv_heads=s.heads))]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``seqpar simulate``; returns the exit status (2 for bad arguments)."""
    args = _parser().parse_args(argv)
    try:
        methods = _methods(args.methods)
        s, sizes = _shape(args, methods)
        m = machine(args.profile, kernels=args.kernels)
        rows = []
        for group, shape in _shapes(args, methods, s):  # linear methods keep kv heads = heads by default
            rows += simulate(group, sizes, shape, m, forward_only=args.forward_only, traces_dir=args.traces,
                             on_result=_exporter(args.trace, shape, m, args.forward_only) if args.trace else None,
                             progress=lambda meth, n, sec: print(f"  replayed {meth} on {n} ranks in {sec:.1f} s",
                                                                 file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"seqpar simulate: error: {exc}", file=sys.stderr)
        return 2
    title = (f"seqpar simulate: T={s.seq_len}, B={s.batch}, Hq={s.heads}, Hkv={s.kv_heads}, D={s.head_dim}, "
             f"{'causal' if s.causal else 'full'}, {'forward' if args.forward_only else 'forward+backward'}; "
             f"{m.name} ({m.description})")
    print_table(rows, title)
    meta = {"command": " ".join(["seqpar", "simulate"] + list(sys.argv[2:] if argv is None else argv)),
            "machine": m.to_dict(), "shape": s.__dict__}
    for path, fmt in ((args.json, "json"), (args.csv, "csv")):
        if path:
            write_rows([{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                        for r in rows], path, meta, fmt)
            print(f"wrote {path}")
    if args.plot:
        plot_efficiency(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return 0


__all__ = ["main", "plot_efficiency", "print_table"]
