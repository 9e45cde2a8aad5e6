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

**Differentiable.** With ``L_i = log(Σ_j exp(s_ij) [+ exp(sink_h)])`` and ``P_ij = exp(s_ij - L_i)``,
``∂L_i/∂s_ij = P_ij`` and ``∂L_i/∂sink_h = p_sink,i``: a gradient ``dlse`` on the lse only changes
the backward's per-row ``delta_i = rowsum(dout_i · out_i)`` into ``delta_i - dlse_i``, wherever delta
is used (``dS_ij = P_ij (dP_ij - delta_i')``, the sinks' ``-Σ_i p_sink,i delta_i'``). The executor's
own rows take delta' and its query bundles carry delta' in place of delta (:mod:`.foreign`: the same
bytes), the packed, windowed, Ulysses and USP paths and :func:`seqpar.checkpoint` pass it on, and the
compiled backward op takes it as one more input. A loss of the lse alone (``out`` unused) works: its
``dout`` is zero. Rows with ``lse = -inf`` (packed padding) see no key and get no gradient from it,
whatever their ``dlse`` (never NaN).

When the lse is not differentiated (``return_lse=False``, or its gradient is None or zeros: the lse
is not in the loss), the backward is the one without it, bit for bit, with the same bytes. With a
``dlse``: the kernels that derive delta from ``out`` get a surrogate ``out``
(:func:`.foreign.surrogate_out`), or, when a row has ``dout = 0`` and ``dlse != 0`` (a loss of the
lse alone), the kernels that take delta itself (the Triton and reference kernels); with
``return_lse=True`` a backward reads bools on the host (device syncs on GPUs): one when a dlse is
given (is it zeros), one more in Ulysses/USP (for their head shards), and one per query bundle that
carries delta (has it a row only delta can carry): the own one with a dlse, and every other
member's one, with a dlse or not (token_ring at N = 4: 3, or 4 with a dlse; measured). The ring
family sends nothing more, and its ranks may differ in whether their loss holds the lse. Ulysses
and USP send ``dlse`` to the head shards by one more all-to-all (``B·Hq·T_local`` fp32 values per
rank, the inverse of the forward's), sent by every member whenever ``return_lse=True`` (zeros from
a rank whose loss does not hold the lse), so that ranks may differ there too: the all-to-all always
matches.

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
    """A family Function's forward result: ``out``, or ``(out, lse)``, both differentiable; unused ones
    reach backward as None (``set_materialize_grads(False)``: :func:`incoming`).

    The lse returned is a copy (``B·Hq·T_local`` values): the ring family saves its lse for backward
    and :func:`seqpar.checkpoint` records it for the replay, so a caller changing the returned one in
    place (``lse.sub_(m)`` when merging) would otherwise make backward raise, or, under
    ``seqpar.checkpoint``, replay the changed values into the backward (silently wrong gradients)."""
    if not with_lse:
        return out
    lse = lse.clone()
    if hasattr(ctx, "set_materialize_grads"):  # (the compiled op's stand-in ctx gets what its autograd gets)
        ctx.set_materialize_grads(False)
    return out, lse


def incoming(dout: torch.Tensor | None, dlse: tuple, shape, like: torch.Tensor):
    """A family Function's backward inputs ``(dout, dlse)``: ``dout`` contiguous, zeros of ``shape`` in
    ``like``'s dtype when only the lse was used; ``dlse`` ``[B, Hq, T_local]`` contiguous, or None
    (``return_lse=False``, or the lse not differentiated). ``dlse``: the backward's other gradients.

    A dlse of zeros is None: a compiled graph (the compiled op, or one around an eager call) hands
    zeros for an lse not in the loss where eager autograd hands None; zeros change nothing, and so
    take the backward without a dlse, bit for bit (one bool read on the host per such backward)."""
    g = dlse[0] if dlse else None
    if g is not None and not bool(g.any()):
        g = None
    if dout is None:
        dout = torch.zeros(shape, dtype=like.dtype, device=like.device)
    return dout.contiguous(), None if g is None else g.contiguous()


__all__ = ["check_return_lse", "incoming", "returned"]
