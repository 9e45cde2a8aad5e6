"""Measurements behind ``seqpar calibrate`` (:mod:`.calibrate`); every function here runs on every rank.

Each ``phase_*`` is one collective step of the calibration: all ranks of the default group call it
with the same arguments (local ranks of :class:`seqpar.comm.pool.LocalRanks` or torchrun ranks) and rank 0's return
value holds the result. Timings are medians after one warm-up; where several ranks time something
at once, the slowest rank counts (what a synchronous step waits for).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def _device():
    """This rank's device: the one the default group's collectives take, its GPU (LOCAL_RANK) under
    NCCL, the CPU under gloo. Every tensor of a phase lives there: the packed steps' inputs and the
    timing all-reduces travel through NCCL, which takes no CPU tensor."""
    import torch

    from seqpar.comm.groups import collective_device

    dev = collective_device()
    if dev.type == "cuda" and "LOCAL_RANK" in os.environ:  # one GPU per local rank, as torchrun starts them
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
    return dev


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _solo_group():
    """A one-rank group per rank (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def _step_inputs(s: int, shape: tuple[int, int, int], dev) -> list:
    """q, k, v, dout of one rank's causal step at length ``s`` (seeded by ``s``), on ``dev``."""
    import torch

    h, hk, d = shape
    gen = torch.Generator().manual_seed(s)
    return [torch.randn(1, s, n, d, generator=gen).to(dev) for n in (h, hk, hk, h)]


def _one_step(method: str, inputs: list, group) -> None:
    """One causal fwd+bwd of ``method`` on ``group`` (queued: the caller synchronises the device)."""
    from seqpar.softmax import attention

    q, k, v, dout = inputs
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    attention(qq, kk, vv, method=method, causal=True, group=group).backward(dout)


def _attention_seconds(method: str, s: int, shape: tuple[int, int, int], group, dev, reps: int,
                       warmup: int = 1, inputs: list | None = None) -> float:
    """Median seconds of one causal fwd+bwd of ``method`` on ``group`` (one rank) at length ``s``
    (``inputs``: made by :func:`_step_inputs` already)."""
    inputs = _step_inputs(s, shape, dev) if inputs is None else inputs
    times = []
    for i in range(reps + warmup):
        _sync(dev)
        t0 = time.perf_counter()
        _one_step(method, inputs, group)
        _sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _max_all(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def phase_compute(methods, seq_lens, shape, reps) -> dict:
    """Rank 0 times each method alone (the others wait): {method: [seconds per length]}."""
    import torch.distributed as dist

    dev, solo = _device(), _solo_group()
    out = {}
    if dist.get_rank() == 0:
        out = {m: [_attention_seconds(m, s, shape, solo, dev, reps) for s in seq_lens] for m in methods}
    dist.barrier()
    return out


def phase_slowdown(method, s, shape, reps) -> dict:
    """{k: time with k ranks computing at once / time alone} for k = 1, 2, 4, ... <= world.

    The counts are interleaved (1, 2, 4, ..., 1, 2, 4, ...) and each factor is a ratio of medians,
    so a burst of outside load hits every k alike rather than one of them.
    """
    import torch.distributed as dist

    dev, solo = _device(), _solo_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    ks = [1 << i for i in range(world.bit_length()) if 1 << i <= world]
    _attention_seconds(method, s, shape, solo, dev, 1)  # warm-up on every rank
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(reps):
        for k in ks:
            dist.barrier()
            mine = _attention_seconds(method, s, shape, solo, dev, 1, warmup=0) if rank < k else 0.0
            times[k].append(_max_all(mine))
    base = statistics.median(times[1])
    return {k: statistics.median(t) / base for k, t in times.items()}


def phase_links(message_bytes, reps) -> dict:
    """{group size: {kind: [(bytes, seconds), ...]}}: every aligned block of g ranks at once."""
    import torch
    import torch.distributed as dist

    dev = _device()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for g in [1 << i for i in range(1, world.bit_length()) if 1 << i <= world]:
        blocks = [list(range(b, b + g)) for b in range(0, world - g + 1, g)]
        groups = [dist.new_group(b) for b in blocks]
        mine = next((grp, b) for grp, b in zip(groups, blocks) if rank in b)
        grp, members = mine
        nxt, prv = members[(members.index(rank) + 1) % g], members[(members.index(rank) - 1) % g]
        rows = {"p2p": [], "all_to_all": [], "all_gather": []}
        for size in message_bytes:
            n = max(g, size // 4 // g * g)
            send, recv = torch.ones(n, device=dev), torch.empty(n, device=dev)
            gathered = [torch.empty(n, device=dev) for _ in range(g)]

            def p2p():
                ops = [dist.P2POp(dist.isend, send, nxt, grp), dist.P2POp(dist.irecv, recv, prv, grp)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            ops = {"p2p": (p2p, n * 4),
                   "all_to_all": (lambda: dist.all_to_all_single(recv, send, group=grp), (g - 1) / g * n * 4),
                   "all_gather": (lambda: dist.all_gather(gathered, send, group=grp), (g - 1) * n * 4)}
            for kind, (fn, nbytes) in ops.items():
                times = []
                for i in range(reps + 1):
                    dist.barrier()
                    _sync(dev)
                    t0 = time.perf_counter()
                    fn()
                    _sync(dev)
                    if i:
                        times.append(_max_all(time.perf_counter() - t0))
                rows[kind].append((nbytes, statistics.median(times)))
        out[g] = rows
    return out


def phase_overlap(method, s, shape, message, reps) -> dict:
    """Compute alone, ring exchange alone, and both at once on every rank (world group)."""
    import torch
    import torch.distributed as dist

    dev, solo = _device(), _solo_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = max(1, int(message) // 4)
    send, recv = torch.ones(n, device=dev), torch.empty(n, device=dev)

    def start():
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                       dist.P2POp(dist.irecv, recv, (rank - 1) % world)])

    def comm_alone():
        _sync(dev)
        t0 = time.perf_counter()
        for w in start():
            w.wait()
        _sync(dev)  # under NCCL wait() only orders the streams: the transfer ends on the device
        return time.perf_counter() - t0

    inputs = _step_inputs(s, shape, dev)  # made before any clock starts, as _attention_seconds does
    tc, tp, tb = [], [], []
    for _ in range(reps):
        dist.barrier()
        tc.append(_max_all(_attention_seconds(method, s, shape, solo, dev, 1, inputs=inputs)))
        dist.barrier()
        tp.append(_max_all(comm_alone()))
        dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        works = start()
        _one_step(method, inputs, solo)
        for w in works:
            w.wait()
        _sync(dev)
        tb.append(_max_all(time.perf_counter() - t0))
    c, p, b = (statistics.median(x) for x in (tc, tp, tb))
    factor = min(1.0, max(0.0, (c + p - b) / min(c, p))) if world > 1 else 1.0
    return {"compute_s": c, "comm_s": p, "both_s": b, "bytes": n * 4, "overlap": factor}


def phase_memory(method, s, shape) -> dict:
    """Bytes per token saved for backward (+ q, k, v, out) on one rank, and this process's resident size."""
    import torch
    import torch.distributed as dist

    from seqpar.softmax import attention

    dev, solo = _device(), _solo_group()
    h, hk, d = shape
    q, k, v = (torch.randn(1, s, n, d, device=dev, requires_grad=True) for n in (h, hk, hk))
    seen: dict[tuple, int] = {}

    def pack(t):
        seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention(q, k, v, method=method, causal=True, group=solo)
    io = sum(x.numel() * x.element_size() for x in (q, k, v, out))
    saved = sum(b for key, b in seen.items() if key[0] not in {x.data_ptr() for x in (q, k, v, out)})
    rss = 0
    try:
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    if dev.type == "cuda":
        _, total = torch.cuda.mem_get_info(dev)
        device_memory = float(total)
    else:
        device_memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / dist.get_world_size()
    return {"bytes_per_token": (io + saved) / s, "rss": rss, "memory_per_rank": device_memory,
            "element_size": q.element_size(), "device": str(dev)}


def _plan_inputs(i: int, n: int, shape: tuple[int, int, int], seed: int):
    """q, k, v, dout of batch sequence ``i`` (``[n, H, D]`` / ``[n, Hkv, D]`` fp32), a function of (seed, i)."""
    import torch

    h, hk, d = shape
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return [torch.randn(n, heads, d, generator=g) for heads in (h, hk, hk, h)]


def phase_plans(plans_json, lens, shape, seed: int, warmup: int, repeats: int):
    """Execute scheduler plans as one attention layer's training step each; returns rank 0's
    ``[(times, loss)]`` per plan: ``times`` the slowest rank's seconds of every timed repeat.

    Each rank takes its group's sequences as one packed batch (:func:`.execute.rank_work`), runs
    causal ``seqpar.attention`` forward and backward with its group's method through
    :func:`.execute.train_step` (global loss normalisation and a world all-reduce, so every rank
    waits for the slowest group), from a barrier to the return. Plans run round-robin so a change
    of outside load hits them alike; process groups are built once, before timing.
    """
    import torch
    import torch.distributed as dist

    from seqpar.schedulers.execute import GroupCache, rank_work, train_step
    from seqpar.schedulers.plan import Plan

    rank, dev = dist.get_rank(), _device()
    groups = GroupCache()
    plans = [Plan.from_json(t) for t in plans_json]
    prepared = []
    for plan in plans:  # this rank's shard of q, k, v, dout for each plan (data loading, untimed)
        work = rank_work(plan, lens, rank, groups)
        if work.empty:
            prepared.append(None)
            continue
        per_seq = {i: [x.to(dev) for x in _plan_inputs(i, lens[i], shape, seed)] for i in work.seqs}
        local = [work.shard(work.pack([per_seq[i][j] if i in per_seq else None for i in range(len(lens))]))
                 for j in range(4)]
        prepared.append((local, int(work.real_mask().sum())))

    def step(k):
        def loss_fn(work):
            (q, kk, v, dout), count = prepared[k]
            q, kk, v = (t.clone().requires_grad_(True) for t in (q, kk, v))
            out = work.attention(q, kk, v, causal=True)
            return (out * dout).sum(), count  # padding rows of dout are zero

        dist.barrier()
        t0 = time.perf_counter()
        loss = train_step(plans[k], lens, rank, groups, loss_fn, [])
        _sync(dev)  # the backward is queued on a GPU: the step ends when the device does
        return time.perf_counter() - t0, loss

    times = [[] for _ in plans]
    losses = [0.0] * len(plans)
    for r in range(warmup + repeats):
        for k in range(len(plans)):
            dt, losses[k] = step(k)
            if r >= warmup:
                times[k].append(dt)
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time of each run
    return [(t[k].tolist(), losses[k]) for k in range(len(plans))] if rank == 0 else None


def phase_kernels(methods, seq_len: int, shape, sizes, reps) -> dict:
    """Rank 0 emulates each method's per-rank kernels on groups of each size (``seqpar bench
    --emulate``: its device — the GPU under torchrun with CUDA, else the CPU — every rank's per-step
    kernels back to back, no communication) at ``seq_len``: ``{method: {size: compute efficiency}}``
    (single-device time over N x the slowest rank's kernel time). A method that cannot run at a
    size (heads) is left out."""
    import torch.distributed as dist

    from .core import BenchCase
    from .emulate import emulate_case

    out: dict = {}
    if dist.get_rank() == 0:
        h, hk, d = shape
        dev, baselines = _device(), {}
        for m in methods:
            for n in sizes:
                t = max(2 * n, seq_len // (2 * n) * (2 * n))
                row = emulate_case(BenchCase(m, t, n, True, heads=h, kv_heads=hk, head_dim=d, repeats=reps, warmup=1),
                                   device=dev, baselines=baselines)
                if not row["error"] and row["efficiency"] > 0:
                    out.setdefault(m, {})[n] = float(row["efficiency"])
    dist.barrier()
    return out
