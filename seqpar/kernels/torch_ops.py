"""Backends on torch's fused attention ops that return the log-sum-exp.

Both take and return the seqpar layout ``[B, T, H, D]``; the aten ops want
``[B, H, T, D]``, which is a free transpose (the ops accept the strided view).
They run on the reduced block of :func:`seqpar.kernels.base.plan_block`
(every row sees a key; causal is top-left with ``Tk <= Tq``).

- ``torch_cpu``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  ``_backward``. Checked with torch 2.13: float32, bfloat16, float16 and
  float64 all work; lse is float32 (float64 for float64); GQA is native (dK
  comes back with Hkv heads); causal with Tq != Tk is top-left; any head dim.
  Half-precision backward (and fp16 forward) run in fp32, see below.
  The op needs one head dim for q, k and v: a value head dim ``D_v != D``
  (MLA) is served by padding the narrower of (q, k) and (v, and dout and
  out in backward) with zero columns inside the call and slicing the
  results back (zero columns add nothing to q·k, and rowsum(dout * out) is
  unchanged); nothing padded leaves the call.
  It returns lse 0 for a fully masked row and dies with SIGFPE on Tq == 0 or
  Tk == 0, which is why the dispatch layer never hands it such blocks.
  No ``window`` capability: a sliding-window band runs as plain causal pieces
  (:func:`seqpar.kernels.masks.band_pieces`). Measured on the 2-core CI
  machine (1 thread, fp32, T = 2048, W = 1024, H = 8, D = 64, forward +
  backward): pieces 641 ms, the op with one additive float mask 1101 ms (it
  computes every masked score), plain causal 659 ms.
- ``torch_cuda``: torch's FlashAttention-2 kernels called directly, ``aten._flash_attention_forward``
  / ``_backward`` (:mod:`.torch_flash`: fp16/bf16, sm_80..sm_121, D % 8 == 0, D <= 256; GQA native,
  nothing expanded; causal of any reduced shape and window bands natively, bottom-right aligned
  bounds translated from seqpar's top-left ones, except bands the kernel's clamping cannot express,
  which dispatch cuts into pieces), else ``aten._scaled_dot_product_efficient_attention`` (fp32
  too, builds without the flash kernel; its causal is top-left). On the memory-efficient kernel,
  non-causal GQA folds the ``g`` query heads of a group into the query length (``q -> [B, Hkv,
  g*Tq, D]``): no K/V expansion. Causal GQA cannot be folded (the mask depends on the row inside
  the group), so there alone K/V heads are repeated *locally, inside the kernel call* and dK/dV
  summed over the group in fp32; nothing expanded ever leaves this function.

  Layout contracts of the CUDA kernels that torch's fake kernels do not check
  (checked on fake CUDA tensors by ``tests/test_gpu_static_torch_cuda.py``):
  the efficient op sees ``[B, H, M, D]`` and hands the kernels the ``[B, M, H, D]`` view,
  whose head dim must be contiguous with 16-byte aligned strides and start;
  the memory-efficient backward reads ``out`` with an implied row stride of
  ``H * D`` (``kernel_backward.h``, ``Params::o_strideM``: it computes
  ``delta = rowsum(dout * out)`` itself for fp16/bf16), so ``out`` is passed
  with exactly that row stride; its lse is padded to a multiple of 32 rows
  (read in blocks of 32). The flash backward reads lse as contiguous
  ``[B, H, M]`` and raises for 192 < D <= 224 on sm_86/89/120/121.
"""

from __future__ import annotations

import torch

from . import torch_flash
from .base import FLOAT_DTYPES, HALF_DTYPES, Backend, Capabilities, lse_dtype

aten = torch.ops.aten


def _bhtd(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` <-> ``[B, H, T, D]`` (a view)."""
    return x.transpose(1, 2)


# Measured on the 2-core CI machine (torch 2.13, B=1, T=2048, Hq=Hkv=8, D=64,
# non-causal, ms; noisy): forward fp32 ~140, bf16 ~65, fp16 ~230; backward
# fp32 ~375, bf16 ~1220, fp16 ~3960. The half backward is also less exact:
# with GQA it sums dK/dV over the query group in bf16 (MQA 8:1 dV error 2.3x
# that of a plain bf16 computation). So half backward (and fp16 forward) run
# the fp32 kernel on upcast copies and round once: faster and more exact.
_CPU_COMPUTE_FWD = {torch.float16: torch.float32}
_CPU_COMPUTE_BWD = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class TorchCPUBackend(Backend):
    """torch's CPU flash-attention op (with lse) and its backward."""

    name = "torch_cpu"
    caps = Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=FLOAT_DTYPES,
        needs_out=True,  # the op derives delta from `out` itself
        priority=20,
        value_dim=True,  # D_v != D: padded with zeros inside the call (_padded)
    )

    def forward(self, q, k, v, *, scale, causal):
        ct = _CPU_COMPUTE_FWD.get(q.dtype, q.dtype)
        width = max(q.shape[3], v.shape[3])
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            *(_bhtd(_padded(x.to(ct), width)) for x in (q, k, v)), 0.0, causal, scale=scale
        )
        return _bhtd(out[..., :v.shape[3]]).to(q.dtype).contiguous(), lse

    def backward(self, dout, q, k, v, out, lse, *, scale, causal, delta):
        ct = _CPU_COMPUTE_BWD.get(q.dtype, q.dtype)
        width = max(q.shape[3], v.shape[3])
        # out: the merged fp32 accumulator stays exact here
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(_bhtd(_padded(x.to(ct), width)) for x in (dout, q, k, v, out)),
            lse.to(lse_dtype(ct)).contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return tuple(_bhtd(g[..., :x.shape[3]]).to(q.dtype).contiguous() for g, x in ((dq, q), (dk, k), (dv, v)))


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [B, T, H, D]`` with zero columns up to head dim ``width`` (``x`` itself when it has it)."""
    return x if x.shape[3] == width else torch.nn.functional.pad(x, (0, width - x.shape[3]))


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _kernel_view(x: torch.Tensor, *, dense_rows: bool = False) -> torch.Tensor:
    """``x`` in kernel layout ``[B, H, M, D]``, copied only if its ``[B, M, H, D]`` view breaks
    what the CUDA kernels assume: contiguous D, 16-byte aligned strides and start, and with
    ``dense_rows`` a row (M) stride of exactly ``H * D`` (``out`` of the efficient backward)."""
    v = x.transpose(1, 2)
    align = 16 // x.element_size()
    fits = v.stride(-1) == 1 and v.storage_offset() % align == 0 and all(
        size == 1 or stride % align == 0 for size, stride in zip(v.shape[:3], v.stride()[:3])
    )
    if dense_rows and v.shape[1] > 1:
        fits = fits and v.stride(1) == v.shape[2] * v.shape[3]
    return x if fits else v.contiguous().transpose(1, 2)


class TorchCUDABackend(Backend):
    """torch's CUDA flash / memory-efficient attention ops (with lse)."""

    name = "torch_cuda"
    caps = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dim_multiple=8,  # both kernels want 16-byte aligned rows
        max_head_dim=256,
        needs_out=True,  # both backward ops derive delta from `out`
        priority=30,
        window=True,  # the flash kernels' window bounds (see window_native)
        varlen=True,  # the flash kernels' cu_seqlens mode (fp16/bf16: see varlen_refusal)
    )

    def rank(self, dtype: torch.dtype, for_backward: bool = False, plan=None) -> tuple[bool, int]:
        """Priority 30 (below ``triton``'s 35), but 36 for the backward of an fp16 / bf16 block that
        torch's flash kernel served when this was measured (not causal, or causal and square; the
        direct flash calls of :mod:`.torch_flash` serve more now, unmeasured: the committed dispatch
        table, :mod:`.dispatch_table`, reorders what a GPU run has measured).

        Measured on one H100 80GB HBM3 (torch 2.11.0+cu130, triton 3.6.0; bf16, 32 query / 8 K,V
        heads, D = 128; benchmarks/results/gpu_real/, launches queued): the backward of a full 8K x 8K
        block took 9.2 ms here against 16.6 ms in seqpar's Triton kernel, 8K x 4K 4.6-4.9 against
        8.0-8.2, a causal 8K 5.3 against 8.2. Not so where the memory-efficient kernel would serve it
        (causal 8K x 4K: 8.4 ms here, 6.5 in Triton), nor for the forward (Triton with its fused
        merge 0.9-2.2 ms, this backend plus the merge 1.8-3.5). Packed calls (``plan`` None) keep 30: this backend has
        no varlen kernel, and one Triton varlen launch stays preferred to a block call per document
        (not measured on a GPU)."""
        preferred, priority = super().rank(dtype, for_backward, plan)
        flash_serves = plan is not None and plan.window is None and (
            not plan.causal or plan.q_stop - plan.q_start == plan.k_stop - plan.k_start)
        if for_backward and dtype in HALF_DTYPES and flash_serves:
            priority = 36
        return preferred, priority

    def unavailable(self, device):
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if _capability(device) < (5, 0):
            return f"GPU compute capability {_capability(device)} < (5, 0)"
        return None

    def extra_refusal(self, q, k, v, plan, for_backward):
        if q.dtype == torch.bfloat16 and _capability(q.device) < (8, 0):
            return "bfloat16 needs compute capability >= 8.0"
        return None

    def window_native(self, q, plan, for_backward: bool) -> bool:
        """Windows run natively on torch's flash kernels where their clamped bounds can express the
        band (:func:`~seqpar.kernels.torch_flash.flash_pieces`); else as plain pieces."""
        return torch_flash.flash_serves(q, for_backward) and \
            torch_flash.flash_pieces(plan.rows, plan.keys, False, plan.window) is not None

    def varlen_refusal(self, q, calls, for_backward: bool) -> str | None:
        if not torch_flash.flash_serves(q, for_backward):
            return "no varlen kernel for this case (only torch's flash kernels have one: fp16/bf16, sm_80..sm_121)"
        return torch_flash.varlen_refusal(calls)

    def varlen_forward(self, q, k, v, call, cu_q, cu_k, *, scale, acc=None):
        return torch_flash.varlen_forward(q, k, v, call, cu_q, cu_k, float(scale))

    def varlen_backward(self, dout, q, k, v, out, lse, delta, call, cu_q, cu_k, *, scale):
        return torch_flash.varlen_backward(dout, q, k, v, out, lse, call, cu_q, cu_k, float(scale))

    @staticmethod
    def _mode(q, k, causal) -> str:
        """How GQA meets the kernel: ``mha`` (Hq == Hkv), ``fold`` or ``expand``."""
        if q.shape[2] == k.shape[2]:
            return "mha"
        return "expand" if causal else "fold"

    @staticmethod
    def _rows_in(x: torch.Tensor, hkv: int, mode: str, *, dense_rows: bool = False) -> torch.Tensor:
        """A q-like ``[B, Tq, Hq, D]`` tensor in kernel layout ``[B, H', R, D]``.

        ``fold`` puts query head ``j*g + i`` of KV group ``j`` at rows ``i*Tq:(i+1)*Tq`` of
        kernel head ``j`` (for a contiguous ``x`` the reshape copies into the kernels' view)."""
        if mode == "fold":
            b, t, hq, d = x.shape
            x = x.reshape(b, t, hkv, hq // hkv, d).permute(0, 3, 1, 2, 4).reshape(b, -1, hkv, d)
        return _kernel_view(_bhtd(x), dense_rows=dense_rows)

    @staticmethod
    def _kv_in(x: torch.Tensor, g: int, mode: str) -> torch.Tensor:
        """``[B, Tk, Hkv, D]`` in kernel layout; repeated to Hq heads only for causal GQA."""
        x = _kernel_view(_bhtd(x))
        return x.repeat_interleave(g, dim=1) if mode == "expand" else x

    @staticmethod
    def _rows_out(x: torch.Tensor, like_q: torch.Tensor, mode: str) -> torch.Tensor:
        """Kernel layout ``[B, H', R, D]`` back to ``[B, Tq, Hq, D]``."""
        b, tq, hq, d = like_q.shape
        if mode == "fold":
            hkv = x.shape[1]
            return x.reshape(b, hkv, hq // hkv, tq, d).permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d)
        return _bhtd(x).contiguous()

    def forward(self, q, k, v, *, scale, causal, window=None):
        if torch_flash.flash_serves(q, for_backward=False):
            pieces = torch_flash.flash_pieces(q.shape[1], k.shape[1], causal, window)
            return torch_flash.forward(q, k, v, pieces, scale)
        b, tq, hq, _ = q.shape  # the memory-efficient kernel (never a window: window_native)
        hkv = k.shape[2]
        mode = self._mode(q, k, causal)
        qh = self._rows_in(q, hkv, mode)
        kh, vh = self._kv_in(k, hq // hkv, mode), self._kv_in(v, hq // hkv, mode)
        out, lse = aten._scaled_dot_product_efficient_attention(
            qh, kh, vh, None, True, 0.0, causal, scale=scale
        )[:2]
        rows = qh.shape[2]
        lse = lse[..., :rows].reshape(b, hq, tq)  # efficient pads rows to a multiple of 32
        return self._rows_out(out, q, mode), lse.float()

    def backward(self, dout, q, k, v, out, lse, *, scale, causal, delta, window=None):
        if torch_flash.flash_serves(q, for_backward=True):
            pieces = torch_flash.flash_pieces(q.shape[1], k.shape[1], causal, window)
            return torch_flash.backward(dout, q, k, v, out, lse, pieces, scale)
        b, tq, hq, d = q.shape
        tk, hkv = k.shape[1], k.shape[2]
        g, dt = hq // hkv, q.dtype
        mode = self._mode(q, k, causal)
        qh = self._rows_in(q, hkv, mode)
        doh = self._rows_in(dout.to(dt), hkv, mode)
        oh = self._rows_in(out.to(dt), hkv, mode, dense_rows=True)
        kh, vh = self._kv_in(k, g, mode), self._kv_in(v, g, mode)
        heads, rows = qh.shape[1], qh.shape[2]
        lse_h = lse.float().reshape(b, heads, rows)
        padded = (rows + 31) // 32 * 32  # the lse layout the forward op returns
        lse_p = lse_h.new_full((b, heads, padded), float("inf"))
        lse_p[..., :rows] = lse_h
        zero = torch.zeros((), dtype=torch.int64)  # philox seed/offset: unused without dropout
        dqh, dkh, dvh, _ = aten._scaled_dot_product_efficient_attention_backward(
            doh, qh, kh, vh, None, oh, lse_p, zero, zero, 0.0,
            [True, True, True, False], causal, scale=scale,
        )
        if mode == "expand":  # sum the group's dK/dV in fp32, round once
            dkh = dkh.float().reshape(b, hkv, g, tk, d).sum(2)
            dvh = dvh.float().reshape(b, hkv, g, tk, d).sum(2)
        return (
            self._rows_out(dqh, q, mode),
            _bhtd(dkh).to(dt).contiguous(),
            _bhtd(dvh).to(dt).contiguous(),
        )
