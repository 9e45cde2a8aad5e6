"""The USP layout: a ring layout over R super-shards, each cut into U contiguous pieces.

``N = U·R`` ranks; rank ``(u, j)`` (member u of its Ulysses group, member j of its ring group) is
member ``i = j·U + u`` of the flat order. With ``c = T/N``:

1. the ring method's layout over R *super-shards* of ``T/R`` tokens: super-shard ``j`` holds
   ``ring.positions(T, R, j)`` in ring-local order (contiguous, zigzag or striped);
2. super-shard ``j`` is cut into U contiguous pieces of ``c`` tokens; rank ``(u, j)`` holds piece u.

A global length must be a multiple of ``R·lcm(m, U)`` (m = 2 for the zigzag layout, else 1). Packed
input is laid out per document by the ring layout over the R ring members (padded so that the ring
member's stream is a multiple of U), and that stream is cut into U pieces
(:class:`~seqpar.layouts.placement.USPPlacement`).
"""

from __future__ import annotations

import math

from .base import Layout


class USPLayout(Layout):
    """``ring``: the ring method's :class:`Layout`; ``ulysses_degree`` U and ``ring_degree`` R.
    ``positions(T, n, i)`` for the flat member ``i = j·U + u`` (``n`` must be ``U·R``)."""

    name = "usp"

    def __init__(self, ring: Layout, ulysses_degree: int, ring_degree: int) -> None:
        self.ring, self.u_deg, self.r_deg = ring, ulysses_degree, ring_degree

    def multiple(self, n: int) -> int:
        return self.r_deg * math.lcm(self.ring.chunks, self.u_deg)

    def _check_n(self, n: int) -> None:
        if n != self.u_deg * self.r_deg:
            raise ValueError(f"the USP layout has {self.u_deg} x {self.r_deg} ranks, not {n}")

    def positions(self, T, n, rank):
        self._check_n(n)
        c, u, j = T // n, rank % self.u_deg, rank // self.u_deg
        return self.ring.positions(T, self.r_deg, j)[u * c:(u + 1) * c]

    def real_count(self, L, T, n, rank):
        return sum(p < L for p in self.positions(T, n, rank))

    def token_indices(self, T, n, rank, device=None):
        self._check_n(n)
        c, u, j = T // n, rank % self.u_deg, rank // self.u_deg
        return self.ring.token_indices(T, self.r_deg, j, device=device)[u * c:(u + 1) * c]

    def check_length(self, T: int, n: int, *, method: str = "usp", argument: str = "x") -> None:
        multiple = self.multiple(n)
        if T % multiple:
            raise ValueError(
                f"{argument}: a sequence of {T} tokens cannot be split for method='usp' with "
                f"ulysses_degree={self.u_deg} x {self.r_deg} ranks of a {self.ring.name} ring layout: "
                f"the length must be a multiple of R*lcm({self.ring.chunks}, U) = {multiple}; pad it to "
                f"{-(-T // multiple) * multiple}")

    def __repr__(self) -> str:
        return f"USPLayout({self.ring!r}, {self.u_deg}, {self.r_deg})"

    def __eq__(self, other) -> bool:
        return isinstance(other, USPLayout) and (other.ring, other.u_deg, other.r_deg) == (
            self.ring, self.u_deg, self.r_deg)

    def __hash__(self) -> int:
        return hash((self.name, self.ring, self.u_deg, self.r_deg))


__all__ = ["USPLayout"]
