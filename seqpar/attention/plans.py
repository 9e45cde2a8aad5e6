"""Per-step plans for the ring family: which slices of Q and of the visiting K,V meet, under which mask.

Ring, zigzag and striped attention are the same loop; they differ only in these plans
(ALGORITHMS.md §1). At step ``s`` rank ``r`` holds the K,V shard of member ``j = (r - s) mod N``.
A plan is built once per call on the host from (rank, N, local length, causal): nothing in the
step loop inspects data or synchronises with the device.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    """One block computation: local query rows ``q`` against rows ``kv`` of the visiting K,V.

    ``mask`` is a block mask of :mod:`seqpar.kernels` (``none``, ``causal``, ``causal_strict``),
    aligned top-left on the two slices.
    """

    q: slice
    kv: slice
    mask: str


@dataclass(frozen=True)
class RingPlan:
    """``steps[s]``: the blocks this rank computes at step ``s`` (empty tuple: nothing to compute).

    ``transport`` says how the K,V of other ranks arrive: ``"p2p"`` (passed around the ring, next
    step prefetched during the current one) or ``"allgather"`` (gathered once up front).
    """

    steps: tuple[tuple[Block, ...], ...]
    transport: str = "p2p"

    @property
    def n(self) -> int:
        return len(self.steps)

    def work(self, t_local: int) -> float:
        """Score elements computed by this rank, counting a causal block as half (load-balance metric)."""
        total = 0.0
        for blocks in self.steps:
            for b in blocks:
                rows = len(range(t_local)[b.q])
                cols = len(range(t_local)[b.kv])
                total += rows * cols * (0.5 if b.mask != "none" else 1.0)
        return total


def _all(t: int) -> slice:
    return slice(0, t)


def ring_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p") -> RingPlan:
    """Contiguous layout. Causal: the diagonal block, full blocks for earlier shards, nothing for later."""
    steps = []
    for s in range(n):
        j = (rank - s) % n
        if not causal:
            steps.append((Block(_all(t_local), _all(t_local), "none"),))
        elif s == 0:
            steps.append((Block(_all(t_local), _all(t_local), "causal"),))
        elif j < rank:
            steps.append((Block(_all(t_local), _all(t_local), "none"),))
        else:
            steps.append(())
    return RingPlan(tuple(steps), transport)


def zigzag_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p") -> RingPlan:
    """Zigzag layout (chunks r and 2N-1-r). Every causal step after the first costs half a block.

    Source j < r: all local Q against the source's first chunk (which precedes both local chunks).
    Source j > r: the local second chunk against all of the source's K,V (both source chunks lie
    between the local chunks). Step 0 is the causal diagonal of the concatenated local chunks.
    """
    if t_local % 2:
        raise ValueError(f"the zigzag layout needs an even local length, got {t_local}")
    h = t_local // 2
    steps = []
    for s in range(n):
        j = (rank - s) % n
        if not causal:
            steps.append((Block(_all(t_local), _all(t_local), "none"),))
        elif s == 0:
            steps.append((Block(_all(t_local), _all(t_local), "causal"),))
        elif j < rank:
            steps.append((Block(_all(t_local), slice(0, h), "none"),))
        else:
            steps.append((Block(slice(h, t_local), _all(t_local), "none"),))
    return RingPlan(tuple(steps), transport)


def striped_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p") -> RingPlan:
    """Striped layout (token i on rank i mod N): local row a is global a·N + r.

    Against source j, query a sees key b iff a·N + r >= b·N + j: b <= a when j <= r (causal,
    diagonal included) and b < a when j > r (``causal_strict``).
    """
    steps = []
    for s in range(n):
        j = (rank - s) % n
        if not causal:
            mask = "none"
        else:
            mask = "causal" if j <= rank else "causal_strict"
        steps.append((Block(_all(t_local), _all(t_local), mask),))
    return RingPlan(tuple(steps), transport)
