"""The dependencies of a traced schedule run: which recorded events produced the data a rank holds.

The executor (:mod:`.executor`) runs a :class:`~seqpar.softmax.plans.Schedule`; with a
:class:`seqpar.Trace` it also tells a :class:`RunBook` what happens, so that every compute event
lists the receives (or collectives) whose operands it reads, and every send the computes and
receives whose results it carries. The book holds ids only (no tensors), so
:mod:`seqpar.bench.schedule_trace` drives the same book to build a trace from a schedule alone.

Keys are ``(payload, owner)`` as in the schedules (``("kv", -1)``: the K,V of the previous member).
"""

from __future__ import annotations

from ..kernels.masks import visible_pairs
from ..tracing import Trace, block_flops, span
from .plans import OPERANDS


class RunBook:
    """Producers of operands and results, and the deps of the sends of the batch being posted."""

    def __init__(self) -> None:
        self.operands: dict = {}  # (what, owner) -> ids of the events that brought it (none: own data)
        self.results: dict = {}  # (what, owner) -> ids of the computes / receives folded into it
        self.batches: dict = {}  # (channel, what) -> deps of each send tensor posted in that batch
        self.incoming: dict = {}  # (what, owner) -> ids of operands that arrived in the current step

    def gathered(self, key: tuple, *events: int) -> None:
        """Operand ``key`` arrived with the collectives ``events`` (K's and V's all-gathers)."""
        self.operands[key] = list(events)

    def needs(self, *keys) -> list:
        """Ids of the events that brought the operands ``keys``."""
        return [i for key in keys for i in self.operands.get(key, ())]

    def computed(self, event: int, q: int, kv: int, bwd: bool) -> None:
        """Compute ``event`` of task ``(q, kv)`` added results for member q's rows (and, backward, kv's)."""
        self.results.setdefault(("out", q), []).append(event)
        if bwd:
            self.results.setdefault(("dkv", kv), []).append(event)

    def sending(self, batch: tuple, what: str, owner: int, tensors: int) -> None:
        """A move of ``tensors`` wire tensors of ``(what, owner)`` joins the sends of ``batch``."""
        if what in OPERANDS:
            deps = list(self.operands.get((what, owner), ()))
        else:  # results leave: what was folded into them goes with them
            deps = self.results.pop((what, owner), [])
        self.batches.setdefault(batch, []).extend([deps] * tensors)

    def posted(self, batch: tuple) -> list:
        """The deps of the sends of ``batch`` (aligned with its send list), now posted."""
        return self.batches.pop(batch, [])

    def arrived(self, what: str, owner: int, ids) -> None:
        """Payload ``(what, owner)`` arrived in the receives ``ids``."""
        if what in OPERANDS:  # several row ranges of one operand may arrive in a step (windows)
            self.incoming.setdefault((what, owner), []).extend(ids)
        else:
            self.results.setdefault((what, owner), []).extend(ids)


    def settle(self) -> None:
        """End of a step: operands that arrived in it replace what was held of them (as the executor's)."""
        self.operands.update(self.incoming)
        self.incoming = {}


def block_span(trace: Trace | None, book: RunBook | None, task, block, q, k, bwd: bool):
    """Time one block call (``q [B, rows, Hq, D]`` against ``k [B, cols, Hkv, D]``) in ``trace``: its
    FLOPs by the bench's formula, the operands it reads as deps; the results added meanwhile are
    this compute's. A shared no-op context without a trace."""
    if trace is None:
        return span(None, "")
    ev = trace.compute(**block_event(task, block, q.shape, k.shape, bwd, book))
    book.computed(ev.id, task.q, task.kv, bwd)
    return ev


def block_event(task, block, q_shape, k_shape, bwd: bool, book: RunBook) -> dict:
    """The fields of a block's compute event (also built from a schedule alone, seqpar.bench)."""
    b, rows, hq, d = q_shape
    varlen = block.segments is not None
    mask = block.mask
    pairs = block.segments.pairs if varlen else None
    if not varlen and not isinstance(mask, str):  # a window band: its visible pairs, named by its edges
        pairs, mask = visible_pairs(rows, k_shape[1], mask), f"band({mask.lo}, {mask.hi})"
    return {"name": ("varlen_" if varlen else "block_") + ("bwd" if bwd else "fwd"),
            "flops": block_flops(b, rows, k_shape[1], hq, d, mask, bwd, pairs=pairs),
            "shape": (b, rows, k_shape[1], hq, k_shape[2], d), "mask": None if varlen else mask,
            "deps": book.needs(("q", task.q), ("kv", task.kv))}


__all__ = ["RunBook", "block_event", "block_span"]
