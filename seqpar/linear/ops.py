"""Sequence-parallel gated linear attention: one forward, one backward, one autograd.Function for
ZeCO, LASP-2 and LASP-1; the methods differ only in their :class:`~seqpar.linear.plans.ScanPlan`.

Per rank (shapes of :func:`seqpar.linear.linear_attention`; ``R`` state rows, ``R = B`` or 1 packed)::

    forward                                          backward
    cheap pass: S_loc (zero incoming state)          recompute chunk states from the saved S_in
    Gamma_end = exp(sum of g) (0 if a doc starts)    L = local part of dS_in (reverse scan, dS_out = 0)
    start exchange (S_loc, Gamma_end)        -.      start exchange (L, Gamma_end, d final)   -.
    intra-chunk output      <- overlapped     |      dq, intra dk, dv     <- overlapped          |
    S_in (, final state)   <------------------'      dS_out  <-----------------------------------'
    chunk states from S_in; add the state term       state gradients from dS_out; dk, dv, dg
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.groups import GroupInfo
from ..comm.stats import CommStats
from ..kernels.linear_chunk import CHUNK, ChunkLayout
from ..tracing import Trace, begin, end, linear_part_flops, span
from .geometry import LinearShard
from .plans import ScanPlan, make_exchange


@dataclass(frozen=True, eq=False)
class LinearConfig:
    """Everything a call needs besides the tensors; built once on the host by the wrapper."""

    info: GroupInfo
    plan: ScanPlan
    shard: LinearShard
    layout: ChunkLayout
    kernel: object
    scale: float
    output_final_state: bool
    stats: CommStats | None = None
    trace: Trace | None = None


def _flops(q, v, part: str, bwd: bool = False) -> float:
    """One kernel's share of the bench's linear-attention FLOPs (seqpar.tracing.linear_part_flops)."""
    return linear_part_flops(*q.shape, v.shape[-1], part, bwd, CHUNK)


def _rows_to_seqs(rows: torch.Tensor, seqs: tuple[int, ...], n_seq: int) -> torch.Tensor | None:
    """Place state row ``r`` at local sequence ``seqs[r]`` (others zero): ``[n_seq, H, K, V]``."""
    if all(s < 0 for s in seqs):
        return None
    if seqs == tuple(range(n_seq)):
        return rows
    out = rows.new_zeros(n_seq, *rows.shape[1:])
    for r, s in enumerate(seqs):
        if s >= 0:
            out[s] = rows[r]
    return out


def _seqs_to_rows(x: torch.Tensor, seqs: tuple[int, ...]) -> torch.Tensor:
    """Row ``r`` = ``x[seqs[r]]`` (zero where ``seqs[r] < 0``): ``[R, H, K, V]``."""
    if all(s >= 0 for s in seqs):
        return x[list(seqs)]
    return torch.stack([x[s] if s >= 0 else torch.zeros_like(x[0]) for s in seqs])


def _gamma_end(g, shard: LinearShard, like: torch.Tensor) -> torch.Tensor:
    """Decay of the whole shard per state row, ``[R, H, K]``; 0 where a document starts inside it."""
    r, hh, kd = like.shape[0], like.shape[1], like.shape[2]
    if g is None:
        gam = like.new_ones(r, hh, kd)
    else:
        s = g.to(like.dtype).sum(1)                                    # [B, H(, K)]
        gam = (s if g.dim() == 4 else s[..., None]).exp().expand(r, hh, kd).clone()
    for i, ok in enumerate(shard.passes):
        if not ok:
            gam[i] = 0
    return gam


def linear_sp_fwd(q, k, v, g, h0, cfg: LinearConfig):
    """Forward on this rank. Returns ``(o [B, T_local, H, V] in q's dtype, final state or None,
    saved)`` where ``saved = (S_in, Gamma_end, exchange)`` is what the backward needs."""
    st, kern, plan = cfg.shard, cfg.kernel, cfg.plan
    if cfg.stats is not None:
        cfg.stats.phase = "fwd"
    tr = cfg.trace
    with span(tr, "linear_states", flops=_flops(q, v, "states"), shape=q.shape):
        p = kern.prepare(q, k, v, g, cfg.scale, cfg.layout)
        h, _ht = kern.states(p, None)                    # cheap pass: S_loc with a zero incoming state
    local = _ht[list(st.out_seqs)]
    gam = _gamma_end(g, st, local)
    first = None if h0 is None else h0.to(local.dtype)
    ex = make_exchange(cfg.info, plan, cfg.stats, tr)
    if plan.overlap:
        ex.start_fwd(local, gam, first)
    with span(tr, "linear_intra", flops=_flops(q, v, "intra"), shape=q.shape):
        o_intra = kern.intra(p)                          # the heavy part, while the states travel
    if not plan.overlap:
        ex.start_fwd(local, gam, first)
    s_in, final = ex.finish_fwd(cfg.output_final_state)
    if st.uses_incoming and (cfg.info.rank > 0 or h0 is not None):
        with span(tr, "linear_states", flops=_flops(q, v, "states"), shape=q.shape):
            h, _ = kern.states(p, _rows_to_seqs(s_in, st.in_seqs, st.n_seq))
    with span(tr, "linear_output", flops=_flops(q, v, "output"), shape=q.shape):
        o = kern.output(p, h, o_intra)
    b, t, hh, _ = q.shape
    return o.view(b, t, hh, -1).to(q.dtype), final, (s_in, gam, ex)


def linear_sp_bwd(do, dfinal, q, k, v, g, h0, saved, cfg: LinearConfig, need_dh0: bool):
    """Backward on this rank: ``(dq, dk, dv, dg, d initial_state)`` in the inputs' dtypes.

    ``dfinal`` is this rank's gradient of its copy of the final state (the copies' gradients are
    summed). The gradient of ``initial_state`` is returned on the group's first rank and is zero on
    the others (summing over the group gives the full gradient, as for any replicated tensor).
    """
    st, kern, plan = cfg.shard, cfg.kernel, cfg.plan
    s_in, gam, ex = saved
    if cfg.stats is not None:
        cfg.stats.phase = "bwd"
    tr = cfg.trace
    with span(tr, "linear_dstates", flops=_flops(q, v, "states", True) * 1.5, shape=q.shape):
        p = kern.prepare(q, k, v, g, cfg.scale, cfg.layout)
        h, _ = kern.states(p, _rows_to_seqs(s_in, st.in_seqs, st.n_seq))
        do_c = kern.chunk_grad(do, p)
        dh, dh0 = kern.dstates(p, do_c, None)            # cheap pass: local part of dS_in
    own = _seqs_to_rows(dh0, st.in_seqs)
    dht = dfinal.to(own.dtype) if cfg.output_final_state else None
    if plan.overlap:
        ex.start_bwd(own, gam, dht)
    with span(tr, "linear_bwd_intra", flops=_flops(q, v, "intra", True), shape=q.shape):
        dq, dk, dv = kern.bwd_intra(p, do_c, h)         # the heavy part, while the gradients travel
    if not plan.overlap:
        ex.start_bwd(own, gam, dht)
    ds_out = ex.finish_bwd()
    if cfg.info.rank < cfg.info.size - 1 or dht is not None:
        with span(tr, "linear_dstates", flops=_flops(q, v, "states", True), shape=q.shape):
            dh, dh0 = kern.dstates(p, do_c, _rows_to_seqs(ds_out, st.out_seqs, st.n_seq))
    with span(tr, "linear_bwd_finish", flops=_flops(q, v, "output", True), shape=q.shape):
        dq, dk, dv, dg = kern.bwd_finish(p, h, dh, dq, dk, dv)
    b, t, hh, _ = q.shape
    dq, dk, dv = (x.view(b, t, hh, -1).to(y.dtype) for x, y in ((dq, q), (dk, k), (dv, v)))
    if dg is not None:
        dg = dg.view(g.shape).to(g.dtype)
    dinit = None
    if need_dh0:
        dinit = (_seqs_to_rows(dh0, st.in_seqs) if cfg.info.rank == 0 else torch.zeros_like(s_in)).to(h0.dtype)
    return dq, dk, dv, dg, dinit


class LinearSPFunction(torch.autograd.Function):
    """Saves and restores only; the work is in :func:`linear_sp_fwd` / :func:`linear_sp_bwd`."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, cfg: LinearConfig):
        with torch.autocast(q.device.type, enabled=False):  # computes in fp32/fp64 whatever autocast says
            o, final, saved = linear_sp_fwd(q, k, v, g, h0, cfg)
        ctx.save_for_backward(q, k, v, g, h0)
        ctx.cfg, ctx.saved = cfg, saved
        if cfg.output_final_state:
            return o, final
        return o

    @staticmethod
    def backward(ctx, do, dfinal=None):
        q, k, v, g, h0 = ctx.saved_tensors
        cfg = ctx.cfg
        need_dh0 = h0 is not None and ctx.needs_input_grad[4]
        if dfinal is None and cfg.output_final_state:
            dfinal = torch.zeros_like(ctx.saved[0])
        begin(cfg.trace, "linear bwd")
        with torch.autocast(q.device.type, enabled=False):
            grads = linear_sp_bwd(do, dfinal, q, k, v, g, h0, ctx.saved, cfg, need_dh0)
        end(cfg.trace, "linear bwd")
        return (*grads, None)
