"""Packed variable-length batches: validation, per-document sharding and ring-step geometry.

A packed batch is one token stream ``[1, T_total, ...]`` holding documents back to back,
described by global ``cu_seqlens`` (flash-attn convention: ``[0, L_0, L_0 + L_1, ...,
T_total]``, int32, the same on every rank). Documents never attend across a boundary.

Sharding is per document. With N ranks every document of length L is padded inside the
library, at its END, to a multiple of ``m = N`` (contiguous, striped) or ``2N`` (zigzag)
and split:

- ``contiguous``: rank r gets piece r of the N equal pieces of every document;
- ``zigzag``: the document is cut into 2N chunks; rank r gets chunks r and 2N-1-r;
- ``striped``: rank r gets document positions i with ``i % N == r``.

Each rank's padded local stream is the concatenation of its pieces, one per document, in
document order; piece lengths (``L_pad / N``) are the same on every rank, so the local
``cu_seqlens`` is too. Because padding sits at the end of each document and every layout
keeps document order inside a piece (zigzag: chunk r precedes chunk 2N-1-r, and the latter
holds real tokens only when the former is full), the REAL tokens of every piece form a
prefix of it, on every layout. Striped pads never change the real-token count of two ranks
by more than one (rank r holds ``ceil((L - r) / N)`` real tokens of the document).

Padding rows of a sharded tensor are zero; padding queries never attend and padding keys
are never attended (the step geometry only covers real tokens), and :func:`unshard_packed`
drops them: ``unshard_packed(shard_packed(x)) == x`` exactly.

Everything here is host geometry computed once per batch from the global ``cu_seqlens``
(one device-to-host copy, in :func:`check_cu_seqlens`); device index tensors are made
lazily and cached in each layout's own :class:`~seqpar.kernels.varlen.TensorCache`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch

from .comm import CommStats, all_gather_stack, group_info
from .comm.groups import collective_device
from .kernels.varlen import Segment, TensorCache, VarlenSegments

LAYOUTS = ("contiguous", "zigzag", "striped")


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


def check_same_on_ranks(cu_host: Sequence[int], group=None, *, device=None,
                        argument: str = "cu_seqlens") -> None:
    """Cheap collective check that every rank passed the same ``cu_seqlens``.

    All-gathers a 3-number fingerprint (count, total, weighted checksum) on ``device``
    (default: the group's collective device, the GPU under NCCL). Every rank sees every
    fingerprint, so every rank raises the same ``ValueError`` and none is left waiting.
    """
    info = group_info(group)
    if info.single:
        return
    device = collective_device(info.group) if device is None else device
    p = (1 << 61) - 1
    fp = torch.tensor([len(cu_host), cu_host[-1], sum((i + 1) * x for i, x in enumerate(cu_host)) % p],
                      dtype=torch.int64, device=device)
    got = all_gather_stack(info, fp, name="check_cu_seqlens").cpu()
    bad = [r for r in range(info.size) if not torch.equal(got[r], got[0])]
    if bad:
        raise ValueError(f"{argument} differs across ranks (ranks {bad} disagree with rank 0): pass the same "
                         "global cu_seqlens on every rank of the group")


def _clamp(x: int, hi: int) -> int:
    return max(0, min(x, hi))


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Per-document sharding of a packed batch over N ranks; host geometry, built once.

    ``kind`` in :data:`LAYOUTS`; ``doc_lens``: global real lengths (each >= 1). Derived:

    - ``cu_seqlens``: global real offsets ``[n_docs + 1]`` (T_total = ``cu_seqlens[-1]``);
    - ``chunk_lens[d]``: padded length of one chunk of document d (zigzag ``L_pad / 2N``,
      else ``L_pad / N``; ``align > 1`` pads the last document further so that ``t_local`` is a
      multiple of ``align``); ``piece_lens[d]``: its local piece (2 chunks for zigzag);
    - ``local_cu_seqlens``: offsets of the pieces in the padded local stream, the same on
      every rank; ``t_local`` = its last entry (padded local length, every rank);
    - ``chunk_real[r][d]``: real tokens in each chunk of rank r's piece of document d (a
      prefix of the chunk); ``real_lens[r][d]``: their sum, a prefix of the piece;
    - ``local_indices[r][p]``: global packed index of row p of rank r's local stream, or
      -1 for padding.
    """

    kind: str
    n: int
    doc_lens: tuple[int, ...]
    align: int = 1
    cu_seqlens: tuple[int, ...] = dataclasses.field(init=False)
    chunk_lens: tuple[int, ...] = dataclasses.field(init=False)
    piece_lens: tuple[int, ...] = dataclasses.field(init=False)
    local_cu_seqlens: tuple[int, ...] = dataclasses.field(init=False)
    chunk_real: tuple[tuple[tuple[int, ...], ...], ...] = dataclasses.field(init=False, repr=False)
    real_lens: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False)
    local_indices: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)
    cache: TensorCache = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "doc_lens", tuple(self.doc_lens))
        if self.kind not in LAYOUTS:
            raise ValueError(f"layout={self.kind!r} is unknown: use one of {LAYOUTS}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r}: the number of ranks must be an int >= 1")
        if not self.doc_lens or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in self.doc_lens):
            raise ValueError(f"doc_lens={self.doc_lens!r}: need at least one document, every length an int >= 1")
        if isinstance(self.align, bool) or not isinstance(self.align, int) or self.align < 1:
            raise ValueError(f"align={self.align!r}: expected an int >= 1")
        n, two = self.n, 2 if self.kind == "zigzag" else 1
        cu, chunk_lens = [0], []
        for L in self.doc_lens:
            cu.append(cu[-1] + L)
            chunk_lens.append(-(-L // (two * n)))
        # align: pad the LAST document's chunks a little more so that t_local is a multiple of align
        # (USP cuts the local stream into `align` equal pieces); at most `align` steps.
        while (two * sum(chunk_lens)) % self.align:
            chunk_lens[-1] += 1
        local_cu = [0]
        for h in chunk_lens:
            local_cu.append(local_cu[-1] + two * h)
        chunk_real, real_lens, indices = [], [], []
        for r in range(n):
            per_doc, idx = [], []
            for L, h, g in zip(self.doc_lens, chunk_lens, cu):
                if self.kind == "zigzag":
                    starts = (r * h, (2 * n - 1 - r) * h)
                    counts = tuple(_clamp(L - s, h) for s in starts)
                    for s, c in zip(starts, counts):
                        idx.extend(range(g + s, g + s + c))
                        idx.extend([-1] * (h - c))
                elif self.kind == "contiguous":
                    counts = (_clamp(L - r * h, h),)
                    idx.extend(range(g + r * h, g + r * h + counts[0]))
                    idx.extend([-1] * (h - counts[0]))
                else:  # striped: positions a*N + r, real while < L
                    counts = (max(0, -(-(L - r) // n)),)
                    idx.extend(range(g + r, g + r + counts[0] * n, n))
                    idx.extend([-1] * (h - counts[0]))
                per_doc.append(counts)
            chunk_real.append(tuple(per_doc))
            real_lens.append(tuple(sum(c) for c in per_doc))
            indices.append(tuple(idx))
        for name, value in (("cu_seqlens", cu), ("chunk_lens", chunk_lens), ("local_cu_seqlens", local_cu),
                            ("chunk_real", chunk_real), ("real_lens", real_lens), ("local_indices", indices)):
            object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "piece_lens", tuple(two * h for h in chunk_lens))
        object.__setattr__(self, "cache", TensorCache())

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, n: int, kind: str, *, total_tokens: int | None = None,
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

    # ------------------------------------------------------------------ geometry and work
    def step_segments(self, rank: int, source: int, *, causal: bool) -> VarlenSegments:
        """See :func:`step_segments`."""
        return step_segments(self, rank, source, causal=causal)

    def ring_plan(self, rank: int, *, causal: bool) -> "PackedRingPlan":
        """:func:`ring_plan`, built once per (rank, causal) and cached on this layout."""
        return self.cache.get(("ring_plan", rank, bool(causal)), lambda: ring_plan(self, rank, causal=causal))

    def work(self, rank: int, causal: bool = True) -> int:
        """Score elements ``rank`` computes over the whole ring (sum over documents and sources)."""
        return sum(step_segments(self, rank, j, causal=causal).pairs for j in range(self.n))

    def balance(self, causal: bool = True) -> float:
        """max / mean per-rank work (1.0 is perfect balance)."""
        w = [self.work(r, causal) for r in range(self.n)]
        return max(w) * self.n / sum(w)


def step_segments(layout: PackedLayout, rank: int, source: int, *, causal: bool) -> VarlenSegments:
    """Local Q of ``rank`` against the K,V shard of ``source``, document by document.

    Streams: q is ``rank``'s padded local stream ``[1, t_local, Hq, D]``, k/v the source's
    ``[1, t_local, Hkv, D]``; document d occupies rows ``local_cu_seqlens[d] : [d+1]`` of both.
    Only real rows and keys are covered (padding rows get out 0, lse -inf). Causal plans
    (masks top-left inside each segment), per document of chunk length h:

    - contiguous: source == rank causal; source < rank all real Q vs all real K; later: none;
    - zigzag (ALGORITHMS.md §1 per document): source == rank causal over the piece;
      source < rank all real Q vs the source's first chunk; source > rank the second local
      chunk vs the whole source piece;
    - striped: ``causal`` when source <= rank, ``causal_strict`` when source > rank.

    Non-causal: each document's real Q against the source's real K. Built on the host.
    """
    r, j = layout._rank(rank), layout._rank(source)
    segs = []
    for d, o in enumerate(layout.local_cu_seqlens[:-1]):
        qr, kj = layout.real_lens[r][d], layout.real_lens[j][d]
        if not causal:
            segs.append(Segment(o, qr, o, kj, "none"))
        elif layout.kind == "striped":
            segs.append(Segment(o, qr, o, kj, "causal" if j <= r else "causal_strict"))
        elif j == r:
            segs.append(Segment(o, qr, o, qr, "causal"))
        elif layout.kind == "contiguous":
            if j < r:
                segs.append(Segment(o, qr, o, kj, "none"))
        elif j < r:
            segs.append(Segment(o, qr, o, layout.chunk_real[j][d][0], "none"))
        else:
            h = layout.chunk_lens[d]
            segs.append(Segment(o + h, layout.chunk_real[r][d][1], o, kj, "none"))
    segs = [s for s in segs if s.pairs]
    return VarlenSegments(layout.t_local, layout.t_local, tuple(segs))


@dataclasses.dataclass(frozen=True)
class PackedRingPlan:
    """``steps[s]``: what ``rank`` computes at ring step s, against the K,V of ``sources[s]``.

    ``sources[s] = (rank - s) % n``, the shard a ring holds at step s. Host-only; the step
    loop only indexes it.
    """

    rank: int
    n: int
    causal: bool
    sources: tuple[int, ...]
    steps: tuple[VarlenSegments, ...]

    @property
    def work(self) -> int:
        return sum(s.pairs for s in self.steps)


def ring_plan(layout: PackedLayout, rank: int, *, causal: bool) -> PackedRingPlan:
    """The :class:`PackedRingPlan` of ``rank`` for a K,V ring over ``layout``."""
    sources = tuple((rank - s) % layout.n for s in range(layout.n))
    steps = tuple(step_segments(layout, rank, j, causal=causal) for j in sources)
    return PackedRingPlan(rank, layout.n, causal, sources, steps)


def gathered_segments(layout: PackedLayout, rank: int, *, causal: bool) -> VarlenSegments:
    """All sources at once, for all-gathered K,V ``[1, N * t_local, Hkv, D]`` (rank-major).

    The same per-source segments as :func:`step_segments`, keys shifted by ``j * t_local``;
    several segments then share query rows and are merged by the kernel.
    """
    t = layout.t_local
    segs = tuple(dataclasses.replace(s, k_start=s.k_start + j * t)
                 for j in range(layout.n) for s in step_segments(layout, rank, j, causal=causal).segments)
    return VarlenSegments(t, layout.n * t, segs)


# ----------------------------------------------------------------------------- shard / unshard


def _resolve(layout, cu_seqlens, n: int, total: int | None) -> PackedLayout:
    if isinstance(layout, PackedLayout):
        if layout.n != n:
            raise ValueError(f"layout was built for {layout.n} ranks but the group has {n}")
        if cu_seqlens is not None and check_cu_seqlens(cu_seqlens, total) != layout.cu_seqlens:
            raise ValueError("cu_seqlens does not match the cu_seqlens the layout was built from")
        if total is not None and layout.total_tokens != total:
            raise ValueError(f"x holds {total} tokens but the layout describes {layout.total_tokens}")
        return layout
    if cu_seqlens is None:
        raise ValueError("cu_seqlens is required unless layout is a PackedLayout")
    return PackedLayout.from_cu_seqlens(cu_seqlens, n, layout, total_tokens=total)


def shard_packed(x: torch.Tensor, cu_seqlens, group=None, layout: str | PackedLayout = "zigzag",
                 dim: int = 1) -> torch.Tensor:
    """This rank's padded local stream of a global packed tensor. Purely local.

    Args:
        x: the global packed tensor, identical on every rank, ``T_total`` tokens along
            ``dim`` (e.g. ``[1, T_total, H, D]`` or labels ``[1, T_total]``).
        cu_seqlens: global document offsets (:func:`check_cu_seqlens`); may be None when
            ``layout`` is a :class:`PackedLayout`.
        group: ProcessGroup or 1-D DeviceMesh of the sequence-parallel ranks (None = world).
        layout: a kind of :data:`LAYOUTS` or a prebuilt :class:`PackedLayout`.
    Returns:
        ``x`` with ``t_local`` rows along ``dim`` (same on every rank): every document's
        piece, real tokens first, padding rows zero.
    """
    info = group_info(group)
    dim = dim % x.dim()
    pl = _resolve(layout, cu_seqlens, info.size, x.shape[dim])
    rows, src = pl.shard_index(info.rank, x.device)
    moved = x.movedim(dim, 0)
    out = moved.new_zeros((pl.t_local, *moved.shape[1:]))
    out.index_copy_(0, rows, moved.index_select(0, src))
    return out.movedim(0, dim).contiguous()


def unshard_packed(x_local: torch.Tensor, cu_seqlens, group=None, layout: str | PackedLayout = "zigzag",
                   dim: int = 1, *, stats: CommStats | None = None) -> torch.Tensor:
    """Gather every rank's local stream and restore the global packed order without padding.

    ``x_local`` has ``t_local`` rows along ``dim`` on every rank; returns ``T_total`` rows
    (every rank gets the full tensor). One all-gather over ``group``; inverse of
    :func:`shard_packed` exactly. Validation happens before the communication.
    """
    info = group_info(group)
    dim = dim % x_local.dim()
    pl = _resolve(layout, cu_seqlens, info.size, None)
    if x_local.shape[dim] != pl.t_local:
        raise ValueError(f"x_local has {x_local.shape[dim]} rows along dim {dim} but this packed layout "
                         f"holds {pl.t_local} per rank: pass the output of shard_packed (same cu_seqlens)")
    moved = x_local.movedim(dim, 0)
    gathered = all_gather_stack(info, moved, stats=stats, name="unshard_all_gather")
    flat = gathered.reshape(info.size * pl.t_local, *moved.shape[1:])
    return flat.index_select(0, pl.unshard_index(x_local.device)).movedim(0, dim).contiguous()


__all__ = [
    "LAYOUTS", "PackedLayout", "PackedRingPlan", "check_cu_seqlens", "check_same_on_ranks",
    "gathered_segments", "ring_plan", "shard_packed", "step_segments", "unshard_packed",
]
