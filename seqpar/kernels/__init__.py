"""Block attention with log-sum-exp: the local kernel of every ring-family method.

Layout ``[B, T, H, D]``; ``q [B, Tq, Hq, D]``, ``k``/``v [B, Tk, Hkv, D]``
with ``Hq % Hkv == 0`` (GQA, never expanded on the wire); ``lse [B, Hq, Tq]``
fp32 (fp64 for fp64). Masks ``MASKS`` and window bands (:class:`Band`, :mod:`.masks`)
are aligned top-left when Tq != Tk.

- :func:`block_forward` -> ``(out, lse)`` of one block.
- :func:`block_backward` -> ``(dq, dk, dv)`` of one block given the FINAL
  merged ``out``/``lse`` (or ``delta``) of its rows; block gradients add up.
- :func:`merge_` folds a partial ``(out, lse)`` into an fp32 accumulator made
  by :func:`new_accumulator`.
- :func:`select_backend` / :func:`available_backends`: dispatch over
  ``flash_attn`` > ``triton`` > ``torch_cuda`` > ``cudnn`` > ``torch_cpu`` > ``reference``
  (``reference`` first for float64), reordered per case by the committed GPU timings
  (:mod:`.dispatch_table`).
- :func:`varlen_forward` / :func:`varlen_backward`: packed streams ``[1, T, H, D]``
  described by :class:`VarlenSegments` (per-document segments; :mod:`.varlen`).
- :data:`FAILED_KERNELS`: the cases in which an automatically chosen backend's kernel
  failed to compile or launch here and was demoted (:mod:`.fallback`); ``.clear()`` retries.
"""

from .base import MASKS, Backend, BlockPlan, Capabilities, check_qkv, plan_block
from .dispatch import (
    BACKEND_NAMES,
    BACKENDS,
    available_backends,
    block_backward,
    block_forward,
    block_forward_into,
    select_backend,
)
from .fallback import FAILED_KERNELS, KernelCase
from .masks import Band, window_band
from .merge import merge_, new_accumulator
from .varlen import Segment, VarlenSegments, varlen_backward, varlen_forward

__all__ = [
    "MASKS",
    "Band",
    "window_band",
    "BACKENDS",
    "BACKEND_NAMES",
    "FAILED_KERNELS",
    "KernelCase",
    "Backend",
    "BlockPlan",
    "Capabilities",
    "available_backends",
    "block_backward",
    "block_forward",
    "block_forward_into",
    "check_qkv",
    "merge_",
    "new_accumulator",
    "plan_block",
    "select_backend",
    "Segment",
    "VarlenSegments",
    "varlen_backward",
    "varlen_forward",
]
