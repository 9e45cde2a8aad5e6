"""``seqpar bench --emulate N``: every rank's per-step kernels of a method, back to back on one device.

For each rank and step the *schedule of the method itself* says which kernel calls the rank
makes (:func:`rank_calls`): the ring family (``ring``, ``zigzag_ring``, ``striped_ring``,
``allgather_kv``, ``token_ring``, ``lightseq``) from the plan builder of the registry
(:mod:`seqpar.softmax.plans`, expanded to a :class:`~seqpar.softmax.plans.Schedule`: the
blocks of every task of every step); ``ulysses`` one full-length block per GQA head segment of the
rank's head shard (:func:`seqpar.softmax.ulysses.split_heads` / ``gqa_segments``); ``usp`` both
(ring plan of the ring axis on the rank's head shard); the linear methods one local chunked
GLA call on the rank's ``T/N`` tokens (``seqpar.kernels.linear_chunk``; the O(K·V) state scan
between ranks is not timed).

Each call is timed (:func:`clock_of`: CPU time of the process on CPU, synchronised wall time on
CUDA) with :func:`seqpar.kernels.block_forward` / :func:`~seqpar.kernels.block_backward`
on tensors of the rank's local shape (communication and the fp32 merges are not included: this
measures kernel compute, its balance and the overhead of many small blocks). Reported:

- ``efficiency`` = single-device fwd+bwd of the whole problem / (N x the slowest rank's total);
- ``step_efficiency``: the same with every step waiting for its slowest rank (a ring synchronises
  at each step): single / (N x sum over steps of the slowest rank's step time);
- ``imbalance``: max over steps of (max / mean over ranks of that step's time);
- ``bound`` / ``step_bound``: the same two ratios computed from the schedule's visible
  (query, key) pairs x heads instead of times: what a perfect kernel would reach. For causal
  lightseq with even N the bound is about N/(N+1) (docs/methods.md); for zigzag about 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from seqpar.comm.usp_groups import default_ulysses_degree
from seqpar.kernels import block_backward, block_forward
from seqpar.kernels.varlen import visible_pairs
from seqpar.methods import DEFAULT_RING_METHOD
from seqpar.methods import method as declared
from seqpar.softmax.registry import dense_plan
from seqpar.softmax.ulysses import gqa_segments, split_heads

from .core import BenchCase, _sync


@dataclass(frozen=True)
class KernelCall:
    """One block call of one rank: rows ``q`` of a ``[B, t_local, q_heads, D]`` query tensor against
    rows ``kv`` of ``[B, t_kv, kv_heads, D]`` K,V under ``mask`` (top-left aligned). ``linear``: one
    local chunked linear-attention call over ``t_local`` tokens instead (``first``: no incoming state)."""

    q: slice
    kv: slice
    mask: str
    t_local: int
    t_kv: int
    q_heads: int
    kv_heads: int
    linear: bool = False
    first: bool = False

    def pairs(self) -> int:
        """Visible (query, key) pairs x query heads (linear: tokens x heads): the work measure."""
        if self.linear:
            return self.t_local * self.q_heads
        rows = len(range(self.t_local)[self.q])
        cols = len(range(self.t_kv)[self.kv])
        return visible_pairs(rows, cols, self.mask) * self.q_heads


def _ring_calls(method: str, rank: int, n: int, t_local: int, causal: bool, hq: int, hkv: int,
                segments=None) -> list[list[KernelCall]]:
    sched = dense_plan(declared(method, kind="ring"), rank, n, t_local, causal).schedule(t_local)
    heads = segments or [(hq, hkv)]
    return [[KernelCall(b.q, b.kv, b.mask, t_local, t_local, sq, sk)
             for task in step.tasks for b in task.blocks for sq, sk in heads] for step in sched.steps]


def _head_segments(hq: int, hkv: int, u: int, member: int) -> list[tuple[int, int]]:
    q_split, kv_split = split_heads(hq, hkv, u)
    segs = gqa_segments(q_split, kv_split, hq // hkv, member)
    return [(s.q.stop - s.q.start, s.kv.stop - s.kv.start) for s in segs]


def rank_calls(method: str, rank: int, n: int, seq_len: int, causal: bool, heads: int,
               kv_heads: int, ulysses_degree: int | None = None) -> list[list[KernelCall]]:
    """The kernel calls rank ``rank`` of ``n`` makes at each step of ``method`` (outer list: steps),
    for a global length ``seq_len`` with ``heads`` query and ``kv_heads`` K,V heads (batch and head
    dim do not change the schedule). Host-only; built from the method's own schedule."""
    if not declared(method).softmax:
        c = seq_len // n
        return [[KernelCall(slice(0, c), slice(0, c), "causal", c, c, heads, heads, linear=True, first=rank == 0)]]
    mask = "causal" if causal else "none"
    if method == "ulysses":
        full = slice(0, seq_len)
        return [[KernelCall(full, full, mask, seq_len, seq_len, sq, sk)
                 for sq, sk in _head_segments(heads, kv_heads, n, rank)]]
    if method == "usp":
        u = ulysses_degree or default_ulysses_degree(n)
        r = n // u
        member, ring_rank = rank % u, rank // u  # blocks of U consecutive ranks form a Ulysses group
        segs = _head_segments(heads, kv_heads, u, member)
        if r == 1:
            full = slice(0, seq_len)
            return [[KernelCall(full, full, mask, seq_len, seq_len, sq, sk) for sq, sk in segs]]
        return _ring_calls(DEFAULT_RING_METHOD, ring_rank, r, seq_len // r, causal, heads, kv_heads, segs)
    return _ring_calls(method, rank, n, seq_len // n, causal, heads, kv_heads)


class _Tensors:
    """Random operands per local shape, made once and reused by every rank and repeat."""

    def __init__(self, batch: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.b, self.d, self.dtype, self.device, self.cache = batch, head_dim, dtype, device, {}
        self.gen = torch.Generator().manual_seed(0)

    def get(self, t: int, heads: int, name: str) -> torch.Tensor:
        key = (t, heads, name)
        if key not in self.cache:
            x = torch.randn(self.b, t, heads, self.d, generator=self.gen)
            if name == "g":
                x = torch.nn.functional.logsigmoid(x + 3) / 16
            self.cache[key] = x.to(self.device, self.dtype)
        return self.cache[key]


def _run_calls(calls: list[KernelCall], ts: _Tensors, scale: float, keep: list) -> None:
    """Forward of every call (``keep`` receives what the backward needs)."""
    from seqpar.kernels.linear_chunk import chunk_gla_fwd

    for c in calls:
        if c.linear:
            args = [ts.get(c.t_local, c.q_heads, x) for x in ("q", "k", "v", "g")]
            # a rank after the first starts from the state the scan brought it (values do not matter here)
            h0 = None if c.first else torch.zeros(ts.b, c.q_heads, ts.d, ts.d, device=ts.device)
            out, _ = chunk_gla_fwd(*args, initial_state=h0)
            keep.append((c, args, h0))
            continue
        q = ts.get(c.t_local, c.q_heads, "q")[:, c.q]
        k, v = ts.get(c.t_kv, c.kv_heads, "k")[:, c.kv], ts.get(c.t_kv, c.kv_heads, "v")[:, c.kv]
        out, lse = block_forward(q, k, v, scale=scale, mask=c.mask)
        keep.append((c, (q, k, v, out, lse), None))


def _run_backward(kept: list, ts: _Tensors, scale: float) -> None:
    from seqpar.kernels.linear_chunk import chunk_gla_bwd

    for c, args, h0 in kept:
        if c.linear:
            chunk_gla_bwd(*args, ts.get(c.t_local, c.q_heads, "do"), initial_state=h0)
            continue
        q, k, v, out, lse = args
        dout = ts.get(c.t_local, c.q_heads, "do")[:, c.q]
        block_backward(dout, q, k, v, out, lse, scale=scale, mask=c.mask)


def clock_of(device: torch.device):
    """The clock of the emulation: wall time (after a device sync) on CUDA; on CPU the CPU time of
    this process (``time.process_time``, all its threads), which other processes competing for
    the cores do not inflate. Why: under a load average of 7-11 from other jobs on a 2-core
    machine, the wall time of the same single-device call varied from 4.5 s to 10.8 s between
    methods of one run (T=8K, N=8), which made compute efficiencies above 1 appear."""
    return time.perf_counter if device.type == "cuda" else time.process_time


def _time_rank(steps: list[list[KernelCall]], ts: _Tensors, scale: float) -> list[tuple[float, float]]:
    """``(fwd ms, bwd ms)`` of each step of one rank: all forward steps, then the backward of every
    step in the same order (the executor's backward runs the same schedule again)."""
    clock = clock_of(ts.device)
    kept_per_step, out = [], []
    for calls in steps:
        kept: list = []
        _sync(ts.device)
        t0 = clock()
        _run_calls(calls, ts, scale, kept)
        _sync(ts.device)
        out.append([(clock() - t0) * 1e3, 0.0])
        kept_per_step.append(kept)
    for s, kept in enumerate(kept_per_step):
        _sync(ts.device)
        t0 = clock()
        _run_backward(kept, ts, scale)
        _sync(ts.device)
        out[s][1] = (clock() - t0) * 1e3
    return [tuple(x) for x in out]


def _ratios(per_rank_step: list[list[float]], n: int, single: float) -> tuple[float, float, float]:
    """``(single / (N x slowest total), single / (N x sum of step maxima), max step imbalance)``."""
    steps = max(len(x) for x in per_rank_step)
    grid = [[x[s] if s < len(x) else 0.0 for x in per_rank_step] for s in range(steps)]
    slowest = max(sum(x) for x in per_rank_step)
    sync = sum(max(col) for col in grid)
    imb = max((max(col) / (sum(col) / len(col)) for col in grid if sum(col) > 0), default=1.0)
    return single / (n * slowest), single / (n * sync), imb


def _single_key(case: BenchCase) -> tuple:
    """Cases with this key run the same single-device computation (whole problem, one call)."""
    return (case.family, case.seq_len, case.causal, case.batch, case.heads, case.kv_heads, case.head_dim,
            case.dtype)


def emulate_case(case: BenchCase, *, device: str | torch.device | None = None,
                 ulysses_degree: int | None = None, baselines: dict | None = None) -> dict:
    """Emulate ``case.world_size`` ranks of ``case.method`` on one device; returns a row dict with
    ``mode="emulate"`` (see the module docstring; a failure sets ``error``).

    Times are the minimum over ``repeats`` (after ``warmup``) per rank and step: the computation
    is deterministic, so the least-disturbed run is the best estimate of its cost on a shared
    machine (the median carries other jobs' load). ``baselines``: a dict shared between cases so
    that methods with the same single-device problem (:func:`_single_key`) use one measurement of
    it, which keeps their efficiencies comparable."""
    from .core import BenchRow

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n, T = case.world_size, case.seq_len
    row = BenchRow(case, mode="emulate").as_dict()
    nan = float("nan")
    row.update(single_ms=nan, slowest_ms=nan, bound=nan, step_bound=nan, step_efficiency=nan, imbalance=nan,
               calls="-")
    try:
        if case.threads and dev.type == "cpu":
            torch.set_num_threads(case.threads)
        ranks = [rank_calls(case.method, r, n, T, case.causal, case.heads, case.kv_heads, ulysses_degree)
                 for r in range(n)]
        single = rank_calls(case.method, 0, 1, T, case.causal, case.heads, case.kv_heads, 1)
        work = [[sum(c.pairs() for c in calls) for calls in steps] for steps in ranks]
        total = sum(c.pairs() for c in single[0])
        if sum(map(sum, work)) != total:  # the schedules must cover every visible pair exactly once
            raise RuntimeError(f"{case.method}: the ranks' blocks cover {sum(map(sum, work))} pairs, the problem "
                               f"{total} (schedule enumeration is wrong)")
        row["bound"], row["step_bound"], _ = _ratios([[float(w) for w in x] for x in work], n, float(total))
        ts = _Tensors(case.batch, case.head_dim, getattr(torch, case.dtype), dev)
        scale = case.head_dim ** -0.5
        baselines = {} if baselines is None else baselines
        key = _single_key(case)
        if key not in baselines:
            baselines[key] = [_time_rank(single, ts, scale) for _ in range(case.warmup + case.repeats)][case.warmup:]
        one = baselines[key]
        reps = [[_time_rank(steps, ts, scale) for steps in ranks] for _ in range(case.warmup + case.repeats)]
        reps = reps[case.warmup:]
        t_single = min(sum(f + b for f, b in x) for x in one)
        # per rank and step: the minimum over repeats of fwd+bwd
        med = [[min(rep[r][s][0] + rep[r][s][1] for rep in reps) for s in range(len(ranks[r]))] for r in range(n)]
        row["efficiency"], row["step_efficiency"], row["imbalance"] = _ratios(med, n, t_single)
        totals = [sum(x) for x in med]
        slow = max(range(n), key=lambda r: totals[r])
        row.update(single_ms=t_single, slowest_ms=totals[slow],
                   fwd_ms=min(sum(f for f, _ in rep[slow]) for rep in reps),
                   bwd_ms=min(sum(b for _, b in rep[slow]) for rep in reps),
                   fwd_ms_1=min(sum(f for f, _ in x) for x in one),
                   bwd_ms_1=min(sum(b for _, b in x) for x in one),
                   calls="-".join(sorted({str(sum(map(len, s))) for s in ranks}, key=int)))
        row["extra"] = {"rank_ms": totals, "rank_pairs": [sum(x) for x in work],
                        "rank_calls": [sum(map(len, s)) for s in ranks], "steps": max(map(len, ranks)),
                        "device": str(dev), "clock": clock_of(dev).__name__}
    except Exception as exc:  # a failing row is reported, the others go on
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def emulate_cases(cases: list[BenchCase], *, progress: bool = True, device=None) -> list[dict]:
    """:func:`emulate_case` for each case, with a progress bar."""
    from .core import _progress

    baselines: dict = {}
    return [emulate_case(c, device=device, baselines=baselines) for c in _progress(cases, "emulating", progress)]
