"""Attention over the stream layout (:mod:`seqpar.layouts.stream`): the packed stream cut into N
contiguous pieces, documents crossing rank boundaries.

Geometry: member ``a``'s queries meet member ``b``'s K,V only inside documents that both pieces
touch. For each such document the block is the document's rows of piece ``a`` against its rows of
piece ``b`` under the document's mask (causal: keys up to the query; a sliding window: the band of
the two runs' global offset), trimmed to the rows and keys that meet; the blocks of a member pair
form one varlen block over the span of rows they use.

Schedule: the direct form the ring takes under a sliding window (:class:`~.window.DirectPlan` with
:func:`~.window.kv_pairing`): the query owner computes every pair, K,V rows travel straight from
their owner (only the rows the pair's blocks use) and dK,dV go straight back. So a rank fetches
exactly the K,V of the documents it holds tokens of, like an all-gather of K,V restricted to what
each rank needs, and a pair of members that shares no document exchanges nothing. Forward and
backward are the shared executor's (:mod:`.executor`), exact like every other schedule.
"""

from __future__ import annotations

import dataclasses

from ..comm import group_info
from ..kernels.masks import Band, plan_block, window_band
from ..kernels.varlen import Segment, VarlenSegments
from ..layouts.stream import StreamLayout, check_stream_method
from .plans import Block, Schedule, row_range
from .window import direct_plan, kv_pairing


def _band(offset: int, window: int | None, causal: bool) -> Band | None:
    """Visible diagonals between two runs whose first global positions differ by ``offset``."""
    if window is None:
        return Band(None, offset) if causal else Band(None, None)
    return window_band(offset, window, causal)


def pair_segments(layout: StreamLayout, a: int, b: int, causal: bool, window: int | None) -> list[Segment]:
    """The segments of member ``a``'s queries against member ``b``'s K,V, in local rows of each."""
    t, segs = layout.t_local, []
    keys = {d: (k0, k1) for d, k0, k1 in layout.pieces[b]}
    for d, q0, q1 in layout.pieces[a]:
        if d not in keys:
            continue
        k0, k1 = keys[d]
        band = _band(q0 - k0, window, causal)
        p = None if band is None else plan_block(q1 - q0, k1 - k0, band)
        if p is None or p.empty:
            continue
        mask = p.window or ("causal" if p.causal else "none")
        segs.append(Segment(q0 - a * t + p.q_start, p.rows, k0 - b * t + p.k_start, p.keys, mask))
    return segs


def _span_block(segs: list[Segment]) -> Block:
    """One varlen block over the spans of local rows and keys that ``segs`` use."""
    q0, q1 = min(s.q_start for s in segs), max(s.q_start + s.q_len for s in segs)
    k0, k1 = min(s.k_start for s in segs), max(s.k_start + s.k_len for s in segs)
    shifted = tuple(dataclasses.replace(s, q_start=s.q_start - q0, k_start=s.k_start - k0) for s in segs)
    return Block(row_range(q0, q1), row_range(k0, k1), "none", VarlenSegments(q1 - q0, k1 - k0, shifted))


def stream_schedule(layout: StreamLayout, rank: int, causal: bool, window: int | None = None) -> Schedule:
    """This rank's schedule for ``layout`` (cached on the layout)."""

    def build() -> Schedule:
        def blocks(a: int, b: int) -> tuple[Block, ...]:
            segs = pair_segments(layout, a, b, causal, window)
            return (_span_block(segs),) if segs else ()

        return direct_plan(rank, layout.n, blocks, kv_pairing).schedule()

    return layout.cache.get(("stream schedule", rank, bool(causal), window), build)


def stream_setup(q, k, method: str, group, layout: StreamLayout) -> StreamLayout:
    """Check a call's local tensors and group against ``layout`` (no communication)."""
    check_stream_method(method)
    info = group_info(group)
    if layout.n != info.size:
        raise ValueError(f"cu_seqlens: the stream layout was built for {layout.n} ranks but the group has "
                         f"{info.size}; build it with seqpar.packed_layout(cu_seqlens, method='ring', group=group, "
                         "split='stream')")
    for name, x in (("q", q), ("k", k)):
        if x.shape[0] != 1 or x.shape[1] != layout.t_local:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: with a stream layout a rank holds its contiguous "
                             f"piece [1, {layout.t_local}, H, D] of the packed stream "
                             f"[1, {layout.total_tokens}, H, D]; "
                             "cut it with seqpar.shard(x, method='ring', cu_seqlens=layout)")
    return layout


__all__ = ["pair_segments", "stream_schedule", "stream_setup"]
