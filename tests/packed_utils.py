"""Packed-geometry helpers for the tests: a layout's K,V-ring steps and their all-gathered form,
read from the packed schedules the library runs (seqpar.softmax.packed)."""

from __future__ import annotations

import dataclasses

from seqpar.comm import group_info
from seqpar.kernels.varlen import VarlenSegments
from seqpar.layouts import PackedLayout, RankPlacement, layout_named
from seqpar.methods import DECLARED
from seqpar.softmax.packed import packed_schedule

#: a plain K,V-ring method of each dense layout (its steps meet source (rank - s) mod N at step s)
RING_OF_LAYOUT = {"contiguous": "ring", "zigzag": "zigzag_ring", "striped": "striped_ring"}


def method_decl(name: str):
    return next(m for m in DECLARED if m.name == name)


def ring_steps(pl: PackedLayout, rank: int, *, causal: bool) -> list[tuple[int, VarlenSegments]]:
    """``[(source, segments)]``: what ``rank`` computes against each source's K,V, step by step."""
    sched = packed_schedule(method_decl(RING_OF_LAYOUT[pl.kind]), pl, rank, causal)
    empty = VarlenSegments(pl.t_local, pl.t_local, ())
    out = []
    for step in sched.steps[:pl.n]:
        (task,) = step.tasks
        segs = task.blocks[0].segments if task.blocks else empty
        out.append(((rank + task.kv) % pl.n, segs))
    return out


def gathered_segments(pl: PackedLayout, rank: int, *, causal: bool) -> VarlenSegments:
    """All sources at once, for all-gathered K,V ``[1, N * t_local, Hkv, D]`` (rank-major)."""
    t = pl.t_local
    segs = tuple(dataclasses.replace(s, k_start=s.k_start + j * t)
                 for j, step in ring_steps(pl, rank, causal=causal) for s in step.segments)
    return VarlenSegments(t, pl.n * t, segs)


def _placement(group, layout) -> RankPlacement:
    kind = layout.layout if isinstance(layout, PackedLayout) else layout_named(layout)
    return RankPlacement(kind, group_info(group), "test")


def shard_packed(x, cu_seqlens, group=None, layout="zigzag", dim: int = 1):
    """This rank's padded local stream of ``x`` in ``layout`` (a name, or a prebuilt PackedLayout)."""
    cu = layout if isinstance(layout, PackedLayout) else cu_seqlens
    return _placement(group, layout).shard(x, dim % x.dim(), cu)


def unshard_packed(x_local, cu_seqlens, group=None, layout="zigzag", dim: int = 1, *, stats=None):
    """Inverse of :func:`shard_packed` (one all-gather over ``group``)."""
    cu = layout if isinstance(layout, PackedLayout) else cu_seqlens
    return _placement(group, layout).unshard(x_local, dim % x_local.dim(), cu, stats)
