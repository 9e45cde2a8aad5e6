"""``plan_batch``: the heterogeneity-adaptive planner (MILP seeded and checked by the greedy plan).

Flow: validate, build the candidate table, run the greedy planner (always valid), bucket the lengths,
solve the MILP with HiGHS within what is left of ``time_limit`` using the greedy plan's bucketed
makespan as an upper bound on C, map the bucket counts back to real sequences (longest first onto
the group with quota left that finishes earliest), refine by local search on the real lengths, and
keep whichever of the MILP and greedy plans is faster. Any failure of the MILP path (scipy missing,
no incumbent within the limit, infeasible) returns the greedy plan with the reason in ``notes``.
"""

from __future__ import annotations

import math
import time as _time
from typing import Sequence

import numpy as np

from .assign import Assignment, Table, refine, to_plan
from .cluster import ClusterSpec
from .cost import CostModel
from .greedy import greedy_assignment, setup
from .milp import Buckets, bucketize, solve_milp
from .plan import Plan

SOLVERS = ("milp", "greedy")


def plan_batch(seq_lens: Sequence[int], cluster: ClusterSpec, cost_model: CostModel | None = None,
               methods: Sequence[str] | None = None, time_limit: float | None = 0.1, solver: str = "milp", *,
               num_buckets: int = 16, mip_gap: float = 1e-3) -> Plan:
    """Plan SP groups, methods and sequence assignment for one batch.

    Args:
        seq_lens: token count of every sequence of the global batch (positive integers).
        cluster: the :class:`ClusterSpec`.
        cost_model: a :class:`CostModel`; default :meth:`CostModel.default` (H100, Llama-3-8B shape).
        methods: methods a group may use; default the cost model's softmax methods.
        time_limit: seconds for the whole call (the MILP gets what greedy planning leaves, minus a
            reserve for decoding); None solves the MILP to ``mip_gap`` without a limit.
        solver: ``"milp"`` (MILP, greedy fallback) or ``"greedy"``.
        num_buckets: length buckets of the MILP (exact when the batch has no more distinct lengths).
        mip_gap: relative optimality gap at which HiGHS stops.

    Returns a valid :class:`Plan`: groups are aligned power-of-two blocks partitioning the ranks,
    every sequence is assigned once, memory fits. ValueError for bad input or a sequence that does
    not fit even on the whole cluster.
    """
    started = _time.perf_counter()
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r}: choose one of {', '.join(SOLVERS)}")
    if time_limit is not None and not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(f"time_limit={time_limit!r}: expected a positive number of seconds or None")
    if not isinstance(num_buckets, int) or num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets!r}: expected a positive integer")
    lens, table = setup(seq_lens, cluster, cost_model, methods)
    plan = _plan(lens, table, started, time_limit, solver, num_buckets, mip_gap)
    plan.validate(lens.astype(np.int64).tolist(), cluster, table.cost_model)  # cheap; guards the invariants
    return plan


def _plan(lens: np.ndarray, table: Table, started: float, time_limit: float | None, solver: str,
          num_buckets: int, mip_gap: float) -> Plan:
    budget = math.inf if time_limit is None else float(time_limit)
    greedy = greedy_assignment(table, lens, refine_time=min(0.05, 0.2 * budget))
    greedy_t = table.plan_time(greedy, lens)
    bound = _lower_bound(table, bucketize(lens, (1.0, 0.0), len(lens)))  # exact lengths: a true bound
    if solver == "greedy":
        return to_plan(table, greedy, lens, solver="greedy", started=started, bound=bound)
    if greedy_t <= bound * (1 + mip_gap):
        return to_plan(table, greedy, lens, solver="greedy", started=started, bound=bound,
                       notes=f"greedy plan within mip_gap={mip_gap:g} of the lower bound: MILP skipped")

    c0 = table.options[0][0][1]  # single-rank coefficients weight the padding
    buckets = bucketize(lens, (c0.lin, c0.quad), num_buckets)
    upper = _bucketed_makespan(table, greedy, buckets)
    lower = _lower_bound(table, buckets)
    if upper is not None:
        lower = min(lower, upper)
    elapsed = _time.perf_counter() - started
    reserve = 0.15 * budget if time_limit is not None else 0.0
    limit = None if time_limit is None else budget - elapsed - reserve
    if limit is not None and limit <= 0.002:
        return to_plan(table, greedy, lens, solver="greedy", started=started, bound=bound,
                       notes="no time left for the MILP after greedy planning")
    res, why = solve_milp(table, buckets, upper=upper, lower=lower, time_limit=limit, mip_gap=mip_gap)
    if res is None:
        return to_plan(table, greedy, lens, solver="greedy", started=started, bound=bound, notes=why)
    assign = _decode(table, res, lens, buckets.bucket_of)
    left = None if time_limit is None else started + budget
    assign = refine(table, assign, lens, deadline=left)
    milp_t = table.plan_time(assign, lens)
    note = (f"MILP status {res.status}: {res.message}; bucketed objective {res.objective:.6g}, "
            f"bucketed dual bound {res.bound}")
    if milp_t <= greedy_t:
        return to_plan(table, assign, lens, solver="milp", started=started, bound=bound, notes=note)
    return to_plan(table, greedy, lens, solver="greedy", started=started, bound=bound,
                   notes=note + f"; greedy plan kept ({greedy_t:.6g} s < {milp_t:.6g} s)")


def _bucketed_makespan(table: Table, assign: Assignment, buckets: Buckets) -> float | None:
    """The greedy plan's makespan in the MILP's bucketed model (a valid upper bound on C), or None
    when the bucketed model would call one of its groups over memory."""
    b = buckets.bucket_of
    G = len(assign.groups)
    s1 = np.bincount(assign.owner, weights=buckets.mean[b], minlength=G)
    s2 = np.bincount(assign.owner, weights=buckets.mean_sq[b], minlength=G)
    s1max = np.bincount(assign.owner, weights=buckets.longest[b], minlength=G)
    worst, work, a = 0.0, 0.0, table.arr
    for g, (_, d) in enumerate(assign.groups):
        if s1[g] <= 0:
            continue
        k = table.size_index[d]
        t, j = min(((c.time(s1[g], s2[g]), j) for j, (_, c) in enumerate(table.options[k])
                    if c.memory(s1max[g]) <= table.memory), default=(math.inf, -1))
        if not math.isfinite(t):
            return None
        worst = max(worst, t)
        work += a["wconst"][k, j] + a["wlin"][k, j] * s1[g] + a["wquad"][k, j] * s2[g]
    return max(worst, work) * (1 + 1e-9)


def _lower_bound(table: Table, buckets: Buckets) -> float:
    """A valid lower bound on the bucketed makespan: the longest single job, total work / ranks, and
    on shared cores the plan's work bound (see :meth:`Table.plan_time`)."""
    counts = buckets.counts
    alone = np.full(len(counts), math.inf)
    work_a = np.full(len(counts), math.inf)
    work_b = np.full(len(counts), math.inf)
    cores = np.full(len(counts), math.inf)
    for k, d in enumerate(table.sizes):
        for j, (_, c) in enumerate(table.options[k]):
            fits = c.mem_const + c.mem_lin * buckets.longest <= table.memory
            a = c.lin * buckets.mean + c.quad * buckets.mean_sq
            b = (c.lin + c.overlap) * buckets.mean
            t = c.const + np.maximum(a, b)
            alone = np.where(fits, np.minimum(alone, t), alone)
            work_a = np.where(fits, np.minimum(work_a, d * a), work_a)
            work_b = np.where(fits, np.minimum(work_b, d * b), work_b)
            w = table.arr["wlin"][k, j] * buckets.mean + table.arr["wquad"][k, j] * buckets.mean_sq
            cores = np.where(fits, np.minimum(cores, w), cores)
    n = table.cluster.world_size
    return float(max(alone.max(), (counts * work_a).sum() / n, (counts * work_b).sum() / n,
                     (counts * cores).sum()))


def _decode(table: Table, res, lens: np.ndarray, bucket_of: np.ndarray) -> Assignment:
    """Real sequences onto the MILP's groups: per bucket, longest first, onto the earliest-finishing
    group that still has quota for that bucket."""
    groups = [(s, d) for s, d, _ in res.groups]
    order = sorted(range(len(groups)), key=lambda g: groups[g][0])
    groups = [groups[g] for g in order]
    quota = res.counts[order].copy()
    k_of = [table.size_index[d] for _, d in groups]
    s1 = [0.0] * len(groups)
    s2 = [0.0] * len(groups)
    owner = np.empty(len(lens), dtype=np.int64)
    for i in np.argsort(-lens, kind="stable"):
        q = bucket_of[i]
        s = float(lens[i])
        best, best_t = -1, math.inf
        for g in np.flatnonzero(quota[:, q] > 0):
            t, _ = table.best(k_of[g], s1[g] + s, s2[g] + s * s)
            if t < best_t or best < 0:
                best, best_t = int(g), t
        quota[best, q] -= 1
        s1[best] += s
        s2[best] += s * s
        owner[i] = best
    return Assignment(groups, owner)
