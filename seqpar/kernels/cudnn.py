"""Backend on torch's built-in cuDNN attention (``aten._scaled_dot_product_cudnn_attention`` and its
``_backward``): cuDNN's fused flash attention, no package to install.

Shapes: seqpar's ``[B, T, H, D]`` blocks are handed over as the ``[B, H, T, D]`` views the ops take
(a free transpose). The forward returns ``out`` in q's layout and the log-sum-exp as fp32
``[B, Hq, Tq, 1]``; the backward takes ``grad_out``, q, k, v, an EXTERNAL ``out`` and ``logsumexp``
(here the merged ones of a ring step, as torch's own ring attention passes them:
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``), the philox seed /
offset (unused without dropout), ``attn_bias``, ``cum_seq_q/k`` (``None``: dense), ``max_q`` /
``max_k`` (the block's Tq / Tk, the sequence lengths the dense path builds its graph with),
``dropout_p`` and ``is_causal``. Both are called with keyword arguments named as in torch's
schema (identical in torch 2.11 and 2.13), so a renamed argument raises instead of binding wrong.

What it serves (``Capabilities`` below): CUDA sm_80 and newer with cuDNN >= 9 in torch's build;
fp16 / bf16; D a multiple of 8 up to 128 (D = 256 needs a newer cuDNN than 9.19, which torch 2.11
ships, so it is refused rather than tried); GQA without expanding K, V (dK, dV come back with Hkv
heads); ``causal`` aligned top-left, so it also serves the non-square causal blocks of a reduced
plan (``Tk <= Tq``) that bottom-right kernels refuse; no windows (dispatch cuts a window into plain
pieces) and no packed calls (per-document block calls). Backward needs ``out``.

cuDNN builds an execution graph per shape and layout on first use (its cache keys on the strides
of q, k, v, out, dout): out and dout are always handed over in one fixed layout (``[B, T, H, D]``
contiguous) so that a ring loop builds each graph once.

Priority 25 (below ``torch_cuda``): until the committed GPU timings
(:mod:`seqpar.kernels.dispatch_table`) rank it first for a case, it serves only when forced.
"""

from __future__ import annotations

import torch

from .base import HALF_DTYPES, Backend, Capabilities, launch_failure
from .torch_ops import _kernel_view

aten = torch.ops.aten
#: cuDNN refusing a graph before anything runs (torch raises ``"cuDNN Frontend error: ..."`` when a graph
#: fails to validate, build or find an execution plan; ``CUDNN_STATUS_NOT_SUPPORTED`` from the backend API)
_GRAPH_REFUSALS = ("cudnn frontend error", "cudnn_status_not_supported")
#: ... but not a failed run or allocation, which must propagate like any other CUDA error
_NOT_REFUSALS = ("execution_failed", "alloc_failed", "out of memory", "illegal")

MIN_CUDNN = 90000  # cuDNN 9.0: the fused flash attention forward and backward torch calls


def _bhtd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _fixed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, T, H, D]`` in ``dtype``, contiguous, as the ``[B, H, T, D]`` view (one layout for every
    out / dout, so that cuDNN's graph cache hits)."""
    return _bhtd(x.to(dtype).contiguous())


class CudnnBackend(Backend):
    """torch's cuDNN fused attention (forward with lse, backward from the merged out / lse)."""

    name = "cudnn"
    caps = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=HALF_DTYPES,
        head_dim_multiple=8,
        max_head_dim=128,  # D = 256 needs cuDNN > 9.19 (torch 2.11 ships 9.19)
        gqa=True,
        needs_out=True,  # the backward graph takes O and derives delta itself
        priority=25,
    )

    def unavailable(self, device: torch.device) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if not torch.backends.cudnn.is_available():
            return "this torch build has no cuDNN"
        version = torch.backends.cudnn.version() or 0
        if version < MIN_CUDNN:
            return f"cuDNN {version} < 9.0 (torch's fused cuDNN attention needs cuDNN 9)"
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 0):
            return f"cuDNN's fused attention needs compute capability >= 8.0, got {cap}"
        return None

    def launch_failure(self, exc: BaseException) -> str | None:
        """Also cuDNN refusing to build a graph for this case (a shape, layout or cuDNN version it
        has no engine for): dispatch then demotes it for the case instead of failing the run."""
        text = str(exc).lower()
        if (isinstance(exc, RuntimeError) and any(m in text for m in _GRAPH_REFUSALS)
                and not any(m in text for m in _NOT_REFUSALS)):
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"[:300]
        return launch_failure(exc)

    def forward(self, q, k, v, *, scale: float, causal: bool):
        b, tq, hq, _ = q.shape
        out, lse = aten._scaled_dot_product_cudnn_attention(
            query=_kernel_view(_bhtd(q)), key=_kernel_view(_bhtd(k)), value=_kernel_view(_bhtd(v)),
            attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=causal,
            return_debug_mask=False, scale=scale,
        )[:2]
        return _bhtd(out).contiguous(), lse.reshape(b, hq, tq).float()

    def backward(self, dout, q, k, v, out, lse, *, scale: float, causal: bool, delta):
        dt, dev = q.dtype, q.device
        seed = torch.zeros((), dtype=torch.int64, device=dev)  # philox: unused without dropout
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            grad_out=_fixed(dout, dt), query=_kernel_view(_bhtd(q)), key=_kernel_view(_bhtd(k)),
            value=_kernel_view(_bhtd(v)), out=_fixed(out, dt),
            logsumexp=lse.float().unsqueeze(-1).contiguous(),  # [B, Hq, Tq, 1]: the forward's layout
            philox_seed=seed, philox_offset=seed, attn_bias=None, cum_seq_q=None, cum_seq_k=None,
            max_q=q.shape[1], max_k=k.shape[1], dropout_p=0.0, is_causal=causal, scale=scale,
        )
        return tuple(_bhtd(g).to(dt).contiguous() for g in (dq, dk, dv))
