"""Packed variable-length batches for the ring family: every document runs the method's own dense plan.

A packed batch is laid out per document (:mod:`seqpar.layouts.packed`): document d is padded at its
end and laid out like a dense sequence, rank r holding a piece of ``t_d`` rows whose real tokens are
a prefix of ``real_lens[r][d]`` rows. So the exact geometry of a document is the method's dense plan
for ``t_d`` rows, each block clipped to the real prefixes of the two pieces it meets (padding rows
are never covered; clipping only trailing rows keeps every top-left mask exact) and shifted to the
piece's offset in the padded local stream. Nothing here knows a layout or a method: a new ring
variant keeps its plan on packed input.

The steps, the tasks (who computes which pair of members when) and the moves of a plan do not
depend on the local length (checked); the packed schedule keeps them, turns every task's blocks
into one :class:`~seqpar.kernels.varlen.VarlenSegments` over the whole local streams (run by the
varlen kernels) and lets every move carry whole local streams (a document's rows are not one
slice of the stream, so token_ring's causal half-query moves carry whole queries here).

Under a sliding window the method's windowed plan (:mod:`.window`) is built per piece length the
same way; its pairs (which member computes which member pair, at which step) do not depend on the
length, so every document's clipped blocks of a pair join one varlen block, and the pair's moves
carry the span of local rows those blocks use: pairs and steps that no document needs cost nothing.
"""

from __future__ import annotations

import dataclasses

from ..kernels.varlen import Segment, VarlenSegments
from ..layouts.packed import PackedLayout
from ..layouts.stream import StreamLayout
from ..methods import Method
from .plans import Block, Move, Schedule, Step, Task, row_range
from .registry import dense_plan
from .stream import stream_schedule
from .window import DirectPlan, Pair


def _structure(sched: Schedule) -> tuple:
    """What must not depend on the local length: tasks' members and moves without their rows."""
    return tuple((tuple((t.q, t.kv) for t in s.tasks),
                  tuple((m.what, m.owner, m.peer, m.send, m.channel) for m in s.moves)) for s in sched.steps)


def _clip(rows: slice, real: int) -> tuple[int, int]:
    """``(start, length)`` of the real rows of a block's row range (real rows: a prefix)."""
    return rows.start, max(0, min(rows.stop, real) - rows.start)


def _segments(docs: list[Schedule], layout: PackedLayout, rank: int, step: int, index: int) -> VarlenSegments:
    """One task of every document's schedule, as segments of the padded local streams."""
    n, segs = layout.n, []
    for d, sched in enumerate(docs):
        task = sched.steps[step].tasks[index]
        real_q = layout.real_lens[(rank + task.q) % n][d]
        real_kv = layout.real_lens[(rank + task.kv) % n][d]
        offset = layout.local_cu_seqlens[d]
        for b in task.blocks:
            (q0, q_len), (k0, k_len) = _clip(b.q, real_q), _clip(b.kv, real_kv)
            seg = Segment(offset + q0, q_len, offset + k0, k_len, b.mask)
            if seg.pairs:
                segs.append(seg)
    return VarlenSegments(layout.t_local, layout.t_local, tuple(segs))


def _packed_schedule(decl: Method, layout: PackedLayout, rank: int, causal: bool) -> Schedule:
    n, t = layout.n, layout.t_local
    whole = dense_plan(decl, rank, n, t, causal).schedule(t)
    plans = {L: dense_plan(decl, rank, n, L, causal).schedule(L) for L in set(layout.piece_lens)}
    docs = [plans[L] for L in layout.piece_lens]
    shape = _structure(whole)
    if any(_structure(s) != shape for s in plans.values()):
        raise RuntimeError(f"method={decl.name!r}: its plan's steps, tasks or moves depend on the local length, "
                           "so it cannot run packed input document by document (internal error of the plan)")
    full = row_range(0, t)
    steps = []
    for i, step in enumerate(whole.steps):
        tasks = []
        for j, task in enumerate(step.tasks):
            segs = _segments(docs, layout, rank, i, j)
            tasks.append(Task(task.q, task.kv, (Block(full, full, "none", segs),) if segs.segments else ()))
        moves = tuple(Move(m.what, m.owner, m.peer, m.send, full, m.channel) for m in step.moves)
        steps.append(Step(tuple(tasks), moves))
    return Schedule(tuple(steps), whole.transport, whole.name)


def _span_block(segs: list) -> Block:
    """One varlen block over the spans of local rows and keys that ``segs`` use."""
    q0, q1 = min(s.q_start for s in segs), max(s.q_start + s.q_len for s in segs)
    k0, k1 = min(s.k_start for s in segs), max(s.k_start + s.k_len for s in segs)
    shifted = tuple(dataclasses.replace(s, q_start=s.q_start - q0, k_start=s.k_start - k0) for s in segs)
    return Block(row_range(q0, q1), row_range(k0, k1), "none", VarlenSegments(q1 - q0, k1 - k0, shifted))


def _window_schedule(decl: Method, layout: PackedLayout, rank: int, causal: bool, window: int) -> Schedule:
    plans = {L: dense_plan(decl, rank, layout.n, L, causal, window) for L in set(layout.piece_lens)}
    found: dict = {}  # (a, b) -> ((step, computer), [segments of every document])
    for d, L in enumerate(layout.piece_lens):
        offset = layout.local_cu_seqlens[d]
        for p in plans[L].pairs:
            where, segs = found.setdefault((p.a, p.b), ((p.step, p.computer), []))
            if where != (p.step, p.computer):
                raise RuntimeError(f"method={decl.name!r}: its windowed plan places pair {(p.a, p.b)} by the local "
                                   "length, so it cannot run packed input (internal error of the plan)")
            for b in p.blocks:
                (q0, q_len), (k0, k_len) = _clip(b.q, layout.real_lens[p.a][d]), _clip(b.kv, layout.real_lens[p.b][d])
                seg = Segment(offset + q0, q_len, offset + k0, k_len, b.mask)
                if seg.pairs:
                    segs.append(seg)
    pairs = tuple(Pair(step, c, a, b, (_span_block(segs),)) for (a, b), ((step, c), segs) in sorted(found.items())
                  if segs)
    some = next(iter(plans.values()))
    return DirectPlan(rank, layout.n, pairs, some.transport, some.name).schedule()


def packed_schedule(decl: Method, layout: PackedLayout, rank: int, causal: bool, window: int | None = None) -> Schedule:
    """This rank's schedule of a ring-family method for ``layout`` (cached on the layout); with a
    ``window``, the method's windowed plan per document."""
    if isinstance(layout, StreamLayout):  # the stream cut into contiguous pieces: its own direct schedule
        return stream_schedule(layout, rank, causal, window)
    key = ("schedule", decl.name, decl.plan, decl.transport, rank, bool(causal))
    if window is None:
        return layout.cache.get(key, lambda: _packed_schedule(decl, layout, rank, causal))
    return layout.cache.get(key + (decl.window_plan, int(window)),
                            lambda: _window_schedule(decl, layout, rank, causal, int(window)))


__all__ = ["packed_schedule"]
