"""What the planner produces: a :class:`Plan` of sequence-parallel groups for one batch.

A plan partitions ranks ``0..world_size-1`` into aligned power-of-two blocks (:class:`GroupPlan`);
each block runs one method over a list of sequence indices of the batch, packed. An executor on rank
``r`` needs only :meth:`Plan.groups_for_rank` (which ranks it joins, with which method) and
:func:`local_batch` (which sequences it packs). Plans are frozen, JSON-serialisable, and
:meth:`Plan.validate` re-checks every invariant against the lengths and the cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from .cluster import ClusterSpec, is_power_of_two
from .cost import CostModel, _check_lens


@dataclass(frozen=True)
class GroupPlan:
    """One sequence-parallel group: ranks ``[start, start + size)``, its method, its sequences.

    ``seqs`` are indices into the batch's ``seq_lens`` (longest first); ``estimated_time`` is the
    cost model's step time of this group in seconds (0 for a group with nothing to do).
    """

    start: int
    size: int
    method: str
    seqs: tuple[int, ...]
    estimated_time: float = 0.0

    @property
    def ranks(self) -> range:
        """Global ranks of the group, in group order."""
        return range(self.start, self.start + self.size)

    def to_dict(self) -> dict:
        """JSON-friendly dict of the fields."""
        return {"start": self.start, "size": self.size, "method": self.method, "seqs": list(self.seqs),
                "estimated_time": self.estimated_time}


@dataclass(frozen=True)
class Plan:
    """SP groups, methods and sequence assignment for one batch.

    Attributes:
        world_size: ranks the plan covers.
        groups: the groups, ordered by start rank; they partition the ranks.
        estimated_time: modelled step time (the slowest group; where ranks share CPU cores, at
            least the plan's total work over the cores), seconds.
        solver: what produced it (``"milp"``, ``"greedy"``, ``"static"``, ...).
        solve_time: wall seconds spent planning.
        bound: a proven lower bound on the optimal step time of this batch under the cost model
            (longest single sequence; total work / ranks), or None; ``estimated_time / bound - 1``
            bounds how far the plan can be from optimal.
        notes: free-form remarks (why a fallback happened, solver status).
    """

    world_size: int
    groups: tuple[GroupPlan, ...]
    estimated_time: float
    solver: str = "greedy"
    solve_time: float = 0.0
    bound: float | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(sorted(self.groups, key=lambda g: g.start)))

    # ------------------------------------------------------------------ executor view
    def groups_for_rank(self, rank: int) -> tuple[GroupPlan, ...]:
        """The groups ``rank`` belongs to (exactly one in a valid plan: the groups partition ranks)."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} must be in [0, {self.world_size})")
        return tuple(g for g in self.groups if g.start <= rank < g.start + g.size)

    @property
    def num_seqs(self) -> int:
        """Sequences assigned over all groups."""
        return sum(len(g.seqs) for g in self.groups)

    def group_sizes(self) -> tuple[int, ...]:
        """Distinct group sizes used (each rank joins at most one process group per size)."""
        return tuple(sorted({g.size for g in self.groups}))

    # ------------------------------------------------------------------ checks
    def validate(self, seq_lens: Sequence[int], cluster: ClusterSpec, cost_model: CostModel | None = None) -> None:
        """Raise ValueError unless this is a valid plan for ``seq_lens`` on ``cluster``.

        Checks: the world size matches; groups are power-of-two, aligned, inside the world and
        partition it; every sequence index appears exactly once; and, with ``cost_model``, that each
        method is known and supported at its size and each group fits the memory per rank.
        """
        lens = _check_lens(seq_lens)
        if self.world_size != cluster.world_size:
            raise ValueError(f"plan: world_size {self.world_size} differs from cluster.world_size "
                             f"{cluster.world_size}")
        covered = [0] * cluster.world_size
        for g in self.groups:
            if not is_power_of_two(g.size) or g.start % g.size or g.start < 0 or g.start + g.size > cluster.world_size:
                raise ValueError(f"plan: group at ranks [{g.start}, {g.start + g.size}) is not an aligned "
                                 f"power-of-two block inside {cluster.world_size} ranks")
            for r in g.ranks:
                covered[r] += 1
        bad = [r for r, c in enumerate(covered) if c != 1]
        if bad:
            raise ValueError(f"plan: rank {bad[0]} is covered by {covered[bad[0]]} groups; groups must "
                             f"partition the ranks")
        seen = [0] * len(lens)
        for g in self.groups:
            for i in g.seqs:
                if not 0 <= i < len(lens):
                    raise ValueError(f"plan: sequence index {i} out of range for {len(lens)} sequences")
                seen[i] += 1
        bad = [i for i, c in enumerate(seen) if c != 1]
        if bad:
            raise ValueError(f"plan: sequence {bad[0]} is assigned {seen[bad[0]]} times; each must be "
                             f"assigned exactly once")
        if cost_model is not None:
            for g in self.groups:
                if not cost_model.supports(g.method, g.size):
                    raise ValueError(f"plan: method {g.method!r} cannot run on a group of {g.size} ranks")
                mem = cost_model.memory(g.method, g.size, [lens[i] for i in g.seqs])
                if g.seqs and mem > cluster.memory_per_rank:
                    raise ValueError(f"plan: group at rank {g.start} needs {mem / 1e9:.1f} GB per rank, more "
                                     f"than memory_per_rank {cluster.memory_per_rank / 1e9:.1f} GB")

    # ------------------------------------------------------------------ JSON / text
    def to_dict(self) -> dict:
        """JSON-friendly dict (``format``/``version`` tagged) of the plan."""
        return {"format": "seqpar-plan", "version": 1, "world_size": self.world_size,
                "estimated_time": self.estimated_time, "solver": self.solver, "solve_time": self.solve_time,
                "bound": self.bound, "notes": self.notes, "groups": [g.to_dict() for g in self.groups]}

    def to_json(self, indent: int | None = None) -> str:
        """The plan as JSON text (read back with :meth:`from_json`)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Inverse of :meth:`to_json`; ValueError when the text is not a plan."""
        try:
            d = json.loads(text)
            groups = tuple(GroupPlan(start=int(g["start"]), size=int(g["size"]), method=str(g["method"]),
                                     seqs=tuple(int(i) for i in g["seqs"]),
                                     estimated_time=float(g.get("estimated_time", 0.0))) for g in d["groups"])
            return cls(world_size=int(d["world_size"]), groups=groups, estimated_time=float(d["estimated_time"]),
                       solver=str(d.get("solver", "")), solve_time=float(d.get("solve_time", 0.0)),
                       bound=None if d.get("bound") is None else float(d["bound"]), notes=str(d.get("notes", "")))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"plan JSON: cannot read a plan ({type(exc).__name__}: {exc})") from None

    def summary(self, seq_lens: Sequence[int] | None = None) -> str:
        """A plain-text table: one line per group (ranks, method, #seqs, tokens, time)."""
        lines = [f"plan: {len(self.groups)} groups on {self.world_size} ranks, estimated {self.estimated_time:.4f} s "
                 f"({self.solver}, solved in {self.solve_time * 1e3:.1f} ms)"]
        lines.append(f"{'ranks':>11} {'size':>4} {'method':<13} {'seqs':>5} {'tokens':>10} {'time s':>9}")
        for g in self.groups:
            tokens = sum(seq_lens[i] for i in g.seqs) if seq_lens is not None else float("nan")
            lines.append(f"{g.start:>5}-{g.start + g.size - 1:<5} {g.size:>4} {g.method:<13} {len(g.seqs):>5} "
                         f"{tokens:>10.0f} {g.estimated_time:>9.4f}")
        return "\n".join(lines)


def local_batch(plan: Plan, rank: int, seq_lens: Sequence[int]) -> list[int]:
    """Indices of the sequences ``rank``'s group packs this step (longest first, ties by index).

    ``seq_lens`` is the batch the plan was made for; it is used to check the indices and to order
    them, so every rank of a group builds the same packed batch (the same cu_seqlens).
    """
    lens = _check_lens(seq_lens)
    out: list[int] = []
    for g in plan.groups_for_rank(rank):
        for i in g.seqs:
            if not 0 <= i < len(lens):
                raise ValueError(f"seq_lens: the plan refers to sequence {i} but the batch has {len(lens)}")
        out.extend(g.seqs)
    return sorted(out, key=lambda i: (-lens[i], i))
