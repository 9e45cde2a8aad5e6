"""torch's FlashAttention-2 kernels called directly: ``aten._flash_attention_forward`` / ``_backward``
(the ops under ``scaled_dot_product_attention``'s flash path), for the ``torch_cuda`` backend.

Unlike the SDPA-level op they take seqpar's layout ``[B, T, H, D]`` (``[R, H, D]`` with
``cu_seq_q/k`` for packed documents), K, V with fewer heads (GQA: dK, dV come back with Hkv heads,
nothing expanded), ``window_size_left/right`` and an external ``out`` / ``lse`` in the backward.
lse is fp32 ``[B, Hq, Tq]`` (``[Hq, R]`` packed).

Alignment: FlashAttention >= 2.1 aligns masks BOTTOM-RIGHT: query ``i`` of a ``[Tq, Tk]`` block sees
keys ``i + Tk - Tq - left .. i + Tk - Tq + right`` (``-1``: unbounded), ``is_causal`` is ``right = 0``.
seqpar's reduced blocks are top-left (:func:`seqpar.kernels.base.plan_block`), so a top-left band
``(lo, hi)`` becomes ``left = Tk - Tq - lo``, ``right = hi - (Tk - Tq)`` (top-left causal: ``hi = 0``).
``mha_fwd`` / ``mha_bwd`` replace a bound ``>= Tk`` by ``-1``: harmless on the left (no key of the
block is below it then), but a right bound ``>= Tk`` that still hides keys (a top-left causal block
with ``Tq - Tk >= Tk``, or such a band) would become unbounded and show keys it must hide.
:func:`seqpar.kernels.flash.flash_pieces` therefore serves causal blocks of that shape as two calls on disjoint rows (the
square causal top, the rows below it unmasked) and refuses such bands (dispatch cuts them into
plain pieces: :meth:`seqpar.kernels.base.Backend.window_native`).

GPUs and limits (``sdp_utils.cpp``, ``flash_api.cpp``): sm_80 .. sm_121, fp16 / bf16, D % 8 == 0,
D <= 256; the backward raises for 192 < D <= 224 on sm_86 / 89 / 120 / 121.
"""

from __future__ import annotations

import torch

from .base import HALF_DTYPES
from .flash import clamp_refusal, flash_pieces, varlen_refusal  # noqa: F401 (the kernels' clamping rules)

aten = torch.ops.aten


def flash_serves(q: torch.Tensor, for_backward: bool) -> bool:
    """Whether torch's flash kernels run a block ``q [B, T, Hq, D]`` on its device (any mask)."""
    cap = torch.cuda.get_device_capability(q.device)
    d = q.shape[-1]
    if for_backward and 192 < d <= 224 and ((8, 6) <= cap <= (8, 9) or (12, 0) <= cap):
        return False
    return (q.dtype in HALF_DTYPES and torch.backends.cuda.is_flash_attention_available()
            and (8, 0) <= cap <= (12, 1) and d % 8 == 0 and d <= 256)


def varlen_forward(q, k, v, call, cu_q, cu_k, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed call on ``[R, H, D]`` streams -> ``(out [Rq, Hq, D], lse [Hq, Rq] fp32)``."""
    out, lse = aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, call.max_q, call.max_k, 0.0, call.causal, False, scale=scale,
        window_size_left=call.window[0], window_size_right=call.window[1],
    )[:2]
    if lse.dim() != 2:
        raise RuntimeError(f"torch's varlen flash forward returned lse of shape {tuple(lse.shape)}, "
                           "expected [Hq, total_q]")
    return out, lse.float()


def varlen_backward(dout, q, k, v, out, lse, call, cu_q, cu_k, scale: float):
    """Gradients of one packed call from the merged ``out`` / ``lse [Hq, Rq]``."""
    dt, dev = q.dtype, q.device
    return aten._flash_attention_backward(
        dout.to(dt), q, k, v, out.to(dt), lse.float().contiguous(), cu_q, cu_k, call.max_q, call.max_k, 0.0,
        call.causal, torch.zeros(2, dtype=torch.uint64, device=dev), torch.zeros((), dtype=torch.uint64, device=dev),
        scale=scale, window_size_left=call.window[0], window_size_right=call.window[1],
    )


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def forward(q, k, v, pieces, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Tq, Hq, D], lse [B, Hq, Tq] fp32)`` of a reduced block from its :func:`flash_pieces`."""
    k, v = _last_dim_dense(k), _last_dim_dense(v)
    outs, lses = [], []
    for rows, (left, right) in pieces:
        qp = _last_dim_dense(q[:, rows])
        out, lse = aten._flash_attention_forward(
            qp, k, v, None, None, qp.shape[1], k.shape[1], 0.0, left < 0 and right == 0, False,
            scale=scale, window_size_left=left, window_size_right=right,
        )[:2]
        outs.append(out)
        lses.append(lse[..., : qp.shape[1]])
    if len(pieces) == 1:
        return outs[0], lses[0].float()
    return torch.cat(outs, 1), torch.cat(lses, 2).float()


def backward(dout, q, k, v, out, lse, pieces, scale: float):
    """``(dq, dk, dv)`` in q's dtype of a reduced block from the merged ``out`` / ``lse`` (dK, dV of
    several pieces summed in fp32, rounded once)."""
    dt, dev = q.dtype, q.device
    k, v = _last_dim_dense(k), _last_dim_dense(v)
    rng = torch.zeros(2, dtype=torch.uint64, device=dev)  # philox state: unused without dropout
    unused = torch.zeros((), dtype=torch.uint64, device=dev)
    parts = []
    for rows, (left, right) in pieces:
        qp = _last_dim_dense(q[:, rows])
        parts.append(aten._flash_attention_backward(
            dout[:, rows].to(dt), qp, k, v, out[:, rows].to(dt), lse[..., rows].float().contiguous(),
            None, None, qp.shape[1], k.shape[1], 0.0, left < 0 and right == 0, rng, unused,
            scale=scale, window_size_left=left, window_size_right=right,
        ))
    if len(parts) == 1:
        return parts[0]
    dq = torch.cat([p[0] for p in parts], 1)
    dk, dv = (sum(p[i].float() for p in parts).to(dt) for i in (1, 2))
    return dq, dk, dv
