"""The flash-attn varlen path of :mod:`seqpar.kernels.varlen`: packed calls of
``flash_attn_varlen_func`` (forward) and the private ``_flash_attn_varlen_backward``.

``segments`` is a :class:`~seqpar.kernels.varlen.VarlenSegments`; streams ``q [1, Tq, Hq, D]``,
``k``/``v [1, Tk, Hkv, D]``, ``lse [1, Hq, Tq]`` fp32. Each function runs every launch before
returning its parts, so the caller merges nothing from a path that failed half-way.
"""

from __future__ import annotations

import torch

from .base import Backend
from .dispatch import BACKEND_NAMES, BACKENDS
from .fallback import FAILED_KERNELS, Attempt, KernelCase
from .flash import _load as _load_flash


def _flash() -> Backend:
    return next(b for b in BACKENDS if b.name == "flash_attn")


def use_flash(q, k, v, backend, for_backward, has_out) -> bool:
    """True to run the flash-attn varlen path; ValueError when it is forced but cannot serve."""
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"backend={backend!r} is unknown: use None (automatic) or one of {list(BACKEND_NAMES)}")
    if backend not in (None, "flash_attn"):
        return False
    why = _flash().refusal(q, k, v, "none", for_backward, has_out)
    if why and backend == "flash_attn":
        raise ValueError(f"backend='flash_attn' cannot serve this varlen block: {why}")
    if why is None and backend is None:
        return FAILED_KERNELS.reason("flash_attn", KernelCase.of(q, k, "varlen", for_backward)) is None
    return why is None


def flash_run(q, k, backend, for_backward, run):
    """``run()`` of the flash varlen path; when chosen automatically, a launch failure demotes the
    case (one warning) and gives ``None``: the caller falls back to per-segment block calls."""
    if backend == "flash_attn":
        return run()
    with Attempt(_flash(), KernelCase.of(q, k, "varlen", for_backward)):
        return run()
    return None


def flash_forward_parts(q, k, v, segments, scale: float):
    """One flash-attn varlen launch per packed call -> ``[(q_index, out [R, Hq, D], lse [Hq, R])]``."""
    fa, _ = _load_flash()
    parts = []
    for i, call in enumerate(segments.packed_calls()):
        qi, ki, cu_q, cu_k = segments.packed_tensors(i, q.device)
        with torch.no_grad():
            o, lse, _ = fa.flash_attn_varlen_func(
                q[0].index_select(0, qi), k[0].index_select(0, ki), v[0].index_select(0, ki),
                cu_q, cu_k, call.max_q, call.max_k, dropout_p=0.0, softmax_scale=float(scale),
                causal=call.causal, window_size=call.window, return_attn_probs=True)
        if lse.dim() != 2:  # flash-attn >= 2.7 returns unpadded [Hq, total_q]
            raise RuntimeError(f"flash_attn_varlen_func returned lse of shape {tuple(lse.shape)}, "
                               "expected [Hq, total_q] (flash-attn >= 2.7)")
        parts.append((qi, o, lse))
    return parts


def flash_backward_parts(dout, q, k, v, out, lse, segments, scale: float):
    """One flash-attn varlen backward per packed call -> ``[(q_index, k_index, dq, dk, dv)]``."""
    fa, _ = _load_flash()
    dt, parts = q.dtype, []
    for i, call in enumerate(segments.packed_calls()):
        qi, ki, cu_q, cu_k = segments.packed_tensors(i, q.device)
        qp, kp, vp = (x[0].index_select(0, j) for x, j in ((q, qi), (k, ki), (v, ki)))
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        fa._flash_attn_varlen_backward(
            dout[0].index_select(0, qi).to(dt), qp, kp, vp, out[0].index_select(0, qi).to(dt),
            lse[0].index_select(1, qi).float().contiguous(), dq, dk, dv, cu_q, cu_k,
            call.max_q, call.max_k, dropout_p=0.0, softmax_scale=float(scale), causal=call.causal,
            window_size_left=call.window[0], window_size_right=call.window[1], softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None)
        parts.append((qi, ki, dq, dk, dv))
    return parts
