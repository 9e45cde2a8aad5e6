"""Where adaptive planning pays: modelled speedup of ``plan_batch`` over three static baselines.

The issue's baseline, ``best_static_plan``, is the strongest static plan there is: it re-picks the
SP degree and method for every batch and balances the sequences by *modelled time*. Static systems
that users run are weaker in two ways, and each is measured here on its own:

* ``per-batch``: best degree x method for this batch, sequences LPT-balanced by modelled time
  (``best_static_plan``; a "batch-homogeneous" planner).
* ``packer``: best degree x method for this batch, sequences balanced by *token count*
  (``best_static_plan(..., balance="tokens")``), as length-aware data loaders do.
* ``fixed``: one degree x method for the whole run, as a Megatron-CP or DeepSpeed-Ulysses job is
  configured, token-balanced. It is chosen with hindsight: the configuration with the least total
  time over all the run's batches among those that fit every batch in memory.

Every number is modelled with the same cost model (``CostModel.default()``'s Llama-3-8B shape,
layer checkpointing, at the profile's FLOP rates) on named machine profiles
(``seqpar.schedulers.cluster.PROFILES``). ``speedup`` is the median over batches of
baseline / adaptive; ``run`` is total baseline time / total adaptive time over the batches (the
throughput gain of a whole run). A sweep of the inter-node bandwidth per GPU on 256 GPUs shows
how the gain depends on the network (plot).

    python benchmarks/bench_scheduler_baselines.py                 # results/scheduler_baselines.{md,csv,png}
    python benchmarks/bench_scheduler_baselines.py --batches 2 --out /tmp --no-sweep   # quick
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench_scheduler import METHOD_SETS  # the same method sets as the main scheduler benchmark
from seqpar.schedulers import CostModel, best_static_plan, fit_to_cluster, plan_batch, sample_lengths, static_plan
from seqpar.schedulers.cluster import get_profile
from seqpar.schedulers.data import sample_tokens
from seqpar.comm.launch import progress_track

PROFILES = ("h100-nvlink-ib", "a100-nvlink-ib")
# data -> tokens per GPU
LOADS = {"fit": (8192, 32768), "real": (8192, 32768)}
SWEEP_GBPS = (100.0, 50.0, 25.0, 12.5, 6.25, 3.125)


def machine(profile: str, world: int, inter_gbps: float | None = None):
    prof = get_profile(profile)
    cluster = prof.cluster(world)
    if inter_gbps is not None:
        cluster = replace(cluster, inter_node_bandwidth=inter_gbps * 1e9)
    return cluster, CostModel.default(attention_flops=prof.attention_flops, gemm_flops=prof.gemm_flops)


def batches_for(data, cluster, cm, tokens_per_rank, count, world):
    out = []
    for b in range(count):
        if data == "fit":
            lens = fit_to_cluster(sample_lengths(512, seed=1000 * world + b), cluster, cm, tokens_per_rank)
        else:
            lens = sample_tokens(int(tokens_per_rank * world), seed=1000 * world + b)
        out.append([int(x) for x in lens])
    return out


def fixed_config(batches, cluster, cm, methods):
    """(degree, method, per-batch times) of the token-balanced static configuration with the least total
    time over ``batches`` among those that fit all of them; None if none does."""
    best = None
    for d in cluster.group_sizes():
        if cluster.world_size % d:
            continue
        for m in methods or cm.default_methods():
            if not cm.supports(m, d):
                continue
            try:
                times = [static_plan(lens, cluster, d, m, cm, balance="tokens").estimated_time for lens in batches]
            except ValueError:  # some batch does not fit this configuration's memory
                continue
            if best is None or sum(times) < sum(best[2]):
                best = (d, m, times)
    return best


def cell(profile, world, data, tpr, count, time_limit, inter_gbps=None):
    """Rows (one per method set) for one machine x data x load."""
    cluster, cm = machine(profile, world, inter_gbps)
    batches = batches_for(data, cluster, cm, tpr, count, world)
    rows = []
    for set_name, methods in METHOD_SETS.items():
        try:
            adaptive = [plan_batch(lens, cluster, cm, methods, time_limit=time_limit).estimated_time
                        for lens in batches]
            per_batch = [best_static_plan(lens, cluster, cm, methods).estimated_time for lens in batches]
        except ValueError as exc:  # e.g. Ulysses alone cannot hold some batch
            print(f"{profile} N={world} {data} {tpr} {set_name}: infeasible ({exc})", flush=True)
            continue
        try:
            packer = [best_static_plan(lens, cluster, cm, methods, balance="tokens").estimated_time
                      for lens in batches]
        except ValueError:  # token balancing can overfill a group that time balancing does not
            packer = [float("nan")] * len(batches)
        fixed = fixed_config(batches, cluster, cm, methods)
        a = np.array(adaptive)
        row = {"profile": profile, "world": world, "inter_gbps": cluster.inter_node_bandwidth / 1e9, "data": data,
               "tokens_per_rank": tpr, "methods": set_name, "batches": len(batches),
               "longest_median": float(np.median([max(x) for x in batches])),
               "per_batch_median": float(np.median(np.array(per_batch) / a)),
               "per_batch_max": float(np.max(np.array(per_batch) / a)),
               "per_batch_run": sum(per_batch) / a.sum(),
               "packer_median": float(np.median(np.array(packer) / a)), "packer_run": sum(packer) / a.sum(),
               "fixed_config": "-" if fixed is None else f"{fixed[0]}x{fixed[1]}",
               "fixed_median": float("nan") if fixed is None else float(np.median(np.array(fixed[2]) / a)),
               "fixed_run": float("nan") if fixed is None else sum(fixed[2]) / a.sum()}
        rows.append(row)
    return rows


def plot(sweep, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for ax, (key, title) in zip(axes, (("per_batch_run", "vs per-batch best static (time-balanced)"),
                                       ("packer_run", "vs per-batch best static (token-balanced)"),
                                       ("fixed_run", "vs one fixed configuration for the run"))):
        for (profile, methods), style in zip(sorted({(r["profile"], r["methods"]) for r in sweep}),
                                             ("o-", "s-", "^-", "o--", "s--", "^--")):
            rs = sorted((r for r in sweep if (r["profile"], r["methods"]) == (profile, methods)),
                        key=lambda r: r["inter_gbps"])
            ax.plot([r["inter_gbps"] for r in rs], [r[key] for r in rs], style, label=f"{profile}, {methods}")
        ax.axhline(1.3, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(SWEEP_GBPS, [f"{g:g}" for g in SWEEP_GBPS])
        ax.minorticks_off()
        ax.set_xlabel("inter-node GB/s per GPU")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("modelled speedup of the adaptive plan (run total)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"256 GPUs, {sweep[0]['data']} lengths, {sweep[0]['tokens_per_rank']} tokens/GPU, "
                 f"{sweep[0]['batches']} batches; dotted: 1.3x", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x, spec=".3f"):
    return "n/a" if x != x else format(x, spec)


def table(rows, sweep_cols=False):
    head = ["profile", "GPUs"] + (["IB GB/s/GPU"] if sweep_cols else []) + [
        "data", "tokens/GPU", "longest (median)", "methods", "vs per-batch: median (max) / run",
        "vs packer: median / run", "fixed config", "vs fixed: median / run"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["profile"], str(r["world"])] + ([f"{r['inter_gbps']:g}"] if sweep_cols else []) + [
            r["data"], str(r["tokens_per_rank"]), f"{r['longest_median']:.0f}", r["methods"],
            f"{_fmt(r['per_batch_median'])} ({_fmt(r['per_batch_max'])}) / {_fmt(r['per_batch_run'])}",
            f"{_fmt(r['packer_median'])} / {_fmt(r['packer_run'])}", r["fixed_config"],
            f"{_fmt(r['fixed_median'])} / {_fmt(r['fixed_run'])}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--worlds", default="64,256")
    p.add_argument("--batches", type=int, default=8, help="batches per cell (one run)")
    p.add_argument("--time-limit", type=float, default=0.1)
    p.add_argument("--no-sweep", action="store_true", help="skip the inter-node bandwidth sweep")
    p.add_argument("--sweep-data", default="fit:32768", help="DATA:TOKENS_PER_GPU of the sweep (256 GPUs)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--name", default="scheduler_baselines")
    args = p.parse_args(argv)
    profiles = [x for x in args.profiles.split(",") if x]
    for x in profiles:
        get_profile(x)
    worlds = [int(x) for x in args.worlds.split(",") if x]
    sweep_data, sweep_tpr = args.sweep_data.split(":")
    load_before = tuple(round(x, 1) for x in os.getloadavg())
    t0 = time.perf_counter()
    jobs = [(pr, n, data, tpr, None) for pr in profiles for n in worlds for data, loads in LOADS.items()
            for tpr in loads]
    if not args.no_sweep:
        jobs += [(pr, 256, sweep_data, int(sweep_tpr), g) for pr in profiles for g in SWEEP_GBPS]
    rows, sweep = [], []
    for pr, n, data, tpr, g in progress_track(jobs, "planning"):
        got = cell(pr, n, data, tpr, args.batches, args.time_limit, g)
        (rows if g is None else sweep).extend(got)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    everything = rows + sweep
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(everything[0]))
        w.writeheader()
        w.writerows(everything)
    command = "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    lines = ["# Adaptive plan vs static baselines (modelled)", "",
             f"- command: `{command}`",
             f"- machine: {platform.platform()}, {os.cpu_count()} CPUs; load average before/after: {load_before} / "
             f"{tuple(round(x, 1) for x in os.getloadavg())}; run time {time.perf_counter() - t0:.0f} s",
             f"- versions: Python {platform.python_version()}, numpy {np.__version__}",
             "- model: `CostModel.default()` (Llama-3-8B, GQA 32/8, layer checkpointing) at each profile's FLOP "
             "rates; clusters from `PROFILES` (8 GPUs per node); planner time limit "
             f"{args.time_limit} s; {args.batches} batches per row",
             "- baselines: `per-batch` = `best_static_plan` (degree x method re-picked per batch, LPT by modelled "
             "time); `packer` = the same, balanced by token count; `fixed` = one token-balanced degree x method for "
             "the whole run, the best in hindsight over the row's batches among those fitting every batch",
             "- `median (max)`: over batches of baseline / adaptive; `run`: total baseline time / total adaptive time",
             "", *table(rows)]
    if sweep:
        plot(sweep, out / f"{args.name}.png")
        lines += ["", f"## Inter-node bandwidth sweep (256 GPUs, {sweep_data}, {sweep_tpr} tokens/GPU)", "",
                  f"![speedup by inter-node bandwidth]({args.name}.png)", "", *table(sweep, sweep_cols=True)]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
