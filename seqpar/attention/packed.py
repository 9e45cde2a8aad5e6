"""Packed variable-length batches for every softmax method (ALGORITHMS.md §5).

The user passes global ``cu_seqlens`` (flash-attn convention) or a prebuilt :class:`PackedLayout`
(see :func:`packed_layout`: build it once per batch and pass it to every layer's call, so the host
geometry and its device index tensors are made once). Everything here is host geometry; the step
loops only index it.

- **Ring family** (``ring``, ``zigzag_ring``, ``striped_ring``, ``allgather_kv``, ``token_ring``,
  ``lightseq``): the layout of the method, per document (:mod:`seqpar.packing`). The method's
  dense schedule decides who computes which (query owner, K,V owner) pair and what moves; every
  block is replaced by the per-document geometry of that pair
  (:func:`~seqpar.packing.step_segments`), run by the varlen kernels. All moves carry whole
  shards: token_ring's causal "second half only" transfers do not apply to packed input (a
  document's real tokens do not sit at fixed rows), so packed token_ring moves whole Q and whole
  partial outputs, like non-causal token_ring.
- **Ulysses**: contiguous per-document layout over the N ranks; after the all-to-all a rank holds
  every rank's piece of every document (rank-major); it is permuted to document order and runs
  one varlen call (one segment per document).
- **USP**: the ring method's layout over the R ring members, its local stream padded to a multiple
  of U (:attr:`PackedLayout.align`) and cut into U contiguous pieces; the Ulysses all-to-all
  rebuilds the ring member's stream, then the packed ring schedule runs over the ring axis.
"""

from __future__ import annotations

import dataclasses

import torch

from ..comm import group_info
from ..kernels.varlen import Segment, TensorCache, VarlenSegments
from ..packing import PackedLayout, check_cu_seqlens, step_segments
from .plans import Block, Schedule, Step, Task, row_range
from .registry import MethodSpec, method_spec


def layout_geometry(method: str, group=None, ulysses_degree=None, ring_method=None) -> tuple[str, int, int]:
    """``(kind, n, align)`` of the packed layout of ``method`` on ``group`` (no communication)."""
    spec = method_spec(method, argument="method", softmax_only=True)
    if spec.family == "usp":
        from .usp import describe_usp, ring_method_spec

        axes = describe_usp(group, ulysses_degree)
        return ring_method_spec(ring_method).layout, axes.ring_degree, axes.ulysses_degree
    return spec.layout, group_info(group).size, 1


def resolve_layout(cu_seqlens, kind: str, n: int, align: int, total_tokens: int | None,
                   argument: str = "cu_seqlens") -> PackedLayout:
    """A :class:`PackedLayout` from ``cu_seqlens`` (validated) or a prebuilt one (checked to fit)."""
    if isinstance(cu_seqlens, PackedLayout):
        pl = cu_seqlens
        if (pl.kind, pl.n, pl.align) != (kind, n, align):
            raise ValueError(f"{argument}: the PackedLayout was built for (layout={pl.kind!r}, n={pl.n}, "
                             f"align={pl.align}) but this call needs ({kind!r}, {n}, {align}): build it with "
                             "seqpar.packed_layout(cu_seqlens, method=..., group=...) for this method and group")
        if total_tokens is not None and pl.total_tokens != total_tokens:
            raise ValueError(f"{argument}: the PackedLayout describes {pl.total_tokens} tokens but the packed "
                             f"stream holds {total_tokens}")
        return pl
    cu = check_cu_seqlens(cu_seqlens, total_tokens, argument=argument)
    return PackedLayout(kind, n, tuple(b - a for a, b in zip(cu, cu[1:])), align)


def packed_layout(cu_seqlens, *, method: str = "zigzag_ring", group=None, ulysses_degree: int | None = None,
                  ring_method: str | None = None) -> PackedLayout:
    """Build the packed geometry of a batch once; pass it as ``cu_seqlens=`` to ``seqpar.shard``,
    ``seqpar.unshard`` and ``seqpar.attention`` (same method and group) instead of the tensor.

    Validates ``cu_seqlens`` (ValueError); local, no communication. Schedules and device index
    tensors are cached on the returned object, so every layer after the first reuses them.
    """
    kind, n, align = layout_geometry(method, group, ulysses_degree, ring_method)
    return resolve_layout(cu_seqlens, kind, n, align, None)


def _packed_schedule(spec: MethodSpec, layout: PackedLayout, rank: int, causal: bool) -> Schedule:
    n, t = layout.n, layout.t_local
    # lightseq's causal schedule decides which rank computes each pair (helpers); every other
    # method takes its non-causal schedule, whose tasks cover every pair and whose moves carry
    # whole shards (token_ring's causal half-Q moves assume fixed rows: not for packed input).
    dense_causal = causal and spec.name == "lightseq"
    sched = spec.plan(rank, n, t, dense_causal, spec.transport).schedule(t)
    full = row_range(0, t)
    steps = []
    for step in sched.steps:
        tasks = []
        for task in step.tasks:
            segs = step_segments(layout, (rank + task.q) % n, (rank + task.kv) % n, causal=causal) \
                if task.blocks else None
            blocks = (Block(full, full, "none", segs),) if segs is not None and segs.segments else ()
            tasks.append(Task(task.q, task.kv, blocks))
        steps.append(Step(tuple(tasks), step.moves))
    return Schedule(tuple(steps), sched.transport, sched.name)


def packed_schedule(spec: MethodSpec, layout: PackedLayout, rank: int, causal: bool) -> Schedule:
    """This rank's schedule of a ring-family method for ``layout`` (cached on the layout)."""
    return layout.cache.get(("schedule", spec.name, spec.transport, rank, bool(causal)),
                            lambda: _packed_schedule(spec, layout, rank, causal))


@dataclasses.dataclass(frozen=True)
class PackedHeads:
    """Ulysses geometry: the whole padded packed stream after the all-to-all.

    ``order[p]``: row of the rank-major gathered stream ``[N * t_local]`` (rank m's piece of every
    document, then rank m+1's, ...) at position p of the document-major stream, where document d
    occupies ``N * local_cu_seqlens[d]`` onwards, real tokens first. ``segments``: one segment per
    document over its real tokens of the document-major stream.
    """

    layout: PackedLayout
    causal: bool
    order: tuple[int, ...] = dataclasses.field(init=False, repr=False)
    segments: VarlenSegments = dataclasses.field(init=False, repr=False)
    cache: TensorCache = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pl, n = self.layout, self.layout.n
        t, order, segs = pl.t_local, [], []
        mask = "causal" if self.causal else "none"
        for d, (o, h, L) in enumerate(zip(pl.local_cu_seqlens, pl.chunk_lens, pl.doc_lens)):
            for m in range(n):
                order.extend(range(m * t + o, m * t + o + h))
            segs.append(Segment(n * o, L, n * o, L, mask))
        object.__setattr__(self, "order", tuple(order))
        object.__setattr__(self, "segments", VarlenSegments(n * t, n * t, tuple(segs)))
        object.__setattr__(self, "cache", TensorCache())

    def index(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``(order, inverse)`` on ``device`` (cached)."""
        device = torch.device(device)

        def build():
            fwd = torch.tensor(self.order, dtype=torch.int64)
            inv = torch.empty_like(fwd)
            inv[fwd] = torch.arange(fwd.numel())
            return fwd.to(device), inv.to(device)

        return self.cache.get(("index", str(device)), build)


def packed_heads(layout: PackedLayout, causal: bool) -> PackedHeads:
    """The :class:`PackedHeads` of ``layout`` (cached on the layout)."""
    return layout.cache.get(("heads", bool(causal)), lambda: PackedHeads(layout, bool(causal)))


__all__ = ["PackedHeads", "layout_geometry", "packed_heads", "packed_layout", "packed_schedule", "resolve_layout"]
