"""How the executor numbers a schedule's messages, and how long it holds operands: host-side data
over :class:`~seqpar.softmax.plans.Schedule` s, shared with the traces built from schedules alone
(:mod:`seqpar.bench.schedule_trace`), so that both number every message the same way."""

from __future__ import annotations

from .plans import OPERANDS, PAYLOADS, Schedule


def message_tag(what: str, part: int, index: int = 0) -> int:
    """Each payload (and each tensor of it) is its own message stream between two ranks, so two
    payloads crossing the same link in one step can never be matched with each other; ``index``
    numbers the row ranges of one payload sent to one peer in one step (in order of their rows,
    the same on both sides), so that they do not either."""
    return 16 * index + 4 * PAYLOADS.index(what) + part


def indexed_moves(moves) -> list:
    """Each move with its index among the step's moves of the same payload, peer, direction and
    channel, in order of their rows (both ends of a message count the same way)."""
    seen: dict = {}
    index = [0] * len(moves)
    for i in sorted(range(len(moves)), key=lambda i: moves[i].rows.start):
        key = (moves[i].what, moves[i].peer, moves[i].send, moves[i].channel)
        index[i] = seen[key] = seen.get(key, -1) + 1
    return list(zip(moves, index))


def last_use(sched: Schedule) -> dict:
    """(payload, owner) -> the last step that reads or forwards that operand (held until then)."""
    last = {}
    for i, step in enumerate(sched.steps):
        for t in step.tasks:
            last[("q", t.q)] = last[("kv", t.kv)] = i
        for m in step.moves:
            if m.send and m.what in OPERANDS:
                last[(m.what, m.owner)] = i
    return last


__all__ = ["indexed_moves", "last_use", "message_tag"]
