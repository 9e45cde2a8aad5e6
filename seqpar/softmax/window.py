"""Sliding-window schedules: every member pair that shares a pair of tokens in the window is
computed once; pairs wholly outside it cost neither compute nor a transfer.

**Geometry.** A layout gives each rank's rows as arithmetic runs of global positions
(:meth:`~seqpar.layouts.base.Layout.pieces`). Between a query run and a key run, a window of ``W``
tokens is one :class:`~seqpar.kernels.Band` of visible diagonals (:func:`~seqpar.kernels.window_band`;
causal: query ``p`` sees keys ``p - W < p' <= p``, flash-attn's ``window_size=(W-1, 0)``; symmetric:
``|p - p'| < W``, ``(W-1, W-1)``); :func:`pair_blocks` turns the runs of two members into blocks
trimmed to the rows and keys that meet anything, so the blocks also say which rows must travel.

**Schedule** (:class:`DirectPlan`). A *pairing* assigns each member pair ``(a, b)`` (queries of
``a``, K,V of ``b``) a step and the member that computes it, ``a`` or ``b``. Whatever the computer
does not own comes straight from its owner during the previous step (only the rows the pair's blocks
use, one message per contiguous range), and whatever it computes for another member's rows goes
straight back during the next step, on channel 1: forward (out, lse) partials, backward dq to the
query owner and dK,dV to the K,V owner (a truncated ring has no ring to carry the dK,dV
accumulators home, so each user returns its share directly). No member relays another's data.

- :func:`kv_pairing` (``ring``, ``zigzag_ring``, ``striped_ring``, ``allgather_kv``): the query
  owner computes; pair ``(a, b)`` at step ``min(o, N - o)``, ``o = (b - a) mod N``, so step ``s``
  meets the members ``s`` before and after. A window of ``W`` tokens over contiguous shards of
  ``c`` tokens ends after ``ceil((W - 1) / c)`` steps (zigzag: chunks of ``c/2``, both directions).
- :func:`q_pairing` (``token_ring``): the K,V owner computes, queries travel, K,V never move.
- ``lightseq`` keeps its helper rule (:mod:`.lightseq`).

With ``transport="allgather"`` (``allgather_kv``) nothing moves between steps: K,V are gathered
whole and dK,dV reduce-scattered, so its bytes do not fall with ``W`` (only its compute does).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..kernels.masks import Band, plan_block, window_band
from ..layouts.base import Layout, layout_named
from .plans import Block, Move, Schedule, Step, Task, row_range

OPERAND_CHANNEL, RESULT_CHANNEL = 0, 1


def effective_window(window: int | None, packed, t_global: int) -> int | None:
    """``window``, or None when it covers every pair anyway (``W >= T``, or ``W`` at least every
    document of packed input ``packed``): the call then runs exactly as without a window."""
    longest = max(packed.doc_lens) if packed is not None else t_global
    return None if window is None or window >= longest else int(window)


def _band(offset: int, window: int | None, causal: bool, stride: int) -> Band | None:
    if window is None:  # no window: causal or full, in the runs' own coordinates
        return Band(None, offset // stride) if causal else Band(None, None)
    return window_band(offset, window, causal, stride)


def pair_blocks(layout: Layout, n: int, t_local: int, a: int, b: int, causal: bool,
                window: int | None) -> tuple[Block, ...]:
    """The blocks of member ``a``'s queries against member ``b``'s K,V (global ranks), one per pair
    of runs that meets, each trimmed to its visible rows and keys; ``()`` when none meets."""
    T, out = t_local * n, []
    for q0, q_len, gq, stride in layout.pieces(T, n, a):
        for k0, k_len, gk, k_stride in layout.pieces(T, n, b):
            if k_stride != stride:
                raise ValueError(f"layout {layout.name!r}: runs of strides {stride} and {k_stride} cannot meet in a band")
            band = _band(gq - gk, window, causal, stride)
            p = None if band is None else plan_block(q_len, k_len, band)
            if p is None or p.empty:
                continue
            mask = p.window or ("causal" if p.causal else "none")
            out.append(Block(row_range(q0 + p.q_start, q0 + p.q_stop), row_range(k0 + p.k_start, k0 + p.k_stop), mask))
    return tuple(out)


def ranges(slices) -> tuple[slice, ...]:
    """The union of row slices as disjoint, sorted, maximal ranges."""
    out: list[list[int]] = []
    for s in sorted(slices, key=lambda s: (s.start, s.stop)):
        if out and s.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s.stop)
        else:
            out.append([s.start, s.stop])
    return tuple(row_range(a, b) for a, b in out)


def kv_pairing(a: int, b: int, n: int) -> tuple[int, int]:
    """K,V travel to the query owner: ``(step, computer)`` of pair ``(a, b)``."""
    o = (b - a) % n
    return min(o, n - o), a


def q_pairing(a: int, b: int, n: int) -> tuple[int, int]:
    """Queries travel to the K,V owner (TokenRing): ``(step, computer)`` of pair ``(a, b)``."""
    o = (b - a) % n
    return min(o, n - o), b


@dataclasses.dataclass(frozen=True)
class Pair:
    """Member ``computer`` computes ``blocks`` of ``a``'s queries against ``b``'s K,V at ``step``."""

    step: int
    computer: int
    a: int
    b: int
    blocks: tuple[Block, ...]


@dataclasses.dataclass(frozen=True)
class DirectPlan:
    """The pairs this rank takes part in (global ranks), expanded by :meth:`schedule`."""

    rank: int
    n: int
    pairs: tuple[Pair, ...]
    transport: str = "p2p"
    name: str = "ring"

    def schedule(self, t_local: int | None = None) -> Schedule:
        r, n = self.rank, self.n
        steps: dict[int, tuple[list, list]] = {}

        def at(i: int) -> tuple[list, list]:
            return steps.setdefault(i, ([], []))

        for p in self.pairs:
            if p.computer == r:
                at(p.step)[0].append(Task((p.a - r) % n, (p.b - r) % n, p.blocks))
            for what, result, owner, rows in (("q", "out", p.a, [b.q for b in p.blocks]),
                                              ("kv", "dkv", p.b, [b.kv for b in p.blocks])):
                if owner == p.computer or (what == "kv" and self.transport == "allgather"):
                    continue
                for rg in ranges(rows):
                    if r == owner:  # send the operand, receive the results back
                        at(p.step - 1)[1].append(Move(what, 0, (p.computer - r) % n, True, rg, OPERAND_CHANNEL))
                        at(p.step + 1)[1].append(Move(result, 0, (p.computer - r) % n, False, rg, RESULT_CHANNEL))
                    elif r == p.computer:
                        at(p.step - 1)[1].append(Move(what, (owner - r) % n, (owner - r) % n, False, rg,
                                                      OPERAND_CHANNEL))
                        at(p.step + 1)[1].append(Move(result, (owner - r) % n, (owner - r) % n, True, rg,
                                                      RESULT_CHANNEL))
        last = max(steps, default=0)
        return Schedule(tuple(Step(tuple(steps.get(i, ([], []))[0]), tuple(steps.get(i, ([], []))[1]))
                              for i in range(last + 1)), self.transport, self.name)

    def work(self, t_local: int) -> float:
        return self.schedule().work(t_local)


def direct_plan(rank: int, n: int, blocks: Callable[[int, int], tuple[Block, ...]], pairing: Callable,
                transport: str = "p2p", name: str = "ring") -> DirectPlan:
    """The pairs of ``rank``: every ``(a, b)`` with ``rank`` in it and a block, placed by ``pairing``."""
    pairs = []
    for a in range(n):
        for b in range(n):
            if rank not in (a, b):
                continue
            found = blocks(a, b)
            if found:
                step, computer = (0, a) if a == b else pairing(a, b, n)
                pairs.append(Pair(step, computer, a, b, found))
    return DirectPlan(rank, n, tuple(pairs), transport, name)


def window_plan(layout, pairing: Callable, rank: int, n: int, t_local: int, causal: bool, transport: str,
                window: int | None, name: str = "ring") -> DirectPlan:
    """The windowed schedule of ``rank`` for a layout (name or object) and a pairing."""
    layout = layout_named(layout)
    if layout.chunks > 1 and t_local % layout.chunks:
        raise ValueError(f"the {layout.name} layout needs a local length that is a multiple of {layout.chunks}, "
                         f"got {t_local}")
    return direct_plan(rank, n, lambda a, b: pair_blocks(layout, n, t_local, a, b, causal, window), pairing,
                       transport, name)


def ring_window_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p",
                     window: int | None = None) -> DirectPlan:
    """``ring``: contiguous layout, K,V fetched from the members within the window."""
    return window_plan("contiguous", kv_pairing, rank, n, t_local, causal, transport, window)


def zigzag_window_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p",
                       window: int | None = None) -> DirectPlan:
    """``zigzag_ring`` / ``allgather_kv``: zigzag layout, K,V from both neighbours' directions."""
    return window_plan("zigzag", kv_pairing, rank, n, t_local, causal, transport, window)


def striped_window_plan(rank: int, n: int, t_local: int, causal: bool, transport: str = "p2p",
                        window: int | None = None) -> DirectPlan:
    """``striped_ring``: every member holds tokens in every window of more than N tokens, so the
    transfers fall only for ``W < N``; the compute falls with ``W`` (banded blocks)."""
    return window_plan("striped", kv_pairing, rank, n, t_local, causal, transport, window)


__all__ = ["DirectPlan", "Pair", "direct_plan", "effective_window", "kv_pairing", "pair_blocks", "q_pairing", "ranges",
           "ring_window_plan", "striped_window_plan", "window_plan", "zigzag_window_plan"]
