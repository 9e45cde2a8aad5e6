"""Byte counting for communication primitives.

Every primitive in :mod:`seqpar.comm` takes an optional :class:`CommStats` and adds the bytes
*this rank sends* under the primitive's name. Nothing is global: the caller owns the counter and
passes it in (``seqpar.attention(..., stats=CommStats())``), so tests and benchmarks read exact
per-rank volumes and compare them with the formulas of docs/methods.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class CommStats:
    """Bytes sent by this rank, per primitive and per phase (``"fwd"`` / ``"bwd"``).

    ``sent[(phase, primitive)]`` is a byte count. ``calls[(phase, primitive)]`` counts calls.
    ``peer_bytes[(phase, peer)]`` counts bytes sent to each peer rank (global rank), so the busiest
    link can be read off with :meth:`busiest_link`.
    """

    sent: dict = field(default_factory=lambda: defaultdict(int))
    calls: dict = field(default_factory=lambda: defaultdict(int))
    peer_bytes: dict = field(default_factory=lambda: defaultdict(int))
    phase: str = "fwd"
    # step_link[phase]: the most bytes sent to one peer within one step of a step loop (note_step)
    step_link: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, primitive: str, nbytes: int, peer: int | None = None) -> None:
        self.sent[(self.phase, primitive)] += int(nbytes)
        self.calls[(self.phase, primitive)] += 1
        if peer is not None:
            self.peer_bytes[(self.phase, peer)] += int(nbytes)

    def add_tensors(self, primitive: str, tensors, peer: int | None = None) -> None:
        self.add(primitive, sum(t.numel() * t.element_size() for t in tensors), peer)

    def total(self, phase: str | None = None, primitive: str | None = None) -> int:
        """Bytes sent, optionally restricted to one phase and/or one primitive."""
        return sum(
            n
            for (ph, prim), n in self.sent.items()
            if (phase is None or ph == phase) and (primitive is None or prim == primitive)
        )

    def busiest_link(self, phase: str | None = None) -> int:
        """Largest number of bytes this rank sent to a single peer."""
        per_peer: dict = defaultdict(int)
        for (ph, peer), n in self.peer_bytes.items():
            if phase is None or ph == phase:
                per_peer[peer] += n
        return max(per_peer.values(), default=0)

    def note_step(self, per_peer: dict) -> None:
        """Record the bytes one step sent to each peer (``{global rank: bytes}``), so that
        :meth:`busiest_link_per_step` can report the largest. Called by step loops; the bytes
        themselves are counted by the primitives as usual."""
        if per_peer:
            self.step_link[self.phase] = max(self.step_link[self.phase], max(per_peer.values()))

    def busiest_link_per_step(self, phase: str | None = None) -> int:
        """Most bytes this rank sent to a single peer within one step (0 if no step loop ran)."""
        return max((n for ph, n in self.step_link.items() if phase is None or ph == phase), default=0)

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()
        self.peer_bytes.clear()
        self.step_link.clear()

    def as_dict(self) -> dict:
        return {f"{ph}/{prim}": n for (ph, prim), n in sorted(self.sent.items())}


def nbytes(*tensors: torch.Tensor) -> int:
    """Total size in bytes of the given tensors."""
    return sum(t.numel() * t.element_size() for t in tensors)
