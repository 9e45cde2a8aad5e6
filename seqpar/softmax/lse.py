"""What ``seqpar.attention(..., return_lse=True)`` returns besides the output: the merged log-sum-exp.

``lse`` ``[B, Hq, T_local]``, float32 (float64 for float64 inputs): for each of this rank's query
rows, in the same layout and order as its output rows (``seqpar.unshard(lse, dim=2)`` restores
global order), the natural log of the row's full softmax denominator over the scaled scores,
``log(Σ_j exp(scale · q_i·k_j))`` over every key the row sees (its mask, window and document)
**plus** ``exp(sinks[h])`` when sinks are given: with sinks ``lse' = logaddexp(lse, sinks[h])``,
the denominator the output was normalised by (:mod:`.sinks`). So ``out_i = Σ_j exp(s_ij - lse_i)
v_j`` holds for every row, with or without sinks.

A row that sees no key has ``lse = -inf`` (and ``out = 0``): the padding rows of packed input
(``cu_seqlens``), which a sink does not change either (their output stays 0). Dense rows, causal
or windowed, always see at least their own key.

The returned lse is the caller's own tensor (a copy): changing it in place changes nothing that
the backward or :func:`seqpar.checkpoint`'s replay reads.

**Not differentiable.** ``lse`` is marked non-differentiable: it has no ``grad_fn``, so a backward
through it alone raises torch's usual error ("does not require grad"), and one through a sum with
``out`` gets the gradient of ``out`` only. Why not exact gradients through it: the gradient is a
small change (``dS_ij = P_ij (dP_ij - delta_i + dlse_i)``: ``delta - dlse`` in place of ``delta``,
plus ``dlse·p_sink`` in the sinks' gradient), but it would have to travel with the query bundle
of every schedule, the varlen and Ulysses paths and the compiled backward op; the callers this
serves (merging with another attention, cascades, the ring-flash-attention drop-in, whose peer
returns an lse without gradient too) read it without differentiating it.

Ulysses and USP hold the lse head-sharded after their local attention; with ``return_lse=True``
one extra all-to-all of ``B·Hq·T_local`` values (fp32) per rank brings it back to this rank's rows.
Without it nothing more is sent.
"""

from __future__ import annotations

import torch


def check_return_lse(return_lse) -> None:
    """ValueError naming ``return_lse`` unless it is a bool (local, before any communication)."""
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected True or False, got {return_lse!r}")


def returned(ctx, out: torch.Tensor, lse: torch.Tensor | None, with_lse: bool):
    """A family Function's forward result: ``out``, or ``(out, lse)`` with lse non-differentiable.

    The lse returned is a copy (``B·Hq·T_local`` values): the ring family saves its lse for backward
    and :func:`seqpar.checkpoint` records it for the replay, so a caller changing the returned one in
    place (``lse.sub_(m)`` when merging) would otherwise make backward raise, or, under
    ``seqpar.checkpoint``, replay the changed values into the backward (silently wrong gradients)."""
    if not with_lse:
        return out
    lse = lse.clone()
    ctx.mark_non_differentiable(lse)
    return out, lse


__all__ = ["check_return_lse", "returned"]
