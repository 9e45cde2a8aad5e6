"""Shared machinery of the planners: candidate (size, method) table, LPT assignment, local search.

:class:`Table` holds, for one (cluster, cost model, allowed methods), the methods worth
considering at each group size: unsupported ones are dropped and so are those another method
dominates for every batch (:meth:`GroupCoeffs.dominates`), ties going to the earlier method. All
times here are for a group's packed batch, given its token sums ``S1 = Σs`` and ``S2 = Σs²``.

Ranks sharing CPU cores (:attr:`ClusterSpec.shares_cores`): a group's time is its time with only
its own ranks computing, and a plan takes at least the time the node's cores need for all its
ranks' compute, shared fairly (:meth:`ClusterSpec.shared_makespan`; :meth:`Table.plan_time`): a
rank whose group finished, or that waits for a message, leaves its core to the others, so one long
document on one rank runs at full speed once the rest is done. The MILP and the local search use
the linear relaxation of that bound (total compute over all cores, the ``w*`` arrays, which hold
each option's per-rank compute x d x :meth:`ClusterSpec.work_scale`). On GPUs these terms are 0.
"""

from __future__ import annotations

import heapq
import math
import time as _time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cluster import ClusterSpec
from .cost import CostModel, GroupCoeffs
from .plan import GroupPlan, Plan

INF = math.inf


class Table:
    """Non-dominated methods per group size, as Python tuples and as padded numpy arrays."""

    def __init__(self, cluster: ClusterSpec, cost_model: CostModel, methods: Sequence[str]):
        self.cluster, self.cost_model, self.methods = cluster, cost_model, tuple(methods)
        self.memory = float(cluster.memory_per_rank)
        self.sizes: list[int] = []
        self.options: list[list[tuple[str, GroupCoeffs]]] = []  # per size index
        self.shared = cluster.shares_cores
        work_scale = cluster.work_scale()
        works = []  # per size index and option: (const, lin, quad) of its work, in plan seconds
        for d in cluster.group_sizes():
            cands = [(m, self.coeffs(m, d)) for m in self.methods if cost_model.supports(m, d)]
            if d == 1:  # one rank communicates nothing: every method is plain local attention there,
                cands = cands[:1]  # so label it with the first (preferred) method
            kept = [(m, c) for i, (m, c) in enumerate(cands)  # (work differs: keep all on shared cores)
                    if self.shared or not any(o.dominates(c) and (j < i or not c.dominates(o))
                                              for j, (_, o) in enumerate(cands) if j != i)]
            if kept:
                self.sizes.append(d)
                self.options.append(kept)
                works.append([tuple(d * work_scale * x for x in cost_model.compute_coeffs(m, d))
                              for m, _ in kept])
        if not self.sizes:
            raise ValueError(f"methods={list(self.methods)}: none of them can run on this cluster")
        self.size_index = {d: k for k, d in enumerate(self.sizes)}
        self.flat = [[(c.const, c.lin, c.quad, c.overlap, c.mem_const, c.mem_lin) for _, c in opts]
                     for opts in self.options]  # plain tuples: the hot loops avoid attribute lookups
        width = max(len(o) for o in self.options)
        shape = (len(self.sizes), width)
        arrays = {n: np.full(shape, INF if n in ("const", "mem_const") else 0.0)
                  for n in ("const", "lin", "quad", "overlap", "mem_const", "mem_lin", "wconst", "wlin", "wquad")}
        for k, opts in enumerate(self.options):
            for j, (_, c) in enumerate(opts):
                for n in ("const", "lin", "quad", "overlap", "mem_const", "mem_lin"):
                    arrays[n][k, j] = getattr(c, n)
                arrays["wconst"][k, j], arrays["wlin"][k, j], arrays["wquad"][k, j] = works[k][j]
        self.arr = arrays

    def coeffs(self, method: str, d: int) -> GroupCoeffs:
        """Coefficients of a group's own time: only its d ranks computing when ranks share cores."""
        return self.cost_model.group_coeffs(method, d, self.cluster, active_ranks=d if self.shared else None)

    def best(self, k: int, s1: float, s2: float) -> tuple[float, int]:
        """(time, option index) of the fastest method at size index ``k`` that fits memory."""
        if s1 <= 0:
            return 0.0, 0
        best_t, best_j, mem = INF, -1, self.memory
        for j, (const, lin, quad, ovl, mc, ml) in enumerate(self.flat[k]):
            if mc + ml * s1 > mem:
                continue
            a, b = quad * s2, ovl * s1
            t = const + lin * s1 + (a if a > b else b)
            if t < best_t:
                best_t, best_j = t, j
        return best_t, best_j

    def best_many(self, k: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`best` times for size indices ``k`` and sums ``s1``, ``s2`` (same shape)."""
        return self.best_and_work(k, s1, s2)[0]

    def best_and_work(self, k: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(:meth:`best_many` times, the work those fastest methods add to the plan's work bound)."""
        a = self.arr
        s1e, s2e = s1[..., None], s2[..., None]
        t = a["const"][k] + a["lin"][k] * s1e + np.maximum(a["quad"][k] * s2e, a["overlap"][k] * s1e)
        t = np.where(a["mem_const"][k] + a["mem_lin"][k] * s1e > self.memory, INF, t)
        busy = s1 > 0
        if not self.shared:
            return np.where(busy, t.min(axis=-1), 0.0), np.zeros(np.shape(s1))
        j = t.argmin(axis=-1)[..., None]
        w = (np.take_along_axis(a["wconst"][k], j, -1) + np.take_along_axis(a["wlin"][k], j, -1) * s1e
             + np.take_along_axis(a["wquad"][k], j, -1) * s2e)[..., 0]
        return np.where(busy, t.min(axis=-1), 0.0), np.where(busy, w, 0.0)

    def plan_time(self, assign: "Assignment", lens: np.ndarray) -> float:
        """Modelled step time of an assignment: its slowest group, and on shared cores at least the
        time the cores need for every rank's compute (:meth:`ClusterSpec.shared_makespan`)."""
        return sum(self.plan_parts(assign, lens)) if self.shared else float(
            self.best_many(self._size_idx(assign), *group_sums(assign, lens)).max(initial=0.0))

    def plan_parts(self, assign: "Assignment", lens: np.ndarray) -> tuple[float, float]:
        """:meth:`plan_time` as ``(attention, rest)``: :meth:`GroupCoeffs.parts` of the slowest group,
        or, when the shared cores bind, that time split as the plan's compute is (attention vs rest)."""
        s1, s2 = group_sums(assign, lens)
        k = self._size_idx(assign)
        t, w = self.best_and_work(k, s1, s2)
        if not np.isfinite(t).all():  # some group does not fit memory
            return math.inf, 0.0
        choice = [max(self.best(int(kk), x, y)[1], 0) for kk, x, y in zip(k, s1, s2)]
        g = int(np.argmax(t))
        if self.shared:
            per_rank = np.zeros(self.cluster.world_size)
            for (start, d), work in zip(assign.groups, w):
                per_rank[start:start + d] = work / (d * self.cluster.work_scale())
            cores = self.cluster.shared_makespan(per_rank)
            if cores > t[g]:
                attn = float(np.sum(np.where(s1 > 0, self.arr["wquad"][k, choice] * s2, 0.0)))
                return cores * attn / w.sum(), cores * (1 - attn / w.sum())
        return self.options[k[g]][choice[g]][1].parts(s1[g], s2[g])

    def _size_idx(self, assign: "Assignment") -> np.ndarray:
        return np.array([self.size_index[d] for _, d in assign.groups], dtype=np.int64)

    def single(self, lens: np.ndarray) -> np.ndarray:
        """Time of each sequence alone on a group of each size: array [n, len(sizes)] (inf: no fit)."""
        n = len(lens)
        out = np.empty((n, len(self.sizes)))
        for k in range(len(self.sizes)):
            out[:, k] = self.best_many(np.full(n, k), lens, lens * lens)
        return out

    def check_fits(self, lens: Sequence[int]) -> None:
        """ValueError when a sequence does not fit in memory even on the largest group."""
        s = float(max(lens))
        k = len(self.sizes) - 1
        if self.best(k, s, s * s)[1] < 0:
            i = int(np.argmax(lens))
            d = self.sizes[k]
            need = min(c.mem_const + c.mem_lin * s for _, c in self.options[k])
            raise ValueError(
                f"seq_lens[{i}] = {int(s)} tokens does not fit the cluster: even split over {d} ranks it needs "
                f"{need / 1e9:.1f} GB per rank, more than memory_per_rank = {self.memory / 1e9:.1f} GB "
                f"(the whole cluster has {self.cluster.world_size} ranks); shorten or split the sequence")


def layout(sizes_desc: Sequence[int]) -> list[tuple[int, int]]:
    """Place group sizes (largest first) on consecutive ranks; the result is aligned (start % size == 0)."""
    out, start = [], 0
    for d in sorted(sizes_desc, reverse=True):
        out.append((start, d))
        start += d
    return out


@dataclass
class Assignment:
    """Mutable working state: groups as (start, size) and the group index of every sequence."""

    groups: list[tuple[int, int]]
    owner: np.ndarray  # [n] group index per sequence


def lpt_assign(table: Table, lens: np.ndarray, groups: Sequence[tuple[int, int]],
               fixed: GroupCoeffs | None = None) -> Assignment:
    """Longest first, each sequence onto the group where it would finish earliest (LPT/EFT).

    Per size class the candidate is the group with the least current time (a heap), so a step costs
    O(sizes · methods). ``fixed`` forces one method's coefficients on every group (static plans).
    Sequences that fit no group's memory go to the largest group (the caller validates).
    """
    by_k: dict[int, list] = {}
    s1 = [0.0] * len(groups)
    s2 = [0.0] * len(groups)
    for g, (_, d) in enumerate(groups):
        by_k.setdefault(table.size_index[d], []).append((0.0, g))
    for h in by_k.values():
        heapq.heapify(h)
    owner = np.empty(len(lens), dtype=np.int64)
    largest = max(by_k)
    forced = None if fixed is None else [(fixed.const, fixed.lin, fixed.quad, fixed.overlap, fixed.mem_const,
                                          fixed.mem_lin)]
    classes = [(k, h, forced or table.flat[k]) for k, h in by_k.items()]
    mem = table.memory
    order = np.argsort(-lens, kind="stable")
    for i, s in zip(order.tolist(), lens[order].tolist()):
        bt, bk, bg = INF, largest, by_k[largest][0][1]
        for k, h, opts in classes:
            g = h[0][1]
            a1, a2 = s1[g] + s, s2[g] + s * s
            for const, lin, quad, ovl, mc, ml in opts:
                if mc + ml * a1 > mem:
                    continue
                x, y = quad * a2, ovl * a1
                t = const + lin * a1 + (x if x > y else y)
                if t < bt:
                    bt, bk, bg = t, k, g
        t, k, g = bt, bk, bg
        s1[g] += s
        s2[g] += s * s
        heapq.heapreplace(by_k[k], (t, g))
        owner[i] = g
    return Assignment(list(groups), owner)


def group_sums(assign: Assignment, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) per group of an assignment."""
    G = len(assign.groups)
    return (np.bincount(assign.owner, weights=lens, minlength=G),
            np.bincount(assign.owner, weights=lens * lens, minlength=G))


def group_times(table: Table, assign: Assignment, lens: np.ndarray) -> np.ndarray:
    """Modelled time per group (fastest fitting method; inf where nothing fits memory)."""
    s1, s2 = group_sums(assign, lens)
    k = np.array([table.size_index[d] for _, d in assign.groups], dtype=np.int64)
    return table.best_many(k, s1, s2)


def refine(table: Table, assign: Assignment, lens: np.ndarray, *, max_iters: int = 400,
           deadline: float | None = None, swap_partners: int = 16) -> Assignment:
    """Local search on the slowest group: best single move, else best swap, until none helps.

    Moves are tried to every group; swaps with the members of the ``swap_partners`` least loaded
    groups (bounding a step to O(|slowest group| · n) work).
    A move/swap is taken only when the larger of the two touched groups' new times is below the
    slowest group's current time, so the makespan never grows; on shared cores also the plan's
    total work must stay below it, and a step that does not lower :meth:`Table.plan_time` is undone
    and ends the search (the same step would be chosen again).
    """
    owner = assign.owner.copy()
    k_of = np.array([table.size_index[d] for _, d in assign.groups], dtype=np.int64)
    G = len(assign.groups)
    s1 = np.bincount(owner, weights=lens, minlength=G)
    s2 = np.bincount(owner, weights=lens * lens, minlength=G)
    times, works = table.best_and_work(k_of, s1, s2)
    sq = lens * lens
    for _ in range(max_iters):
        if deadline is not None and _time.perf_counter() > deadline:
            break
        gs = int(np.argmax(times))
        cur = times[gs]
        items = np.flatnonzero(owner == gs)
        if len(items) == 0 or G == 1:
            break
        total = works.sum()
        before = table.plan_time(Assignment(assign.groups, owner), lens) if table.shared else cur
        # moves: item i of gs -> group h
        new_src, w_src = table.best_and_work(np.full(len(items), k_of[gs]), s1[gs] - lens[items],
                                             s2[gs] - sq[items])
        dst_s1 = s1[None, :] + lens[items, None]
        dst_s2 = s2[None, :] + sq[items, None]
        new_dst, w_dst = table.best_and_work(np.broadcast_to(k_of, dst_s1.shape), dst_s1, dst_s2)
        worst = np.maximum(new_src[:, None], new_dst)
        if table.shared:
            worst = np.maximum(worst, total - works[gs] - works[None, :] + w_src[:, None] + w_dst)
        worst[:, gs] = INF
        a, h = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if worst[a, h] < cur * (1 - 1e-12):
            i = items[a]
            _apply(owner, s1, s2, times, works, table, k_of, lens, sq, i, gs, h)
            if _worse(table, assign, owner, lens, before):
                _apply(owner, s1, s2, times, works, table, k_of, lens, sq, i, h, gs)
                break
            continue
        # swaps: item i of gs <-> item j of one of the least loaded groups, s_j < s_i
        partners = np.argsort(times)[:swap_partners]
        others = np.flatnonzero(np.isin(owner, partners[partners != gs]))
        if len(others) == 0:
            break
        delta1 = lens[items, None] - lens[None, others]
        delta2 = sq[items, None] - sq[None, others]
        src, w_src = table.best_and_work(np.full(delta1.shape, k_of[gs]), s1[gs] - delta1, s2[gs] - delta2)
        ho = owner[others]
        dst, w_dst = table.best_and_work(np.broadcast_to(k_of[ho], delta1.shape), s1[ho][None, :] + delta1,
                                         s2[ho][None, :] + delta2)
        worst = np.maximum(src, dst)
        if table.shared:
            worst = np.maximum(worst, total - works[gs] - works[ho][None, :] + w_src + w_dst)
        worst = np.where(delta1 > 0, worst, INF)
        a, b = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if not worst[a, b] < cur * (1 - 1e-12):
            break
        i, j = items[a], others[b]
        h = int(owner[j])
        _apply(owner, s1, s2, times, works, table, k_of, lens, sq, i, gs, h)
        _apply(owner, s1, s2, times, works, table, k_of, lens, sq, j, h, gs)
        if _worse(table, assign, owner, lens, before):
            _apply(owner, s1, s2, times, works, table, k_of, lens, sq, j, gs, h)
            _apply(owner, s1, s2, times, works, table, k_of, lens, sq, i, h, gs)
            break
    return Assignment(assign.groups, owner)


def _worse(table: Table, assign: Assignment, owner: np.ndarray, lens: np.ndarray, before: float) -> bool:
    """On shared cores: True when the step just taken did not lower the plan's modelled time."""
    return table.shared and not table.plan_time(Assignment(assign.groups, owner), lens) < before * (1 - 1e-12)


def _apply(owner, s1, s2, times, works, table, k_of, lens, sq, i, src, dst) -> None:
    """Move sequence i from group src to dst, updating the sums and the two groups' times and work."""
    owner[i] = dst
    for g, sign in ((src, -1.0), (dst, 1.0)):
        s1[g] += sign * lens[i]
        s2[g] += sign * sq[i]
        t, w = table.best_and_work(k_of[g:g + 1], np.maximum(s1[g:g + 1], 0.0), np.maximum(s2[g:g + 1], 0.0))
        times[g], works[g] = t[0], w[0]


def to_plan(table: Table, assign: Assignment, lens: np.ndarray, *, solver: str, started: float,
            fixed_method: str | None = None, bound: float | None = None, notes: str = "") -> Plan:
    """Freeze an assignment into a :class:`Plan`, picking each group's fastest fitting method; its
    estimated time is :meth:`Table.plan_time` (with ``fixed_method``: that method's)."""
    out = []
    s1, s2 = group_sums(assign, lens)
    for g, (start, d) in enumerate(assign.groups):
        seqs = np.flatnonzero(assign.owner == g)
        seqs = tuple(int(i) for i in seqs[np.argsort(-lens[seqs], kind="stable")])
        k = table.size_index[d]
        if fixed_method is not None:
            t, method = table.coeffs(fixed_method, d).time(s1[g], s2[g]), fixed_method
        else:
            t, j = table.best(k, s1[g], s2[g])
            method = table.options[k][max(j, 0)][0]
        out.append(GroupPlan(start=start, size=d, method=method, seqs=seqs, estimated_time=float(t)))
    makespan = max(g.estimated_time for g in out)
    if table.shared:  # the cores shared by the ranks (fixed_method: the table holds only that method)
        makespan = max(makespan, table.plan_time(assign, lens))
    return Plan(world_size=table.cluster.world_size, groups=tuple(out), estimated_time=float(makespan),
                solver=solver, solve_time=_time.perf_counter() - started, bound=bound, notes=notes)
