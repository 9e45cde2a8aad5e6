"""Cases, FLOP formulas and the per-rank runner of ``seqpar bench``.

One :class:`BenchCase` is one method at one global shape on N ranks. :func:`run_case_on_rank`
runs it on every rank of the default process group (all ranks call it together): forward and
backward times are the median over ``repeats`` (after ``warmup``) of the slowest rank; the same
computation is then timed on one rank (a group of one, same threads) for the ideal
``t_1 / N`` and the error. Linear-attention methods (``zeco``, ``lasp2``, ``lasp1``) run through
:func:`seqpar.linear.linear_attention` with a per-key log-decay, softmax methods through
:func:`seqpar.attention`.

By default :func:`run_cases` spawns N local CPU ranks (gloo, :class:`seqpar.comm.pool.LocalRanks`,
kept for the command's cases); under ``torchrun`` the launched ranks are used (NCCL and one GPU per rank
when CUDA is available).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from seqpar.comm import CommStats, TokenRingGroups
from seqpar.comm.collectives import peer_errors
from seqpar.comm.launch import launched_by_torchrun as launched
from seqpar.comm.launch import launched_process_group
from seqpar.comm.launch import progress_track as _progress
from seqpar.comm.pool import LocalRanks
from seqpar.comm.usp_groups import default_ulysses_degree
from seqpar.kernels.linear_chunk import (
    CHUNK as LINEAR_CHUNK,  # the chunk of the linear kernels
)
from seqpar.layouts import packed_layout, shard, unshard
from seqpar.linear import linear_attention
from seqpar.methods import LINEAR_METHODS, head_imbalance
from seqpar.methods import method as declared
from seqpar.softmax import attention
from seqpar.tracing import Trace, attention_flops, trace
from seqpar.tracing import linear_flops as _linear_flops

from .memory import PeakMemory


@dataclass(frozen=True)
class BenchCase:
    """One row of the matrix: ``method`` on a ``[batch, seq_len, heads, head_dim]`` problem
    (K,V with ``kv_heads`` heads) split over ``world_size`` ranks.

    ``packed_seed``: one packed stream of stdlib document lengths (``--packed``) instead of a dense
    batch. Linear methods are always causal and need ``kv_heads == heads``.
    """

    method: str
    seq_len: int
    world_size: int
    causal: bool = True
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    repeats: int = 3
    warmup: int = 1
    threads: int = 1
    packed_seed: int | None = None

    @property
    def family(self) -> str:
        """``"linear"`` for linear attention, else ``"softmax"``."""
        return "linear" if self.method in LINEAR_METHODS else "softmax"

    @property
    def head_imbalance(self) -> float:
        """Most query heads on one rank over the mean, for methods that shard heads (ulysses: over N;
        usp: over its default Ulysses degree); 1.0 for the others and whenever the degree divides
        ``heads``. NaN when the heads cannot be split at all (the row then fails)."""
        if not declared(self.method).head_sharded:
            return 1.0
        degree = self.world_size if self.method == "ulysses" else default_ulysses_degree(self.world_size)
        return head_imbalance(self.heads, degree) if self.heads >= degree else float("nan")


def linear_flops(batch: int, seq_len: int, heads: int, key_dim: int, value_dim: int,
                 chunk: int = LINEAR_CHUNK) -> tuple[float, float]:
    """:func:`seqpar.tracing.linear_flops` with the chunk of seqpar's linear kernels."""
    return _linear_flops(batch, seq_len, heads, key_dim, value_dim, chunk)


def case_flops(case: BenchCase) -> tuple[float, float]:
    """``(forward, backward)`` FLOPs of one case (whole problem, all ranks together)."""
    b = 1 if case.packed_seed is not None else case.batch
    if case.family == "linear":
        return linear_flops(b, case.seq_len, case.heads, case.head_dim, case.head_dim)
    return attention_flops(b, case.seq_len, case.heads, case.head_dim, case.causal)


def stdlib_doc_lengths(total: int, seed: int = 0) -> list[int]:
    """A packed batch of ``total`` tokens drawn from a long-tailed real length distribution available
    offline: the byte sizes of the Python standard library's ``.py`` files / 4 (a token estimate,
    :func:`seqpar.schedulers.data.stdlib_lengths`), sampled with ``seed`` until the total is reached
    (the last document is cut to fit)."""
    import random

    from seqpar.schedulers.data import stdlib_lengths

    sizes = [int(x) for x in stdlib_lengths()]
    rng, lens = random.Random(seed), []
    while sum(lens) < total:
        lens.append(min(rng.choice(sizes), total - sum(lens)))
    return lens


@dataclass
class BenchRow:
    """Measured numbers of one case. Times in ms (slowest rank, median over repeats); ``*_1``: the
    same computation on one rank; bytes are the most any rank sent; ``peak_mem`` (bytes) the most
    any rank held (:class:`~seqpar.bench.memory.PeakMemory`); ``max_error`` relative to the
    single-rank output; ``error`` is set instead when the row failed. :meth:`as_dict` adds the
    case's ``family`` and ``head_imbalance`` (:attr:`BenchCase.head_imbalance`)."""

    case: BenchCase
    mode: str = "dist"
    fwd_ms: float = float("nan")
    bwd_ms: float = float("nan")
    fwd_ms_1: float = float("nan")
    bwd_ms_1: float = float("nan")
    efficiency: float = float("nan")
    step_ms: float = float("nan")  # forward+backward of the slowest rank (what a training step waits for)
    tokens_per_s: float = float("nan")
    tflops: float = float("nan")
    bytes_fwd: int = 0
    bytes_bwd: int = 0
    busiest_link: int = 0
    busiest_link_step: int = 0  # forward: most bytes sent to one peer within one step
    peak_mem: int = 0
    peak_mem_1: int = 0
    max_error: float = float("nan")
    error: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self.case)
        d["family"], d["head_imbalance"] = self.case.family, self.case.head_imbalance
        d.update({k: v for k, v in asdict(self).items() if k != "case"})
        return d


def _device() -> torch.device:
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):  # "nccl" or "cpu:gloo,cuda:nccl"
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(case: BenchCase, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """Global inputs (the same on every rank): softmax ``q, k, v, dout``; linear ``q, k, v, g, dout``
    with a per-key log-decay ``g <= 0``."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    B, T, H, Hk, D = case.batch, case.seq_len, case.heads, case.kv_heads, case.head_dim
    if case.packed_seed is not None:
        B = 1  # one packed stream
    if case.family == "linear":
        shapes = [(B, T, H, D)] * 5
    else:
        shapes = [(B, T, H, D), (B, T, Hk, D), (B, T, Hk, D), (B, T, H, D)]
    xs = [torch.randn(s, generator=gen) for s in shapes]
    if case.family == "linear":
        xs[3] = torch.nn.functional.logsigmoid(xs[3] + 3) / 16  # decays in (0, 1), as in seqpar.linear.bench
    return [x.to(device, dtype) for x in xs]


def _call(case: BenchCase, tensors, group, stats=None, comm=None, cu_seqlens=None):
    """One forward + backward; returns ``(out, fwd_ms, bwd_ms)``."""
    device = tensors[0].device
    *ins, dout = tensors
    leaves = [t.detach().requires_grad_() for t in ins]
    if group is not None:
        with peer_errors(group, "bench barrier"):
            dist.barrier(group)
    _sync(device)
    t0 = time.perf_counter()
    if case.family == "linear":
        q, k, v, g = leaves
        out, _ = linear_attention(q, k, v, g, group=group, method=case.method, stats=stats)
    else:
        q, k, v = leaves
        out = attention(q, k, v, method=case.method, causal=case.causal, group=comm or group,
                               stats=stats, cu_seqlens=cu_seqlens)
    _sync(device)
    t1 = time.perf_counter()
    out.backward(dout)
    _sync(device)
    t2 = time.perf_counter()
    return out.detach(), (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _reduce(x: float, group, op=None) -> float:
    if group is None:
        return x
    t = torch.tensor([float(x)], dtype=torch.float64, device=_device())
    with peer_errors(group, "bench all-reduce"):
        dist.all_reduce(t, op=op or dist.ReduceOp.MAX, group=group)
    return float(t)


_TWO_WAY = ("token_ring", "lightseq")


def _timed(case, tensors, group, *, stats=None, comm=None, cu=None):
    """Warm-up, then ``repeats`` timed calls, then one call under :class:`PeakMemory`.
    Returns ``(out, fwd list, bwd list, step list, peak bytes)``; times are this rank's."""
    fwd, bwd, step, out = [], [], [], None
    for i in range(case.warmup + case.repeats):
        out, tf, tb = _call(case, tensors, group, stats=stats if i == 0 else None, comm=comm, cu_seqlens=cu)
        if i >= case.warmup:
            fwd.append(tf)
            bwd.append(tb)
            step.append(tf + tb)
    with PeakMemory(tensors[0].device) as mem:
        _call(case, tensors, group, comm=comm, cu_seqlens=cu)
    return out, fwd, bwd, step, mem.peak


def trace_file(case: BenchCase, rank: int) -> str:
    """The name of a rank's trace file of ``case`` (``seqpar bench --trace DIR``)."""
    return f"{case.method}_n{case.world_size}_t{case.seq_len}_rank{rank}.json"


def _trace_call(case: BenchCase, tensors, group, comm, cu, trace_dir: str) -> None:
    """One more (untimed) forward+backward, recorded in a :class:`seqpar.Trace` saved to ``trace_dir``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    rec = Trace(rank=rank, world_size=case.world_size, meta={**asdict(case), "family": case.family})
    with trace(rec):
        _call(case, tensors, group, comm=comm, cu_seqlens=cu)
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    rec.save(Path(trace_dir) / trace_file(case, rank))


def run_case_on_rank(case: BenchCase, trace_dir: str | None = None) -> dict:
    """Run one case on this rank (all ranks of the default group call it). Returns the row as a dict
    (complete on rank 0; a failure is caught and reported in ``error``). ``trace_dir``: also save
    every rank's trace of one more step there (:func:`trace_file`)."""
    torch.set_num_threads(case.threads)
    n = dist.get_world_size() if dist.is_initialized() else 1
    group = dist.group.WORLD if dist.is_initialized() else None
    device = _device()
    row = BenchRow(case)
    try:
        if n != case.world_size:
            raise ValueError(f"world_size: the case asks for {case.world_size} ranks but {n} are running")
        tensors = _inputs(case, device)
        pl = None
        if case.packed_seed is not None:  # one packed stream; geometry built once, reused by every repeat
            lens = stdlib_doc_lengths(case.seq_len, case.packed_seed)
            cu = [0] + [sum(lens[:i + 1]) for i in range(len(lens))]
            pl = packed_layout(cu, method=case.method, group=group)
            if case.method not in ("usp",):
                w = [pl.work(r, case.causal) for r in range(pl.n)] if pl.n > 1 else [1]
                row.extra.update(docs=len(lens), max_doc=max(lens), balance=max(w) * len(w) / sum(w),
                                 padding=pl.num_padding / pl.total_tokens)
        local = [shard(t, method=case.method, group=group, cu_seqlens=pl) for t in tensors]
        stats = CommStats()
        # methods whose two traffic directions get their own communicators (created once, collectively)
        comm = TokenRingGroups(group) if group is not None and case.method in _TWO_WAY else None
        out, fwd, bwd, step, peak = _timed(case, local, group, stats=stats, comm=comm, cu=pl)
        if trace_dir:
            _trace_call(case, local, group, comm, pl, trace_dir)
        if comm is not None:
            comm.destroy()
        # the slowest rank per repeat: max(fwd) + max(bwd) would count a rank that finished its
        # forward early and then waits in backward for the others twice
        row.fwd_ms = statistics.median(_reduce(x, group) for x in fwd)
        row.bwd_ms = statistics.median(_reduce(x, group) for x in bwd)
        row.step_ms = statistics.median(_reduce(x, group) for x in step)
        row.bytes_fwd = int(_reduce(stats.total("fwd"), group))
        row.bytes_bwd = int(_reduce(stats.total("bwd"), group))
        row.busiest_link = int(_reduce(max(stats.busiest_link("fwd"), stats.busiest_link("bwd")), group))
        row.busiest_link_step = int(_reduce(stats.busiest_link_per_step("fwd"), group))
        row.peak_mem = int(_reduce(peak, group))
        full = unshard(out, method=case.method, group=group, cu_seqlens=pl)
        f_flops, b_flops = case_flops(case)
        row.tokens_per_s = (1 if pl is not None else case.batch) * case.seq_len / (row.step_ms * 1e-3)
        row.tflops = (f_flops + b_flops) / (row.step_ms * 1e-3) / 1e12
        # single-rank baseline with the same threads: the same method on a group of one rank
        solo = None
        if dist.is_initialized():
            solo = [dist.new_group([r]) for r in range(n)][dist.get_rank()]  # every rank creates every group
        if not dist.is_initialized() or dist.get_rank() == 0:
            pl1 = None
            if pl is not None:  # the same packed batch on one rank (its own, one-rank layout)
                pl1 = packed_layout(pl.cu_seqlens, method=case.method, group=solo)
            one = tensors if pl1 is None else [shard(t, method=case.method, cu_seqlens=pl1, group=solo)
                                                for t in tensors]
            out1, f1, b1, _, row.peak_mem_1 = _timed(case, one, solo, cu=pl1)
            row.fwd_ms_1, row.bwd_ms_1 = statistics.median(f1), statistics.median(b1)
            if pl1 is not None:
                out1 = unshard(out1, method=case.method, cu_seqlens=pl1, group=solo)
            ref = out1.double()
            row.max_error = float((full.double() - ref).abs().max() / ref.abs().max())
            row.efficiency = (row.fwd_ms_1 + row.bwd_ms_1) / (n * row.step_ms)
    except Exception as exc:  # a failing row is reported, the others go on
        row.error = f"{type(exc).__name__}: {exc}"
    return row.as_dict()


def run_cases(cases: list[BenchCase], *, progress: bool = True, trace_dir: str | None = None) -> list[dict]:
    """Run cases on local CPU ranks (spawned, gloo) or, under torchrun, on the launched ranks.
    A case that fails (on any rank, or by timing out) gives a row with ``error`` set; the others run.
    ``trace_dir``: every rank of every case also saves a trace of one step there."""
    rows = []
    if launched():
        with launched_process_group():
            return [run_case_on_rank(case, trace_dir) for case in
                    _progress(cases, "benchmarking", progress and os.environ.get("RANK", "0") == "0")]
    with LocalRanks() as ranks:
        for case in _progress(cases, "benchmarking", progress):
            try:
                rows.append(ranks.run(run_case_on_rank, case.world_size, case, trace_dir, timeout=3600)[0])
            except Exception as exc:
                rows.append(BenchRow(case, error=f"{type(exc).__name__}: {exc}").as_dict())
    return rows
