"""Measured step time of executed scheduler plans on local CPU gloo ranks (issue 8's measured target).

On ``--nproc`` (default 4) local gloo ranks (the persistent pools of :mod:`seqpar.testing`, one
thread each), for long-tailed batches of real document lengths (the Python standard library's .py
files, bytes / 4 = tokens, sampled with :func:`seqpar.schedulers.sample_lengths` and scaled to
``--tokens-per-rank`` tokens per rank keeping the shape of the distribution):

1. the cost model and cluster come from ``seqpar calibrate`` on this machine
   (:func:`seqpar.bench.calibrate.calibrate`, attention shape ``--heads`` x ``--head-dim``,
   fp32), or from a saved calibration (``--calibration FILE``);
2. the batch is planned with :func:`plan_batch` (the adaptive plan) and with :func:`static_plan`
   for every SP degree 1, 2, 4 and every method (the baselines; degree 1 once: on one rank every
   method runs the same local kernel);
3. every plan is executed: one training step of one attention layer (``seqpar.attention`` forward
   and backward over the group with the group's method, packed documents, causal) through
   :func:`seqpar.schedulers.execute.train_step` (global loss normalisation, world-wide reduction),
   from a barrier to the return of ``train_step`` (which ends in a world all-reduce, so every rank
   waits for the slowest); the step time is the slowest rank's wall time, median over
   ``--repeats`` after ``--warmup`` runs, plans interleaved round-robin so load changes hit all.

The workload is one attention layer because that is what the calibration measures (its
coefficients are per attention layer); projections/MLP would add the same per-token work to every
plan. Reported per batch: modelled and measured time of each plan, the measured speedup of the
adaptive plan over the best *measured* static plan, and the loss of every plan (all equal: the same
batch). Note: N ranks share this machine's cores (4 ranks on 2 cores here), which the calibration's
core-sharing factor models; comparisons between plans are relative, under the same sharing.

    flock /tmp/seqpar-timing.lock python benchmarks/bench_scheduler_exec.py      # results/scheduler_exec.{md,csv}
    python benchmarks/bench_scheduler_exec.py --batches 1 --repeats 1 --out /tmp   # quick
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from seqpar.schedulers import fit_to_cluster, plan_batch, sample_lengths, static_plan
from seqpar.bench.measure import phase_plans
from seqpar.comm.launch import usable_cores

DEFAULT_METHODS = ("zigzag_ring", "striped_ring", "ring", "allgather_kv", "ulysses", "usp", "lightseq", "token_ring")


# ----------------------------------------------------------------------------- driver
def candidate_plans(lens, cluster, cost, methods, time_limit):
    """``[(label, kind, plan)]``: the adaptive plan, then every feasible static (degree, method)."""
    adaptive = plan_batch(lens, cluster, cost, methods, time_limit=time_limit)
    adaptive.validate(lens, cluster, cost)
    out = [("adaptive", "adaptive", adaptive)]
    for d in cluster.group_sizes():
        if cluster.world_size % d:
            continue
        for m in (methods[:1] if d == 1 else methods):
            if not cost.supports(m, d):
                continue
            try:
                p = static_plan(lens, cluster, d, m, cost)
            except ValueError:  # over memory at this degree: not a baseline
                continue
            out.append((f"static {d}x{'any' if d == 1 else m}", "static", p))
    return out


def run_batch(lens, cluster, cost, methods, *, nproc, heads, head_dim, seed, warmup, repeats, time_limit,
              run=None):
    """Plan and execute one batch; returns one row per plan (dicts).

    ``run(fn, args)`` runs ``fn(*args)`` on ``nproc`` ranks and returns rank 0's result (default: the
    persistent single-thread gloo pool of :mod:`seqpar.testing`).
    """
    if run is None:
        from seqpar.testing import get_pool

        def run(fn, args):
            return get_pool(nproc, threads_per_rank=1).run(fn, args, {}, timeout=3600)[0]

    cands = candidate_plans(lens, cluster, cost, methods, time_limit)
    res = run(phase_plans, ([p.to_json() for _, _, p in cands], lens, (heads, heads, head_dim), seed, warmup, repeats))
    rows = []
    for (label, kind, plan), (times, loss) in zip(cands, res):
        rows.append({"plan": label, "kind": kind, "predicted_s": plan.estimated_time,
                     "measured_s": statistics.median(times), "measured_min_s": min(times),
                     "measured_max_s": max(times), "loss": loss, "solver": plan.solver,
                     "groups": " ".join(f"{g.size}x{g.method}:{len(g.seqs)}" for g in plan.groups)})
    best = min((r for r in rows if r["kind"] == "static"), key=lambda r: r["measured_s"])
    best_pred = min((r for r in rows if r["kind"] == "static"), key=lambda r: r["predicted_s"])
    for r in rows:
        r.update(best_static=best["plan"], speedup_measured=best["measured_s"] / r["measured_s"],
                 best_predicted_static=best_pred["plan"],
                 speedup_predicted=best_pred["predicted_s"] / r["predicted_s"])
    return rows


def one_rank_work(lens, cluster, cost, method, *, heads, head_dim, seed, warmup, repeats):
    """Seconds of the whole batch on one rank alone (a 1-rank pool, one thread, the degree-1 kernel):
    the total work. No plan on C cores can beat ``work / min(C, nproc)`` (perfect division, free
    communication), so ``best static / that`` is the most any plan could gain on this machine."""
    from seqpar.testing import get_pool

    plan = static_plan(lens, cluster.with_world_size(1), 1, method, cost)
    (times, _), = get_pool(1, threads_per_rank=1).run(
        phase_plans, ([plan.to_json()], lens, (heads, heads, head_dim), seed, warmup, repeats), {}, timeout=3600)[0]
    return statistics.median(times)


def batch_lengths(num_seqs, seed, cluster, cost, tokens_per_rank):
    lens = fit_to_cluster(sample_lengths(num_seqs, seed=seed), cluster, cost, tokens_per_rank)
    return [int(x) for x in lens]


def long_tailed_seeds(args, cluster, cost, tries: int = 1000) -> list[int]:
    """The first ``--batches`` sample seeds from ``--seed`` on whose batch has a longest sequence of at
    least ``--min-tail`` times the mean length (a long-tailed batch; 0 takes every seed)."""
    seeds, seed = [], args.seed
    while len(seeds) < args.batches and seed < args.seed + tries:
        lens = batch_lengths(args.num_seqs, seed, cluster, cost, args.tokens_per_rank)
        if max(lens) * len(lens) >= args.min_tail * sum(lens):
            seeds.append(seed)
        seed += 1
    if len(seeds) < args.batches:
        raise ValueError(f"--min-tail {args.min_tail}: only {len(seeds)} of {tries} seeds give such a batch; lower it")
    return seeds


def get_model(args):
    """(cluster, cost model) from --calibration, or measured now (saved next to the results)."""
    from seqpar.bench.calibrate import calibrate
    from seqpar.schedulers.calibration import load_calibration

    if args.calibration:
        cluster, cost = load_calibration(args.calibration)
    else:
        out = Path(args.out) / "scheduler_exec_calibration.json"
        Path(args.out).mkdir(parents=True, exist_ok=True)
        cluster, cost = calibrate(nproc=args.nproc, methods=list(args.methods), heads=args.heads,
                                  head_dim=args.head_dim, quick=args.quick_calibration, out=out,
                                  share_compute=True, progress=True,
                                  command=f"bench_scheduler_exec.py (nproc={args.nproc})")
        args.calibration_written = str(out)
    if cluster.world_size != args.nproc:
        cluster = cluster.with_world_size(args.nproc)
    return cluster, cost.with_methods([m for m in args.methods if m in cost.method_names])


def write(rows, out_dir: Path, header: list[str]):
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "scheduler_exec.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = list(header)
    lines += ["| batch | max/mean | plan | groups (size x method : seqs) | modelled s | measured s (min-max) | "
              "measured / modelled | loss |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['max_over_mean']:.1f} | {r['plan']} | {r['groups']} | "
                     f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} ({r['measured_min_s']:.3f}-"
                     f"{r['measured_max_s']:.3f}) | {r['measured_s'] / r['predicted_s']:.2f} | {r['loss']:.6g} |")
    lines += ["", "| batch | adaptive measured s | best measured static | its s | measured speedup | "
              "modelled speedup (vs best modelled static) | whole batch on 1 rank s | ceiling: best static / "
              "(1 rank / cores) |", "|---|---|---|---|---|---|---|---|"]
    for b in sorted({r["batch"] for r in rows}):
        a = next(r for r in rows if r["batch"] == b and r["kind"] == "adaptive")
        best = next(r for r in rows if r["batch"] == b and r["plan"] == a["best_static"])
        lines.append(f"| {b} | {a['measured_s']:.3f} | {a['best_static']} | {best['measured_s']:.3f} | "
                     f"**{a['speedup_measured']:.2f}x** | {a['speedup_predicted']:.2f}x "
                     f"({a['best_predicted_static']}) | {a['one_rank_s']:.3f} | {a['ceiling_speedup']:.2f}x |")
    (out_dir / "scheduler_exec.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--tokens-per-rank", type=float, default=2048)
    p.add_argument("--seed", type=int, default=0, help="first sample seed tried")
    p.add_argument("--min-tail", type=float, default=8.0,
                   help="keep only batches whose longest sequence is >= this x the mean (long-tailed)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--time-limit", type=float, default=1.0, help="plan_batch time limit (s)")
    p.add_argument("--calibration", default=None, help="a 'seqpar calibrate --out' file (default: calibrate now)")
    p.add_argument("--quick-calibration", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    args.methods = tuple(m for m in args.methods.split(",") if m)
    load_before = tuple(round(x, 2) for x in os.getloadavg())
    t0 = time.perf_counter()
    cluster, cost = get_model(args)
    rows = []
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is optional
        def tqdm(x, **_):
            return x
    seeds = long_tailed_seeds(args, cluster, cost)
    for b, seed in enumerate(tqdm(seeds, desc="batches")):
        lens = batch_lengths(args.num_seqs, seed, cluster, cost, args.tokens_per_rank)
        batch_rows = run_batch(lens, cluster, cost, list(args.methods), nproc=args.nproc, heads=args.heads,
                               head_dim=args.head_dim, seed=seed, warmup=args.warmup,
                               repeats=args.repeats, time_limit=args.time_limit)
        work = one_rank_work(lens, cluster, cost, args.methods[0], heads=args.heads, head_dim=args.head_dim,
                             seed=seed, warmup=args.warmup, repeats=args.repeats)
        floor = work / min(usable_cores(), args.nproc)
        best_static = min(r["measured_s"] for r in batch_rows if r["kind"] == "static")
        for r in batch_rows:
            r.update(batch=b, sample_seed=seed, seqs=len(lens), tokens=sum(lens), max_len=max(lens),
                     max_over_mean=max(lens) * len(lens) / sum(lens), one_rank_s=work, floor_s=floor,
                     ceiling_speedup=best_static / floor)
        a = batch_rows[0]
        print(f"batch {b}: lens max {max(lens)} / total {sum(lens)}; adaptive {a['measured_s']:.3f}s measured "
              f"({a['predicted_s']:.3f}s modelled); best measured static {a['best_static']}; measured speedup "
              f"{a['speedup_measured']:.2f}x, modelled {a['speedup_predicted']:.2f}x", flush=True)
        rows.extend(batch_rows)
    rows = [{"batch": r.pop("batch"), **r} for r in rows]
    import torch

    import seqpar

    command = "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    header = [
        "# Executed scheduler plans: measured step time on CPU gloo", "",
        f"- command: `{command}`",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs shared by {args.nproc} single-thread ranks "
        f"({usable_cores()} usable cores; ranks beyond that share them, which the calibration measures); "
        f"load average before/after: {load_before} / {tuple(round(x, 2) for x in os.getloadavg())}",
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, seqpar "
        f"{getattr(seqpar, '__version__', '?')}, numpy {np.__version__}",
        f"- cost model: {args.calibration or getattr(args, 'calibration_written', '')} (seqpar calibrate: "
        f"attention {args.heads} heads x {args.head_dim}, fp32); world {cluster.world_size}",
        f"- workload: one causal attention layer, forward + backward, packed documents, via "
        f"`train_step`; {args.num_seqs} sequences per batch sampled from stdlib .py sizes / 4, scaled to "
        f"{args.tokens_per_rank:g} tokens per rank, the first {args.batches} sample seeds from {args.seed} whose "
        f"longest sequence is >= {args.min_tail:g}x the mean (seeds {', '.join(map(str, seeds))}); "
        f"step time = slowest rank, median of {args.repeats} after "
        f"{args.warmup} warm-up (plans interleaved); run time {time.perf_counter() - t0:.0f} s",
        "- speedup: best measured static plan (any degree 1/2/4 x method) / adaptive plan, measured; the modelled "
        "speedup is against the best modelled static plan",
        f"- ceiling: no plan can beat the whole batch's time on one rank alone divided by the "
        f"{min(usable_cores(), args.nproc)} cores the ranks share (perfect division, free communication); "
        "best measured static / that bound is the largest speedup any plan could show on this machine", ""]
    write(rows, Path(args.out), header)
    print((Path(args.out) / "scheduler_exec.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
