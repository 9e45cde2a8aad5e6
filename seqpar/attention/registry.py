"""The method registry: one entry per method, naming its family, token layout and plan builder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import lightseq, plans, token_ring


@dataclass(frozen=True)
class MethodSpec:
    """What ``seqpar`` needs to know about a method.

    ``family``: which implementation runs it (``ring`` = the shared ring loop, ``linear`` = linear
    attention). ``layout``: the token layout of :mod:`seqpar.layout`. ``plan``: for the ring family,
    the per-step plan builder ``(rank, n, t_local, causal, transport) -> RingPlan``.
    """

    name: str
    family: str
    layout: str
    plan: Callable | None = None
    transport: str = "p2p"
    summary: str = ""


_SPECS = (
    MethodSpec("ring", "ring", "contiguous", plans.ring_plan, "p2p",
               "K,V pass around the ring; contiguous shards (causal load is unbalanced)."),
    MethodSpec("zigzag_ring", "ring", "zigzag", plans.zigzag_plan, "p2p",
               "ring with chunks r and 2N-1-r per rank: balanced causal work."),
    MethodSpec("striped_ring", "ring", "striped", plans.striped_plan, "p2p",
               "ring with token i on rank i mod N: balanced causal work."),
    MethodSpec("allgather_kv", "ring", "zigzag", plans.zigzag_plan, "allgather",
               "all-gather K,V once, local Q against what it needs; reduce-scatter dK,dV."),
    MethodSpec("token_ring", "ring", "zigzag", token_ring.token_ring_plan, "p2p",
               "K,V stay; Q travels one hop per step, partial outputs go straight home (both link directions)."),
    MethodSpec("lightseq", "ring", "contiguous", lightseq.lightseq_plan, "p2p",
               "contiguous causal, balanced by helper ranks that compute for the busiest (DistAttn)."),
    MethodSpec("ulysses", "ulysses", "contiguous", summary="all-to-all to head shards, full local attention, "
               "all-to-all back; KV heads sent only to the ranks that use them (GQA)."),
    MethodSpec("usp", "usp", "usp", summary="2-D: Ulysses inside one mesh axis, any ring-family method "
               "across the other (ring_method=, ulysses_degree=)."),
)
_LINEAR = (
    MethodSpec("zeco", "linear", "contiguous", summary="linear attention, All-Scan of one state per rank."),
    MethodSpec("lasp2", "linear", "contiguous", summary="linear attention, all-gather of states."),
    MethodSpec("lasp1", "linear", "contiguous", summary="linear attention, unpipelined state chain."),
)

REGISTRY: dict[str, MethodSpec] = {s.name: s for s in _SPECS + _LINEAR}
METHODS: tuple[str, ...] = tuple(s.name for s in _SPECS)
LINEAR_METHODS: tuple[str, ...] = tuple(s.name for s in _LINEAR)


def method_spec(method: str, *, argument: str = "method", softmax_only: bool = False) -> MethodSpec:
    """Look up a method; ValueError naming ``argument`` and listing the valid names otherwise."""
    names = METHODS if softmax_only else tuple(REGISTRY)
    if not isinstance(method, str) or method not in names:
        raise ValueError(f"{argument}={method!r} is not a known method; choose one of {', '.join(names)}")
    return REGISTRY[method]
