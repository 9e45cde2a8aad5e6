"""Greedy and static planners (always produce a valid plan when one exists).

``greedy_plan``: choose group sizes by a dual-approximation search on the makespan T (give every
sequence the smallest group that finishes it within T, count the groups that its load needs, find
the smallest T whose groups fit the world), place them on aligned ranges, assign sequences longest
first onto the group that would finish earliest (LPT), then improve by local search. Static layouts
(every group the same size) are tried too, so the greedy plan is never worse than the best static
plan's LPT assignment.

``static_plan``: the baseline of one SP degree and one method for the whole batch, sequences spread
over the data-parallel replicas by LPT.
"""

from __future__ import annotations

import heapq
import math
import time as _time
from typing import Sequence

import numpy as np

from .assign import Assignment, Table, group_times, layout, lpt_assign, refine, to_plan
from .cluster import ClusterSpec, is_power_of_two
from .cost import CostModel, _check_lens
from .plan import Plan

# how a static plan spreads sequences over its equal groups (see static_plan)
BALANCES = ("time", "tokens")


def setup(seq_lens: Sequence[int], cluster: ClusterSpec, cost_model: CostModel | None,
          methods: Sequence[str] | None) -> tuple[np.ndarray, Table]:
    """Validate the inputs and build the candidate table (shared by every planner)."""
    lens = np.asarray(_check_lens(seq_lens), dtype=np.float64)
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(f"cluster: expected a ClusterSpec, got {type(cluster).__name__}")
    cost_model = CostModel.default() if cost_model is None else cost_model
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model: expected a CostModel or None, got {type(cost_model).__name__}")
    if methods is None:
        methods = cost_model.default_methods()
    elif isinstance(methods, str) or not all(isinstance(m, str) for m in methods) or not methods:
        raise ValueError(f"methods: expected a non-empty list of method names, got {methods!r}")
    for m in methods:
        if m not in cost_model.method_names:
            raise ValueError(f"methods: {m!r} is not in the cost model (it has {', '.join(cost_model.method_names)})")
    table = Table(cluster, cost_model, methods)
    table.check_fits(lens)
    return lens, table


def _layouts_for(table: Table, single: np.ndarray, target: float) -> list[list[int]] | None:
    """Group sizes that run every sequence within ``target`` (fluid bin count), or None."""
    sizes = np.array(table.sizes)
    cmin = np.array([min(c.const for _, c in opts) for opts in table.options])
    ok = single <= target
    if not ok.any(axis=1).all():
        return None
    k = ok.argmax(axis=1)  # smallest size that finishes the sequence alone within target
    w = single[np.arange(len(k)), k] - cmin[k]
    cap = np.maximum(target - cmin, 1e-30)
    # groups per size: a job over half the capacity needs a group of its own (two cannot share);
    # the other jobs fill, in rank-seconds, what those groups leave free (LPT will put them there:
    # a big job's attention compute also hides their ring traffic), then fresh groups of their size
    big = w > 0.5 * cap[k]
    n_big = np.bincount(k[big], minlength=len(sizes))
    room = float(((cap[k] - w) * sizes[k])[big].sum())
    small = np.bincount(k[~big], weights=w[~big] * sizes[k[~big]], minlength=len(sizes))  # rank-seconds
    total = small.sum()
    rest = small * (max(total - room, 0.0) / total) if total > 0 else small
    bins = n_big + np.ceil(rest / (cap * sizes) - 1e-9).astype(np.int64)
    used = int((bins * sizes).sum())
    n = table.cluster.world_size
    if used > n:
        return None
    base = [int(d) for d, b in zip(sizes, bins) for _ in range(b)]
    left = n - used
    ones = base + [1] * left if 1 in table.size_index else None
    binary = base + [1 << b for b in range(left.bit_length()) if left >> b & 1 and (1 << b) in table.size_index]
    out = [x for x in (ones, binary) if x is not None and sum(x) == n]
    return out or None


def _search_layouts(table: Table, single: np.ndarray) -> tuple[list[list[int]], float]:
    """Dual approximation: bisection on the makespan target T for the fluid group count."""
    best_single = np.min(single, axis=1)
    lo = float(best_single.max())
    hi = lo
    for _ in range(80):
        if _layouts_for(table, single, hi) is not None:
            break
        hi *= 2
    else:
        return [], math.inf
    if _layouts_for(table, single, lo) is not None:
        hi = lo
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if hi - lo <= 1e-4 * hi:
            break
        if _layouts_for(table, single, mid) is None:
            lo = mid
        else:
            hi = mid
    found: list[list[int]] = []
    for t in (hi, hi * 1.03, hi * 1.1, hi * 1.25):
        for lay in _layouts_for(table, single, t) or []:
            if sorted(lay) not in [sorted(x) for x in found]:
                found.append(lay)
    return found, hi


def greedy_plan(seq_lens: Sequence[int], cluster: ClusterSpec, cost_model: CostModel | None = None,
                methods: Sequence[str] | None = None, *, refine_time: float = 0.05) -> Plan:
    """LPT on layouts from a dual-approximation search and on static layouts, then local search.

    ``refine_time`` bounds the local search (seconds). Raises ValueError for bad input or a
    sequence that does not fit the cluster's memory.
    """
    started = _time.perf_counter()
    lens, table = setup(seq_lens, cluster, cost_model, methods)
    assign = greedy_assignment(table, lens, refine_time=refine_time)
    return to_plan(table, assign, lens, solver="greedy", started=started)


def greedy_assignment(table: Table, lens: np.ndarray, *, refine_time: float = 0.05) -> Assignment:
    """The greedy planner on prepared inputs; returns the refined :class:`Assignment`."""
    single = table.single(lens)
    n = table.cluster.world_size
    candidates, target = _search_layouts(table, single)
    runs = [(layout(sizes), None) for sizes in candidates]
    # static layouts (n/d groups of size d, one method) around the smallest size that runs every
    # sequence alone within the target: smaller ones cannot reach it, larger ones only add
    # communication. These are exactly the static plans of those sizes, so greedy never loses to them.
    smallest_fit = int(np.max(np.argmax(np.isfinite(single), axis=1)))
    within = single <= target * 1.02
    k0 = int(np.max(np.argmax(within, axis=1))) if within.any(axis=1).all() else smallest_fit
    for k in range(max(k0 - 1, smallest_fit), min(k0 + 2, len(table.sizes))):
        d = table.sizes[k]
        if n % d == 0:
            runs += [(layout([d] * (n // d)), c) for _, c in table.options[k]]
    best, best_t = None, math.inf
    for groups, fixed in runs:
        a = lpt_assign(table, lens, groups, fixed=fixed)
        t = table.plan_time(a, lens)
        if t < best_t:
            best, best_t = a, t
    # Every other static layout whose lower bound could beat the best so far (the time of a group is
    # convex in (S1, S2), so the slowest of n/d groups is at least the time of the average group, and
    # at least the longest sequence alone): with memory-light methods a large degree can win (one
    # long document at d=1 leaves the other ranks idle), and the planner must never lose to a static
    # plan it could have returned.
    s1, s2, longest = float(lens.sum()), float((lens * lens).sum()), float(lens.max())
    tried = {(k, id(c)) for k in range(max(k0 - 1, smallest_fit), min(k0 + 2, len(table.sizes)))
             for _, c in table.options[k]}
    for k in range(smallest_fit, len(table.sizes)):
        d = table.sizes[k]
        if n % d:
            continue
        per = n // d
        for _, c in table.options[k]:
            if (k, id(c)) in tried or c.memory(longest) > table.memory:
                continue
            if max(c.time(s1 / per, s2 / per), c.time(longest, longest * longest)) >= best_t:
                continue
            a = lpt_assign(table, lens, layout([d] * per), fixed=c)
            t = table.plan_time(a, lens)
            if t < best_t:
                best, best_t = a, t
    if best is not None and math.isfinite(best_t):
        best, best_t = _layout_search(table, lens, best, best_t, _time.perf_counter() + refine_time / 2)
    if best is None or not math.isfinite(best_t):
        per_rank = min(c.mem_lin * d for d, opts in zip(table.sizes, table.options) for _, c in opts)
        raise ValueError(
            f"seq_lens: no plan found that fits memory: the batch has {int(lens.sum())} tokens, about "
            f"{lens.sum() / n:.0f} per rank, and a rank holds at most "
            f"{(table.memory - min(c.mem_const for o in table.options for _, c in o)) / per_rank:.0f} "
            f"tokens; use a smaller batch or more ranks")
    return refine(table, best, lens, deadline=_time.perf_counter() + refine_time)


def _coarsen(groups: list[tuple[int, int]], d: int) -> list[tuple[int, int]]:
    """Replace every aligned block of size ``d`` that is tiled by smaller groups with one group."""
    out = [g for g in groups if g[1] >= d]
    for start in sorted({g[0] - g[0] % d for g in groups if g[1] < d}):
        inside = [g for g in groups if start <= g[0] < start + d]
        if all(g[1] < d for g in inside) and sum(g[1] for g in inside) == d:
            out.append((start, d))
        else:
            out += inside
    return out


def _neighbours(groups: list[tuple[int, int]], times: np.ndarray, max_size: int) -> list[list[tuple[int, int]]]:
    """Layouts one step away: merge the slowest or the least loaded group with its buddy range
    (for the slowest, also coarsening the small groups left around to its old size), split the
    slowest group, or coarsen every group below the largest size."""
    def merged(i):
        s, d = groups[i]
        if 2 * d > max_size:
            return None
        ps = s - s % (2 * d)
        inside = [g for g in groups if ps <= g[0] < ps + 2 * d]
        if sum(g[1] for g in inside) != 2 * d or any(g[1] > d for g in inside):
            return None
        return [g for g in groups if g not in inside] + [(ps, 2 * d)]

    slow, fast = int(np.argmax(times)), int(np.argmin(times))
    s, d = groups[slow]
    m = merged(slow)
    out = [m, None if m is None else _coarsen(m, d), merged(fast), _coarsen(groups, max(g[1] for g in groups))]
    if d > 1:
        out.append([g for g in groups if g != (s, d)] + [(s, d // 2), (s + d // 2, d // 2)])
    return [sorted(c) for c in out if c is not None and len(c) and sorted(c) != sorted(groups)]


def _layout_search(table: Table, lens: np.ndarray, best: Assignment, best_t: float,
                   deadline: float) -> tuple[Assignment, float]:
    """Hill-climb over layouts (:func:`_neighbours`), each scored by LPT, until none helps or time is up."""
    seen = {tuple(sorted(best.groups))}
    while _time.perf_counter() < deadline:
        times = group_times(table, best, lens)
        groups = list(best.groups)
        step = None
        for cand in _neighbours(groups, times, table.sizes[-1]):
            key = tuple(cand)
            if key in seen or any(d not in table.size_index for _, d in cand):
                continue
            seen.add(key)
            a = lpt_assign(table, lens, cand)
            t = table.plan_time(a, lens)
            if t < best_t * (1 - 1e-9) and (step is None or t < step[1]):
                step = (a, t)
        if step is None:
            break
        best, best_t = step
    return best, best_t


def static_plan(seq_lens: Sequence[int], cluster: ClusterSpec, sp_degree: int, method: str,
                cost_model: CostModel | None = None, balance: str = "time") -> Plan:
    """One SP degree and one method for the whole batch: ``world_size / sp_degree`` equal groups.

    ``balance="time"`` (default) spreads the sequences longest first onto the group that would
    finish earliest under the cost model (LPT), so the baseline is balanced as well as a fixed degree
    allows. ``balance="tokens"`` does the same by token count, as data loaders and packers of static
    systems do (they know lengths, not the quadratic attention cost). ValueError when ``sp_degree``
    does not tile the world, the method cannot run at that degree, a group exceeds memory, or
    ``balance`` is neither.
    """
    started = _time.perf_counter()
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r}: expected one of {', '.join(BALANCES)}")
    if not is_power_of_two(sp_degree) or sp_degree > cluster.world_size or cluster.world_size % sp_degree:
        raise ValueError(f"sp_degree={sp_degree!r} must be a power of two dividing world_size={cluster.world_size}")
    lens, table = setup(seq_lens, cluster, cost_model, [method] if isinstance(method, str) else method)
    cm = table.cost_model
    if not cm.supports(method, sp_degree):
        raise ValueError(f"method={method!r} cannot run with sp_degree={sp_degree} (n_heads={cm.n_heads})")
    coeffs = table.coeffs(method, sp_degree)
    groups = layout([sp_degree] * (cluster.world_size // sp_degree))
    if sp_degree not in table.size_index:  # only possible if the table dropped the size: rebuild
        raise ValueError(f"sp_degree={sp_degree}: method {method!r} is unavailable at this size")
    if balance == "time":
        a = lpt_assign(table, lens, groups, fixed=coeffs)
    else:
        a = Assignment(list(groups), _token_balanced(lens, len(groups)))
    s1 = np.bincount(a.owner, weights=lens, minlength=len(groups))
    worst = float(coeffs.memory(s1.max()))
    if worst > cluster.memory_per_rank:
        raise ValueError(f"sp_degree={sp_degree}, method={method!r}: a group needs {worst / 1e9:.1f} GB per rank, "
                         f"more than memory_per_rank = {cluster.memory_per_rank / 1e9:.1f} GB")
    plan = to_plan(table, a, lens, solver="static", started=started, fixed_method=method)
    return plan


def _token_balanced(lens: np.ndarray, num_groups: int) -> np.ndarray:
    """Owner of each sequence when placed longest first onto the group holding the fewest tokens."""
    heap = [(0, g) for g in range(num_groups)]
    owner = np.empty(len(lens), dtype=np.int64)
    for i in np.argsort(-lens, kind="stable").tolist():
        tokens, g = heap[0]
        heapq.heapreplace(heap, (tokens + int(lens[i]), g))
        owner[i] = g
    return owner


def best_static_plan(seq_lens: Sequence[int], cluster: ClusterSpec, cost_model: CostModel | None = None,
                     methods: Sequence[str] | None = None, balance: str = "time") -> Plan:
    """The fastest feasible :func:`static_plan` over every degree and method (the baseline to beat);
    ``balance`` as in :func:`static_plan`."""
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r}: expected one of {', '.join(BALANCES)}")
    cost_model = CostModel.default() if cost_model is None else cost_model
    methods = cost_model.default_methods() if methods is None else tuple(methods)
    best, errors = None, []
    for d in cluster.group_sizes():
        if cluster.world_size % d:
            continue
        for m in methods:
            if not cost_model.supports(m, d):
                continue
            try:
                p = static_plan(seq_lens, cluster, d, m, cost_model, balance)
            except ValueError as exc:
                errors.append(str(exc))
                continue
            if best is None or p.estimated_time < best.estimated_time:
                best = p
    if best is None:
        raise ValueError("seq_lens: no static plan fits the cluster's memory: " + (errors[-1] if errors else ""))
    return best
