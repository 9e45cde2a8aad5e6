"""The MILP planner (seqpar/schedulers/README.md), solved by HiGHS through ``scipy.optimize.milp``.

Lengths are grouped into at most ``num_buckets`` buckets by a 1-D dynamic programme that minimises
the padded compute ``Σ w(bucket max) - w(s)`` with ``w(s) = α2·s + α1·s²`` (padding a long
sequence costs more than padding a short one). Time uses each bucket's mean s and mean s² (with the
longest member instead, the bucketed optimum sat ~12% above real plans on stdlib batches and never
beat the greedy plan); memory uses the longest member, so memory limits stay safe.

Variables: ``y_g`` binary for every candidate group g = (aligned block, method); ``n_bg`` integer,
the number of bucket-b sequences group g runs; ``C`` the makespan. Constraints: every rank covered
by exactly one selected block; every bucket's count placed; ``n_bg ≤ cap_bg·y_g``; memory of each
group; ``C ≥ const·y_g + Σ_b n_bg·(lin·ℓ_b + quad·ℓ_b²)`` and ``C ≥ const·y_g + Σ_b n_bg·(lin +
overlap)·ℓ_b`` (the max of the cost model, exact because it is minimised); on ranks sharing CPU
cores one more row, ``C ≥`` the plan's total compute over the cores (a relaxation of
:meth:`.assign.Table.plan_time`; there every method is kept, and the MILP may pick a slower one
for its smaller work, which decoding replaces by the fastest again); and, to break the
symmetry of equal blocks, sizes non-increasing from rank 0 (any multiset of power-of-two sizes can
be placed that way, so no plan is lost). An empty selected group is charged its constant, which
never binds: every busy group costs at least the smallest constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .assign import Table


def bucketize(lens: np.ndarray, weight: tuple[float, float], num_buckets: int = 16) -> "Buckets":
    """Optimal contiguous bucketing of the distinct lengths (1-D DP, O(num_buckets · m²) for m values).

    ``weight = (a2, a1)`` defines w(s) = a2·s + a1·s²; the DP minimises the padding
    Σ (w(bucket max) - w(s)). Exact (one bucket per distinct length) when there are at most
    ``num_buckets`` distinct lengths.
    """
    values, inverse, cnt = np.unique(lens, return_inverse=True, return_counts=True)
    m = len(values)
    kmax = min(num_buckets, m)
    if kmax == m:
        return _stats(lens, inverse, m)
    a2, a1 = weight
    w = a2 * values + a1 * values * values
    pc = np.concatenate([[0.0], np.cumsum(cnt)])
    pw = np.concatenate([[0.0], np.cumsum(cnt * w)])
    # cost[i, j] of one bucket holding values i..j (i <= j): count·w(v_j) - Σ count·w
    i = np.arange(m)[:, None]
    j = np.arange(m)[None, :]
    cost = np.where(i <= j, (pc[j + 1] - pc[i]) * w[j] - (pw[j + 1] - pw[i]), np.inf)
    dp = cost[0].copy()  # dp[j]: best cost of values 0..j in k buckets
    choice = np.zeros((kmax, m), dtype=np.int64)
    for k in range(1, kmax):
        prev = np.concatenate([[np.inf], dp[:-1]])  # bucket starting at i follows dp[i-1]
        total = prev[:, None] + cost  # [i, j]
        arg = np.argmin(total, axis=0)
        new = total[arg, np.arange(m)]
        better = new < dp
        choice[k] = np.where(better, arg, -1)
        dp = np.where(better, new, dp)
        choice[k][~better] = -1
    # walk back: recompute boundaries
    bounds, j, k = [], m - 1, kmax - 1
    while j >= 0:
        while k > 0 and choice[k, j] < 0:
            k -= 1
        i0 = int(choice[k, j]) if k > 0 else 0
        bounds.append((i0, j))
        j, k = i0 - 1, k - 1
    bounds.reverse()
    value_bucket = np.empty(m, dtype=np.int64)
    for q, (a, b) in enumerate(bounds):
        value_bucket[a:b + 1] = q
    return _stats(lens, value_bucket[inverse], len(bounds))


@dataclass(frozen=True)
class Buckets:
    """Length buckets: per bucket the count, the longest member (memory), and the mean of s and of
    s² (time: a group's bucketed S1, S2 are exact whenever it takes a whole bucket, and the decoding
    balances the members of a bucket across the groups that share it)."""

    counts: np.ndarray
    longest: np.ndarray
    mean: np.ndarray
    mean_sq: np.ndarray
    bucket_of: np.ndarray

    def __len__(self) -> int:
        return len(self.counts)


def _stats(lens: np.ndarray, bucket_of: np.ndarray, nb: int) -> Buckets:
    counts = np.bincount(bucket_of, minlength=nb)
    longest = np.zeros(nb)
    np.maximum.at(longest, bucket_of, lens)
    mean = np.bincount(bucket_of, weights=lens, minlength=nb) / counts
    mean_sq = np.bincount(bucket_of, weights=lens * lens, minlength=nb) / counts
    return Buckets(counts.astype(np.int64), longest, mean, mean_sq, np.asarray(bucket_of, dtype=np.int64))


# A time-limited solve is attempted only with at least this much time per integer variable. On the
# 2-core development machine HiGHS needed ~50 ms to find an incumbent for 375 variables (8 GPUs,
# 512 sequences) and found none within 50 ms for 3.4K variables (64 GPUs), overrunning its limit
# by up to a second on 40K variables (256 GPUs) in presolve.
SECONDS_PER_VARIABLE = 100e-6


@dataclass
class MilpResult:
    """Decoded MILP solution: chosen groups [(start, size, option index)], counts [G_sel, B]."""

    groups: list[tuple[int, int, int]]
    counts: np.ndarray
    objective: float
    bound: float | None
    status: int
    message: str


@dataclass
class _Candidates:
    """The MILP's variables: candidate groups g = (aligned block, method option) and the (g, bucket)
    pairs p a group may take, with the per-candidate coefficient vectors of the table."""

    ks: np.ndarray
    js: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    co: dict
    per_a: np.ndarray  # [G, B] compute side of the time row per sequence of each bucket
    per_b: np.ndarray  # [G, B] communication side
    per_m: np.ndarray  # [G, B] memory per sequence
    pg: np.ndarray
    pb: np.ndarray
    pcap: np.ndarray

    @property
    def G(self) -> int:
        return len(self.ks)

    @property
    def P(self) -> int:
        return len(self.pg)


def _candidates(table: Table, buckets: Buckets, upper: float | None) -> _Candidates | None:
    """Every (block, method option) candidate and the buckets it can take; None when some bucket
    fits no candidate under ``upper`` (the greedy plan's makespan) and memory."""
    E, counts = table.memory, buckets.counts.astype(np.float64)
    ks, js, starts = [], [], []
    for k, d in enumerate(table.sizes):
        blocks = np.array(table.cluster.aligned_blocks(d))
        for j in range(len(table.options[k])):
            ks.append(np.full(len(blocks), k))
            js.append(np.full(len(blocks), j))
            starts.append(blocks)
    ks, js, starts = np.concatenate(ks), np.concatenate(js), np.concatenate(starts)
    co = {n: a[ks, js] for n, a in table.arr.items()}  # coefficient vectors over candidates
    per_a = co["lin"][:, None] * buckets.mean + co["quad"][:, None] * buckets.mean_sq  # [G, B]
    per_b = (co["lin"] + co["overlap"])[:, None] * buckets.mean
    per_m = co["mem_lin"][:, None] * buckets.longest
    room = (E - co["mem_const"])[:, None]
    cap = np.minimum(counts[None, :], np.where(room > 0, np.floor(room / np.maximum(per_m, 1e-300) + 1e-9), 0))
    if upper is not None:
        slack = (upper - co["const"])[:, None]
        cap = np.minimum(cap, np.floor(slack / np.maximum(np.maximum(per_a, per_b), 1e-300) + 1e-9))
    pg, pb = np.nonzero(cap >= 1)
    if len(pg) == 0 or len(np.unique(pb)) < len(buckets):
        return None
    return _Candidates(ks, js, starts, np.array(table.sizes)[ks], co, per_a, per_b, per_m, pg, pb, cap[pg, pb])


class _Rows:
    """Sparse constraint rows ``lo <= A x <= hi``, appended block by block."""

    def __init__(self) -> None:
        self.rows, self.cols, self.vals, self.lo, self.hi, self.n = [], [], [], [], [], 0

    def add(self, rr, cc, vv, lower_b, upper_b, nrows: int) -> None:
        self.rows.append(self.n + np.asarray(rr, dtype=np.int64))
        self.cols.append(np.asarray(cc, dtype=np.int64))
        self.vals.append(np.broadcast_to(np.asarray(vv, dtype=np.float64), np.shape(cc)))
        self.lo.append(np.broadcast_to(np.float64(lower_b), (nrows,)) if np.ndim(lower_b) == 0 else lower_b)
        self.hi.append(np.broadcast_to(np.float64(upper_b), (nrows,)) if np.ndim(upper_b) == 0 else upper_b)
        self.n += nrows

    def constraint(self, nv: int, LinearConstraint, coo_matrix):
        A = coo_matrix((np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
                       shape=(self.n, nv)).tocsr()
        return LinearConstraint(A, np.concatenate(self.lo), np.concatenate(self.hi))


def _model_rows(table: Table, buckets: Buckets, c: _Candidates) -> _Rows:
    """Coverage, placement, linking, memory, time (and shared-core work) rows; variables are the G
    group selections y_g, then the P counts n_bg, then the makespan C."""
    G, P, E = c.G, c.P, table.memory
    iC, rows = G + P, _Rows()
    # coverage: every rank in exactly one selected block
    offs = np.arange(c.sizes.sum()) - np.repeat(np.cumsum(c.sizes) - c.sizes, c.sizes)
    rows.add(np.repeat(c.starts, c.sizes) + offs, np.repeat(np.arange(G), c.sizes), 1.0, 1.0, 1.0,
             table.cluster.world_size)
    # every bucket placed
    counts = buckets.counts.astype(np.float64)
    rows.add(c.pb, G + np.arange(P), 1.0, counts, counts, len(buckets))
    # linking n_bg <= cap·y_g
    ar, ag = np.arange(P), np.arange(G)
    rows.add(np.concatenate([ar, ar]), np.concatenate([G + ar, c.pg]), np.concatenate([np.ones(P), -c.pcap]),
             -np.inf, 0.0, P)
    # memory (scaled by 1/E): Σ_b mem·n_bg <= (E - mem_const)·y_g
    rows.add(np.concatenate([c.pg, ag]), np.concatenate([G + ar, ag]),
             np.concatenate([c.per_m[c.pg, c.pb] / E, -(E - c.co["mem_const"]) / E]), -np.inf, 0.0, G)
    # time: const·y_g + Σ_b n_bg·coef - C <= 0, for the compute side and the communication side
    for per in ((c.per_a, c.per_b) if np.any(c.co["overlap"] > 0) else (c.per_a,)):
        rows.add(np.concatenate([c.pg, ag, ag]), np.concatenate([G + ar, ag, np.full(G, iC)]),
                 np.concatenate([per[c.pg, c.pb], c.co["const"], -np.ones(G)]), -np.inf, 0.0, G)
    if table.shared:  # ranks sharing cores: the plan's total work over the cores - C <= 0, one row
        # (without the per-group constants: an idle selected group does no work, and the row stays a
        # relaxation of Table.plan_time that the greedy plan's bucketed makespan always satisfies)
        per_w = c.co["wlin"][:, None] * buckets.mean + c.co["wquad"][:, None] * buckets.mean_sq
        rows.add(np.zeros(P + 1, dtype=np.int64), np.concatenate([G + ar, [iC]]),
                 np.concatenate([per_w[c.pg, c.pb], [-1.0]]), -np.inf, 0.0, 1)
    _symmetry_rows(table, c, rows)
    return rows


def _symmetry_rows(table: Table, c: _Candidates, rows: _Rows) -> None:
    """Symmetry: the rank before a block of size d lies in a selected block of size >= d."""
    sym_r, sym_c, sym_v = [], [], []
    n_sym = 0
    cand_of: dict = {}  # (size, start) -> candidate indices
    for g, key in enumerate(zip(c.sizes.tolist(), c.starts.tolist())):
        cand_of.setdefault(key, []).append(g)
    for (d, st), own in cand_of.items():
        if st == 0:
            continue
        cover = [g for d2 in table.sizes if d2 >= d for g in cand_of.get((d2, ((st - 1) // d2) * d2), ())]
        sym_r += [n_sym] * (len(own) + len(cover))
        sym_c += own + cover
        sym_v += [1.0] * len(own) + [-1.0] * len(cover)
        n_sym += 1
    if n_sym:
        rows.add(np.array(sym_r), np.array(sym_c), np.array(sym_v), -np.inf, 0.0, n_sym)


def solve_milp(table: Table, buckets: Buckets, *, upper: float | None,
               lower: float, time_limit: float | None, mip_gap: float) -> tuple[MilpResult | None, str]:
    """Build (vectorised) and solve the MILP. Returns (result, "") or (None, why not): scipy missing,
    model too large for the time limit (see SECONDS_PER_VARIABLE), infeasible, or no incumbent."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        return None, "scipy is not installed"
    c = _candidates(table, buckets, upper)
    if c is None:
        return None, "no candidate group can take some bucket under the greedy plan's makespan"
    G, P = c.G, c.P
    if time_limit is not None and time_limit < SECONDS_PER_VARIABLE * (G + P):
        return None, (f"MILP of {G + P} integer variables skipped: it needs about "
                      f"{SECONDS_PER_VARIABLE * (G + P) * 1e3:.0f} ms, {time_limit * 1e3:.0f} ms were left")
    iC, nv = G + P, G + P + 1
    constraints = _model_rows(table, buckets, c).constraint(nv, LinearConstraint, coo_matrix)
    c_obj = np.zeros(nv)
    c_obj[iC] = 1.0
    integrality = np.ones(nv)
    integrality[iC] = 0
    ub = np.concatenate([np.ones(G), c.pcap, [np.inf if upper is None else upper]])
    lb = np.concatenate([np.zeros(G + P), [lower]])
    options = {"mip_rel_gap": mip_gap, "presolve": True}
    if time_limit is not None:
        options["time_limit"] = max(float(time_limit), 1e-3)
    res = milp(c_obj, integrality=integrality, bounds=Bounds(lb, ub), constraints=constraints, options=options)
    if res.x is None:
        return None, f"HiGHS found no solution better than greedy (status {res.status}: {res.message})"
    return _decode(res, c, len(buckets))


def _decode(res, c: _Candidates, B: int) -> tuple[MilpResult | None, str]:
    x, G, P = res.x, c.G, c.P
    chosen = np.flatnonzero(x[:G] > 0.5)
    index = {int(g): t for t, g in enumerate(chosen)}
    cnt = np.zeros((len(chosen), B), dtype=np.int64)
    for p in np.flatnonzero(np.round(x[G:G + P]) > 0):
        if int(c.pg[p]) not in index:
            return None, "inconsistent MILP solution (counts on an unselected group)"
        cnt[index[int(c.pg[p])], c.pb[p]] += int(round(x[G + p]))
    groups = [(int(c.starts[g]), int(c.sizes[g]), int(c.js[g])) for g in chosen]
    bound = getattr(res, "mip_dual_bound", None)
    bound = None if bound is None or not math.isfinite(bound) else float(bound)
    return MilpResult(groups, cnt, float(x[G + P]), bound, int(res.status), str(res.message)), ""
