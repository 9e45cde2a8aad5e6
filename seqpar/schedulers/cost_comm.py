"""The communication and buffer terms of the cost model, by the traits each method declares.

A method's declaration (:mod:`seqpar.methods`) names its communication structure (``comm``) and its
per-token buffers (``buffers``); this module turns them into bytes. Volumes are what seqpar's
implementations send (causal, docs/methods.md, asserted byte for byte by their tests through
``CommStats``); the schedule-dependent ones (TokenRing, LightSeq) come from the replayed schedule
traces (:mod:`.replay_table`).
"""

from __future__ import annotations

from ..methods import method as declared
from .cluster import ClusterSpec
from .replay_table import schedule_bytes, usp_degree


def method_buffers(method: str, hidden: int, kv_hidden: int, n_heads: int, e: int) -> tuple[float, float]:
    """Extra bytes per token a method holds: (divided over the group, held in full by every rank).

    ``head_shards`` (Ulysses/USP): full-length q, k, v, out of H/d heads; ``kv_double`` (ring family,
    LightSeq): a K,V double buffer; ``q_partials`` (TokenRing): q in flight and fp32 partial outputs;
    ``kv_gathered`` (all-gather KV): the gathered K,V and fp32 dK,dV; ``none``: nothing.
    """
    kind = declared(method).buffers
    return {
        "head_shards": (2 * (hidden + kv_hidden) * e, 0.0),
        "kv_double": (4 * kv_hidden * e, 0.0),
        "q_partials": (4 * (hidden + n_heads) * 4, 0.0),
        "kv_gathered": (0.0, 2 * kv_hidden * e + 2 * kv_hidden * 4),
        "none": (0.0, 0.0),
    }[kind]


def comm_parts(model, method: str, d: int, cluster: ClusterSpec) -> tuple[list[tuple], float]:
    """Communication of one step, all layers, fwd+bwd, per rank of a group of ``d``, for ``model``
    (a :class:`~seqpar.schedulers.cost.CostModel`: its hidden sizes, layers and wire dtypes).

    Returns ``(parts, latency_seconds)``; each part is ``(bytes_per_token, const_bytes, overlapped,
    link_size, kind)``: ``bytes_per_token·S1 + const_bytes`` bytes a rank sends (``all_gather``:
    receives) over the link of an aligned group of ``link_size`` ranks, measured as ``kind``
    (see :meth:`ClusterSpec.bandwidth`), with c = S1/d tokens per rank. By the method's ``comm``:
    ``kv_ring`` sends K,V d-1 hops forward, again in backward, plus d hops of the dK,dV accumulators;
    ``kv_allgather`` gathers K,V twice and reduce-scatters dK,dV; ``alltoall`` (Ulysses) moves the
    same volume in backward as forward; ``schedule`` (TokenRing, LightSeq) counts the busiest rank's
    sends of its causal schedule; ``alltoall_ring`` is Ulysses inside a node and a ring across;
    ``state_pipelined_chain`` (ZeCO) sends one state per pass, its N-1 hops pipelined;
    ``state_chain`` (LASP-1) sends it whole, hop after hop (d-1 state transfers exposed);
    ``state_allgather`` (LASP-2) gathers (d-1) states.
    """
    if d == 1:
        return [], 0.0
    h, hk, H, L, e = model.hidden, model.kv_hidden, model.n_heads, model.layers, model.bytes_per_element
    acc = model.grad_bytes_per_element
    f = (d - 1) / d
    lat = cluster.latency(d)
    kind = declared(method).comm
    if kind == "alltoall":  # (d-1)/d·c·(2h+2hk) per pass, fwd + bwd, not overlapped
        return [(f * (2 * h + 2 * hk) * e / d * 2 * L, 0.0, False, d, "all_to_all")], \
            8 * L * cluster.latency(d, "all_to_all")
    if kind == "kv_ring":  # K,V (d-1)·c·2hk fwd and bwd + d·c·2hk fp32 dK,dV; overlapped
        return [((2 * f * e + acc) * 2 * hk * L, 0.0, True, d, "p2p")], 2 * (d - 1) * L * lat
    if kind == "kv_allgather":  # gather K,V fwd and bwd, reduce-scatter fp32 dK,dV; not overlapped
        return [(f * 2 * hk * (2 * e + acc) * L, 0.0, False, d, "all_gather")], \
            3 * L * cluster.latency(d, "all_gather")
    if kind == "schedule":  # busiest rank of the causal schedule, overlapped
        per_c = schedule_bytes(method, d, H, hk // (h // H), h // H, e, acc)
        steps = d - 1 if method == "token_ring" else d // 2
        return [(per_c / d * L, 0.0, True, d, "p2p")], 2 * (steps + 1) * L * lat
    if kind == "alltoall_ring":  # Ulysses over u ranks inside a node, ring over r = d/u across
        u = usp_degree(H, d, cluster.ranks_per_node)
        r = d // u
        parts = []
        if u > 1:
            parts.append(((u - 1) / u * (2 * h + 2 * hk) * e / d * 2 * L, 0.0, False, u, "all_to_all"))
        if r > 1:
            parts.append(((2 * (r - 1) / r * e + acc) * 2 * hk / u * L, 0.0, True, d, "p2p"))
        return parts, (8 * L * cluster.latency(u, "all_to_all") if u > 1 else 0.0) + 2 * (r - 1) * L * lat
    state = 2 * L * h * (h // H) * e  # one state H·K·V = h·head_dim per layer, forward and backward
    if kind == "state_pipelined_chain":
        return [(0.0, state, False, d, "p2p")], 2 * L * (d - 1) * lat
    if kind == "state_chain":
        return [(0.0, (d - 1) * state, False, d, "p2p")], 2 * L * (d - 1) * lat
    if kind == "state_allgather":  # all-gather of (d-1)·H·K·(V+1) per layer and pass
        return [(0.0, 2 * L * (d - 1) * h * (h // H + 1) * e, False, d, "all_gather")], \
            2 * L * cluster.latency(d, "all_gather")
    raise ValueError(f"method={method!r} has no communication model (comm={kind!r})")
