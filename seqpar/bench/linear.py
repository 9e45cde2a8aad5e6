"""Per-rank benchmark entry point for the linear-attention methods (for ``seqpar bench --linear``).

:func:`bench_linear` runs on every rank of ``group`` (all ranks call it together) and returns this
rank's timings and bytes. A CLI runs it for N = 1 (the single-rank time) and N = 2, 4, 8 and reports
efficiency against the ideal with :func:`efficiency`. Bytes are those of one call (forward and
backward), counted by :class:`~seqpar.comm.stats.CommStats`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.collectives import all_reduce_, peer_errors
from ..comm.groups import collective_device, group_info
from ..comm.stats import CommStats
from ..linear import linear_attention


def efficiency(t_single: float, t_parallel: float, n: int) -> float:
    """Ideal time (single-rank time / N) over the measured time: 1.0 is perfect scaling."""
    return t_single / (n * t_parallel)


def _inputs(B: int, t_local: int, H: int, K: int, V: int, decay: str, dev, dtype, gen, backward: bool):
    """q, k, v, g (or None), dout of one rank: random, log-decays in (-1/16, 0)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    q, k, v = rnd(B, t_local, H, K), rnd(B, t_local, H, K), rnd(B, t_local, H, V)
    g = None
    if decay == "k":
        g = F.logsigmoid(rnd(B, t_local, H, K).float() + 3).to(dtype) / 16
    elif decay == "s":
        g = F.logsigmoid(rnd(B, t_local, H).float() + 3).to(dtype) / 16
    for t in (q, k, v) + ((g,) if g is not None else ()):
        t.requires_grad_(backward)
    return q, k, v, g, rnd(B, t_local, H, V)


def _add_stats(stats: CommStats, one: CommStats) -> None:
    for table in ("sent", "calls", "peer_bytes"):
        for key, val in getattr(one, table).items():
            getattr(stats, table)[key] += val


def bench_linear(method: str, T_global: int, H: int, K: int, V: int, repeats: int = 3,
                 stats: CommStats | None = None, *, B: int = 1, group=None, dtype=torch.float32,
                 decay: str = "k", backward: bool = True, warmup: int = 1, device=None, seed: int = 0) -> dict:
    """Time ``linear_attention`` on this rank's contiguous shard of a ``[B, T_global, H, K]`` problem.

    ``decay``: ``"k"`` (per-key log-decay), ``"s"`` (scalar per head) or ``"none"``. Each repeat is
    one forward and (if ``backward``) one backward, with a barrier before it; times are medians
    over ``repeats`` and the ``*_max`` fields are the slowest rank's (what a training step waits
    for). ``cpu_s`` is this process's CPU time for one call (all its threads): on an oversubscribed
    machine it measures the work a rank does, where wall time measures the machine's load.
    ``stats``, when given, receives the bytes of one call. ``device``: where the tensors live
    (default: the group's, i.e. this rank's GPU under NCCL, else the CPU). Returns a dict of plain
    numbers.
    """
    info = group_info(group)
    n = info.size
    if T_global % n:
        raise ValueError(f"T_global: {T_global} is not divisible by the group size {n}")
    t_local = T_global // n
    dev = collective_device(group) if device is None else torch.device(device)
    q, k, v, g, do = _inputs(B, t_local, H, K, V, decay, dev, dtype, torch.Generator().manual_seed(seed + info.rank),
                             backward)
    leaves = [t for t in (q, k, v, g) if t is not None]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def call(st=None):
        sync()
        if not info.single:
            with peer_errors(info, "bench barrier"):
                dist.barrier(group=info.group)
        c0, t0 = time.process_time(), time.perf_counter()
        o, _ = linear_attention(q, k, v, g, group=group, method=method, stats=st)
        sync()
        t1 = time.perf_counter()
        if backward:
            torch.autograd.grad(o, leaves, do)
            sync()
        return t1 - t0, time.perf_counter() - t1, time.process_time() - c0

    one = CommStats()
    call(one)                                     # untimed: counts the bytes of one call
    if stats is not None:
        _add_stats(stats, one)
    for _ in range(warmup):
        call()
    fwd, bwd, cpu = zip(*(call() for _ in range(repeats)))
    res = {"method": method, "N": n, "rank": info.rank, "B": B, "T_global": T_global, "T_local": t_local,
           "H": H, "K": K, "V": V, "dtype": str(dtype).replace("torch.", ""), "decay": decay,
           "fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd) if backward else 0.0,
           "cpu_s": statistics.median(cpu), "bytes_fwd": one.total("fwd"), "bytes_bwd": one.total("bwd"),
           "bytes_by_primitive": one.as_dict()}
    res["total_s"] = res["fwd_s"] + res["bwd_s"]
    worst = torch.tensor([res["fwd_s"], res["bwd_s"], res["total_s"]], dtype=torch.float64, device=dev)
    all_reduce_(info, worst, op=dist.ReduceOp.MAX, name="bench all-reduce")
    res["fwd_s_max"], res["bwd_s_max"], res["total_s_max"] = worst.tolist()
    return res
