"""LightSeq / DistAttn (docs/methods.md): a balanced causal schedule with helper ranks.

Contiguous layout, causal. Steps t = 0..⌊N/2⌋:

- t = 0: every rank computes its causal diagonal block;
- t ≥ 1, rank r ≥ t ("normal"): local queries against the K,V of rank r-t, fetched from it;
- t ≥ 1, rank r < t, while N - t > t ("helper"): it would idle, so it computes the queries of the
  heavy rank h = r - t + N (fetched from h) against its own K,V, unmasked, and sends the partial
  (out, lse) back to h, which merges it.

A pair (q_i, kv_j), i > j, at distance δ = i - j is computed by the query owner at t = δ when
δ ≤ ⌊N/2⌋, else by the K,V owner at t = N - δ: every pair exactly once. For odd N no rank idles;
for even N half the ranks idle at the last step (schedule bound N/(N+1) of the ideal).

At step t everything flows from offset -t: a rank sends its K,V (to a normal rank r+t) or its
queries (to a helper r+t-N) over a direct link. The data of step t+1 is fetched during step t
(double buffer). Results go back one step behind, on a second channel: helpers return (out, lse);
in backward, which runs the same schedule, helpers receive (q, dout, lse, delta), return dq and
keep dK,dV for their own K,V, while normal ranks return the dK,dV of the fetched K,V to its owner.

Non-causal attention has no imbalance to fix: it runs the plain ring plan.
"""

from __future__ import annotations

from .plans import Block, Move, RingPlan, Schedule, Step, Task, ring_plan, row_range
from .window import DirectPlan, kv_pairing, window_plan

FETCH_CHANNEL, RESULT_CHANNEL = 0, 1


def helpers_at(t: int, n: int) -> bool:
    """Whether the ranks r < t help at step t (they do while N - t > t)."""
    return 0 < t < n - t


def lightseq_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p") -> Schedule | RingPlan:
    """This rank's schedule: steps 0..⌊N/2⌋, then one step that returns the last results."""
    if not causal:
        return ring_plan(rank, n, t_local, causal, transport)
    if transport != "p2p":
        raise ValueError(f"transport={transport!r}: lightseq fetches its blocks point to point")
    full = row_range(0, t_local)
    last = n // 2
    steps = []
    for t in range(last + 2 if n > 1 else 1):
        tasks = ()
        if t == 0:
            tasks = (Task(0, 0, (Block(full, full, "causal"),)),)
        elif t <= last and rank >= t:  # normal: our queries, the K,V of rank r - t
            tasks = (Task(0, -t % n, (Block(full, full, "none"),)),)
        elif t <= last and helpers_at(t, n):  # helper: the queries of h = r - t + N, our K,V
            tasks = (Task(-t % n, 0, (Block(full, full, "none"),)),)
        moves = []
        u = t + 1  # prefetch what step u needs
        if u <= last:
            if rank + u < n:
                moves.append(Move("kv", 0, u, True, full, FETCH_CHANNEL))
            elif helpers_at(u, n):
                moves.append(Move("q", 0, u % n, True, full, FETCH_CHANNEL))
            if rank >= u:
                moves.append(Move("kv", -u % n, -u % n, False, full, FETCH_CHANNEL))
            elif helpers_at(u, n):
                moves.append(Move("q", -u % n, -u % n, False, full, FETCH_CHANNEL))
        p = t - 1  # return what step p computed for others
        if 1 <= p <= last:
            if rank >= p:  # backward only: dK,dV of the fetched K,V
                moves.append(Move("dkv", -p % n, -p % n, True, full, RESULT_CHANNEL))
            elif helpers_at(p, n):
                moves.append(Move("out", -p % n, -p % n, True, full, RESULT_CHANNEL))
            if rank + p < n:
                moves.append(Move("dkv", 0, p % n, False, full, RESULT_CHANNEL))
            elif helpers_at(p, n):
                moves.append(Move("out", 0, p % n, False, full, RESULT_CHANNEL))
        steps.append(Step(tasks, tuple(moves)))
    return Schedule(tuple(steps), "p2p", "lightseq")


def lightseq_pairing(a: int, b: int, n: int) -> tuple[int, int]:
    """LightSeq's rule as a pairing (:mod:`.window`): pair ``(a, b)``, ``a > b`` at distance
    ``d = a - b``, is computed by the query owner at step ``d`` when ``d <= N/2``, else by the K,V
    owner as a helper at step ``N - d``."""
    d = a - b
    if d <= 0:  # not a causal pair of the contiguous layout (non-causal calls use the K,V pairing)
        return kv_pairing(a, b, n)
    return (d, a) if d <= n // 2 else (n - d, b)


def lightseq_window_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p",
                         window: int | None = None) -> DirectPlan:
    """LightSeq under a sliding window: its steps and helpers, restricted to the pairs of shards
    that meet in the window (the K,V or queries of those rows only). A window of ``W`` tokens over
    shards of ``c`` needs pairs up to distance ``ceil((W - 1) / c)``: helpers only when that exceeds
    ``N / 2``. Non-causal: the K,V pairing of the plain ring."""
    if transport != "p2p":
        raise ValueError(f"transport={transport!r}: lightseq fetches its blocks point to point")
    pairing = lightseq_pairing if causal else kv_pairing
    return window_plan("contiguous", pairing, rank, n, t_local, causal, transport, window, name="lightseq")
