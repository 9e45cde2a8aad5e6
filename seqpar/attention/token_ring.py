"""TokenRing (ALGORITHMS.md §2): queries travel, partial outputs go straight home, K,V never move.

Zigzag layout (rank r holds chunks r and 2N-1-r). Queries move one hop per step toward r-1, so at
step s rank r holds the queries of owner ``j = (r + s) mod N`` and computes them against its own
K,V. The partial ``(out, lse)`` computed at step s goes straight back to owner j at step s+1 (one
step behind the compute, over a direct link), on a second channel: outputs flow against the
queries, so both directions of every link carry traffic, and the two directions use separate
process groups (:class:`TokenRingGroups`) so that they do not serialise on one communicator.

Causal (zigzag): against owner ``j > r`` (met before the wrap) every row of ``Q_j`` sees exactly
the FIRST local K,V chunk; against ``j < r`` only the SECOND half of ``Q_j`` sees anything (all of
the local K,V). Each step is half a block. Because queries move toward r-1, the owners met before
the wrap need their full Q and those after it only the second half: once a query has wrapped,
only that half travels on, and only that half of the output comes back.

Backward (our design): the query bundle (q, dout, lse, delta) travels the same way, the partial dq
computed for a foreign query goes home one step behind (in ``grad_comm_dtype``), and dK,dV
accumulate locally and never travel.

Elements sent per rank (c = T_local, non-causal): forward ``(N-1)·c·Hq·D`` queries one way and
``(N-1)·c·(Hq·D + Hq)`` outputs the other; backward ``(N-1)·c·(2·Hq·D + 2·Hq)`` bundles and
``(N-1)·c·Hq·D`` dq. Causal: rank r sends full queries on ``N - r`` steps and halves on ``r - 1``
(rank 0: halves on all ``N - 1``), full outputs for the ``N - 1 - r`` owners after it and halves
for the ``r`` before it.
"""

from __future__ import annotations

import torch.distributed as dist

from ..comm import GroupInfo, group_info
from .plans import Block, Move, Schedule, Step, Task, row_range

#: channel of the queries (and backward bundles) and channel of the partial results
Q_CHANNEL, OUT_CHANNEL = 0, 1


class TokenRingGroups:
    """A sequence-parallel group plus one duplicate communicator per traffic direction.

    Create it collectively (every member of ``group`` calls it, in the same order as its other
    group creations; for the whole world that is every process) and pass it as
    ``group=`` to :func:`seqpar.attention` (any method accepts it; ``token_ring`` then sends
    queries on ``channels[0]`` and partial results on ``channels[1]``), and to ``seqpar.shard`` /
    ``unshard`` as ``group=groups.group``. The caller owns the groups: keep the object for the
    whole training run and call :meth:`destroy` at the end. With a plain group instead, token_ring
    runs both directions on that group (tagged streams: correct, but on NCCL one stream).

    Attributes: ``group`` (the original), ``info`` (its :class:`~seqpar.comm.GroupInfo`),
    ``channels`` (two ``GroupInfo`` with the same members and order).
    """

    def __init__(self, group=None):
        self.group = group
        self.info = group_info(group)
        self._owned = []
        if self.info.single:
            self.channels: tuple[GroupInfo, ...] = (self.info, self.info)
            return
        ranks = list(self.info.global_ranks)
        # A subgroup is duplicated by its members alone (local synchronisation). The whole world
        # uses torch's counter-named groups instead: hashed names depend on how many groups exist,
        # so after groups were destroyed a new one could reuse a dead group's rendezvous keys.
        local = self.info.size != dist.get_world_size()
        chans = []
        for _ in (Q_CHANNEL, OUT_CHANNEL):
            pg = dist.new_group(ranks, use_local_synchronization=local)
            self._owned.append(pg)
            chans.append(GroupInfo(pg, dist.get_rank(pg), len(ranks), tuple(dist.get_process_group_ranks(pg))))
        if any(c.global_ranks != self.info.global_ranks or c.rank != self.info.rank for c in chans):
            raise RuntimeError("TokenRingGroups: a duplicated group orders its members differently (internal error)")
        self.channels = tuple(chans)

    def destroy(self) -> None:
        """Destroy the duplicated communicators (collective over the members)."""
        for pg in self._owned:
            dist.destroy_process_group(pg)
        self._owned = []
        self.channels = (self.info, self.info)

    def __repr__(self) -> str:
        return f"TokenRingGroups(size={self.info.size}, ranks={list(self.info.global_ranks)})"


def token_ring_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p") -> Schedule:
    """This rank's TokenRing schedule: N compute steps, then one step that sends the last partial home."""
    if t_local % 2:
        raise ValueError(f"token_ring uses the zigzag layout and needs an even local length, got {t_local}")
    if transport != "p2p":
        raise ValueError(f"transport={transport!r}: token_ring only moves queries point to point")
    h = t_local // 2
    full, second = row_range(0, t_local), row_range(h, t_local)

    def need(holder: int, owner: int) -> slice:
        """Rows of ``owner``'s queries that ``holder`` computes with (and returns results for)."""
        return full if (not causal or owner > holder) else second

    steps = []
    for s in range(n + 1 if n > 1 else 1):
        tasks = ()
        if s == 0:
            tasks = (Task(0, 0, (Block(full, full, "causal" if causal else "none"),)),)
        elif s < n:
            j = (rank + s) % n
            if not causal:
                block = Block(full, full, "none")
            elif j > rank:
                block = Block(full, row_range(0, h), "none")  # Q_j against the first local chunk
            else:
                block = Block(second, full, "none")  # the second half of Q_j against all local K,V
            tasks = (Task(s, 0, (block,)),)
        moves = []
        if s + 1 < n:  # the queries held now go one hop toward r-1; the next come from r+1
            held = (rank + s) % n
            moves += [Move("q", s % n, -1 % n, True, need((rank - 1) % n, held), Q_CHANNEL),
                      Move("q", (s + 1) % n, 1, False, need(rank, (rank + s + 1) % n), Q_CHANNEL)]
        if 2 <= s <= n:  # the partial of step s-1 goes straight home; ours comes from its holder
            back = s - 1
            moves += [Move("out", back % n, back % n, True, need(rank, (rank + back) % n), OUT_CHANNEL),
                      Move("out", 0, -back % n, False, need((rank - back) % n, rank), OUT_CHANNEL)]
        steps.append(Step(tasks, tuple(moves)))
    return Schedule(tuple(steps), "p2p", "token_ring")
