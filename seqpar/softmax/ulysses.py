"""Ulysses attention: all-to-all from sequence shards to head shards, full attention, and back.

Shapes (U = ranks on the Ulysses axis, ``c = T_local``, ``L = U·c``; contiguous layout, so member m
holds global tokens ``[m·c, (m+1)·c)``):

- in:  q ``[B, c, Hq, D]``, k, v ``[B, c, Hkv, D]`` (sequence shards);
- after the all-to-all: q ``[B, L, Hq/U, D]`` (member m owns query heads ``[m·Hq/U, (m+1)·Hq/U)``)
  and k, v ``[B, L, n_m, D]`` with the ``n_m`` KV heads those query heads use (see below);
- full attention of the whole sequence for the local heads (``block_forward``; GQA native), or, in
  USP (:mod:`seqpar.softmax.usp`), the shared ring loop over the ring axis on these head shards;
- out ``[B, L, Hq/U, D]`` goes back through the inverse all-to-all to ``[B, c, Hq, D]``.

**GQA head routing.** With ``g = Hq/Hkv`` and ``h = Hq/U``, member m needs the KV heads
``[⌊m·h/g⌋, ⌊((m+1)·h - 1)/g⌋ + 1)``. Each KV head is sent only to the members whose query heads
use it: when ``Hkv % U == 0`` every member gets ``Hkv/U`` heads of its own; when ``Hkv < U`` a KV
head is replicated to the ``U/Hkv`` members that share it (never padded, never expanded to Hq).
All of q, k and v travel in ONE uneven ``all_to_all_single`` (per destination: its query heads,
then its K heads, then its V heads). In backward the members' dK,dV of a shared KV head are summed
(in fp32) by the sequence owner when the gradients come back. When a member's query heads do not
split evenly over its KV heads (``h % g`` and ``g % h`` both non-zero, e.g. Hq=12, Hkv=6, U=4) the
local heads are cut into a few *segments*, each a plain GQA block with equal groups.

Volume per rank (elements; esize bytes each): forward ``(U-1)/U·c·2d`` for q and out plus
``2·B·c·D·(Σ_m n_m - n_me)`` for k, v (``= (U-1)/U·c·2d_kv`` when ``Hkv % U == 0``: docs/methods.md
§4/§8); backward the same (dout out, dq, dk, dv back, in the input dtype).

Shared by ``ulysses`` and ``usp``: one autograd Function, :class:`UlyssesAttention`; the local step
is either ``block_forward`` or ``ring_forward`` (never a copy of the ring loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from ..comm import CommStats, GroupInfo, all_to_all
from ..kernels import block_backward, block_forward
from ..kernels.varlen import varlen_backward, varlen_forward
from ..layouts.ulysses import packed_heads
from ..tracing import Trace, begin, block_flops, end, span
from .executor import RingConfig, ring_backward, ring_forward


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
    """Query heads split evenly over ``u`` members; each member's KV heads = those its queries use."""
    h, g = hq // u, hq // hkv
    q = HeadSplit(tuple(m * h for m in range(u)), tuple((m + 1) * h for m in range(u)))
    kv = HeadSplit(tuple(m * h // g for m in range(u)), tuple(((m + 1) * h - 1) // g + 1 for m in range(u)))
    return q, kv


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
    (this member's heads of ``splits[i]``, whole Ulysses-axis sequence in member order)."""
    if axis.single:
        return list(parts)
    u, me = axis.size, axis.rank
    b, c, _, d = parts[0].shape
    sizes = [[b * c * s.count(m) * d for s in splits] for m in range(u)]
    send = parts[0].new_empty(sum(map(sum, sizes)))
    off = 0
    for m in range(u):
        for x, s, size in zip(parts, splits, sizes[m]):
            send[off:off + size].view(b, c, s.count(m), d).copy_(x[:, :, s.start[m]:s.stop[m]])
            off += size
    chunk = sum(sizes[me])
    recv = all_to_all(axis, send, input_splits=[sum(x) for x in sizes], output_splits=[chunk] * u,
                      stats=stats, name=name, trace=trace).view(u, chunk)
    outs, off = [], 0
    for s, size in zip(splits, sizes[me]):
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
    b, t, _, d = parts[0].shape
    c = t // u
    sizes = [[b * c * s.count(m) * d for s in splits] for m in range(u)]
    chunk = sum(sizes[me])
    send = parts[0].new_empty(u * chunk)
    grid, off = send.view(u, chunk), 0
    for y, size, s in zip(parts, sizes[me], splits):
        n = s.count(me)
        grid[:, off:off + size].view(u, b, c, n, d).copy_(rearrange(y, "b (u c) n d -> u b c n d", u=u))
        off += size
    recv = all_to_all(axis, send, input_splits=[chunk] * u, output_splits=[sum(x) for x in sizes],
                      stats=stats, name=name, trace=trace)
    acc = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    outs = [parts[0].new_empty(b, c, h, d) if s.disjoint else parts[0].new_zeros(b, c, h, d, dtype=acc)
            for s, h in zip(splits, heads)]
    off = 0
    for m in range(u):
        for out, s, size in zip(outs, splits, sizes[m]):
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
    trace: Trace | None = None  # records the all-to-alls and the local attention (seqpar.tracing)


def _span(cfg: UlyssesConfig, q, k, bwd: bool):
    """Time the local attention of heads ``q [B, L, h, D]`` in the trace (a no-op without one)."""
    tr = cfg.trace
    if tr is None:
        return span(None, "")
    b, t, h, d = q.shape
    pairs = cfg.packed.segments.pairs if cfg.packed is not None else None
    mask = "causal" if cfg.causal else "none"
    return tr.compute(("varlen_" if pairs is not None else "block_") + ("bwd" if bwd else "fwd"),
                      flops=block_flops(b, t, k.shape[1], h, d, mask, bwd, pairs=pairs),
                      shape=(b, t, k.shape[1], h, k.shape[2], d), mask=None if pairs is not None else mask,
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
        return block_forward(q, k, v, scale=cfg.scale, mask="causal" if cfg.causal else "none",
                             backend=cfg.backend)


def _segment_backward(dout, q, k, v, out, lse, cfg: UlyssesConfig):
    if cfg.ring is not None:
        return ring_backward(dout, q, k, v, out, lse, cfg.ring)
    with _span(cfg, q, k, True):
        if cfg.packed is not None:
            order, inv = cfg.packed.index(q.device)
            grads = varlen_backward(*(x.index_select(1, order) for x in (dout, q, k, v, out)),
                                    lse.index_select(2, order), cfg.packed.segments, scale=cfg.scale,
                                    backend=cfg.backend)
            return tuple(g.index_select(1, inv) for g in grads)
        return block_backward(dout, q, k, v, out, lse, scale=cfg.scale, mask="causal" if cfg.causal else "none",
                              backend=cfg.backend)


def _local_forward(qh, kh, vh, cfg: UlyssesConfig):
    """Attention of the local heads over the whole sequence: ``(out [B, L, h, D] in q's dtype, lse)``."""
    if len(cfg.segments) == 1:
        out, lse = _segment_forward(qh, kh, vh, cfg)
        return out.to(qh.dtype), lse
    parts = [_segment_forward(qh[:, :, s.q], kh[:, :, s.kv], vh[:, :, s.kv], cfg) for s in cfg.segments]
    return torch.cat([o.to(qh.dtype) for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=1)


def _local_backward(douth, qh, kh, vh, outh, lse, cfg: UlyssesConfig):
    """Gradients of the local heads, in the input dtype (dk, dv with this member's KV heads)."""
    if len(cfg.segments) == 1:
        grads = _segment_backward(douth, qh, kh, vh, outh, lse, cfg)
        return [g.to(qh.dtype) for g in grads]
    dq, dk, dv = torch.empty_like(qh), torch.empty_like(kh), torch.empty_like(vh)
    for s in cfg.segments:
        gq, gk, gv = _segment_backward(douth[:, :, s.q], qh[:, :, s.q], kh[:, :, s.kv], vh[:, :, s.kv],
                                       outh[:, :, s.q], lse[:, s.q], cfg)
        dq[:, :, s.q], dk[:, :, s.kv], dv[:, :, s.kv] = gq, gk, gv
    return [dq, dk, dv]


def ulysses_forward(q, k, v, cfg: UlyssesConfig):
    """Sequence shards in, sequence shards out: ``out [B, c, Hq, D]`` in q's dtype.

    Also returns what backward needs: the head-sharded ``qh, kh, vh, outh`` and ``lse [B, h, L]``.
    """
    splits = (cfg.q_split, cfg.kv_split, cfg.kv_split)
    qh, kh, vh = seq_to_heads(cfg.axis, (q, k, v), splits, stats=cfg.stats, name="ulysses_qkv", trace=cfg.trace)
    outh, lse = _local_forward(qh, kh, vh, cfg)
    (out,) = heads_to_seq(cfg.axis, (outh,), (cfg.q_split,), cfg.heads[:1], stats=cfg.stats, name="ulysses_out",
                          trace=cfg.trace)
    return out, (qh, kh, vh, outh, lse)


def ulysses_backward(dout, saved, cfg: UlyssesConfig):
    """``dout [B, c, Hq, D]`` -> ``dq [B, c, Hq, D]``, ``dk, dv [B, c, Hkv, D]`` in the input dtype."""
    qh, kh, vh, outh, lse = saved
    (douth,) = seq_to_heads(cfg.axis, (dout,), (cfg.q_split,), stats=cfg.stats, name="ulysses_dout", trace=cfg.trace)
    grads = _local_backward(douth, qh, kh, vh, outh, lse, cfg)
    splits = (cfg.q_split, cfg.kv_split, cfg.kv_split)
    heads = (cfg.heads[0], cfg.heads[1], cfg.heads[1])
    return heads_to_seq(cfg.axis, grads, splits, heads, stats=cfg.stats, name="ulysses_dqkv", trace=cfg.trace)


class UlyssesAttention(torch.autograd.Function):
    """Saves what backward needs and restores it; the work is in ulysses_forward / ulysses_backward."""

    @staticmethod
    def forward(ctx, q, k, v, cfg: UlyssesConfig):
        if cfg.stats is not None:
            cfg.stats.phase = "fwd"
        out, saved = ulysses_forward(q, k, v, cfg)
        ctx.save_for_backward(*saved)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, dout):
        cfg = ctx.cfg
        if cfg.stats is not None:
            cfg.stats.phase = "bwd"
        begin(cfg.trace, "attention bwd")
        dq, dk, dv = ulysses_backward(dout.contiguous(), ctx.saved_tensors, cfg)
        end(cfg.trace, "attention bwd")
        if cfg.stats is not None:
            cfg.stats.phase = "fwd"
        return dq, dk, dv, None


def check_heads(q: torch.Tensor, degree: int, *, what: str) -> None:
    """ValueError (before any communication) unless Hq is divisible by the Ulysses degree."""
    hq = q.shape[2]
    if hq % degree:
        fits = [u for u in range(1, degree + 1) if degree % u == 0 and hq % u == 0]
        raise ValueError(
            f"q: Hq={hq} query heads cannot be split over {what}={degree} (Ulysses gives every rank "
            f"Hq/{degree} heads): use a Ulysses degree that divides both ({fits}), e.g. method='usp' "
            f"with ulysses_degree={fits[-1]}, or a ring-family method"
        )


def ulysses_config(axis: GroupInfo, q, k, call, ring: RingConfig | None = None, packed=None) -> UlyssesConfig:
    """The frozen config of one call (``call`` is the API's validated ``CallSpec``)."""
    hq, hkv = q.shape[2], k.shape[2]
    q_split, kv_split = split_heads(hq, hkv, axis.size)
    return UlyssesConfig(axis=axis, q_split=q_split, kv_split=kv_split,
                         segments=gqa_segments(q_split, kv_split, hq // hkv, axis.rank), heads=(hq, hkv),
                         causal=call.causal, scale=call.scale, backend=call.backend, stats=call.stats, ring=ring,
                         packed=packed, trace=call.trace)


def run_ulysses(q, k, v, call) -> torch.Tensor:
    """Runner of the ``ulysses`` method: the whole group is the Ulysses axis."""
    check_heads(q, call.info.size, what="the Ulysses degree (ranks in group)")
    packed = None
    if call.packed is not None:
        packed = packed_heads(call.packed, call.causal)
    return UlyssesAttention.apply(q, k, v, ulysses_config(call.info, q, k, call, packed=packed))
