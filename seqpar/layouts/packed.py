"""Packed variable-length batches: validation and per-document sharding geometry.

A packed batch is one token stream ``[1, T_total, ...]`` holding documents back to back,
described by global ``cu_seqlens`` (flash-attn convention: ``[0, L_0, L_0 + L_1, ...,
T_total]``, int32, the same on every rank). Documents never attend across a boundary.

Sharding is per document, in the method's :class:`~seqpar.layouts.base.Layout`: every document of
length L is padded inside the library, at its END, to ``L_pad``, a multiple of ``chunks·N`` (2N for
zigzag, else N), and laid out exactly like a dense sequence of ``L_pad`` tokens. Each rank's padded
local stream is the concatenation of its pieces (``L_pad / N`` rows), one per document, in document
order, so the local ``cu_seqlens`` is the same on every rank. Because every layout keeps global
order along the local rows and the padding sits at the end of the document, the REAL tokens of
every piece form a prefix of it (:attr:`PackedLayout.real_lens`). Schedules use exactly that: a
method's dense plan for one piece, clipped to the real prefixes, is the document's exact geometry
(:mod:`seqpar.softmax.packed`).

Padding rows of a sharded tensor are zero; padding queries never attend and padding keys are never
attended, and ``unshard`` drops them: ``unshard(shard(x)) == x`` exactly.

Everything here is host geometry computed once per batch from the global ``cu_seqlens``
(one device-to-host copy, in :func:`check_cu_seqlens`); device index tensors are made
lazily and cached in each layout's own :class:`~seqpar.kernels.varlen.TensorCache`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch

from ..kernels.varlen import TensorCache
from .base import Layout, layout_named


def check_cu_seqlens(cu_seqlens, total_tokens: int | None, *, argument: str = "cu_seqlens") -> tuple[int, ...]:
    """Validate global ``cu_seqlens`` and return it as a host tuple (one device-to-host copy).

    Accepts a 1-D int32 (flash-attn convention) or int64 tensor, or a sequence of ints:
    starts at 0, strictly increasing (every document holds at least one token), ends at
    ``total_tokens`` (skipped when None). Raises ``ValueError`` naming ``argument``
    otherwise (floats and bools are refused, so NaN cannot occur). Call it before any
    communication.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{argument} has dtype {cu_seqlens.dtype}: pass document offsets as an int32 "
                             "tensor (flash-attn convention; int64 is accepted too)")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"{argument} has shape {tuple(cu_seqlens.shape)}: it must be 1-D "
                             "[n_docs + 1] offsets of the packed stream (one cu_seqlens per batch)")
        host = tuple(int(x) for x in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, Sequence) and not isinstance(cu_seqlens, (str, bytes)):
        vals = []
        for x in cu_seqlens:
            if isinstance(x, bool) or not hasattr(x, "__index__"):
                raise ValueError(f"{argument} holds {x!r} ({type(x).__name__}): it must be a 1-D sequence of "
                                 "int offsets, or an int32 tensor")
            vals.append(operator.index(x))
        host = tuple(vals)
    else:
        raise ValueError(f"{argument} is a {type(cu_seqlens).__name__}: pass an int32 tensor (or a list of "
                         "ints) of document offsets [0, L_0, L_0 + L_1, ..., T_total]")
    if len(host) < 2:
        raise ValueError(f"{argument}={list(host)} describes no document: it needs n_docs + 1 >= 2 offsets")
    if host[0] != 0:
        raise ValueError(f"{argument} starts at {host[0]}: the offsets must start at 0")
    for i, (a, b) in enumerate(zip(host, host[1:])):
        if b <= a:
            raise ValueError(f"{argument} is not strictly increasing at index {i} ({a} -> {b}): every document "
                             "must hold at least one token; drop empty documents")
    if total_tokens is not None and host[-1] != total_tokens:
        raise ValueError(f"{argument} ends at {host[-1]} but the packed stream holds {total_tokens} tokens: "
                         "the last offset must equal the token count of the packed dimension")
    return host


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Per-document sharding of a packed batch over N ranks; host geometry, built once.

    ``kind``: a :class:`~seqpar.layouts.base.Layout` or its name; ``doc_lens``: global real lengths
    (each >= 1). ``align``: the padded local length must be a multiple of it (USP cuts the local
    stream into ``align`` equal pieces; the last document is padded a little more). Derived:

    - ``layout``: the layout object; ``cu_seqlens``: global real offsets ``[n_docs + 1]``;
    - ``chunk_lens[d]``: padded length of one chunk of document d (``L_pad / (chunks·N)``);
      ``piece_lens[d]``: its local piece (``chunks`` chunks);
    - ``local_cu_seqlens``: offsets of the pieces in the padded local stream, the same on every
      rank; ``t_local`` = its last entry;
    - ``real_lens[r][d]``: real tokens of rank r's piece of document d (a prefix of the piece);
    - ``local_indices[r][p]``: global packed index of row p of rank r's local stream, -1 for padding.
    """

    kind: str | Layout
    n: int
    doc_lens: tuple[int, ...]
    align: int = 1
    layout: Layout = dataclasses.field(init=False, repr=False, compare=False)
    cu_seqlens: tuple[int, ...] = dataclasses.field(init=False)
    chunk_lens: tuple[int, ...] = dataclasses.field(init=False)
    piece_lens: tuple[int, ...] = dataclasses.field(init=False)
    local_cu_seqlens: tuple[int, ...] = dataclasses.field(init=False)
    real_lens: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False)
    local_indices: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)
    cache: TensorCache = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layout = layout_named(self.kind)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "kind", layout.name)
        object.__setattr__(self, "doc_lens", tuple(self.doc_lens))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r}: the number of ranks must be an int >= 1")
        if not self.doc_lens or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in self.doc_lens):
            raise ValueError(f"doc_lens={self.doc_lens!r}: need at least one document, every length an int >= 1")
        if isinstance(self.align, bool) or not isinstance(self.align, int) or self.align < 1:
            raise ValueError(f"align={self.align!r}: expected an int >= 1")
        n, k = self.n, layout.chunks
        cu, chunk_lens = [0], []
        for L in self.doc_lens:
            cu.append(cu[-1] + L)
            chunk_lens.append(-(-L // (k * n)))
        while (k * sum(chunk_lens)) % self.align:  # at most `align` steps
            chunk_lens[-1] += 1
        local_cu = [0]
        for h in chunk_lens:
            local_cu.append(local_cu[-1] + k * h)
        padded = [k * n * h for h in chunk_lens]
        real = tuple(tuple(layout.real_count(L, T, n, r) for L, T in zip(self.doc_lens, padded)) for r in range(n))
        indices = tuple(tuple(g + p if p < L else -1 for L, T, g in zip(self.doc_lens, padded, cu)
                              for p in layout.positions(T, n, r)) for r in range(n))
        for name, value in (("cu_seqlens", tuple(cu)), ("chunk_lens", tuple(chunk_lens)),
                            ("local_cu_seqlens", tuple(local_cu)), ("real_lens", real), ("local_indices", indices),
                            ("piece_lens", tuple(k * h for h in chunk_lens)), ("cache", TensorCache())):
            object.__setattr__(self, name, value)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, n: int, kind: str | Layout, *, total_tokens: int | None = None,
                        argument: str = "cu_seqlens", align: int = 1) -> "PackedLayout":
        """Validate ``cu_seqlens`` (:func:`check_cu_seqlens`) and build the layout."""
        cu = check_cu_seqlens(cu_seqlens, total_tokens, argument=argument)
        return cls(kind, n, tuple(b - a for a, b in zip(cu, cu[1:])), align)

    # ------------------------------------------------------------------ sizes
    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def total_tokens(self) -> int:
        """T_total: real tokens of the global packed stream."""
        return self.cu_seqlens[-1]

    @property
    def t_local(self) -> int:
        """Padded local length, the same on every rank."""
        return self.local_cu_seqlens[-1]

    @property
    def num_padding(self) -> int:
        """Padding tokens over all ranks: ``N * t_local - T_total``."""
        return self.n * self.t_local - self.total_tokens

    def local_index(self, rank: int) -> tuple[int, ...]:
        """Global packed index of every row of ``rank``'s local stream (-1: padding)."""
        return self.local_indices[self._rank(rank)]

    def _rank(self, rank: int) -> int:
        if not 0 <= rank < self.n:
            raise ValueError(f"rank={rank} is outside the group of {self.n} ranks")
        return rank

    # ------------------------------------------------------------------ device tensors (cached)
    def local_cu_seqlens_tensor(self, device=None) -> torch.Tensor:
        """``local_cu_seqlens`` as an int32 tensor on ``device`` (cached)."""
        device = torch.device(device or "cpu")
        return self.cache.get(("local_cu", str(device)),
                              lambda: torch.tensor(self.local_cu_seqlens, dtype=torch.int32, device=device))

    def shard_index(self, rank: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``(local_rows, global_rows)`` of the real tokens of ``rank`` (cached)."""
        device = torch.device(device or "cpu")

        def build():
            li = torch.tensor(self.local_index(rank), dtype=torch.int64)
            rows = torch.nonzero(li >= 0).flatten()
            return rows.to(device), li[rows].to(device)

        return self.cache.get(("shard", rank, str(device)), build)

    def unshard_index(self, device=None) -> torch.Tensor:
        """int64 ``[T_total]``: row of the rank-major gathered ``[N * t_local]`` stream for each token."""
        device = torch.device(device or "cpu")

        def build():
            li = torch.tensor([g for idx in self.local_indices for g in idx], dtype=torch.int64)
            real = li >= 0
            src = torch.empty(self.total_tokens, dtype=torch.int64)
            src[li[real]] = torch.nonzero(real).flatten()
            return src.to(device)

        return self.cache.get(("unshard", str(device)), build)

    # ------------------------------------------------------------------ work
    def work(self, rank: int, causal: bool = True) -> int:
        """(query, key) pairs ``rank``'s real queries see over every rank's keys (load-balance metric)."""
        self._rank(rank)
        total = 0
        for L, h in zip(self.doc_lens, self.chunk_lens):
            mine = [p for p in self.layout.positions(self.layout.chunks * self.n * h, self.n, rank) if p < L]
            total += sum(p + 1 for p in mine) if causal else len(mine) * L
        return total

    def balance(self, causal: bool = True) -> float:
        """max / mean per-rank work (1.0 is perfect balance)."""
        w = [self.work(r, causal) for r in range(self.n)]
        return max(w) * self.n / sum(w)


def resolve_layout(cu_seqlens, kind: str | Layout, n: int, align: int, total_tokens: int | None,
                   argument: str = "cu_seqlens") -> PackedLayout:
    """A :class:`PackedLayout` from ``cu_seqlens`` (validated) or a prebuilt one (checked to fit)."""
    if isinstance(cu_seqlens, PackedLayout):
        pl = cu_seqlens
        kind = layout_named(kind).name
        if (pl.kind, pl.n, pl.align) != (kind, n, align):
            raise ValueError(f"{argument}: the PackedLayout was built for (layout={pl.kind!r}, n={pl.n}, "
                             f"align={pl.align}) but this call needs ({kind!r}, {n}, {align}): build it with "
                             "seqpar.packed_layout(cu_seqlens, method=..., group=...) for this method and group")
        if total_tokens is not None and pl.total_tokens != total_tokens:
            raise ValueError(f"{argument}: the PackedLayout describes {pl.total_tokens} tokens but the packed "
                             f"stream holds {total_tokens}")
        return pl
    return PackedLayout.from_cu_seqlens(cu_seqlens, n, kind, total_tokens=total_tokens, argument=argument,
                                        align=align)


__all__ = ["PackedLayout", "check_cu_seqlens", "resolve_layout"]
