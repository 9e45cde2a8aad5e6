"""Every method of seqpar, declared once. Torch-free: the planner, the CLI and the docs read it too.

A :class:`Method` says what the rest of the library needs to know about a method:

- ``family``: which implementation runs it: ``"ring"`` (the one schedule executor of
  :mod:`seqpar.softmax.executor`; the method is a plan), ``"ulysses"``, ``"usp"`` (Ulysses inside
  one mesh axis, any ring-family method across the other) or ``"linear"`` (gated linear attention,
  :mod:`seqpar.linear`; the method is a scan plan).
- ``layout``: the token layout of :mod:`seqpar.layouts` (``"contiguous"``, ``"zigzag"``,
  ``"striped"``; ``"usp"`` composes the ring method's layout with contiguous Ulysses pieces).
- ``plan``: ``"module:function"`` of the per-rank schedule builder of a ring-family method,
  ``(rank, n, t_local, causal, transport) -> RingPlan | Schedule``; the scan plan name of a linear
  method. Resolved by :func:`seqpar.softmax.registry.plan_builder`.
- ``transport``: how the data moves (ring: ``"p2p"`` or ``"allgather"``; ulysses/usp:
  ``"alltoall"``; linear: ``"chain"`` or ``"allgather"``).
- capabilities: ``causal_balanced`` (every rank gets the same causal work; checked against the
  schedules by the tests), ``packed`` (packed variable-length input), ``adaptive`` (runs on the
  1-D groups of ``seqpar train --adaptive`` for any head count), ``window`` (sliding windows,
  causal and symmetric: ``seqpar.attention(..., window=W)``; a ring-family method names its
  windowed plan builder in ``window_plan``, ``(rank, n, t_local, causal, transport, window) ->
  plan``; usp serves a window when its ring method does), ``sinks`` (attention sinks,
  ``seqpar.attention(sinks=)``), ``head_sharded`` (query heads are split over the ranks of the
  Ulysses axis: any head count of at least that many ranks, as even as :func:`head_shards` makes
  it, at a compute imbalance of :func:`head_imbalance`).
- cost traits, read by :mod:`seqpar.schedulers.cost`: ``comm`` (the communication structure of
  its cost model), ``buffers`` (the per-token buffers a rank holds besides activations) and
  ``preference`` (the planner's tie-break: of two methods with equal modelled cost, the lower wins).

Adding a ring variant: write its plan builder and add one :class:`Method` here (see
docs/architecture.md). Nothing else lists methods.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("ring", "ulysses", "usp", "linear")
LAYOUTS = ("contiguous", "zigzag", "striped", "usp")
#: communication structures of the cost model (seqpar.schedulers.cost)
COMM_KINDS = ("kv_ring", "kv_allgather", "schedule", "alltoall", "alltoall_ring", "state_chain",
              "state_pipelined_chain", "state_allgather")
#: per-token buffer kinds of the cost model (seqpar.schedulers.cost.method_buffers)
BUFFER_KINDS = ("kv_double", "kv_gathered", "q_partials", "head_shards", "none")


@dataclass(frozen=True)
class Method:
    """One method of seqpar (see the module docstring for the fields)."""

    name: str
    family: str
    layout: str
    transport: str
    plan: str | None
    comm: str
    buffers: str
    preference: int
    summary: str
    causal_balanced: bool = True
    packed: bool = True
    adaptive: bool = False
    window: bool = False
    window_plan: str | None = None
    sinks: bool = True
    head_sharded: bool = False

    def __post_init__(self) -> None:
        for field, value, allowed in (("family", self.family, FAMILIES), ("layout", self.layout, LAYOUTS),
                                      ("comm", self.comm, COMM_KINDS), ("buffers", self.buffers, BUFFER_KINDS)):
            if value not in allowed:
                raise ValueError(f"Method {self.name!r}: {field}={value!r} is not one of {allowed}")
        if self.family == "ring" and (self.plan is None or ":" not in self.plan):
            raise ValueError(f"Method {self.name!r}: a ring-family method needs plan='module:function'")
        if self.family == "ring" and self.window and (self.window_plan is None or ":" not in self.window_plan):
            raise ValueError(f"Method {self.name!r}: a ring-family method with window=True needs "
                             "window_plan='module:function'")

    @property
    def softmax(self) -> bool:
        return self.family != "linear"

    @property
    def layout_multiple(self) -> int:
        """Tokens per rank must be a multiple of this (the zigzag layout holds two equal chunks)."""
        return 2 if self.layout == "zigzag" else 1


_PLANS = "seqpar.softmax.plans"
_WINDOW = "seqpar.softmax.window"

#: Every method, softmax first, in the order of the README's tables.
DECLARED: tuple[Method, ...] = (
    Method("ring", family="ring", layout="contiguous", transport="p2p", plan=f"{_PLANS}:ring_plan",
           comm="kv_ring", buffers="kv_double", preference=7, causal_balanced=False, adaptive=True,
           window=True, window_plan=f"{_WINDOW}:ring_window_plan",
           summary="K,V pass around the ring; contiguous shards (causal load is unbalanced)."),
    Method("zigzag_ring", family="ring", layout="zigzag", transport="p2p", plan=f"{_PLANS}:zigzag_plan",
           comm="kv_ring", buffers="kv_double", preference=0, adaptive=True,
           window=True, window_plan=f"{_WINDOW}:zigzag_window_plan",
           summary="ring with chunks r and 2N-1-r per rank: balanced causal work."),
    Method("striped_ring", family="ring", layout="striped", transport="p2p", plan=f"{_PLANS}:striped_plan",
           comm="kv_ring", buffers="kv_double", preference=6, adaptive=True,
           window=True, window_plan=f"{_WINDOW}:striped_window_plan",
           summary="ring with token i on rank i mod N: balanced causal work."),
    Method("allgather_kv", family="ring", layout="zigzag", transport="allgather", plan=f"{_PLANS}:zigzag_plan",
           comm="kv_allgather", buffers="kv_gathered", preference=5, adaptive=True,
           window=True, window_plan=f"{_WINDOW}:zigzag_window_plan",
           summary="all-gather K,V once, local Q against what it needs; reduce-scatter dK,dV."),
    Method("token_ring", family="ring", layout="zigzag", transport="p2p",
           plan="seqpar.softmax.token_ring:token_ring_plan", comm="schedule", buffers="q_partials", preference=3,
           window=True, window_plan="seqpar.softmax.token_ring:token_ring_window_plan",
           summary="K,V stay; Q travels one hop per step, partial outputs go straight home (both link directions)."),
    Method("lightseq", family="ring", layout="contiguous", transport="p2p",
           plan="seqpar.softmax.lightseq:lightseq_plan", comm="schedule", buffers="kv_double", preference=4,
           causal_balanced=False, window=True, window_plan="seqpar.softmax.lightseq:lightseq_window_plan",
           summary="contiguous causal, balanced by helper ranks that compute for the busiest (DistAttn)."),
    Method("ulysses", family="ulysses", layout="contiguous", transport="alltoall", plan=None, comm="alltoall",
           buffers="head_shards", preference=1, window=True, head_sharded=True,
           summary="all-to-all to head shards, full local attention, all-to-all back; KV heads sent only to "
                   "the ranks that use them (GQA)."),
    Method("usp", family="usp", layout="usp", transport="alltoall", plan=None, comm="alltoall_ring",
           buffers="head_shards", preference=2, window=True, head_sharded=True,
           summary="2-D: Ulysses inside one mesh axis, any ring-family method across the other "
                   "(ring_method=, ulysses_degree=)."),
    Method("zeco", family="linear", layout="contiguous", transport="chain", plan="zeco",
           comm="state_pipelined_chain", buffers="none", preference=8, sinks=False,
           summary="linear attention, All-Scan of one state per rank."),
    Method("lasp2", family="linear", layout="contiguous", transport="allgather", plan="lasp2",
           comm="state_allgather", buffers="none", preference=9, sinks=False,
           summary="linear attention, all-gather of states."),
    Method("lasp1", family="linear", layout="contiguous", transport="chain", plan="lasp1", comm="state_chain",
           buffers="none", preference=10, sinks=False, summary="linear attention, unpipelined state chain."),
)

#: softmax methods (``seqpar.METHODS``)
METHODS: tuple[str, ...] = tuple(m.name for m in DECLARED if m.softmax)
#: linear-attention methods (``seqpar.LINEAR_METHODS``)
LINEAR_METHODS: tuple[str, ...] = tuple(m.name for m in DECLARED if not m.softmax)
#: ring-family methods: any of them runs on the ring axis of usp
RING_METHODS: tuple[str, ...] = tuple(m.name for m in DECLARED if m.family == "ring")
ALL_METHODS: tuple[str, ...] = METHODS + LINEAR_METHODS
#: methods ``seqpar train --adaptive`` runs on its 1-D groups, in the planner's order of preference
ADAPTIVE_METHODS: tuple[str, ...] = tuple(m.name for m in sorted(DECLARED, key=lambda m: m.preference) if m.adaptive)
#: every method in the planner's order of preference (``Method.preference``)
BY_PREFERENCE: tuple[str, ...] = tuple(m.name for m in sorted(DECLARED, key=lambda m: m.preference))

_KINDS = {"any": (lambda m: True, "a known method"), "softmax": (lambda m: m.softmax, "a softmax method"),
          "linear": (lambda m: not m.softmax, "a linear-attention method"),
          "ring": (lambda m: m.family == "ring", "a ring-family method")}


def names(kind: str = "any") -> tuple[str, ...]:
    """Names of the declared methods of ``kind`` (``"any"``, ``"softmax"``, ``"linear"``, ``"ring"``).

    Read from :data:`DECLARED` at each call, so a test that declares a toy method sees it everywhere."""
    keep = _KINDS[kind][0]
    return tuple(m.name for m in DECLARED if keep(m))


def method(name, *, argument: str = "method", kind: str = "any") -> Method:
    """The declaration of ``name``; ValueError naming ``argument`` and the valid names otherwise.

    ``kind``: ``"any"``, ``"softmax"``, ``"linear"`` or ``"ring"`` (the methods accepted)."""
    valid = names(kind)
    if not isinstance(name, str) or name not in valid:
        what = _KINDS[kind][1] if isinstance(name, str) and name in names() else "a known method"
        raise ValueError(f"{argument}={name!r} is not {what}; choose one of {', '.join(valid)}")
    return next(m for m in DECLARED if m.name == name)


#: the ring-axis method of usp when ``ring_method`` is not given (balanced causal work)
DEFAULT_RING_METHOD = "zigzag_ring"


def ring_method(name: str | None) -> Method:
    """The ring-axis method of usp: ``name`` (any ring-family method) or :data:`DEFAULT_RING_METHOD`."""
    return method(DEFAULT_RING_METHOD if name is None else name, argument="ring_method", kind="ring")


def check_window(decl: Method, window, ring_method_name=None) -> None:
    """ValueError naming ``window`` unless it is None or an int >= 1 that ``decl`` serves (usp: and
    its ring method); raised locally, before any communication."""
    if window is None:
        return
    if isinstance(window, bool) or not hasattr(window, "__index__") or int(window) < 1:
        raise ValueError(f"window={window!r}: expected None or an int >= 1 (tokens a query sees: itself and the "
                         "window - 1 before it when causal, |i - j| < window otherwise)")
    served = decl.window and (decl.name != "usp" or ring_method(ring_method_name).window)
    if not served:
        which = names("softmax")
        ok = [m for m in which if next(d for d in DECLARED if d.name == m).window]
        what = f"ring_method={ring_method(ring_method_name).name!r}" if decl.name == "usp" else f"method={decl.name!r}"
        raise ValueError(f"window={window}: {what} does not serve a sliding window; use one of {', '.join(ok)}")


def head_shards(hq: int, degree: int, what: str | None = None) -> tuple[int, ...]:
    """Query heads per member of a head-sharded method's Ulysses axis of ``degree`` ranks: as even as
    possible, the first ``hq % degree`` members one more (9 heads on 2 ranks: 5 + 4). ValueError
    naming ``q``, ``what`` (the degree's origin) and the alternatives when a member would get none
    (more ranks than heads)."""
    if degree > hq:
        fits = [u for u in range(1, degree + 1) if degree % u == 0 and u <= hq]
        raise ValueError(
            f"q: Hq={hq} query heads cannot be split over {what or f'{degree} ranks'} (every rank needs at "
            f"least one query head): use method='usp' with a smaller ulysses_degree (one of {fits}, e.g. "
            f"ulysses_degree={fits[-1]}), or a ring-family method such as 'zigzag_ring'")
    base, extra = divmod(hq, degree)
    return tuple(base + (m < extra) for m in range(degree))


def head_imbalance(hq: int, degree: int) -> float:
    """Most query heads on one rank over the mean (1.0 when ``degree`` divides ``hq``; 5/4.5 = 1.11
    for 9 heads on 2 ranks): the attention compute of the slowest member relative to an even split."""
    return max(head_shards(hq, degree)) * degree / hq


def check_usp_options(name, ulysses_degree, ring_method_name) -> None:
    """ValueError when a usp-only option (``ulysses_degree``, ``ring_method``) is given to another method."""
    if name != "usp":
        for option, value in (("ulysses_degree", ulysses_degree), ("ring_method", ring_method_name)):
            if value is not None:
                raise ValueError(f"{option}={value!r}: only method='usp' takes it (method={name!r}); "
                                 f"drop it, or use method='usp'")


__all__ = ["ADAPTIVE_METHODS", "BY_PREFERENCE", "DEFAULT_RING_METHOD", "check_usp_options", "check_window", "ring_method", "ALL_METHODS", "BUFFER_KINDS", "COMM_KINDS", "DECLARED", "FAMILIES", "LAYOUTS",
           "LINEAR_METHODS", "METHODS", "Method", "RING_METHODS", "head_imbalance", "head_shards", "method", "names"]
