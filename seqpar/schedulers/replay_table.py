"""The schedule-dependent terms of the cost model, read from the replay's coefficient table.

``replay_coeffs.json`` (next to this file) holds, per ring-family method and group size d = 2..1024,
the compute imbalance of its causal schedule and the bytes each rank sends per local token, both
from replayed schedule traces (:mod:`seqpar.bench.replay_coeffs`, which documents the fields and
regenerates the file: ``python -m seqpar.bench.replay_coeffs``). Reading it needs no torch: the
planner stays torch-free. Methods without an entry (Ulysses, USP, all-gather KV, linear) are
balanced; their communication has closed forms (:mod:`.cost_comm`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ..methods import head_imbalance
from ..methods import method as declared

TABLE = Path(__file__).with_name("replay_coeffs.json")


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    try:
        data = json.loads(TABLE.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cost model table {str(TABLE)!r}: cannot be read ({exc}); regenerate it with "
                         f"'python -m seqpar.bench.replay_coeffs'") from None
    if data.get("format") != "seqpar-replay-coeffs" or data.get("version") != 1:
        raise ValueError(f"cost model table {str(TABLE)!r}: not a version-1 replay coefficient table")
    return data


def _entry(method: str, d: int, field: str):
    """The table's ``field`` for ``method`` at group size ``d`` (None when the method has no entry)."""
    data = _table()
    m = data["methods"].get(method)
    if m is None:
        spec = declared(method)
        if spec.family == "ring" and spec.transport == "p2p":
            raise ValueError(f"method={method!r}: the replayed cost coefficients have no entry for it; regenerate "
                             f"them with 'python -m seqpar.bench.replay_coeffs'")
        return None
    if d <= 1:
        return None
    if str(d) not in m[field]:
        raise ValueError(f"group_size={d}: the replayed coefficients of {method} cover group sizes "
                         f"{data['sizes']} (powers of two); regenerate the table for larger groups")
    return m[field][str(d)]


def causal_imbalance(method: str, d: int) -> float:
    """Replayed causal step of ``d`` ranks over the perfectly divided one-rank step (1 if balanced)."""
    value = _entry(method, d, "imbalance")
    return 1.0 if value is None else float(value)


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


def attention_factor(method: str, d: int, slowdown: float = 1.0, n_heads: int | None = None,
                     ranks_per_node: int | None = None) -> float:
    """Slowest rank's attention time over the perfectly divided single-rank time ``α1·S2/d``.

    With a device per rank (``slowdown == 1``) it is the schedule's :func:`causal_imbalance` times
    the head imbalance of a head-sharded method with ``n_heads`` query heads (:func:`heads_factor`;
    ``n_heads`` None: 1). When the d ranks share cores (each computing ``slowdown`` times slower
    when all are busy), a rank with less work finishes early and frees its core: the slowest rank
    then needs about ``max(its own work, the node's total work / effective cores)`` =
    ``max(imbalance, slowdown)`` times the average work, not their product.
    """
    heads = 1.0 if n_heads is None else heads_factor(method, d, n_heads, ranks_per_node)
    return max(causal_imbalance(method, d) * heads, slowdown)


def schedule_bytes(method: str, d: int, hq: int, hkv: int, head_dim: int, e: int, g: int) -> float:
    """Bytes the busiest rank sends in one causal forward+backward per local token (scale by c =
    tokens per rank): inputs in ``e`` bytes, row statistics in fp32, gradients in ``g`` bytes."""
    rows = _entry(method, d, "rows")
    if rows is None:
        raise ValueError(f"method={method!r}: no replayed communication coefficients (comm is not 'schedule')")
    sizes = (hq * head_dim * e, hq * 4, hkv * head_dim * e, hq * head_dim * g, hkv * head_dim * g)
    return max(sum(a * b for a, b in zip(r, sizes)) for r in rows)


__all__ = ["attention_factor", "causal_imbalance", "heads_factor", "schedule_bytes", "usp_degree"]
