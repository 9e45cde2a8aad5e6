"""Schedules: what one rank computes and sends at each step of a softmax sequence-parallel method.

Every softmax method of seqpar is a :class:`Schedule` run by ONE executor
(:func:`seqpar.softmax.executor.execute`); the methods differ only in the schedule, built once per
call on the host from (rank, N, local length, causal). Nothing in the step loop inspects data or
synchronises with the device.

Vocabulary (all positions are *offsets* on the group's ring, taken mod N: 0 is this rank, +1 the
next member, -1 the previous one; a schedule is therefore written from the point of view of one
rank and needs no global rank):

- **operands**: ``"q"`` the query bundle of a member (forward: q; backward: q, dout, lse, delta)
  and ``"kv"`` its K,V (``[B, T, Hkv, D]`` and ``[B, T, Hkv, D_v]``, never GQA-expanded).
- **results**: ``"out"`` the partial results for a member's query rows (forward: out and lse;
  backward: dq) and ``"dkv"`` those for its K,V rows (backward only: dK, dV).
- a :class:`Task` computes :class:`Block` s between the query bundle of member ``q`` and the K,V
  of member ``kv``; results for offset 0 go to this rank's accumulators, results for others are
  kept until a :class:`Move` sends them.
- a :class:`Move` is one message: rows ``rows`` (in the owner's local order) of payload ``what``
  of member ``owner``, sent to or received from member ``peer``, on communication ``channel``
  (channel 1 carries results against the direction of the operands: its own process group).
  Several moves of one payload and owner in one step carry disjoint row ranges (a sliding window
  needs the tail of one zigzag chunk and the head of another); what arrives in a step replaces
  what was held of that owner's payload.

The moves of step ``s`` are posted together before the tasks of step ``s`` and waited on after
them: received operands serve the following steps (prefetch), received results are folded into
the accumulators. Results computed at step ``s`` can therefore leave at step ``s + 1`` ("one step
behind"); a schedule ends with a step without tasks that sends the last results home.

This module holds the vocabulary and the ring family (``ring``, ``zigzag_ring``,
``striped_ring``, ``allgather_kv``), which differ only in the blocks of each step
(:class:`RingPlan`); ``token_ring`` and ``lightseq`` live in their own modules, and sliding-window
schedules (any of them restricted to the pairs in a window) in :mod:`.window`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels.masks import as_band, visible_pairs
from ..layouts.base import layout_named

OPERANDS = ("q", "kv")
RESULTS = ("out", "dkv")
PAYLOADS = OPERANDS + RESULTS


@dataclass(frozen=True)
class Wire:
    """One tensor of a message, carrying one named part (``parts``: a 1-tuple; every part travels as
    its own tensor, so nothing is stacked on send or unstacked on receipt).

    ``stat``: the part is a row statistic ``[B, H, T]`` (lse, delta), else rows ``[B, T, H, D]``;
    ``heads``: ``"q"`` (Hq) or ``"kv"`` (Hkv); ``dtype``: ``"input"`` (the inputs' dtype),
    ``"acc"`` (fp32, fp64 for fp64 input) or ``"grad"`` (the ``grad_comm_dtype`` of gradients);
    ``dim``: the head dim of rows, ``"qk"`` (D of q and k) or ``"v"`` (D_v of v and the output,
    which may differ: MLA models)."""

    parts: tuple[str, ...]
    heads: str = "q"
    dtype: str = "input"
    stat: bool = False
    dim: str = "qk"

    @property
    def row_dim(self) -> int:
        """The dimension that holds the token rows."""
        return 2 if self.stat else 1


def _w(part: str, **kw) -> Wire:
    return Wire((part,), **kw)


#: What each payload carries, in forward (False) and backward (True): the message's tensors (one
#: per part, sent in one batch), and for results how they fold into an accumulator (``"merge"``:
#: running (out, lse) in fp32; ``"sum"``: gradients summed in fp32). The executor reads this table
#: instead of branching. ``delta`` travels only with a foreign query bundle (token_ring, lightseq);
#: where the query rows stay home the block kernels derive it from ``out``.
WIRES: dict[tuple[str, bool], tuple[Wire, ...]] = {
    ("q", False): (_w("q"),),
    ("q", True): (_w("q"), _w("dout", dim="v"), _w("lse", dtype="acc", stat=True),
                  _w("delta", dtype="acc", stat=True)),
    ("kv", False): (_w("k", heads="kv"), _w("v", heads="kv", dim="v")),
    ("kv", True): (_w("k", heads="kv"), _w("v", heads="kv", dim="v")),
    ("out", False): (_w("out", dim="v"), _w("lse", dtype="acc", stat=True)),
    ("out", True): (_w("dq", dtype="grad"),),
    ("dkv", True): (_w("dk", heads="kv", dtype="grad"), _w("dv", heads="kv", dtype="grad", dim="v")),
}
FOLD = {("out", False): "merge", ("out", True): "sum", ("dkv", True): "sum"}


@dataclass(frozen=True)
class Block:
    """One block computation: query rows ``q`` against K,V rows ``kv`` (each in its owner's local
    order). ``mask`` is a block mask of :mod:`seqpar.kernels` (``none``, ``causal``,
    ``causal_strict``, or a window :class:`~seqpar.kernels.Band`), aligned top-left on the two slices.

    ``segments``: packed variable-length input (:mod:`seqpar.softmax.packed`): the block is a
    :class:`~seqpar.kernels.varlen.VarlenSegments` over the two slices (document by document,
    padding never covered) and ``mask`` is unused; the executor calls the varlen kernels."""

    q: slice
    kv: slice
    mask: object  # str | Band
    segments: object = None  # VarlenSegments | None (typed loosely: plans import no kernels)


@dataclass(frozen=True)
class Task:
    """The blocks between the query bundle of member ``q`` and the K,V of member ``kv`` (offsets)."""

    q: int
    kv: int
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Move:
    """One message: rows ``rows`` of payload ``what`` (:data:`PAYLOADS`) belonging to member
    ``owner``, sent to (``send=True``) or received from member ``peer``, on ``channel``."""

    what: str
    owner: int
    peer: int
    send: bool
    rows: slice
    channel: int = 0


@dataclass(frozen=True)
class Step:
    """``moves`` are posted before ``tasks`` run and waited on after them."""

    tasks: tuple[Task, ...] = ()
    moves: tuple[Move, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """A rank's whole schedule for one attention call (forward and backward use the same one).

    ``transport="allgather"``: the K,V of every member are all-gathered before step 0 (tasks then
    name any ``kv`` offset and no K,V move is needed) and the backward reduce-scatters dK,dV after
    the last step. ``name`` prefixes the primitive names in ``CommStats`` (``"ring"`` ->
    ``ring_kv``, ``ring_dkv``; ``"token_ring"`` -> ``token_ring_q``, ``token_ring_out``).
    """

    steps: tuple[Step, ...]
    transport: str = "p2p"
    name: str = "ring"

    @property
    def n(self) -> int:
        return len(self.steps)

    def schedule(self, t_local: int | None = None) -> "Schedule":
        return self

    def work(self, t_local: int) -> float:
        """Score elements this rank computes, a causal block counting half (load-balance metric)."""
        return sum(_block_work(b, t_local) for s in self.steps for t in s.tasks for b in t.blocks)


def _block_work(b: Block, t_local: int) -> float:
    if b.segments is not None:
        return float(b.segments.pairs)
    rows = len(range(t_local)[b.q])
    cols = len(range(t_local)[b.kv])
    if not isinstance(b.mask, str):  # a window band: its exact pair count
        return float(visible_pairs(rows, cols, b.mask))
    return rows * cols * (0.5 if b.mask != "none" else 1.0)


def row_range(start: int, stop: int) -> slice:
    """An explicit row range (schedules never use open slices: the executor does arithmetic on them)."""
    return slice(int(start), int(stop))


@dataclass(frozen=True)
class RingPlan:
    """The ring family: ``steps[s]`` are the blocks of local Q against the K,V of member ``-s``.

    ``transport``: ``"p2p"`` (K,V pass one hop per step, the next prefetched during the current
    one; in backward the fp32 dK,dV accumulators travel one step behind and arrive home after N
    hops) or ``"allgather"`` (gathered once up front). :meth:`schedule` expands it.
    """

    steps: tuple[tuple[Block, ...], ...]
    transport: str = "p2p"

    @property
    def n(self) -> int:
        return len(self.steps)

    def work(self, t_local: int) -> float:
        return sum(_block_work(b, t_local) for blocks in self.steps for b in blocks)

    def schedule(self, t_local: int) -> Schedule:
        """The executor's form: step ``s`` computes against member ``-s``; with ``p2p`` it also
        forwards the K,V it holds to ``+1`` and the dK,dV partial sums of the previous step's
        shard (which arrived from ``-1`` and gained this rank's share) after them."""
        n = self.n
        ring = self.transport != "allgather" and n > 1
        every = row_range(0, t_local)
        steps = []
        for s in range(n + (1 if ring else 0)):
            tasks = (Task(0, -s % n, self.steps[s]),) if s < n else ()
            moves = []
            if ring and s + 1 < n:  # the K,V of step s+1, posted before the blocks of step s
                moves += [Move("kv", -s % n, 1, True, every), Move("kv", -(s + 1) % n, -1, False, every)]
            if ring and s >= 1:  # the dK,dV of the shard of step s-1 follow it, one hop behind
                moves += [Move("dkv", -(s - 1) % n, 1, True, every), Move("dkv", -s % n, -1, False, every)]
            steps.append(Step(tasks, tuple(moves)))
        return Schedule(tuple(steps), self.transport, "ring")


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


def verify(build, n: int, t_local: int, causal: bool, layout, window: int | None = None) -> None:
    """Check the schedules of all ``n`` ranks of a builder ``(rank, n, t_local, causal) -> plan``
    (with ``window``: called with ``window=window``) against each other, on the host (for tests
    and for anyone writing a schedule):

    - every send has a matching receive (same step, channel, payload, owner and rows) and back;
    - every operand a task or a send uses is held at that step (own, or received earlier);
    - every (query, key) pair the mask (and window) allows is computed exactly once, none other.

    ``layout``: a :class:`~seqpar.layouts.base.Layout` or its name. Raises ``AssertionError``
    describing the first problem.
    """
    layout = layout_named(layout)
    T = t_local * n
    extra = {} if window is None else {"window": window}
    scheds = [build(r, n, t_local, causal, **extra).schedule(t_local) for r in range(n)]
    cover = [[0] * T for _ in range(T)]
    held = [{("q", r): [(0, t_local)], ("kv", r): [(0, t_local)]} for r in range(n)]
    if scheds[0].transport == "allgather":
        for r in range(n):
            held[r].update({("kv", j): [(0, t_local)] for j in range(n)})
    for i in range(max(s.n for s in scheds)):
        arrivals: dict = {}
        for r, sched in enumerate(scheds):
            step = sched.steps[i] if i < sched.n else Step()
            streams: dict = {}
            for m in step.moves:
                _check_move(scheds, held, arrivals, n, r, i, m)
                streams.setdefault((m.what, m.peer % n, m.send, m.channel), []).append(m)
            for same in streams.values():  # the executor numbers these messages by their rows
                spans = sorted((m.rows.start, m.rows.stop) for m in same)
                assert len({m.owner % n for m in same}) == 1 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), \
                    f"rank {r} step {i}: messages {same} of one stream overlap or mix owners"
            for t in step.tasks:
                a, b = (r + t.q) % n, (r + t.kv) % n
                qi, ki = layout.positions(T, n, a), layout.positions(T, n, b)
                for blk in t.blocks:
                    _has(held, r, "q", a, blk.q, f"step {i} task")
                    _has(held, r, "kv", b, blk.kv, f"step {i} task")
                    band = as_band(blk.mask)
                    for x, gq in enumerate(qi[blk.q]):
                        for y, gk in enumerate(ki[blk.kv]):
                            cover[gq][gk] += band.sees(x, y)
        for (r, key), spans in arrivals.items():
            held[r][key] = spans
    for gq in range(T):
        for gk in range(T):
            d = gq - gk
            want = int((d >= 0 or not causal) and (window is None or (0 <= d < window if causal else abs(d) < window)))
            assert cover[gq][gk] == want, f"query {gq}, key {gk}: computed {cover[gq][gk]} times, expected {want}"


def _has(held, r, what, owner, rows, where):
    spans = held[r].get((what, owner), [])
    assert any(lo <= rows.start and rows.stop <= hi for lo, hi in spans), \
        f"rank {r} {where}: {what} rows {rows} of {owner} not held (held: {spans})"


def _check_move(scheds, held, arrivals, n, r, i, m):
    dst, owner = (r + m.peer) % n, (r + m.owner) % n
    assert dst != r, f"rank {r} step {i}: a move to itself"
    other = [(o.what, o.owner % n, o.peer % n, o.send, o.rows, o.channel)
             for o in (scheds[dst].steps[i].moves if i < scheds[dst].n else ())]
    twin = (m.what, (owner - dst) % n, -m.peer % n, not m.send, m.rows, m.channel)
    assert twin in other, f"rank {r} step {i}: {m} has no matching move on rank {dst}"
    if m.send and m.what in OPERANDS:
        _has(held, r, m.what, owner, m.rows, f"step {i} send")
    elif not m.send and m.what in OPERANDS:
        arrivals.setdefault((r, (m.what, owner)), []).append((m.rows.start, m.rows.stop))
