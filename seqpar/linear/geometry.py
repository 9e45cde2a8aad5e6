"""Per-rank geometry of a contiguous linear-attention shard, built once on the host.

Rank ``p`` of ``N`` holds tokens ``[p*T_local, (p+1)*T_local)`` of the global sequence. The *state rows*
are what travels between ranks: one row per batch row (``R = B``), or a single row for a packed stream
(``R = 1``, ``B = 1``). For a packed stream (``cu_seqlens``, global, flash-attn convention) the shard is
cut at every document start that falls inside it:

- the first local piece continues the state from rank ``p-1`` unless the shard starts exactly on a
  document start (rank 0's first document starts from ``initial_state``);
- the last local piece's final state leaves the rank;
- the outgoing state depends on the incoming one only when the shard lies inside one document.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearShard:
    """This rank's shard: the local sequences the kernel sees and how the state rows attach to them.

    ``seq_lens``: local sequence lengths (``B`` rows of ``T_local``, or the local document pieces).
    ``in_seqs[r]``: the local sequence that starts from incoming state row ``r`` (-1: none does).
    ``out_seqs[r]``: the local sequence whose final state is outgoing row ``r``.
    ``passes[r]``: outgoing row ``r`` depends on incoming row ``r`` (then ``in_seqs[r] == out_seqs[r]``).
    """

    rank: int
    world: int
    batch: int
    t_local: int
    seq_lens: tuple[int, ...]
    in_seqs: tuple[int, ...]
    out_seqs: tuple[int, ...]
    passes: tuple[bool, ...]
    packed: bool

    @property
    def rows(self) -> int:
        return len(self.out_seqs)

    @property
    def n_seq(self) -> int:
        return len(self.seq_lens)

    @property
    def uses_incoming(self) -> bool:
        return any(i >= 0 for i in self.in_seqs)


def check_cu_seqlens(cu_seqlens, *, batch: int, t_local: int, world: int) -> list[int]:
    """Validate a global ``cu_seqlens`` for a contiguous linear-attention shard.

    The offsets themselves are checked by :func:`seqpar.layouts.packed.check_cu_seqlens` (the one check
    every method shares); this adds what is specific here: packed input has batch size 1 and the
    offsets cover ``N * T_local`` tokens (no padding: linear attention needs none).
    """
    from ..layouts.packed import check_cu_seqlens as check_offsets

    if batch != 1:
        raise ValueError(f"cu_seqlens: packed input must have batch size 1 ([1, T_local, H, K]), got B={batch}")
    cu = list(check_offsets(cu_seqlens, None))
    if cu[-1] != world * t_local:
        raise ValueError(
            f"cu_seqlens: is the GLOBAL cu_seqlens of the packed stream, so cu_seqlens[-1] must equal "
            f"N * T_local = {world} * {t_local} = {world * t_local}, got {cu[-1]}")
    return cu


def build_shard(rank: int, world: int, batch: int, t_local: int, cu: list[int] | None) -> LinearShard:
    """Geometry of rank ``rank``'s contiguous shard (``cu``: validated host ``cu_seqlens`` or None)."""
    if cu is None:
        rows = tuple(range(batch))
        return LinearShard(rank, world, batch, t_local, (t_local,) * batch, rows, rows,
                           (True,) * batch, False)
    off = rank * t_local
    cuts = [c - off for c in cu if off < c < off + t_local]
    edges = [0, *cuts, t_local]
    seq_lens = tuple(b - a for a, b in zip(edges[:-1], edges[1:]))
    continues = rank == 0 or off not in set(cu)
    in_seq = 0 if continues else -1
    return LinearShard(rank, world, 1, t_local, seq_lens, (in_seq,), (len(seq_lens) - 1,),
                       (continues and len(seq_lens) == 1,), True)
