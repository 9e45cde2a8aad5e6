"""Packed variable-length block attention: many (query rows, key rows, mask) segments in one call.

Shapes (one packed stream, batch 1; per rank when called inside a ring step):

- ``q``: ``[1, Tq, Hq, D]``; ``k``, ``v``: ``[1, Tk, Hkv, D]`` with ``Hq % Hkv == 0``.
- ``out``: ``[1, Tq, Hq, D]`` in q's dtype; ``lse``: ``[1, Hq, Tq]`` fp32 (fp64 for fp64 inputs).

A :class:`Segment` says: rows ``q_start : q_start + q_len`` of q meet rows
``k_start : k_start + k_len`` of k/v under ``mask`` (one of ``MASKS`` or a
:class:`~seqpar.kernels.masks.Band`), aligned TOP-LEFT inside the segment
(segment-local query ``i`` and key ``j`` counted from 0: ``causal`` is
``j <= i``, ``causal_strict`` is ``j < i``, a band ``lo <= j - i <= hi``). Several
segments may cover the same query rows: their partial results are merged
(:func:`seqpar.kernels.merge_`), i.e. the softmax runs over the union of their
keys, so give each row disjoint key sets. Rows covered by no segment get
``out = 0``, ``lse = -inf`` and ``dq = 0``; keys covered by none get
``dk = dv = 0``.

Execution (chosen per call, like the dense kernels):

- per-segment block calls (:func:`seqpar.kernels.block_forward`), any device:
  segments of one shape ``(q_len, k_len, mask)`` on disjoint rows are stacked
  into the batch dimension and served by ONE block call (packed batches hold
  many short documents; one call per document would be dominated by overhead);
- the varlen kernels of a backend whose capabilities say ``varlen`` (flash-attn's
  ``flash_attn_varlen_func``, seqpar's Triton kernel), on CUDA: segments are gathered
  into contiguous streams described by ``cu_seqlens_q/k`` (:mod:`.varlen_packed`, which
  also says how the backend is chosen; if chosen automatically and its kernels fail to
  launch here, the per-segment path takes over: :mod:`.fallback`).

The descriptor is built once on the host (frozen); device index tensors are
made lazily on first use and kept in its own :class:`TensorCache`, so repeated
calls (forward, backward, every layer) copy nothing from the device.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Hashable, Iterable

import torch

from .base import MASKS, check_mask, check_qkv, check_scale, lse_dtype, plan_block
from .dispatch import block_backward, block_forward
from .masks import Band, as_band, canonical, visible_pairs
from .merge import merge_, new_accumulator
from .varlen_packed import PackedCall, backward_parts, colour, forward_parts, plan_packed, run_packed


class TensorCache:
    """Lazily built values (device tensors, derived host plans) of one frozen descriptor.

    Keyed by a hashable key that includes the device. Owned by exactly one
    descriptor: never shared, never module-level. Values are pure functions of
    the descriptor, so the cache never needs invalidating.
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: dict[Hashable, object] = {}

    def get(self, key: Hashable, build: Callable[[], object]):
        """The value for ``key``, built by ``build()`` on first request."""
        if key not in self._items:
            self._items[key] = build()
        return self._items[key]

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"TensorCache({len(self._items)} entries)"


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows ``q_start : q_start + q_len`` of q against rows ``k_start : k_start + k_len`` of k/v.

    ``mask`` is aligned top-left inside the segment.
    """

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    mask: str | Band = "none"

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs: the score elements this segment computes."""
        return visible_pairs(self.q_len, self.k_len, self.mask)

    def trimmed(self) -> "Segment":
        """The same segment with keys no row can see dropped (causal: ``k_len <= q_len``); a band
        also loses the rows and leading keys outside it (re-expressed on what is left)."""
        p = plan_block(self.q_len, self.k_len, self.mask)
        if p.empty or not isinstance(self.mask, Band):
            return dataclasses.replace(self, k_len=0 if p.empty else p.k_stop)
        return Segment(self.q_start + p.q_start, p.rows, self.k_start + p.k_start, p.keys,
                       canonical(as_band(self.mask).shifted(p.q_start, p.k_start)))


@dataclasses.dataclass(frozen=True)
class SegmentBatch:
    """Segments of one shape on pairwise disjoint query rows: one batched block call."""

    q_len: int
    k_len: int
    mask: str | Band
    q_starts: tuple[int, ...]
    k_starts: tuple[int, ...]


def _plan_batches(segments: Iterable[Segment]) -> tuple[SegmentBatch, ...]:
    groups: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    for seg in segments:
        t = seg.trimmed()
        if t.q_len and t.k_len:
            groups.setdefault((t.q_len, t.k_len, t.mask), []).append((t.q_start, t.k_start))
    batches = []
    for (q_len, k_len, mask), items in groups.items():
        for layer in colour(items, lambda item, n=q_len: n):
            batches.append(SegmentBatch(q_len, k_len, mask, tuple(i[0] for i in layer),
                                        tuple(i[1] for i in layer)))
    return tuple(batches)


def _as_int(x, what: str) -> int:
    if isinstance(x, bool):
        raise ValueError(f"{what}={x!r} must be an int")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{what}={x!r} must be an int") from None


def _rows_index(ranges: Iterable[tuple[int, int]], device) -> torch.Tensor:
    idx: list[int] = []
    for start, length in ranges:
        idx.extend(range(start, start + length))
    return torch.tensor(idx, dtype=torch.int64, device=device)


@dataclasses.dataclass(frozen=True)
class VarlenSegments:
    """Frozen description of a packed block: a ``[Tq] x [Tk]`` stream pair and its segments.

    Build with :meth:`build` (accepts :class:`Segment` or 5-tuples) or
    :meth:`from_cu_seqlens` (one segment per document). ``batches`` (the
    per-segment execution plan) is derived on construction; :meth:`packed_calls`
    and the device tensors are derived lazily and cached in ``cache``.
    """

    tq: int
    tk: int
    segments: tuple[Segment, ...]
    batches: tuple[SegmentBatch, ...] = dataclasses.field(init=False, compare=False, repr=False)
    cache: TensorCache = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        tq, tk = _as_int(self.tq, "tq"), _as_int(self.tk, "tk")
        if tq < 0 or tk < 0:
            raise ValueError(f"tq={tq}, tk={tk}: stream lengths must be >= 0")
        for i, s in enumerate(self.segments):
            if not isinstance(s, Segment):
                raise ValueError(f"segments[{i}] is a {type(s).__name__}: use Segment (or VarlenSegments.build)")
            check_mask(s.mask)
            for side, start, length, total in (("q", s.q_start, s.q_len, tq), ("k", s.k_start, s.k_len, tk)):
                if start < 0 or length < 0 or start + length > total:
                    raise ValueError(
                        f"segments[{i}] = {s}: {side} rows [{start}, {start + length}) do not fit a stream of "
                        f"{total} rows (need 0 <= {side}_start and {side}_start + {side}_len <= {total})")
        object.__setattr__(self, "batches", _plan_batches(self.segments))
        object.__setattr__(self, "cache", TensorCache())

    @classmethod
    def build(cls, segments: Iterable, tq: int, tk: int) -> "VarlenSegments":
        """From :class:`Segment` objects or ``(q_start, q_len, k_start, k_len[, mask])`` tuples."""
        segs = []
        for i, s in enumerate(segments):
            if not isinstance(s, Segment):
                if not isinstance(s, (tuple, list)) or len(s) not in (4, 5):
                    raise ValueError(f"segments[{i}]={s!r}: need (q_start, q_len, k_start, k_len[, mask])")
                s = Segment(*(_as_int(x, f"segments[{i}]") for x in s[:4]), *s[4:])
            segs.append(s)
        return cls(_as_int(tq, "tq"), _as_int(tk, "tk"), tuple(segs))

    @classmethod
    def from_cu_seqlens(cls, cu_q: Iterable[int], cu_k: Iterable[int] | None = None, *,
                        mask: str = "causal") -> "VarlenSegments":
        """One segment per document (flash-attn ``cu_seqlens`` as host ints), all under ``mask``."""
        cu_q = tuple(cu_q)
        cu_k = cu_q if cu_k is None else tuple(cu_k)
        if len(cu_q) != len(cu_k) or len(cu_q) < 1:
            raise ValueError(f"cu_q has {len(cu_q)} offsets and cu_k {len(cu_k)}: need one per document + 1")
        segs = [Segment(a, b - a, c, d - c, mask) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
        return cls(cu_q[-1], cu_k[-1], tuple(segs))

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs over all segments (the work of this block)."""
        return sum(s.pairs for s in self.segments)

    @property
    def empty(self) -> bool:
        return not self.batches

    def packed_calls(self) -> tuple[PackedCall, ...]:
        """Launches of a varlen kernel (``cu_seqlens`` form) that cover every segment (cached)."""
        return self.cache.get("packed_calls", lambda: plan_packed(self.segments))

    def packed_tensors(self, i: int, device) -> tuple[torch.Tensor, ...]:
        """Device tensors of :meth:`packed_calls` ``[i]``: ``(q_index, k_index, cu_q, cu_k)``.

        Indices int64 into the q / k streams; ``cu_*`` int32 (flash-attn convention). Cached.
        """
        device = torch.device(device)

        def build():
            c = self.packed_calls()[i]
            return (_rows_index(c.q_rows, device), _rows_index(c.k_rows, device),
                    torch.tensor(c.cu_q, dtype=torch.int32, device=device),
                    torch.tensor(c.cu_k, dtype=torch.int32, device=device))

        return self.cache.get(("packed", i, str(device)), build)

    def batch_tensors(self, device) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Per batch of ``batches``: int64 ``(q_index [G*q_len], k_index [G*k_len])``. Cached."""
        device = torch.device(device)

        def build():
            qi = _rows_index(((s, b.q_len) for b in self.batches for s in b.q_starts), device)
            ki = _rows_index(((s, b.k_len) for b in self.batches for s in b.k_starts), device)
            out, qo, ko = [], 0, 0
            for b in self.batches:
                nq, nk = len(b.q_starts) * b.q_len, len(b.k_starts) * b.k_len
                out.append((qi[qo:qo + nq], ki[ko:ko + nk]))
                qo, ko = qo + nq, ko + nk
            return tuple(out)

        return self.cache.get(("batches", str(device)), build)


# ----------------------------------------------------------------------------- dispatch


def _check_streams(q, k, v, segments: VarlenSegments) -> None:
    check_qkv(q, k, v)
    if not isinstance(segments, VarlenSegments):
        raise ValueError(f"segments must be a VarlenSegments, got {type(segments).__name__}")
    if q.shape[0] != 1:
        raise ValueError(f"q has batch {q.shape[0]}: a packed stream is [1, T, H, D] (put documents in T)")
    if q.shape[1] != segments.tq or k.shape[1] != segments.tk:
        raise ValueError(f"q has {q.shape[1]} rows and k {k.shape[1]}, but segments describe streams of "
                         f"{segments.tq} and {segments.tk}: build the segments for these streams")


def _merge_rows(acc_out, acc_lse, idx, out_rows, lse_rows) -> None:
    """Merge ``out_rows [R, H, D]``, ``lse_rows [H, R]`` into accumulator rows ``idx`` (disjoint)."""
    ao = acc_out[0].index_select(0, idx).unsqueeze(0)
    al = acc_lse[0].index_select(1, idx).unsqueeze(0)
    merge_(ao, al, out_rows.unsqueeze(0), lse_rows.unsqueeze(0))
    acc_out[0].index_copy_(0, idx, ao[0])
    acc_lse[0].index_copy_(1, idx, al[0])


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments, *,
                   scale: float, backend: str | None = None,
                   acc: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Attention of every segment with its log-sum-exp -> ``(out, lse)``.

    ``q [1, Tq, Hq, D]``, ``k [1, Tk, Hkv, D]``, ``v [1, Tk, Hkv, D_v]``; returns ``out [1, Tq, Hq, D_v]``
    in q's dtype and ``lse [1, Hq, Tq]`` fp32 (fp64 for fp64). Rows in no segment:
    ``out = 0``, ``lse = -inf``. ``backend``: None (a varlen kernel when the first-ranked
    backend has one, else per-segment block calls with automatic dispatch: :mod:`.varlen_packed`),
    a backend with ``caps.varlen`` (its varlen kernel), or another backend name forced for
    every per-segment call. ``acc=(acc_out, acc_lse)``
    (fp32/fp64 accumulators of :func:`new_accumulator` for ``q``): merge into them in
    place and return them instead (the ring loop's running result).
    """
    _check_streams(q, k, v, segments)
    check_scale(scale)
    out_shape = tuple(q.shape[:3]) + (v.shape[3],)
    if acc is None:
        acc_out, acc_lse = new_accumulator(out_shape, q.device, dtype=lse_dtype(q.dtype))
    else:
        acc_out, acc_lse = acc
        if tuple(acc_out.shape) != out_shape or tuple(acc_lse.shape) != (1, q.shape[2], q.shape[1]):
            raise ValueError(f"acc shapes {tuple(acc_out.shape)}, {tuple(acc_lse.shape)} do not fit q "
                             f"{tuple(q.shape)}, v {tuple(v.shape)}: make them with new_accumulator({out_shape})")
    hq, d, dv = q.shape[2], q.shape[3], v.shape[3]
    parts = run_packed(q, k, v, backend, False, True,
                       lambda chosen: forward_parts(chosen, q, k, v, segments, scale, (acc_out, acc_lse)),
                       segments.packed_calls())
    if parts is not None:
        for qi, o, lse, merged in parts:
            if merged:  # the kernel merged into the gathered accumulator rows
                acc_out[0].index_copy_(0, qi, o)
                acc_lse[0].index_copy_(1, qi, lse)
            else:
                _merge_rows(acc_out, acc_lse, qi, o, lse)
    else:
        for b, (qi, ki) in zip(segments.batches, segments.batch_tensors(q.device)):
            g = len(b.q_starts)
            kb = k[0].index_select(0, ki).view(g, b.k_len, *k.shape[2:])
            vb = v[0].index_select(0, ki).view(g, b.k_len, *v.shape[2:])
            o, lse = block_forward(q[0].index_select(0, qi).view(g, b.q_len, hq, d), kb, vb,
                                   scale=scale, mask=b.mask, backend=backend)
            _merge_rows(acc_out, acc_lse, qi, o.reshape(-1, hq, dv),
                        lse.transpose(0, 1).reshape(hq, -1))
    if acc is not None:
        return acc_out, acc_lse
    return acc_out.to(q.dtype), acc_lse


def varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor | None, lse: torch.Tensor, segments: VarlenSegments, *,
                    scale: float, backend: str | None = None, delta: torch.Tensor | None = None,
                    grad_acc: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Gradients of every segment given the FINAL merged ``out``/``lse`` of the rows -> ``(dq, dk, dv)``.

    ``dout``/``out``: ``[1, Tq, Hq, D_v]`` (``out`` may be the fp32 accumulator, or None
    when ``delta`` = rowsum(dout * out) ``[1, Hq, Tq]`` fp32 is given); ``lse``
    ``[1, Hq, Tq]``. Returns dq ``[1, Tq, Hq, D]``, dk ``[1, Tk, Hkv, D]``, dv ``[1, Tk, Hkv, D_v]`` in the
    input dtype (accumulated in fp32, rounded once); rows in no segment get ``dq = 0``,
    keys in none ``dk = dv = 0``. Summed over all blocks of a row set, they are the
    exact gradient. ``grad_acc=(dq, dk, dv)`` (fp32/fp64, those shapes): add into them
    in place and return them instead.
    """
    _check_streams(q, k, v, segments)
    check_scale(scale)
    b_, tq, hq, d = q.shape
    o_shape = (b_, tq, hq, v.shape[3])
    for name, x, shape in (("dout", dout, o_shape), ("out", out, o_shape), ("lse", lse, (1, hq, tq)),
                           ("delta", delta, (1, hq, tq))):
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if dout is None or lse is None or (out is None and delta is None):
        raise ValueError("varlen_backward needs dout, lse and `out` (merged output) or `delta`")
    acc = lse_dtype(q.dtype)
    if delta is None:
        delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
    if grad_acc is None:
        dq_a, dk_a, dv_a = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    else:
        dq_a, dk_a, dv_a = grad_acc
        for name, x, like in (("dq", dq_a, q), ("dk", dk_a, k), ("dv", dv_a, v)):
            if tuple(x.shape) != tuple(like.shape):
                raise ValueError(f"grad_acc {name} has shape {tuple(x.shape)}, expected {tuple(like.shape)}")
    parts = run_packed(q, k, v, backend, True, out is not None,
                       lambda chosen: backward_parts(chosen, dout, q, k, v, out, lse, delta, segments, scale),
                       segments.packed_calls())
    if parts is not None:
        for qi, ki, dq, dk, dv in parts:
            dq_a[0].index_add_(0, qi, dq.to(acc))
            dk_a[0].index_add_(0, ki, dk.to(acc))
            dv_a[0].index_add_(0, ki, dv.to(acc))
    else:
        for b, (qi, ki) in zip(segments.batches, segments.batch_tensors(q.device)):
            g = len(b.q_starts)

            def rows(x, heads):  # [1, Tq, heads, d] -> the batch's rows [G, q_len, heads, d]
                return x[0].index_select(0, qi).view(g, b.q_len, heads, x.shape[-1])

            def stats(x):  # [1, Hq, Tq] -> [G, Hq, q_len]
                return x[0].index_select(1, qi).view(hq, g, b.q_len).transpose(0, 1).contiguous()

            kb = k[0].index_select(0, ki).view(g, b.k_len, *k.shape[2:])
            vb = v[0].index_select(0, ki).view(g, b.k_len, *v.shape[2:])
            dq, dk, dv = block_backward(
                rows(dout, hq), rows(q, hq), kb, vb, None if out is None else rows(out, hq), stats(lse),
                scale=scale, mask=b.mask, backend=backend, delta=stats(delta))
            dq_a[0].index_add_(0, qi, dq.reshape(-1, hq, d).to(acc))
            dk_a[0].index_add_(0, ki, dk.reshape(-1, *k.shape[2:]).to(acc))
            dv_a[0].index_add_(0, ki, dv.reshape(-1, *v.shape[2:]).to(acc))
    if grad_acc is not None:
        return dq_a, dk_a, dv_a
    return dq_a.to(q.dtype), dk_a.to(k.dtype), dv_a.to(v.dtype)


__all__ = ["MASKS", "Band", "PackedCall", "Segment", "SegmentBatch", "TensorCache", "VarlenSegments",
           "varlen_backward", "varlen_forward", "visible_pairs"]
