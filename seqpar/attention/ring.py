"""The shared ring loop (forward and backward) and the one autograd.Function of the ring family.

Every ring-family method runs through :func:`ring_forward` / :func:`ring_backward` with a
:class:`~seqpar.attention.plans.RingPlan`. The K,V of other ranks arrive through a transport:

- ``p2p``: K,V travel around the ring (``[2, B, T, Hkv, D]`` in one message, never GQA-expanded).
  The transfer for step s+1 is posted before the blocks of step s are computed and waited on after
  them. In backward the fp32 dK,dV accumulators of each shard travel one step behind their K,V and
  arrive home after N hops; the incoming accumulator is waited on only after this step's blocks.
- ``allgather``: K,V are all-gathered once; backward re-gathers them and reduce-scatters dK,dV.

Running output and lse stay in fp32 for the whole loop and are cast once at the end, so the error
does not grow with the ring size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import CommStats, GroupInfo, all_gather_stack, reduce_scatter_stack, ring_shift
from ..kernels import block_backward, block_forward, merge_, new_accumulator
from .plans import RingPlan


@dataclass(frozen=True)
class RingConfig:
    """Everything the ring loop needs besides tensors; frozen, built once per call."""

    info: GroupInfo
    plan: RingPlan
    scale: float
    backend: str | None = None
    grad_comm_dtype: torch.dtype | None = None  # None: dK,dV travel in fp32 (exact)
    stats: CommStats | None = None


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: RingConfig):
    """Local Q ``[B, T, Hq, D]`` against every rank's K,V ``[B, T, Hkv, D]``.

    Returns ``(out, lse)``: out ``[B, T, Hq, D]`` in fp32 (float64 for float64 input), lse
    ``[B, Hq, T]`` fp32.
    """
    info, plan = cfg.info, cfg.plan
    acc_out, acc_lse = new_accumulator(q.shape, q.device, dtype=_acc_dtype(q))
    kv = torch.stack([k, v])
    gathered = None
    if plan.transport == "allgather" and not info.single:
        gathered = all_gather_stack(info, kv, stats=cfg.stats, name="allgather_kv")
    cur = kv
    for s, blocks in enumerate(plan.steps):
        pending = None
        if gathered is not None:
            cur = gathered[(info.rank - s) % info.size]
        elif s + 1 < plan.n:
            pending = ring_shift(info, cur, stats=cfg.stats, name="ring_kv")
        for b in blocks:
            o, lse = block_forward(q[:, b.q], cur[0][:, b.kv], cur[1][:, b.kv],
                                   scale=cfg.scale, mask=b.mask, backend=cfg.backend)
            merge_(acc_out[:, b.q], acc_lse[:, :, b.q], o, lse)
        if pending is not None:
            cur = pending.wait()[0]
    return acc_out, acc_lse


def ring_backward(dout, q, k, v, out, lse, cfg: RingConfig):
    """Gradients for the local q, k, v given the merged ``out``/``lse`` of the local rows.

    Returns fp32 (float64 for float64 input) ``dq [B, T, Hq, D]``, ``dk``, ``dv [B, T, Hkv, D]``.
    """
    info, plan = cfg.info, cfg.plan
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    gathered = dkv_all = None
    if plan.transport == "allgather" and not info.single:
        gathered = all_gather_stack(info, kv, stats=cfg.stats, name="allgather_kv")
        dkv_all = torch.zeros(gathered.shape, dtype=acc, device=q.device)
    wire = cfg.grad_comm_dtype or acc
    cur, incoming, outgoing = kv, None, None
    for s, blocks in enumerate(plan.steps):
        pending_kv = None
        if gathered is not None:
            src = (info.rank - s) % info.size
            cur, dkv = gathered[src], dkv_all[src]
        else:
            if s + 1 < plan.n:
                pending_kv = ring_shift(info, cur, stats=cfg.stats, name="ring_kv")
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for b in blocks:
            gq, gk, gv = block_backward(dout[:, b.q], q[:, b.q], cur[0][:, b.kv], cur[1][:, b.kv],
                                        out[:, b.q], lse[:, :, b.q], scale=cfg.scale, mask=b.mask,
                                        backend=cfg.backend)
            dq[:, b.q] += gq
            dkv[0][:, b.kv] += gk
            dkv[1][:, b.kv] += gv
        if gathered is None:
            if incoming is not None:  # partial sums of this shard from the ranks before us
                dkv += incoming.wait()[0].to(acc)
            outgoing = dkv.to(wire) if info.size > 1 else dkv
            if info.size > 1:
                incoming = ring_shift(info, outgoing, stats=cfg.stats, name="ring_dkv")
        if pending_kv is not None:
            cur = pending_kv.wait()[0]
    if gathered is not None:
        dkv = reduce_scatter_stack(info, dkv_all, stats=cfg.stats, name="reduce_scatter_dkv")
    elif info.size > 1:
        dkv = incoming.wait()[0].to(acc)  # our own shard, home after N hops
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Saves what backward needs and restores it; the work is in ring_forward / ring_backward."""

    @staticmethod
    def forward(ctx, q, k, v, cfg: RingConfig):
        if cfg.stats is not None:
            cfg.stats.phase = "fwd"
        out, lse = ring_forward(q, k, v, cfg)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        if cfg.stats is not None:
            cfg.stats.phase = "bwd"
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, cfg)
        if cfg.stats is not None:
            cfg.stats.phase = "fwd"
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
