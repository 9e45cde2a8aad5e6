"""Ulysses attention: all-to-all from sequence shards to head shards, full attention, and back.

Shapes (U = ranks on the Ulysses axis, ``c = T_local``, ``L = U·c``; contiguous layout, so member m
holds global tokens ``[m·c, (m+1)·c)``):

- in:  q ``[B, c, Hq, D]``, k, v ``[B, c, Hkv, D]`` (sequence shards);
- after the all-to-all: q ``[B, L, h_m, D]`` (member m owns the ``h_m`` query heads
  ``[start_m, start_m + h_m)``: ``h_m = ⌈Hq/U⌉`` for the first ``Hq mod U`` members, ``⌊Hq/U⌋`` for
  the others, :func:`seqpar.methods.head_shards`; any Hq >= U) and k, v ``[B, L, n_m, D]`` with the
  ``n_m`` KV heads those query heads use (see below);
- full attention of the whole sequence for the local heads (``block_forward``; GQA native; a
  sliding window is the band of that one block: the communication does not change with it), or,
  in USP (:mod:`seqpar.softmax.usp`), the shared ring loop over the ring axis on these head shards;
- out ``[B, L, h_m, D]`` goes back through the inverse all-to-all to ``[B, c, Hq, D]``.

**Uneven head counts.** When U does not divide Hq the members hold ``⌈Hq/U⌉`` or ``⌊Hq/U⌋`` query
heads (9 heads on 2 ranks: 5 + 4) and the all-to-alls have uneven splits (gloo and NCCL take them);
the busiest member computes ``max h_m / mean h_m`` of the even share (1.11 for 9 on 2). Only
Hq < U (a member with no head) is refused.

**GQA head routing.** With ``g = Hq/Hkv``, member m needs the KV heads
``[⌊start_m/g⌋, ⌊(start_m + h_m - 1)/g⌋ + 1)``. Each KV head is sent only to the members whose
query heads use it: when ``Hkv % U == 0`` (and U divides Hq) every member gets ``Hkv/U`` heads of
its own; otherwise a KV head whose group straddles members is replicated to each of them (never
padded, never expanded to Hq).
All of q, k and v travel in ONE uneven ``all_to_all_single`` (per destination: its query heads,
then its K heads, then its V heads). In backward the members' dK,dV of a shared KV head are summed
(in fp32) by the sequence owner when the gradients come back. When a member's query heads do not
split evenly over its KV heads (e.g. Hq=12, Hkv=6, U=4, or 9 heads over 3 KV heads on 2 ranks)
the local heads are cut into a few *segments*, each a plain GQA block with equal groups.

**Sinks** (:mod:`.sinks`): member m applies the sinks of its query heads ``s[start_m, start_m + h_m)``
to its whole-sequence rows and returns ``ds`` for those heads (zeros elsewhere: its share).

Volume per rank (elements; esize bytes each): forward ``(U-1)/U·c·2d`` for q and out plus
``2·B·c·D·(Σ_m n_m - n_me)`` for k, v (``= (U-1)/U·c·2d_kv`` when ``Hkv % U == 0``: docs/methods.md
§4/§8); backward the same (dout out, dq, dk, dv back, in the input dtype). With uneven heads q and
out are ``B·c·D·(Σ_{m≠me} h_m + (U-1)·h_me)`` and backward's dk, dv ``2·B·c·D·(U-1)·n_me``.
``return_lse=True`` adds ``(U-1)·B·c·h_me`` fp32 values (the lse's all-to-all, :func:`lse_to_seq`).

Shared by ``ulysses`` and ``usp``: one autograd Function, :class:`UlyssesAttention`; the local step
is either ``block_forward`` or ``ring_forward`` (never a copy of the ring loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from ..comm import CommStats, GroupInfo, all_to_all
from ..kernels import block_backward, block_forward, window_band
from ..kernels.masks import visible_pairs
from ..kernels.varlen import varlen_backward, varlen_forward
from ..layouts.ulysses import packed_heads
from ..methods import head_shards
from ..tracing import Trace, begin, block_flops, end, span
from .checkpoint import active_tape
from .executor import RingConfig, ring_backward, ring_forward
from .foreign import lse_grad_stats
from .lse import incoming, returned
from .sinks import apply_sinks, sinks_grad
from .window import effective_window


@dataclass(frozen=True)
class HeadSplit:
    """Heads each member holds after the all-to-all: member m gets ``[start[m], stop[m])``."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    def count(self, m: int) -> int:
        return self.stop[m] - self.start[m]

    @property
    def disjoint(self) -> bool:
        """True when no head goes to two members (then gradients need no summing)."""
        return all(a <= b for a, b in zip(self.stop[:-1], self.start[1:]))


@dataclass(frozen=True)
class Segment:
    """Local query heads ``q`` and the local KV heads ``kv`` they use, as one plain GQA block."""

    q: slice
    kv: slice


def split_heads(hq: int, hkv: int, u: int) -> tuple[HeadSplit, HeadSplit]:
    """Query heads split over ``u`` members as evenly as possible (:func:`seqpar.methods.head_shards`);
    each member's KV heads = those its queries use. Needs ``hq >= u``."""
    g, counts = hq // hkv, head_shards(hq, u)
    starts = tuple(sum(counts[:m]) for m in range(u))
    stops = tuple(a + n for a, n in zip(starts, counts))
    return HeadSplit(starts, stops), HeadSplit(tuple(a // g for a in starts), tuple((b - 1) // g + 1 for b in stops))


def gqa_segments(q_split: HeadSplit, kv_split: HeadSplit, g: int, m: int) -> tuple[Segment, ...]:
    """Cut member m's heads into runs sharing a KV head, merging neighbouring runs of equal length.

    One segment in the usual cases (``h % g == 0`` or ``g % h == 0``); at most a few otherwise.
    """
    q0, kv0 = q_split.start[m], kv_split.start[m]
    runs: list[list[int]] = []  # [first local q head, stop, local kv head]
    for head in range(q0, q_split.stop[m]):
        kv = head // g - kv0
        if runs and runs[-1][2] == kv:
            runs[-1][1] += 1
        else:
            runs.append([head - q0, head - q0 + 1, kv])
    segs: list[list[int]] = []  # [q start, q stop, kv start, kv stop, run length]
    for a, b, kv in runs:
        if segs and segs[-1][4] == b - a:
            segs[-1][1], segs[-1][3] = b, kv + 1
        else:
            segs.append([a, b, kv, kv + 1, b - a])
    return tuple(Segment(slice(a, b), slice(c, d)) for a, b, c, d, _ in segs)


def seq_to_heads(axis: GroupInfo, parts, splits, *, stats: CommStats | None, name: str, trace: Trace | None = None):
    """One all-to-all: ``parts[i]`` ``[B, c, H_i, D]`` (sequence shards) -> ``[B, U·c, n_i, D]``
    (this member's heads of ``splits[i]``, whole Ulysses-axis sequence in member order). Each part
    keeps its own head dim (v's ``D_v`` may differ from q's and k's ``D``: MLA)."""
    if axis.single:
        return list(parts)
    u, me = axis.size, axis.rank
    b, c = parts[0].shape[:2]
    ds = [x.shape[3] for x in parts]
    sizes = [[b * c * s.count(m) * d for s, d in zip(splits, ds)] for m in range(u)]
    send = parts[0].new_empty(sum(map(sum, sizes)))
    off = 0
    for m in range(u):
        for x, s, size, d in zip(parts, splits, sizes[m], ds):
            send[off:off + size].view(b, c, s.count(m), d).copy_(x[:, :, s.start[m]:s.stop[m]])
            off += size
    chunk = sum(sizes[me])
    recv = all_to_all(axis, send, input_splits=[sum(x) for x in sizes], output_splits=[chunk] * u,
                      stats=stats, name=name, trace=trace).view(u, chunk)
    outs, off = [], 0
    for s, size, d in zip(splits, sizes[me], ds):
        n = s.count(me)
        piece = recv[:, off:off + size].view(u, b, c, n, d)  # member m's rows of this rank's heads
        outs.append(rearrange(piece, "u b c n d -> b (u c) n d"))
        off += size
    return outs


def heads_to_seq(axis: GroupInfo, parts, splits, heads, *, stats: CommStats | None, name: str,
                 trace: Trace | None = None):
    """Inverse of :func:`seq_to_heads`: ``parts[i]`` ``[B, U·c, n_i, D]`` -> ``[B, c, heads[i], D]``.

    A head held by several members (a shared KV head) comes back summed in fp32, then cast.
    """
    if axis.single:
        return list(parts)
    u, me = axis.size, axis.rank
    b, t = parts[0].shape[:2]
    ds = [x.shape[3] for x in parts]  # each part's own head dim
    c = t // u
    sizes = [[b * c * s.count(m) * d for s, d in zip(splits, ds)] for m in range(u)]
    chunk = sum(sizes[me])
    send = parts[0].new_empty(u * chunk)
    grid, off = send.view(u, chunk), 0
    for y, size, s, d in zip(parts, sizes[me], splits, ds):
        n = s.count(me)
        grid[:, off:off + size].view(u, b, c, n, d).copy_(rearrange(y, "b (u c) n d -> u b c n d", u=u))
        off += size
    recv = all_to_all(axis, send, input_splits=[chunk] * u, output_splits=[sum(x) for x in sizes],
                      stats=stats, name=name, trace=trace)
    acc = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    outs = [parts[0].new_empty(b, c, h, d) if s.disjoint else parts[0].new_zeros(b, c, h, d, dtype=acc)
            for s, h, d in zip(splits, heads, ds)]
    off = 0
    for m in range(u):
        for out, s, size, d in zip(outs, splits, sizes[m], ds):
            piece = recv[off:off + size].view(b, c, s.count(m), d)
            if s.disjoint:
                out[:, :, s.start[m]:s.stop[m]] = piece
            else:
                out[:, :, s.start[m]:s.stop[m]] += piece
            off += size
    return [o.to(p.dtype) for o, p in zip(outs, parts)]


@dataclass(frozen=True)
class UlyssesConfig:
    """Everything the Ulysses Function needs besides tensors; frozen, built once per call.

    ``axis``: the Ulysses axis. ``ring``: the ring axis config of USP (plan built for the local
    length ``U·c``), or None for plain Ulysses (local attention over the whole sequence).
    """

    axis: GroupInfo
    q_split: HeadSplit
    kv_split: HeadSplit
    segments: tuple[Segment, ...]
    heads: tuple[int, int]  # (Hq, Hkv) of the caller's tensors
    causal: bool
    scale: float
    backend: str | None = None
    stats: CommStats | None = None
    ring: RingConfig | None = None
    packed: object = None  # PackedHeads (seqpar.layouts.ulysses) of packed plain-Ulysses input
    window: int | None = None  # sliding window of the local attention (plain Ulysses, dense input)
    trace: Trace | None = None  # records the all-to-alls and the local attention (seqpar.tracing)
    return_lse: bool = False  # the Function returns (out, lse), lse back in sequence shards (:mod:`.lse`)

    @property
    def mask(self):
        """The mask of the local attention over the whole sequence (query and key rows aligned)."""
        if self.window is not None:
            return window_band(0, self.window, self.causal)
        return "causal" if self.causal else "none"


def _span(cfg: UlyssesConfig, q, k, bwd: bool):
    """Time the local attention of heads ``q [B, L, h, D]`` in the trace (a no-op without one)."""
    tr = cfg.trace
    if tr is None:
        return span(None, "")
    b, t, h, d = q.shape
    pairs = cfg.packed.segments.pairs if cfg.packed is not None else None
    mask = cfg.mask
    if pairs is None and not isinstance(mask, str):  # a window band: its visible pairs
        pairs, mask = visible_pairs(t, k.shape[1], mask), f"band({mask.lo}, {mask.hi})"
    varlen = cfg.packed is not None
    return tr.compute(("varlen_" if varlen else "block_") + ("bwd" if bwd else "fwd"),
                      flops=block_flops(b, t, k.shape[1], h, d, mask, bwd, pairs=pairs),
                      shape=(b, t, k.shape[1], h, k.shape[2], d), mask=None if varlen else mask,
                      deps=[tr.last_id])


def _segment_forward(q, k, v, cfg: UlyssesConfig):
    if cfg.ring is not None:
        return ring_forward(q, k, v, cfg.ring)
    with _span(cfg, q, k, False):
        if cfg.packed is not None:  # rank-major pieces -> document order, one varlen call, back
            order, inv = cfg.packed.index(q.device)
            out, lse = varlen_forward(*(x.index_select(1, order) for x in (q, k, v)), cfg.packed.segments,
                                      scale=cfg.scale, backend=cfg.backend)
            return out.index_select(1, inv), lse.index_select(2, inv)
        return block_forward(q, k, v, scale=cfg.scale, mask=cfg.mask, backend=cfg.backend)


def _segment_backward(dout, q, k, v, out, lse, cfg: UlyssesConfig, dlse=None):
    if cfg.ring is not None:
        return ring_backward(dout, q, k, v, out, lse, cfg.ring, dlse)
    delta = None
    if dlse is not None:  # delta' = delta - dlse, out a surrogate for it (or None: :mod:`.foreign`)
        out, delta = lse_grad_stats(dout, out, lse, dlse)
    with _span(cfg, q, k, True):
        if cfg.packed is not None:
            order, inv = cfg.packed.index(q.device)
            grads = varlen_backward(*(x.index_select(1, order) for x in (dout, q, k, v)),
                                    None if out is None else out.index_select(1, order),
                                    lse.index_select(2, order), cfg.packed.segments, scale=cfg.scale,
                                    backend=cfg.backend, delta=None if delta is None else delta.index_select(2, order))
            return tuple(g.index_select(1, inv) for g in grads)
        return block_backward(dout, q, k, v, out, lse, scale=cfg.scale, mask=cfg.mask, backend=cfg.backend,
                              delta=delta)


def _local_forward(qh, kh, vh, cfg: UlyssesConfig, sinks=None):
    """Attention of the local heads over the whole sequence: ``(out [B, L, h, D] in q's dtype, lse)``,
    with the local heads' ``sinks`` ``[h]`` applied when given."""
    if len(cfg.segments) == 1:
        out, lse = _segment_forward(qh, kh, vh, cfg)
    else:
        parts = [_segment_forward(qh[:, :, s.q], kh[:, :, s.kv], vh[:, :, s.kv], cfg) for s in cfg.segments]
        out, lse = torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=1)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out.to(qh.dtype), lse


def _local_backward(douth, qh, kh, vh, outh, lse, cfg: UlyssesConfig, dlse=None):
    """Gradients of the local heads, in the input dtype (dk, dv with this member's KV heads);
    ``dlse [B, h, L]``: the gradient on the lse of the local heads, or None."""
    if len(cfg.segments) == 1:
        grads = _segment_backward(douth, qh, kh, vh, outh, lse, cfg, dlse)
        return [g.to(qh.dtype) for g in grads]
    dq, dk, dv = torch.empty_like(qh), torch.empty_like(kh), torch.empty_like(vh)
    for s in cfg.segments:
        gq, gk, gv = _segment_backward(douth[:, :, s.q], qh[:, :, s.q], kh[:, :, s.kv], vh[:, :, s.kv],
                                       outh[:, :, s.q], lse[:, s.q], cfg, None if dlse is None else dlse[:, s.q])
        dq[:, :, s.q], dk[:, :, s.kv], dv[:, :, s.kv] = gq, gk, gv
    return [dq, dk, dv]


def _local_sinks(sinks, cfg: UlyssesConfig):
    """This member's slice ``[h]`` of the sinks ``[Hq]`` (None when there are none)."""
    me = cfg.axis.rank
    return None if sinks is None else sinks[cfg.q_split.start[me]:cfg.q_split.stop[me]]


def _qkv_to_heads(q, k, v, cfg: UlyssesConfig):
    splits = (cfg.q_split, cfg.kv_split, cfg.kv_split)
    return seq_to_heads(cfg.axis, (q, k, v), splits, stats=cfg.stats, name="ulysses_qkv", trace=cfg.trace)


def ulysses_forward(q, k, v, cfg: UlyssesConfig, sinks=None):
    """Sequence shards in, sequence shards out: ``out [B, c, Hq, D]`` in q's dtype.

    Also returns what backward needs: the head-sharded ``qh, kh, vh, outh`` and ``lse [B, h, L]``.
    """
    qh, kh, vh = _qkv_to_heads(q, k, v, cfg)
    outh, lse = _local_forward(qh, kh, vh, cfg, _local_sinks(sinks, cfg))
    (out,) = heads_to_seq(cfg.axis, (outh,), (cfg.q_split,), cfg.heads[:1], stats=cfg.stats, name="ulysses_out",
                          trace=cfg.trace)
    return out, (qh, kh, vh, outh, lse)


def lse_to_seq(lse, cfg: UlyssesConfig):
    """The local heads' lse ``[B, h, U·c]`` back to this rank's rows ``[B, Hq, c]``: the output's
    inverse all-to-all, on ``B·h·U·c`` fp32 values (only for ``return_lse=True``, :mod:`.lse`)."""
    (rows,) = heads_to_seq(cfg.axis, (lse.transpose(1, 2).unsqueeze(-1),), (cfg.q_split,), cfg.heads[:1],
                           stats=cfg.stats, name="ulysses_lse", trace=cfg.trace)
    return rows.squeeze(-1).transpose(1, 2).contiguous()


def lse_to_heads(dlse, cfg: UlyssesConfig):
    """Inverse of :func:`lse_to_seq`: this rank's rows' ``dlse [B, Hq, c]`` (the returned lse's gradient)
    to the local heads ``[B, h, U·c]``, one all-to-all of ``B·Hq·c`` fp32 values (:mod:`.lse`)."""
    (heads,) = seq_to_heads(cfg.axis, (dlse.transpose(1, 2).unsqueeze(-1),), (cfg.q_split,), stats=cfg.stats,
                            name="ulysses_dlse", trace=cfg.trace)
    return heads.squeeze(-1).transpose(1, 2).contiguous()


def ulysses_backward(dout, saved, cfg: UlyssesConfig, sinks=None, dlse=None):
    """``dout [B, c, Hq, D]`` -> ``dq [B, c, Hq, D]``, ``dk, dv [B, c, Hkv, D]`` in the input dtype,
    and ``ds [Hq]`` (this member's heads; zeros elsewhere) when ``sinks`` is given. ``dlse [B, Hq, c]``:
    the gradient on the returned lse of this rank's rows, or None."""
    qh, kh, vh, outh, lse = saved
    (douth,) = seq_to_heads(cfg.axis, (dout,), (cfg.q_split,), stats=cfg.stats, name="ulysses_dout", trace=cfg.trace)
    if cfg.return_lse:  # every member sends, its loss holding the lse or not: the all-to-all must match
        if dlse is None:
            dlse = torch.zeros((dout.shape[0], cfg.heads[0], dout.shape[1]), dtype=lse.dtype, device=lse.device)
        dlse = lse_to_heads(dlse, cfg)
        dlse = dlse if bool(dlse.any()) else None  # none of these heads' rows is in a loss: the plain backward
    grads = _local_backward(douth, qh, kh, vh, outh, lse, cfg, dlse)
    splits = (cfg.q_split, cfg.kv_split, cfg.kv_split)
    heads = (cfg.heads[0], cfg.heads[1], cfg.heads[1])
    dq, dk, dv = heads_to_seq(cfg.axis, grads, splits, heads, stats=cfg.stats, name="ulysses_dqkv", trace=cfg.trace)
    ds = None
    if sinks is not None:
        me = cfg.axis.rank
        ds = torch.zeros_like(sinks)
        ds[cfg.q_split.start[me]:cfg.q_split.stop[me]] = sinks_grad(douth, outh, lse, _local_sinks(sinks, cfg), dlse)
    return dq, dk, dv, ds


class UlyssesAttention(torch.autograd.Function):
    """Saves what backward needs and restores it; the work is in ulysses_forward / ulysses_backward.

    Inside :func:`seqpar.checkpoint`, the first forward records ``out``, the head-sharded
    ``(outh, lse)`` and (``return_lse``) the lse of this rank's rows; the recomputation before
    backward replays them: neither the attention (nor, for USP, its ring) nor the output's (or the
    lse's) all-to-all runs again, only the all-to-all of q, k, v, whose head-sharded copies the
    backward needs (keeping them would cost the memory checkpointing saves).
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg: UlyssesConfig):
        if cfg.stats is not None:
            cfg.stats.phase = "fwd"
        tape = active_tape()
        if tape is not None and tape.replaying:
            out, (outh, lse, rows_lse) = tape.replay(q, v)
            out, saved = out.detach(), (*_qkv_to_heads(q, k, v, cfg), outh, lse)
        else:
            out, saved = ulysses_forward(q, k, v, cfg, sinks)
            rows_lse = lse_to_seq(saved[4], cfg) if cfg.return_lse else None
            if tape is not None:
                tape.record(out.detach(), (saved[3].detach(), saved[4], rows_lse))
        ctx.save_for_backward(*saved, sinks)
        ctx.cfg = cfg
        return returned(ctx, out, rows_lse, cfg.return_lse)

    @staticmethod
    def backward(ctx, dout, *dlse):  # dlse: the returned lse's gradient (return_lse=True), or None
        cfg = ctx.cfg
        *saved, sinks = ctx.saved_tensors  # first: under seqpar.checkpoint this recomputes the forward
        if cfg.stats is not None:
            cfg.stats.phase = "bwd"
        qh, outh = saved[0], saved[3]
        shape = (qh.shape[0], qh.shape[1] // cfg.axis.size, cfg.heads[0], outh.shape[3])
        dout, dlse = incoming(dout, dlse, shape, qh)
        begin(cfg.trace, "attention bwd")
        dq, dk, dv, ds = ulysses_backward(dout, saved, cfg, sinks if ctx.needs_input_grad[3] else None, dlse)
        end(cfg.trace, "attention bwd")
        if cfg.stats is not None:
            cfg.stats.phase = "fwd"
        return dq, dk, dv, ds, None


def check_heads(q: torch.Tensor, degree: int, *, what: str) -> None:
    """ValueError (before any communication) when Hq < the Ulysses degree: a member would hold no
    query head. Any other head count is served (uneven shards, :func:`split_heads`)."""
    head_shards(q.shape[2], degree, what)


def ulysses_config(axis: GroupInfo, q, k, call, ring: RingConfig | None = None, packed=None,
                   window: int | None = None) -> UlyssesConfig:
    """The frozen config of one call (``call`` is the API's validated ``CallSpec``)."""
    hq, hkv = q.shape[2], k.shape[2]
    q_split, kv_split = split_heads(hq, hkv, axis.size)
    return UlyssesConfig(axis=axis, q_split=q_split, kv_split=kv_split,
                         segments=gqa_segments(q_split, kv_split, hq // hkv, axis.rank), heads=(hq, hkv),
                         causal=call.causal, scale=call.scale, backend=call.backend, stats=call.stats, ring=ring,
                         packed=packed, window=window, trace=call.trace, return_lse=call.return_lse)


def run_ulysses(q, k, v, call) -> torch.Tensor:
    """Runner of the ``ulysses`` method: the whole group is the Ulysses axis."""
    return UlyssesAttention.apply(q, k, v, call.sinks, ulysses_setup(q, k, v, call))


def ulysses_setup(q, k, v, call) -> UlyssesConfig:
    """The :class:`UlyssesConfig` of a ``ulysses`` call (checks the head count first)."""
    check_heads(q, call.info.size, what=f"the {call.info.size} ranks of the group (method='ulysses')")
    packed = None
    window = effective_window(call.window, call.packed, call.info.size * q.shape[1])
    if call.packed is not None:
        packed = packed_heads(call.packed, call.causal, window)
    return ulysses_config(call.info, q, k, call, packed=packed, window=window)
