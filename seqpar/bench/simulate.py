"""``seqpar simulate``: project step time and efficiency of every method to 8..1024 GPUs.

For one sequence of ``seq_len`` tokens spread over N ranks (one SP group of N), every method's
step time (forward + backward, all layers) comes from :class:`~.cost.CostModel` on a
:class:`~.cluster.ClusterSpec`:

    step = compute + exposed communication
    compute = slowdown·(β1 + α2·T/N) + α1·max(imbalance, slowdown)·T²/N
    exposed = non-overlapped comm + max(0, overlapped comm − α1·max(imbalance, slowdown)·T²/N)

(``slowdown`` = 1 on GPUs; on shared CPU cores see :func:`~.cost.attention_factor`.)

with the overlap of docs/methods.md: the ring family, TokenRing and LightSeq send their next block
while computing the current one (overlapped, times ``cluster.overlap_factor``); Ulysses' all-to-alls
and all-gather KV's collectives are not overlapped; USP's Ulysses axis is not, its ring axis is.
``efficiency = step(N=1) / (N·step(N))`` (the ideal is perfect division of the single-rank work);
a row is *comm-bound* when its communication time is at least its compute time (more bandwidth
would then pay off more than more FLOPs).

Coefficients: the H100-class FLOP-count defaults of :meth:`CostModel.default` at the given model
shape with a named bandwidth profile (:data:`~.cluster.PROFILES`), or a ``seqpar calibrate`` file
(``--calibration``) whose measured links, core sharing and overlap then describe the machine.
``--validate`` (:mod:`.sim_validate`) checks the model against real runs on local CPU ranks.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Sequence

from seqpar.schedulers.calibration import load_calibration, rescale_cost_model
from seqpar.schedulers.cluster import (
    PROFILES,
    ClusterSpec,
    get_profile,
    is_power_of_two,
)
from seqpar.schedulers.cost import (
    KNOWN_METHODS,
    SOFTMAX_METHODS,
    CostModel,
    attention_factor,
)
from seqpar.schedulers.data import parse_lengths

from .report import write_rows

DEFAULT_WORLD_SIZES = tuple(1 << k for k in range(3, 11))  # 8 .. 1024


def simulate(seq_len: int, cluster: ClusterSpec, cost: CostModel, *,
             world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES, methods: Sequence[str] | None = None) -> list[dict]:
    """One row per (method, N): modelled step of one ``seq_len``-token sequence on an SP group of N.

    ``cluster`` describes the machine (its ``world_size`` is replaced by each N). Row keys: method,
    world_size, seq_len, step_ms, ideal_ms, efficiency, compute_ms, comm_ms (all communication,
    hidden or not), exposed_comm_ms, comm_bound, bytes_per_rank, memory_gb (per rank),
    fits_memory, error (why the method cannot run at this N; the numbers are then NaN).
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len: expected a positive integer number of tokens, got {seq_len!r}")
    sizes = list(world_sizes)
    bad = [n for n in sizes if not is_power_of_two(n)]
    if bad or not sizes:
        raise ValueError(f"world_sizes: expected powers of two (1, 2, 4, ...), got {sizes}")
    methods = list(methods) if methods is not None else list(cost.method_names)
    for m in methods:
        cost.coeffs(m)  # ValueError naming an unknown method
    T = seq_len
    rows = []
    for m in methods:
        c = cost.coeffs(m)
        t1 = cost.time(m, 1, [T], cluster.with_world_size(1))
        for n in sizes:
            row = {"method": m, "world_size": n, "seq_len": T}
            nan = float("nan")
            try:
                cl = cluster.with_world_size(n)
                g = cost.group_coeffs(m, n, cl)
            except ValueError as exc:
                row.update(step_ms=nan, ideal_ms=t1 / n * 1e3, efficiency=nan, compute_ms=nan, comm_ms=nan,
                           exposed_comm_ms=nan, comm_bound=False, bytes_per_rank=nan, memory_gb=nan,
                           fits_memory=False, error=str(exc))
                rows.append(row)
                continue
            slow = cl.compute_slowdown()
            attn = c.alpha1 * attention_factor(m, n, slow, cost.n_heads, cl.ranks_per_node) / n * T * T
            compute = slow * (c.beta1 + c.alpha2 * T / n) + attn
            step = g.time(T, T * T)
            lin_comm, over, const_comm = cost._comm_terms(m, n, cl)
            comm = c.comm_scale * ((lin_comm + over) * T + const_comm)
            mem = cost.memory(m, n, [T])
            row.update(step_ms=step * 1e3, ideal_ms=t1 / n * 1e3, efficiency=t1 / (n * step),
                       compute_ms=compute * 1e3, comm_ms=comm * 1e3, exposed_comm_ms=(step - compute) * 1e3,
                       comm_bound=comm >= compute, bytes_per_rank=cost.comm_bytes(m, n, T, cl), memory_gb=mem / 1e9,
                       fits_memory=mem <= cl.memory_per_rank, error="")
            rows.append(row)
    return rows


def _fmt_bytes(b: float) -> str:
    if b != b:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def print_table(rows: list[dict], title: str) -> None:
    """Methods x N: step ms, efficiency, comm-bound mark (C) and bytes per rank (rich, else plain)."""
    sizes = sorted({r["world_size"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["world_size"]): r for r in rows}

    def text(r):
        if r["error"]:
            return "n/a"
        mark = " C" if r["comm_bound"] else ""
        mem = "" if r["fits_memory"] else " OOM"
        t = r["step_ms"]
        step = f"{t:.3g} ms" if t < 1000 else f"{t / 1e3:.3g} s" if t < 1e5 else f"{t / 1e3:.0f} s"
        return f"{step}\n{r['efficiency']:.2f}{mark}{mem}\n{_fmt_bytes(r['bytes_per_rank'])}"

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: plain text
        print(title)
        for m in methods:
            print(m, *(text(cell[m, n]).replace("\n", " | ") for n in sizes), sep="  ")
        return
    table = Table(title=title, show_lines=True)
    table.add_column("method", no_wrap=True)
    for n in sizes:
        table.add_column(f"N={n}", justify="right", no_wrap=True)
    for m in methods:
        table.add_row(m, *(text(cell[m, n]) for n in sizes))
    Console(width=max(100, 16 + 12 * len(sizes))).print(table)
    print("cell: step ms / efficiency vs ideal (C = comm-bound: communication >= compute; OOM = over memory) "
          "/ bytes sent per rank per step")


def plot_efficiency(rows: list[dict], path: str, title: str) -> None:
    """Efficiency vs N (log2 axis), one line per method (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["world_size"], r["efficiency"]) for r in rows if r["method"] == m and not r["error"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks N (one SP group)")
    ax.set_ylabel("efficiency vs ideal (step(1) / (N step(N)))")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqpar simulate", description="Project step time and efficiency of every "
                                "method for 8..1024 GPUs from the cost model (overlap included); --validate "
                                "compares the model with real runs on local CPU ranks.")
    p.add_argument("--seq-len", default=None, help="tokens of the sequence (default 128k; with --validate 8k)")
    p.add_argument("--world-sizes", default=None, help="comma-separated powers of two (default 8..1024; "
                   "with --validate 2,4,8)")
    p.add_argument("--methods", default=None, help=f"comma-separated, from {', '.join(KNOWN_METHODS)} "
                   "(default: the softmax methods)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; --validate 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 8 = Llama-3-8B GQA; "
                   "--validate: --heads)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (--validate 32)")
    p.add_argument("--layers", type=int, default=None, help="default 32 (a calibration: its own, 1)")
    p.add_argument("--ffn", type=int, default=None, help="MLP width for the linear FLOPs (default 3.5 x hidden)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--profile", default=None, help=f"bandwidth profile: {', '.join(PROFILES)} (default "
                   "h100-nvlink-ib, or the calibrated machine with --calibration)")
    p.add_argument("--calibration", metavar="JSON", help="a 'seqpar calibrate' file: measured coefficients, "
                   "links, core sharing and overlap")
    p.add_argument("--csv", metavar="PATH")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="efficiency vs N per method")
    p.add_argument("--validate", action="store_true", help="run the methods on local CPU gloo ranks at "
                   "--world-sizes (2,4,8) and print measured vs predicted step times and their error")
    p.add_argument("--repeats", type=int, default=3, help="--validate: timed repeats per case (after 1 warm-up)")
    p.add_argument("--calibration-out", metavar="PATH", help="--validate without --calibration: where to save "
                   "the calibration it measures first")
    p.add_argument("--no-track-load", action="store_true", help="--validate: skip the per-case probe of the "
                   "machine's current speed (see seqpar.bench.sim_validate)")
    p.add_argument("--group-scales", action="store_true", help="--validate: first time each method on N ranks at "
                   "T/8, T/4 and T/2 and correct the formula by a fit there (see seqpar.bench.sim_validate); "
                   "the rows keep the formula's error too")
    p.add_argument("--no-probe", action="store_true", help="--validate: skip the per-case speed probe (a "
                   "single-rank kernel timed before each repeat; see seqpar.bench.sim_validate)")
    p.add_argument("--no-progress", action="store_true")
    return p


def simulate_main(argv: list[str] | None = None) -> int:
    """Entry point of ``seqpar simulate``; returns the exit status (2 for bad arguments)."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        for flag in ("heads", "kv_heads", "head_dim", "layers", "ffn", "vocab", "repeats"):
            value = getattr(args, flag)  # 0 would otherwise read as "not given" and take the default
            if value is not None and value < 1:
                raise ValueError(f"--{flag.replace('_', '-')}: expected a positive integer, got {value}")
        if args.validate:
            from .sim_validate import validate_main

            return validate_main(args)
        return _run(args)
    except ValueError as exc:
        print(f"seqpar simulate: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    lens = parse_lengths(args.seq_len or "128k", "--seq-len")
    if len(lens) != 1:
        raise ValueError(f"--seq-len: one length, got {args.seq_len!r}")
    seq_len = lens[0]
    sizes = parse_lengths(args.world_sizes, "--world-sizes") if args.world_sizes else list(DEFAULT_WORLD_SIZES)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    bad = [m for m in methods or [] if m not in KNOWN_METHODS]
    if bad:
        raise ValueError(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(KNOWN_METHODS)}")
    if args.calibration:

        cluster, cost = load_calibration(args.calibration)
        heads = args.heads or cost.n_heads
        hd = args.head_dim or cost.hidden // cost.n_heads
        kv = args.kv_heads or (cost.kv_hidden // (cost.hidden // cost.n_heads) if not args.heads else heads)
        cost = rescale_cost_model(cost, heads, kv, hd, args.layers or cost.layers)
        if args.profile:  # another machine: the factors measured on the calibrated one do not apply
            cost = cost.for_other_hardware()
            prof = get_profile(args.profile)
            cluster = replace(prof.cluster(cluster.world_size), cores=cluster.cores,
                              compute_slowdown_by_ranks=cluster.compute_slowdown_by_ranks)
        where = f"calibration {args.calibration}" + (f" + profile {args.profile}" if args.profile else "")
    else:
        prof = get_profile(args.profile or "h100-nvlink-ib")
        heads, hd = args.heads or 32, args.head_dim or 128
        kv = args.kv_heads or (8 if not args.heads else heads)
        hidden, layers = heads * hd, args.layers or 32
        if heads % kv:
            raise ValueError(f"--kv-heads={kv} must divide --heads={heads}")
        ffn = args.ffn if args.ffn is not None else int(3.5 * hidden)
        cost = CostModel.default(hidden=hidden, kv_hidden=kv * hd, layers=layers, n_heads=heads, ffn=ffn,
                                 vocab=args.vocab, attention_flops=prof.attention_flops, gemm_flops=prof.gemm_flops,
                                 methods=methods or SOFTMAX_METHODS)
        cluster = prof.cluster(max(8, prof.ranks_per_node))
        where = f"profile {prof.name} ({prof.description})"
    rows = simulate(seq_len, cluster, cost, world_sizes=sizes,
                    methods=methods or [m for m in cost.method_names if m in SOFTMAX_METHODS] or None)
    title = (f"seqpar simulate: T={seq_len}, Hq={cost.n_heads}, Hkv={cost.kv_hidden * cost.n_heads // cost.hidden}, "
             f"D={cost.hidden // cost.n_heads}, layers={cost.layers}; {where}")
    print_table(rows, title)
    meta = {"command": " ".join(["seqpar", "simulate"] + sys.argv[2:]), "machine_model": where,
            "cluster": cluster.to_dict(), "cost_model": cost.to_dict()}
    for path, fmt in ((args.csv, "csv"), (args.json, "json")):
        if path:
            write_rows(rows, path, meta, fmt)
            print(f"wrote {path}")
    if args.plot:
        plot_efficiency(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(simulate_main())


__all__ = ["DEFAULT_WORLD_SIZES", "plot_efficiency", "print_table", "simulate", "simulate_main"]
