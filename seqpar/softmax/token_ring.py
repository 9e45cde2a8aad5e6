"""TokenRing (docs/methods.md): queries travel, partial outputs go straight home, K,V never move.

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

from ..comm.channels import OUT_CHANNEL, Q_CHANNEL
from .plans import Block, Move, Schedule, Step, Task, row_range
from .window import DirectPlan, q_pairing, window_plan


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


def token_ring_window_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p",
                           window: int | None = None) -> DirectPlan:
    """TokenRing under a sliding window (:mod:`.window`): the queries (and backward bundles) of a
    rank go straight to the members whose K,V they meet in the window, only the rows that meet
    them, and the partial results come straight back; members beyond the window are never visited.
    In the zigzag layout the first chunk meets members before it and the second chunk members
    after it, so step ``s`` serves the members ``s`` away in both directions."""
    if transport != "p2p":
        raise ValueError(f"transport={transport!r}: token_ring only moves queries point to point")
    return window_plan("zigzag", q_pairing, rank, n, t_local, causal, transport, window, name="token_ring")
