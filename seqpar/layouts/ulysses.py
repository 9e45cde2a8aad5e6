"""The Ulysses blocks of a packed stream: where every token sits after the sequence-to-heads all-to-all.

Plain Ulysses shards a packed batch with the contiguous layout per document; after the all-to-all a
rank holds every rank's piece of every document, rank-major. :class:`PackedHeads` maps that stream
to document order (and back), so the local attention runs one varlen call, one segment per document.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.masks import window_band
from ..kernels.varlen import Segment, TensorCache, VarlenSegments
from .packed import PackedLayout


@dataclasses.dataclass(frozen=True)
class PackedHeads:
    """Ulysses geometry: the whole padded packed stream after the all-to-all.

    ``order[p]``: row of the rank-major gathered stream ``[N * t_local]`` (rank m's piece of every
    document, then rank m+1's, ...) at position p of the document-major stream, where document d
    occupies ``N * local_cu_seqlens[d]`` onwards, real tokens first. ``segments``: one segment per
    document over its real tokens of the document-major stream, under the causal or full mask, or
    a ``window`` band (:func:`~seqpar.kernels.window_band`).
    """

    layout: PackedLayout
    causal: bool
    window: int | None = None
    order: tuple[int, ...] = dataclasses.field(init=False, repr=False)
    segments: VarlenSegments = dataclasses.field(init=False, repr=False)
    cache: TensorCache = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pl, n = self.layout, self.layout.n
        if pl.layout.name != "contiguous":
            raise ValueError(f"PackedHeads needs the contiguous layout of Ulysses, got {pl.kind!r}")
        t, order, segs = pl.t_local, [], []
        mask = "causal" if self.causal else "none"
        if self.window is not None:
            mask = window_band(0, self.window, self.causal)
        for o, h, L in zip(pl.local_cu_seqlens, pl.chunk_lens, pl.doc_lens):
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


def packed_heads(layout: PackedLayout, causal: bool, window: int | None = None) -> PackedHeads:
    """The :class:`PackedHeads` of ``layout`` (cached on the layout)."""
    return layout.cache.get(("heads", bool(causal), window), lambda: PackedHeads(layout, bool(causal), window))


__all__ = ["PackedHeads", "packed_heads"]
