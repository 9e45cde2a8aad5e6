"""``seqpar plan``: plan one batch and compare it with the best static plan.

    seqpar plan lengths.txt --world-size 64          # one length per line, or a JSON list
    seqpar plan --dist stdlib --num-seqs 512 --world-size 64 --plot plan.png
    seqpar plan --dist stdlib-mix --world-size 256 --profile a100-nvlink-ib --methods zigzag_ring
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .cluster import PROFILES, ClusterSpec, get_profile
from .cost import CostModel
from .data import DISTRIBUTIONS, fit_to_cluster, sample_lengths
from .greedy import best_static_plan
from .plan import Plan
from .planner import SOLVERS, plan_batch


def read_lengths(path: str) -> list[int]:
    """Lengths from a file: a JSON list, or one integer per line (blank lines and # comments skipped)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"lengths file {path!r}: cannot be read ({exc})") from None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lengths file {path!r}: not a valid JSON list ({exc})") from None
        if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
            raise ValueError(f"lengths file {path!r}: the JSON list must hold integers")
        return data
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                out.append(int(line))
            except ValueError:
                raise ValueError(f"lengths file {path!r}, line {n}: {line!r} is not an integer") from None
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqpar plan", description="Plan sequence-parallel groups, methods and "
                                "sequence assignment for one batch (seqpar/schedulers/README.md) and compare with the best "
                                "static plan (one SP degree and method for the whole batch).")
    p.add_argument("lengths", nargs="?", help="file of sequence lengths (one per line, or a JSON list)")
    p.add_argument("--dist", choices=DISTRIBUTIONS, help="sample lengths from a built-in distribution instead")
    p.add_argument("--num-seqs", type=int, default=512, help="sequences to sample with --dist (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens-per-rank", type=float, default=None,
                   help="scale lengths to this many tokens per rank (default 32768 with --dist, none for files)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--profile", choices=list(PROFILES), default=None,
                   help="named machine: its links, memory and FLOP rates (default: h100-nvlink-ib); "
                        "--ranks-per-node, --intra-bw, --inter-bw and --memory override it")
    p.add_argument("--ranks-per-node", type=int, default=None, help="(default: the profile's, 8)")
    p.add_argument("--intra-bw", type=float, default=None, help="intra-node GB/s per rank and direction")
    p.add_argument("--inter-bw", type=float, default=None, help="inter-node GB/s per rank and direction")
    p.add_argument("--memory", type=float, default=None, help="GB of memory per rank")
    p.add_argument("--cost-model", help="JSON cost model (default: Llama-3-8B shape at the profile's FLOP rates)")
    p.add_argument("--methods", help="comma-separated methods a group may use (default: softmax methods)")
    p.add_argument("--time-limit", default="0.1", help="seconds for planning, or 'none' (default 0.1)")
    p.add_argument("--solver", choices=SOLVERS, default="milp")
    p.add_argument("--plot", metavar="PNG", help="draw the groups to this file (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    return p


def plan_main(argv: list[str] | None = None) -> int:
    """Entry point of ``seqpar plan``; returns the exit status (2 for bad arguments)."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:
        print(f"seqpar plan: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if (args.lengths is None) == (args.dist is None):
        raise ValueError("give either a lengths file or --dist (not both)")
    profile = get_profile(args.profile or "h100-nvlink-ib")
    fields = {"world_size": args.world_size, "ranks_per_node": args.ranks_per_node or profile.ranks_per_node,
              "latency_intra": profile.latency_intra, "latency_inter": profile.latency_inter}
    for name, value, default in (("intra_node_bandwidth", args.intra_bw, profile.intra_node_bandwidth),
                                 ("inter_node_bandwidth", args.inter_bw, profile.inter_node_bandwidth),
                                 ("memory_per_rank", args.memory, profile.memory_per_rank)):
        fields[name] = default if value is None else value * 1e9
    cluster = ClusterSpec(**fields)
    methods = None if not args.methods else [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.cost_model:
        cost_model = CostModel.load(args.cost_model, required=methods or ())
    else:
        cost_model = CostModel.default(attention_flops=profile.attention_flops, gemm_flops=profile.gemm_flops)
    time_limit = None if str(args.time_limit).lower() == "none" else float(args.time_limit)
    if args.dist:
        raw = sample_lengths(args.num_seqs, args.seed, args.dist)
        tpr = 32768.0 if args.tokens_per_rank is None else args.tokens_per_rank
        lens = [int(x) for x in fit_to_cluster(raw, cluster, cost_model, tpr, methods)]
    else:
        lens = read_lengths(args.lengths)
        if args.tokens_per_rank is not None:
            lens = [int(x) for x in fit_to_cluster(lens, cluster, cost_model, args.tokens_per_rank, methods)]
    plan = plan_batch(lens, cluster, cost_model, methods, time_limit=time_limit, solver=args.solver)
    plan.validate(lens, cluster, cost_model)
    static = packer = None
    try:
        static = best_static_plan(lens, cluster, cost_model, methods)
        packer = best_static_plan(lens, cluster, cost_model, methods, balance="tokens")
    except ValueError as exc:
        print(f"(no {'token-balanced ' if static else ''}static plan fits: {exc})")
    _print(plan, lens, static, packer)
    if args.json:
        Path(args.json).write_text(plan.to_json(indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot_plan(plan, lens, args.plot, static=static)
        print(f"wrote {args.plot}")
    return 0


def _print(plan: Plan, lens: list[int], static: Plan | None, packer: Plan | None = None) -> None:
    rows = [(f"{g.start}-{g.start + g.size - 1}", str(g.size), g.method, str(len(g.seqs)),
             f"{sum(lens[i] for i in g.seqs):,}", f"{max((lens[i] for i in g.seqs), default=0):,}",
             f"{g.estimated_time:.4f}") for g in plan.groups]
    head = ("ranks", "size", "method", "seqs", "tokens", "longest", "time s")
    title = f"{len(lens)} sequences, {sum(lens):,} tokens, {plan.world_size} ranks"
    try:
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        print(title)
        print("  ".join(f"{h:>10}" for h in head))
        for r in rows:
            print("  ".join(f"{c:>10}" for c in r))
    else:
        t = RichTable(title=title)
        for h in head:
            t.add_column(h, justify="left" if h == "method" else "right")
        for r in rows:
            t.add_row(*r)
        Console().print(t)
    print(f"modeled step time: {plan.estimated_time:.4f} s  (solver {plan.solver}, planned in "
          f"{plan.solve_time * 1e3:.1f} ms)")
    if plan.bound:
        print(f"lower bound:       {plan.bound:.4f} s  (plan within {100 * (plan.estimated_time / plan.bound - 1):.2f}%)")
    if static is not None:
        g = static.groups[0]
        print(f"best static plan:  {static.estimated_time:.4f} s  (sp_degree {g.size}, {g.method})")
        print(f"speedup over best static: {static.estimated_time / plan.estimated_time:.3f}x")
    if packer is not None:
        g = packer.groups[0]
        print(f"best static plan with a token-balancing packer: {packer.estimated_time:.4f} s  (sp_degree {g.size}, "
              f"{g.method}; speedup {packer.estimated_time / plan.estimated_time:.3f}x)")
    if plan.notes:
        print(f"notes: {plan.notes}")


def plot_plan(plan: Plan, lens: list[int], path: str, static: Plan | None = None) -> None:
    """Bars per group over the ranks it spans (height: modelled time), labelled method / #seqs."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    methods = sorted({g.method for g in plan.groups})
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, plan.world_size / 4)), 4))
    for g in plan.groups:
        ax.bar(g.start, g.estimated_time, width=g.size, align="edge", color=colors[g.method],
               edgecolor="black", linewidth=0.5)
        if g.size >= max(1, plan.world_size // 32):
            ax.text(g.start + g.size / 2, g.estimated_time, f"{g.method}\n{len(g.seqs)} seq",
                    ha="center", va="bottom", fontsize=7, rotation=90 if g.size < plan.world_size // 8 else 0)
    if static is not None:
        ax.axhline(static.estimated_time, color="gray", linestyle="--",
                   label=f"best static ({static.groups[0].size}x {static.groups[0].method})")
    for m in methods:
        ax.bar(0, 0, color=colors[m], label=m)
    top = max([g.estimated_time for g in plan.groups] + [static.estimated_time if static else 0.0])
    ax.set_ylim(0, top * 1.35 if top > 0 and math.isfinite(top) else 1)
    ax.set_xlim(0, plan.world_size)
    ax.set_xlabel("rank")
    ax.set_ylabel("modelled step time (s)")
    ax.set_title(f"{len(lens)} sequences on {plan.world_size} ranks: {plan.estimated_time:.3f} s ({plan.solver})")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(plan_main())
