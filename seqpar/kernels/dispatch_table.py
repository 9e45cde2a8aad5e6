"""Backend order by measurement: a committed table of GPU timings decides which capable backend runs
a block first.

The table (``dispatch_table.json`` beside this file) is written by the kernel benchmark
(``python benchmarks/gpu_backends.py --out DIR --table seqpar/kernels/dispatch_table.json``; the
exact command is stored in the file): for each measured case, the backends that ran it,
fastest first. A case is a :class:`TableKey`: the GPU architecture (``"sm90"``), the pass
(``"forward"`` / ``"backward"``), the kind of the REDUCED block (:func:`~seqpar.kernels.masks.plan_block`:
``"none"``, ``"causal"`` or ``"window"``), its shape class (``"square"``, ``"tall"``: more rows
than keys, ``"wide"``: fewer), the dtype (``"bf16"``) and the head dim. Lengths are not part of the
key: the benchmark sums a backend's time over every block of a case, so the order is the one that
is fastest for the blocks the schedules issue.

Dispatch (:func:`seqpar.kernels.dispatch.select_backend` and the block entry points) ranks the
backends as before (:meth:`~seqpar.kernels.base.Backend.rank`), then puts the ones the table lists
for the block's case in the table's order, in the places they held among themselves: a backend the
table does not list (not installed on the measuring machine, or failed there) keeps its place, and
a case the table does not have keeps the ranked order, as does every CPU block. Capabilities still
decide who may serve, and a backend whose kernel fails to compile or launch is still demoted
(:mod:`seqpar.kernels.fallback`).

The table is read once, at import, into an immutable :class:`DispatchTable`.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from .masks import BlockPlan

TABLE_PATH = Path(__file__).with_name("dispatch_table.json")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
PASSES = ("forward", "backward")
KINDS = ("none", "causal", "window")
SHAPES = ("square", "tall", "wide")


def shape_class(rows: int, keys: int) -> str:
    """``"square"``, ``"tall"`` (more query rows than keys) or ``"wide"`` of a reduced block."""
    return "square" if rows == keys else "tall" if rows > keys else "wide"


def kind_of(plan: BlockPlan) -> str:
    return "window" if plan.window is not None else "causal" if plan.causal else "none"


@dataclasses.dataclass(frozen=True)
class TableKey:
    """One measured case (see the module docstring)."""

    arch: str
    direction: str
    kind: str
    shape: str
    dtype: str
    head_dim: int

    def __post_init__(self) -> None:
        for name, value, allowed in (("direction", self.direction, PASSES), ("kind", self.kind, KINDS),
                                     ("shape", self.shape, SHAPES), ("dtype", self.dtype, DTYPE_NAMES.values())):
            if value not in allowed:
                raise ValueError(f"dispatch table: {name}={value!r} is not one of {list(allowed)}")
        if not self.arch.startswith("sm") or not self.arch[2:].isdigit():
            raise ValueError(f"dispatch table: arch={self.arch!r} must look like 'sm90'")

    @classmethod
    def of(cls, q: torch.Tensor, plan: BlockPlan, for_backward: bool) -> TableKey | None:
        """The case of a block ``q [B, Tq, Hq, D]`` with reduced ``plan``; ``None`` off CUDA."""
        if q.device.type != "cuda" or q.dtype not in DTYPE_NAMES:
            return None
        major, minor = torch.cuda.get_device_capability(q.device)
        return cls(f"sm{major}{minor}", PASSES[for_backward], kind_of(plan), shape_class(plan.rows, plan.keys),
                   DTYPE_NAMES[q.dtype], int(q.shape[-1]))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DispatchTable:
    """``TableKey -> backend names, fastest first`` (read-only), and how it was produced."""

    orders: Mapping[TableKey, tuple[str, ...]]
    command: str = ""

    @classmethod
    def from_json(cls, doc: dict) -> DispatchTable:
        """From the table file's content (``{"command": ..., "cases": [{key fields, "order": [...]}]}``)."""
        orders = {}
        for case in doc.get("cases", []):
            key = TableKey(**{f.name: case[f.name] for f in dataclasses.fields(TableKey)})
            order = case["order"]
            if not isinstance(order, list) or not all(isinstance(n, str) for n in order) or len(set(order)) != len(order):
                raise ValueError(f"dispatch table: order {order!r} of {key} must be distinct backend names")
            orders[key] = tuple(order)
        return cls(types.MappingProxyType(orders), str(doc.get("command", "")))

    @classmethod
    def load(cls, path: Path = TABLE_PATH) -> DispatchTable:
        """The table in ``path``; an empty one when the file does not exist."""
        if not path.exists():
            return cls(types.MappingProxyType({}))
        return cls.from_json(json.loads(path.read_text()))

    def order(self, key: TableKey | None) -> tuple[str, ...] | None:
        return None if key is None else self.orders.get(key)

    def arrange(self, ranked: Sequence, key: TableKey | None) -> list:
        """``ranked`` backends (best first by rank) with those the table lists for ``key`` put in
        the table's order, in the places they held among themselves; a backend the table does not
        list keeps its place (it was not measured there); unchanged when the case is not measured."""
        order = self.order(key)
        out = list(ranked)
        if not order:
            return out
        pos = {name: i for i, name in enumerate(order)}
        slots = [i for i, b in enumerate(out) if b.name in pos]
        for i, b in zip(slots, sorted((out[i] for i in slots), key=lambda b: pos[b.name])):
            out[i] = b
        return out


def build_table(measurements: Iterable[dict], command: str) -> dict:
    """The table file's content from benchmark measurements.

    Each measurement: the :class:`TableKey` fields plus ``"backend"`` and ``"ms"`` (median time of
    one block; ``None`` when the backend could not run it). Per case, a backend's times are summed
    over the case's blocks; a backend missing or failed on any block of the case is left out of
    its order. Cases and orders are sorted, so the file only changes when the order does."""
    fields = [f.name for f in dataclasses.fields(TableKey)]
    per_case: dict[TableKey, dict[str, list]] = {}
    for m in measurements:
        key = TableKey(**{f: m[f] for f in fields})
        block = (m.get("rows"), m.get("keys"), m.get("block"))
        per_case.setdefault(key, {}).setdefault(m["backend"], []).append((block, m["ms"]))
    cases = []
    for key in sorted(per_case, key=lambda k: tuple(str(v) for v in dataclasses.astuple(k))):
        times = per_case[key]
        blocks = {b for entries in times.values() for b, _ in entries}
        total = {name: sum(ms for _, ms in entries) for name, entries in times.items()
                 if {b for b, ms in entries if ms is not None} == blocks and all(ms is not None for _, ms in entries)}
        order = sorted(total, key=lambda n: (total[n], n))
        if order:
            cases.append({**key.as_dict(), "order": order, "ms": {n: round(total[n], 4) for n in order}})
    return {"command": command, "cases": cases}
