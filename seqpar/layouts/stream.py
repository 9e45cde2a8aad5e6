"""The stream layout of a packed batch: the packed stream cut into N contiguous pieces.

The per-document layout of :mod:`seqpar.layouts.packed` splits every document over all ranks (each
rank holds a balanced share of every document). The *stream* layout instead cuts the packed stream
``[1, T_total, ...]`` itself into ``N`` contiguous pieces of ``T_local = T_total / N`` tokens: rank
``r`` holds global tokens ``[r·T_local, (r+1)·T_local)``, so a document may start on one rank and
end on a later one, and a short document lives on one rank only. This is how a data loader that
packs documents and then slices the token stream lays out a batch (ring-flash-attention's
``llama3_flash_attn_*`` functions, axolotl's sequence parallelism), and it needs no padding inside
documents (only ``T_total % N == 0``).

Attention over it (:mod:`seqpar.softmax.stream`) fetches, for each rank, only the K,V rows its own
documents need, directly from the ranks that hold them; the load is not balanced across ranks
(the last rank of a long document sees the most keys): prefer the per-document layout when the
loader can be changed.

Everything here is host geometry built once per batch from the global ``cu_seqlens``; pass the
:class:`StreamLayout` as ``cu_seqlens=`` to ``seqpar.shard``, ``seqpar.unshard`` and
``seqpar.attention`` (method ``"ring"``, whose dense layout is also contiguous).
"""

from __future__ import annotations

import dataclasses

import torch

from ..comm import CommStats, GroupInfo, all_gather_stack
from ..kernels.varlen import TensorCache
from .packed import check_cu_seqlens

#: The one method the stream layout runs with: ``ring``'s dense layout is contiguous too.
STREAM_METHOD = "ring"


@dataclasses.dataclass(frozen=True)
class StreamLayout:
    """A packed stream of ``cu_seqlens[-1]`` tokens cut into ``n`` contiguous pieces.

    ``cu_seqlens``: global document offsets (host tuple, flash-attn convention). Derived:
    ``t_local`` (tokens per rank), ``doc_lens``, and ``pieces[r]``: the documents rank r holds
    tokens of, as ``(doc, global_start, global_stop)`` clipped to the rank's piece, in order.
    """

    n: int
    cu_seqlens: tuple[int, ...]
    kind: str = dataclasses.field(default="stream", init=False)
    t_local: int = dataclasses.field(init=False)
    doc_lens: tuple[int, ...] = dataclasses.field(init=False)
    pieces: tuple[tuple[tuple[int, int, int], ...], ...] = dataclasses.field(init=False, repr=False)
    cache: TensorCache = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r}: the number of ranks must be an int >= 1")
        cu = check_cu_seqlens(self.cu_seqlens, None)
        total = cu[-1]
        if total % self.n:
            raise ValueError(f"cu_seqlens: the packed stream holds {total} tokens, not a multiple of the {self.n} "
                             f"ranks; pad the stream (e.g. a last padding document of {-total % self.n} tokens) "
                             "so that every rank holds the same number of tokens")
        t = total // self.n
        pieces = []
        for r in range(self.n):
            lo, hi = r * t, (r + 1) * t
            pieces.append(tuple((d, max(a, lo), min(b, hi)) for d, (a, b) in enumerate(zip(cu, cu[1:]))
                                if a < hi and b > lo))
        for name, value in (("cu_seqlens", cu), ("t_local", t), ("doc_lens", tuple(b - a for a, b in zip(cu, cu[1:]))),
                            ("pieces", tuple(pieces)), ("cache", TensorCache())):
            object.__setattr__(self, name, value)

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    def local_cu_seqlens(self, rank: int) -> tuple[int, ...]:
        """Offsets of the (pieces of) documents in ``rank``'s local stream: ``[0, ..., t_local]``."""
        lo = rank * self.t_local
        return (0,) + tuple(stop - lo for _, _, stop in self.pieces[rank])

    def doc_starts(self, rank: int) -> tuple[int, ...]:
        """Global start of the document of each piece of ``rank`` (before the piece when it crosses in)."""
        return tuple(self.cu_seqlens[d] for d, _, _ in self.pieces[rank])

    def work(self, rank: int, causal: bool = True) -> int:
        """(query, key) pairs ``rank``'s queries see (load-balance metric)."""
        total = 0
        for d, a, b in self.pieces[rank]:
            s, e = self.cu_seqlens[d], self.cu_seqlens[d + 1]
            total += sum(p - s + 1 for p in range(a, b)) if causal else (b - a) * (e - s)
        return total


def stream_layout(cu_seqlens, n: int) -> StreamLayout:
    """Validate ``cu_seqlens`` (:func:`~seqpar.layouts.packed.check_cu_seqlens`: one device-to-host
    copy) and build the :class:`StreamLayout` for ``n`` ranks. ValueError when ``T_total % n``."""
    return StreamLayout(n, check_cu_seqlens(cu_seqlens, None))


def check_stream_method(method) -> None:
    """The stream layout is contiguous: only ``method="ring"`` runs it (ValueError otherwise)."""
    if method != STREAM_METHOD:
        raise ValueError(f"method={method!r}: a stream layout (seqpar.packed_layout(..., split='stream')) cuts the "
                         f"packed stream into contiguous pieces, which is method={STREAM_METHOD!r}'s layout; pass "
                         f"method={STREAM_METHOD!r} (its schedule fetches only the K,V rows each rank's documents "
                         "need)")


def _check_fits(layout: StreamLayout, info: GroupInfo, rows: int | None, argument: str) -> None:
    if layout.n != info.size:
        raise ValueError(f"{argument}: the stream layout was built for {layout.n} ranks but the group has {info.size}; "
                         "build it with seqpar.packed_layout(cu_seqlens, method='ring', group=group, split='stream')")
    if rows is not None and rows != layout.total_tokens:
        raise ValueError(f"{argument}: the stream layout describes {layout.total_tokens} tokens but x holds {rows} "
                         "along dim")


def stream_shard(x: torch.Tensor, dim: int, layout: StreamLayout, info: GroupInfo) -> torch.Tensor:
    """Rank ``info.rank``'s contiguous piece of the global packed ``x`` along ``dim`` (local)."""
    _check_fits(layout, info, x.shape[dim], "cu_seqlens")
    return x.narrow(dim, info.rank * layout.t_local, layout.t_local).contiguous()


def stream_unshard(x_local: torch.Tensor, dim: int, layout: StreamLayout, info: GroupInfo,
                   stats: CommStats | None = None) -> torch.Tensor:
    """Every rank's piece, concatenated in rank order (one all-gather)."""
    _check_fits(layout, info, None, "cu_seqlens")
    if x_local.shape[dim] != layout.t_local:
        raise ValueError(f"x_local has {x_local.shape[dim]} rows along dim {dim} but the stream layout gives each rank "
                         f"{layout.t_local}: pass the output of seqpar.shard with the same stream layout")
    moved = x_local.movedim(dim, 0)
    gathered = all_gather_stack(info, moved, stats=stats, name="unshard_all_gather")
    return gathered.reshape(-1, *moved.shape[1:]).movedim(0, dim).contiguous()


__all__ = ["STREAM_METHOD", "StreamLayout", "check_stream_method", "stream_layout", "stream_shard", "stream_unshard"]
