"""The chunked layout of the gated-linear-attention kernels (:mod:`seqpar.kernels.linear_chunk`):
where every token of ``[T, H, D]`` sits in ``[n_chunks, H, C, D]``, built once on the host per set
of sequence lengths, and the moves between the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 64


@dataclass(frozen=True)
class ChunkLayout:
    """Where every token sits in the chunked layout, built once on the host.

    Chunks never cross a sequence boundary. They are ordered *level-major*: level ``j`` holds the
    ``j``-th chunk of every sequence that has one, sequences sorted by chunk count (longest first),
    so level ``j`` is the contiguous range ``[level_start[j], level_start[j] + level_size[j])`` and
    its ``r``-th chunk belongs to sorted sequence ``r``. The state scans then work on slices only.
    ``tok_idx[n*C + c]`` is the token at position ``c`` of chunk ``n`` (``T`` = padding);
    ``inv_idx[t]`` is the flat chunk position of token ``t``.
    """

    seq_lens: tuple[int, ...]
    chunk: int
    n_chunks: int
    level_start: tuple[int, ...]
    level_size: tuple[int, ...]
    order: tuple[int, ...]          # sorted position -> sequence index
    tok_idx: torch.Tensor | None    # None: identity layout (one sequence, T % C == 0)
    inv_idx: torch.Tensor | None

    @property
    def n_seq(self) -> int:
        return len(self.seq_lens)

    @property
    def total(self) -> int:
        return sum(self.seq_lens)


def seq_lens_from(batch: int, t: int, cu_seqlens) -> tuple[int, ...]:
    """Sequence lengths of a ``[B, T]`` input: ``B`` rows of ``T``, or the documents of ``cu_seqlens``."""
    if cu_seqlens is None:
        return (t,) * batch
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return tuple(int(b - a) for a, b in zip(cu[:-1], cu[1:]))


def make_layout(seq_lens, chunk: int = CHUNK, device=None) -> ChunkLayout:
    seq_lens = tuple(int(n) for n in seq_lens)
    assert chunk >= 2 and chunk & (chunk - 1) == 0, "chunk must be a power of two"
    assert seq_lens and min(seq_lens) > 0, "every sequence needs at least one token"
    nch = [-(-n // chunk) for n in seq_lens]
    order = tuple(sorted(range(len(seq_lens)), key=lambda i: -nch[i]))  # stable: ties keep order
    sizes, starts, s = [], [], 0
    for j in range(nch[order[0]]):
        m = sum(1 for i in order if nch[i] > j)
        starts.append(s)
        sizes.append(m)
        s += m
    if len(seq_lens) == 1 and seq_lens[0] % chunk == 0:
        return ChunkLayout(seq_lens, chunk, s, tuple(starts), tuple(sizes), order, None, None)
    seq_start = [0]
    for n in seq_lens[:-1]:
        seq_start.append(seq_start[-1] + n)
    total = seq_start[-1] + seq_lens[-1]
    tok = torch.full((s, chunk), total, dtype=torch.long)
    for j, (st, m) in enumerate(zip(starts, sizes)):
        for r in range(m):
            i = order[r]
            a = seq_start[i] + j * chunk
            b = min(seq_start[i] + seq_lens[i], a + chunk)
            tok[st + r, : b - a] = torch.arange(a, b)
    flat = tok.view(-1)
    inv = torch.empty(total, dtype=torch.long)
    real = flat < total
    inv[flat[real]] = torch.arange(flat.numel())[real]
    return ChunkLayout(seq_lens, chunk, s, tuple(starts), tuple(sizes), order,
                       flat.to(device), inv.to(device))


def to_chunks(x: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """``[T, H, D]`` -> ``[n_chunks, H, C, D]`` (padding is zero)."""
    t, h, d = x.shape
    if lay.tok_idx is not None:
        x = torch.cat([x, x.new_zeros(1, h, d)]).index_select(0, lay.tok_idx)
    return x.reshape(lay.n_chunks, lay.chunk, h, d).transpose(1, 2).contiguous()


def from_chunks(xc: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """``[n_chunks, H, C, D]`` -> ``[T, H, D]`` (padding dropped)."""
    n, h, c, d = xc.shape
    x = xc.transpose(1, 2).reshape(n * c, h, d)
    return x if lay.inv_idx is None else x.index_select(0, lay.inv_idx)


def _to_sorted(x: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    return x if lay.order == tuple(range(lay.n_seq)) else x[list(lay.order)]


def _from_sorted(xs: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    if lay.order == tuple(range(lay.n_seq)):
        return xs
    out = torch.empty_like(xs)
    out[list(lay.order)] = xs
    return out
