"""Schedule-dependent terms of the cost model: each method's causal and head imbalance and the bytes
its causal schedule sends from the busiest rank (docs/methods.md); :mod:`.cost` uses them."""

from __future__ import annotations

import functools

from ..methods import head_imbalance
from ..methods import method as declared


def usp_degree(n_heads: int, d: int, ranks_per_node: int) -> int:
    """The Ulysses degree the cost model gives usp on a group of ``d``: the ranks of one node
    (``min(d, ranks_per_node)``), halved while it exceeds the head count (every rank needs a head)."""
    u = min(d, ranks_per_node)
    while u > n_heads:
        u //= 2
    return u


def heads_factor(method: str, d: int, n_heads: int, ranks_per_node: int | None = None) -> float:
    """Most query heads on one rank over the mean for methods that shard heads (ulysses over ``d``,
    usp over :func:`usp_degree`; ``ranks_per_node`` None: one node), 1 for the others."""
    if not declared(method).head_sharded:
        return 1.0
    u = d if declared(method).family == "ulysses" else usp_degree(n_heads, d, ranks_per_node or d)
    return head_imbalance(n_heads, u)


@functools.lru_cache(maxsize=4096)
def _schedule_bytes(method: str, n: int, hq: int, hkv: int, head_dim: int, e: int, acc: int) -> float:
    """Bytes the busiest rank sends in one causal fwd+bwd with c = 1 token per rank (scale by c).

    token_ring (zigzag, queries toward r-1, docs/methods.md): rank r sends q_rows query rows (fwd:
    q; bwd: q, dout, fp32 lse and delta) and out_rows partial rows (fwd: out + fp32 lse; bwd: fp32 dq)
    with q_rows = (n-1)/2 for r = 0 else (n-r) + (r-1)/2, out_rows = (n-1-r) + r/2.
    lightseq (§3): at t = 1..n//2 a rank sends K,V forward if r+t < n, else its queries to a helper
    (when helpers work, n-t > t); a helper returns (out, lse) and dq; bwd returns dK,dV (fp32).
    """
    q, lse, kv = hq * head_dim, hq, 2 * hkv * head_dim
    best = 0.0
    for r in range(n):
        if method == "token_ring":
            q_rows = (n - 1) / 2 if r == 0 else (n - r) + (r - 1) / 2
            out_rows = (n - 1 - r) + r / 2
            sent = q_rows * (q * e + 2 * q * e + 2 * lse * 4) + out_rows * (q * e + lse * 4 + q * acc)
        else:
            sent = 0.0
            for t in range(1, n // 2 + 1):
                helpers = t < n - t
                if r + t < n:
                    sent += 2 * kv * e
                elif helpers:
                    sent += q * e + 2 * q * e + 2 * lse * 4
                if r >= t:
                    sent += kv * acc
                elif helpers:
                    sent += q * e + lse * 4 + q * acc
        best = max(best, sent)
    return best


def attention_factor(method: str, d: int, slowdown: float = 1.0, n_heads: int | None = None,
                     ranks_per_node: int | None = None) -> float:
    """Slowest rank's attention time over the perfectly divided single-rank time ``α1·S2/d``.

    With a device per rank (``slowdown == 1``) it is the schedule's :func:`causal_imbalance` times
    the head imbalance of a head-sharded method with ``n_heads`` query heads (:func:`heads_factor`;
    ``n_heads`` None: 1). When
    the d ranks share cores (each computing ``slowdown`` times slower when all are busy), a rank
    with less work finishes early and frees its core: the slowest rank then needs about
    ``max(its own work, the node's total work / effective cores)`` = ``max(imbalance, slowdown)``
    times the average work, not their product (contiguous ring on 8 ranks and 2 cores runs at the
    speed of the total work, its imbalance hidden by the oversubscription).
    """
    heads = 1.0 if n_heads is None else heads_factor(method, d, n_heads, ranks_per_node)
    return max(causal_imbalance(method, d) * heads, slowdown)


def causal_imbalance(method: str, d: int) -> float:
    """Slowest rank's causal attention work over the average (the schedule bound is its inverse).

    ring (contiguous): the last rank computes its diagonal (half a block) and d-1 full blocks while the
    average is d/2 blocks: (2d-1)/d. lightseq, even d: d/2 steps plus the diagonal against d/2 blocks
    of average work: (d+1)/d (odd d is balanced). The zigzag/striped layouts and Ulysses balance.
    """
    if d <= 1:
        return 1.0
    if method == "ring":
        return (2 * d - 1) / d
    if method == "lightseq" and d % 2 == 0:
        return (d + 1) / d
    return 1.0
