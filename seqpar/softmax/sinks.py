"""Attention sinks (gpt-oss): one learned logit ``s_h`` per query head, added to every softmax
denominator with no value attached.

For row i of head h with scores ``S_ij`` over the keys it may see, the sink-free result is
``out_i = Σ_j exp(S_ij - lse_i) v_j`` with ``lse_i = log Σ_j exp(S_ij)``. The sink adds
``exp(s_h)`` to the denominator:

    lse'_i = logaddexp(lse_i, s_h),      out'_i = exp(lse_i - lse'_i) · out_i

so it is applied once, to the merged ``(out, lse)`` of all steps: no method's schedule or
communication changes.

Backward. With ``P'_ij = exp(S_ij - lse'_i)`` and the sink's probability ``p_i = exp(s_h - lse'_i)``
(``Σ_j P'_ij + p_i = 1``), ``∂P'_ij/∂S_ik = P'_ij(δ_jk - P'_ik)`` and ``∂P'_ij/∂s_h = -P'_ij p_i``.
For a loss with ``dout_i = ∂L/∂out'_i`` and ``dP_ij = dout_i · v_j``:

    dS_ij = P'_ij (dP_ij - delta_i),     delta_i = Σ_j P'_ij dP_ij = rowsum(dout_i · out'_i)
    ds_h  = Σ_i Σ_j dP_ij (-P'_ij p_i) = -Σ_i exp(s_h - lse'_i) · delta_i

The first line is the block backward of :mod:`seqpar.kernels` run on ``(out', lse')`` unchanged
(it derives delta from out' and P' from lse'); only ``ds`` is new (:func:`sinks_grad`). Rows that
see no key (padding rows of packed input: ``out = 0``, ``lse = -inf``) are left as they are and
contribute nothing to ``ds``.

Shapes: ``out`` ``[B, T, H, D]``, ``lse`` ``[B, H, T]``, ``sinks`` ``[H]`` (the H heads the rows
hold: all Hq for the ring family, a Ulysses member's slice of them for ulysses and usp).
"""

from __future__ import annotations

import torch

from .foreign import shifted_delta


def check_sinks(sinks, q) -> None:
    """ValueError naming ``sinks`` unless it is a float32 tensor ``[Hq]`` on q's device (float64
    accepted with float64 q, for reference-precision runs). Local: no communication."""
    if sinks is None:
        return
    hq = q.shape[2]
    allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks: expected a float32 tensor [Hq] = [{hq}] (one logit per query head), "
                         f"got {type(sinks).__name__}")
    if tuple(sinks.shape) != (hq,) or sinks.dtype not in allowed:
        raise ValueError(f"sinks: expected a float32 tensor [Hq] = [{hq}] (one logit per query head of q), got "
                         f"shape {list(sinks.shape)} and dtype {sinks.dtype}; pass the layer's sink parameter "
                         "itself (e.g. gpt-oss's self_attn.sinks), not a sharded or expanded copy")
    if sinks.device != q.device:
        raise ValueError(f"sinks: on {sinks.device} but q is on {q.device}; move the sinks to q's device")


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out', lse')`` of rows whose sink-free result is ``(out, lse)``; out' in out's dtype,
    computed in lse's dtype (fp32, or float64). Rows with ``lse = -inf`` are returned unchanged."""
    s = sinks.detach().to(lse.dtype)[None, :, None]
    seen = torch.isfinite(lse)
    new = torch.where(seen, torch.logaddexp(lse, s), lse)
    factor = torch.where(seen, torch.exp(lse - new), 0.0).transpose(1, 2).unsqueeze(-1)
    return (out.to(lse.dtype) * factor).to(out.dtype), new


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
               dlse: torch.Tensor | None = None) -> torch.Tensor:
    """``ds [H]`` in sinks' dtype from this rank's rows: ``-Σ_rows exp(s_h - lse'_i)·delta_i`` with
    ``delta_i = rowsum(dout_i · out'_i)``, minus ``dlse_i`` when the returned lse has a gradient
    ``dlse [B, H, T]`` (``∂lse'_i/∂s_h = p_i``, :mod:`.lse`); ``out``, ``lse`` are the sink-adjusted ones."""
    acc = lse.dtype
    delta = shifted_delta(dout, out, dlse, acc)  # [B, H, T]
    seen = torch.isfinite(lse)
    p = torch.exp(sinks.detach().to(acc)[None, :, None] - torch.where(seen, lse, 0.0))
    # where, not a product: padding rows may hold NaN in dout (never read), and must add exactly 0
    return -torch.where(seen, p * delta, 0.0).sum(dim=(0, 2)).to(sinks.dtype)


__all__ = ["apply_sinks", "check_sinks", "sinks_grad"]
