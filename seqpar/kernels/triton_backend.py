"""Dispatch backend on seqpar's own Triton kernel
(:mod:`seqpar.kernels.triton_attention`), imported lazily so that seqpar works
without triton installed.

Capabilities: CUDA, fp16 / bf16 / fp32, head dims 1..256 (no multiple-of-8
rule: the kernel pads D itself) where a kernel configuration fits the
device's shared memory (see :mod:`seqpar.kernels.triton_target`), GQA native, backward from ``delta`` alone
(no ``out`` needed), causal in any alignment (dispatch only ever hands it
top-left causal), window bands natively (``caps.window``: a reduced
:class:`~seqpar.kernels.masks.Band` ``(lo, hi)`` becomes the kernel's causal
offset ``hi`` and ``window_left = hi - lo``, or a lower bound alone), packed calls (``caps.varlen``:
the kernels' ``cu_seqlens`` mode, bottom-right aligned, flash-attn's ``(left, right)`` windows
mapped by :func:`varlen_geometry`) and in-kernel accumulation (``caps.accumulate``). Priority 35:
above ``torch_cuda`` (30), below ``flash_attn`` (40); but ``torch_cuda`` outranks it for the
backward of the fp16 / bf16 blocks its flash kernel serves, where that kernel was measured 1.6-1.8x
faster on an H100 (:meth:`seqpar.kernels.torch_ops.TorchCUDABackend.rank`).

CPU tensors: refused, except under ``TRITON_INTERPRET=1`` (Triton's slow
interpreter, for tests), where the backend also accepts CPU but ranks below
every other backend, so that only a caller that forces ``backend="triton"``
gets it there.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .base import Backend, Capabilities
from .masks import Band

_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def _interpreting() -> bool:
    # Read at call time: the backend object may be built before a test sets
    # it (Triton itself only honours it for kernels defined afterwards).
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _caps(devices: frozenset[str]) -> Capabilities:
    return Capabilities(
        devices=devices,
        dtypes=_DTYPES,
        max_head_dim=256,  # any D up to 256: the kernel pads D itself
        gqa=True,
        needs_out=False,  # delta = rowsum(dout * out) is enough
        priority=35,
        window=True,  # the kernels' HAS_WINDOW masks: one launch per band, no pieces
        varlen=True,  # IS_VARLEN kernels over cu_seqlens, bottom-right aligned per document
        accumulate=True,  # the forward's ACCUMULATE mode merges into fp32 (out, lse) in the kernel
    )


_CAPS = _caps(frozenset({"cuda"}))
_CAPS_INTERPRET = _caps(frozenset({"cuda", "cpu"}))


class TritonBackend(Backend):
    """seqpar's Triton FlashAttention-class kernel (forward with lse, backward)."""

    name = "triton"

    @property
    def caps(self) -> Capabilities:
        return _CAPS_INTERPRET if _interpreting() else _CAPS

    def rank(self, dtype: torch.dtype, for_backward: bool = False, plan=None) -> tuple[bool, int]:
        # Under the interpreter never win automatic dispatch (it is ~1000x
        # slower than torch's CPU op); a forced backend="triton" skips ranking.
        if _interpreting():
            return (False, -1)
        return super().rank(dtype, for_backward, plan)

    def unavailable(self, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'seqpar[triton]')"
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "CUDA is not available"
            if torch.cuda.get_device_capability(device) < (7, 0):
                return "Triton needs compute capability >= 7.0"
        elif not _interpreting():
            return f"runs on CUDA only (CPU only under TRITON_INTERPRET=1), not {device.type}"
        return None

    def extra_refusal(self, q, k, v, plan, for_backward: bool) -> str | None:
        if (q.is_cuda and q.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(q.device) < (8, 0)):
            return "bfloat16 needs compute capability >= 8.0"
        from .triton_attention_host import refusal

        # Includes "no configuration fits the shared memory of sm_XX", per direction: a case whose
        # backward does not fit the device may still run its forward here.
        return refusal(q, k, v, **mask_geometry(plan.causal, plan.window), backward=for_backward)

    def forward(self, q, k, v, *, scale: float, causal: bool, window: Band | None = None):
        from .triton_attention import triton_attention_forward

        return triton_attention_forward(q, k, v, scale=scale, **mask_geometry(causal, window))

    def backward(self, dout, q, k, v, out, lse, *, scale: float, causal: bool, delta,
                 window: Band | None = None):
        # lse may carry +inf for rows that saw no key anywhere: the kernel
        # treats +inf and -inf alike (probabilities exactly 0).
        from .triton_attention import triton_attention_backward

        return triton_attention_backward(dout, q, k, v, out, lse, scale=scale, delta=delta,
                                         **mask_geometry(causal, window))


    def forward_into(self, acc_out, acc_lse, q, k, v, *, scale: float, causal: bool,
                     window: Band | None = None) -> None:
        from .triton_attention import triton_attention_forward

        triton_attention_forward(q, k, v, scale=scale, acc=(acc_out, acc_lse), **mask_geometry(causal, window))

    def varlen_forward(self, q, k, v, call, cu_q, cu_k, *, scale: float, acc=None):
        from .triton_attention import triton_attention_forward

        return triton_attention_forward(q, k, v, scale=scale, packed=_packed(call, cu_q, cu_k), acc=acc,
                                        align="bottom_right", **varlen_geometry(call.causal, call.window))

    def varlen_backward(self, dout, q, k, v, out, lse, delta, call, cu_q, cu_k, *, scale: float):
        from .triton_attention import triton_attention_backward

        return triton_attention_backward(dout, q, k, v, out, lse, scale=scale, delta=delta,
                                         packed=_packed(call, cu_q, cu_k), align="bottom_right",
                                         **varlen_geometry(call.causal, call.window))


def _packed(call, cu_q, cu_k):
    """The kernels' :class:`~seqpar.kernels.triton_attention_host.PackedSeqs` of a packed call
    (host offsets from the call: no device sync)."""
    from .triton_attention_host import PackedSeqs

    return PackedSeqs(cu_q, cu_k, call.cu_q, call.cu_k, call.max_q, call.max_k)


def varlen_geometry(causal: bool, window: tuple[int, int]) -> dict:
    """The kernels' ``mask`` / ``causal_offset`` / ``window_left`` for a packed call in flash-attn's
    terms, aligned bottom-right: query ``i`` of a document sees keys ``i + s - left .. i + s + right``
    (``s = len_k - len_q``, ``-1`` = unbounded, ``causal`` = ``right`` 0). With ``align="bottom_right"``
    the kernels' offset ``off`` gains that ``s`` and they hide ``j > i + off`` (causal) and
    ``j < i + off - window_left`` (window), so an upper edge is ``causal`` at offset ``right`` with
    ``window_left = left + right``, and a lower edge alone is ``none`` at offset ``-left``."""
    left, right = window
    if causal:
        right = 0
    if right < 0:
        return {"mask": "none"} if left < 0 else {"mask": "none", "causal_offset": -left, "window_left": 0}
    if left < 0:
        return {"mask": "causal", "causal_offset": right}
    return {"mask": "causal", "causal_offset": right, "window_left": left + right}


def mask_geometry(causal: bool, window: Band | None) -> dict:
    """The Triton kernels' ``mask`` / ``causal_offset`` / ``window_left`` (top-left) for a reduced
    block: plain ``none`` / ``causal``, or a band ``lo <= j - i <= hi``. The kernels hide keys
    ``j > i + causal_offset`` (causal) and ``j < i + causal_offset - window_left`` (window), so a
    band with both edges is ``causal`` at offset ``hi`` with ``window_left = hi - lo``, and a band
    with a lower edge only is ``none`` at offset ``lo`` with ``window_left = 0``."""
    if window is None:
        return {"mask": "causal" if causal else "none"}
    if window.lo is None:
        return {"mask": "causal", "causal_offset": window.hi} if window.hi is not None else {"mask": "none"}
    if window.hi is None:
        return {"mask": "none", "causal_offset": window.lo, "window_left": 0}
    return {"mask": "causal", "causal_offset": window.hi, "window_left": window.hi - window.lo}
