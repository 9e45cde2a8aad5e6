"""FlashAttention-class block attention in Triton: forward with log-sum-exp,
backward from the merged (out, lse), and in-kernel merging into a running fp32
accumulator, for the ring loops of seqpar.

Shapes (flash-attn layout; ``T`` is the length of this block on this rank):

- dense: ``q [B, Tq, Hq, D]``, ``k, v [B, Tk, Hkv, D]``, ``Hq % Hkv == 0``
  (query head ``h`` reads kv head ``h // (Hq // Hkv)``; K/V are never
  expanded); ``out [B, Tq, Hq, D]`` in q's dtype, ``lse [B, Hq, Tq]`` fp32.
- packed (``packed=PackedSeqs``): ``q [total_q, Hq, D]``, ``k, v [total_k,
  Hkv, D]`` (or the same with a leading batch dim of 1); document ``b`` is
  rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q against rows
  ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v; ``lse [Hq, total_q]`` (or
  ``[1, Hq, total_q]``).

Masks (positions ``i`` of a query and ``j`` of a key counted from 0 inside
one block, or inside one document when packed):

- ``"none"``: every key; ``"causal"``: ``j <= i + off``; ``"causal_strict"``:
  ``j <= i + off - 1`` (the second diagonal of striped layouts);
- ``off = causal_offset`` for ``align="top_left"`` (the default, as in
  :mod:`seqpar.kernels.base`) and ``causal_offset + Tk - Tq`` for
  ``align="bottom_right"`` (flash-attn's convention; per document when packed);
- ``window_left=W`` additionally hides keys ``j < i + off' - W`` where ``off'``
  is the offset of the last visible key (so a causal row sees at most W + 1
  keys); with ``mask="none"`` it is a lower bound only.

A row that sees no key gets ``out = 0`` and ``lse = -inf``. Inputs fp16 /
bf16 (fp32 accumulation, tensor cores) or fp32 (IEEE fp32 dots); head dims
1..256 (64, 128, 256 run unpadded; 80, 96 and the rest are padded inside the
kernel to the next power of two, at least 16, with masked loads).

The kernels are ``torch.library`` custom ops (``seqpar::triton_attn_fwd``,
``seqpar::triton_attn_fwd_acc``, ``seqpar::triton_attn_bwd``) with fake
implementations, so they trace under ``torch.compile``; the forward op has an
autograd formula (including the gradient that flows into ``lse``).

CUDA only, except on CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter,
for tests).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton

from . import triton_attention_bwd as kern_bwd
from . import triton_attention_kernels as kern
from . import triton_target
from .triton_attention_host import ALIGNS, DTYPES, INTERPRET, MASKS, MAX_HEAD_DIM, PackedSeqs, block_d, refusal



def _autotune(kernel: str, jit_fn, key_extra=(), restore_value=None):
    """Autotune over every configuration of ``kernel`` (triton_target.CONFIGS), pruned at launch to
    the table of the dtype and head dim that fits the device."""
    if INTERPRET:
        # The interpreter's autotuner fails with several configs; 16x16 blocks make
        # tiny test shapes cross block boundaries, masks and padding.
        configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    else:
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                   for bm, bn, w, st in triton_target.all_configs(kernel)]
    key = ["seq_bucket", "GROUP", "HEAD_DIM", "IS_VARLEN", "IS_CAUSAL", "HAS_WINDOW", *key_extra]
    return triton.autotune(configs, key=key, restore_value=restore_value,
                           prune_configs_by={"early_config_prune": triton_target.pruner(kernel)})(jit_fn)


# restore_value: tuning runs the kernel several times; in accumulate mode
# Out/Lse are read-modify-write, so they must be restored between trials.
_fwd_kernel = _autotune("fwd", kern.attn_fwd_kernel, ["ACCUMULATE"], ["Out", "Lse"])
_dq_kernel = _autotune("dq", kern_bwd.attn_bwd_dq_kernel)
_dkdv_kernel = _autotune("dkdv", kern_bwd.attn_bwd_dkdv_kernel)


def tuned_configs() -> dict[str, str | None]:
    """The configuration the autotuner ran last for each attention kernel (``"fwd"``, ``"dq"``,
    ``"dkdv"``) as ``"BLOCK_MxBLOCK_N wW sS"``, ``None`` for one not launched yet: what the kernel
    benchmark records next to a time (Triton keeps it on the autotuner; nothing is stored here)."""
    def name(tuner) -> str | None:
        c = getattr(tuner, "best_config", None)
        return None if c is None else f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"

    return {"fwd": name(_fwd_kernel), "dq": name(_dq_kernel), "dkdv": name(_dkdv_kernel)}


def _require(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(f"triton attention: {reason}")


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """Kernels need unit stride on the last dim (and no broadcast strides)."""
    return x if x.stride(-1) == 1 and 0 not in x.stride() else x.contiguous()


@dataclasses.dataclass(frozen=True)
class _Geom:
    """Mask geometry in the kernels' terms (see triton_attention_kernels)."""

    scale: float
    causal: bool
    offset: int
    bottom_right: bool
    window: int  # -1: no window

    @classmethod
    def of(cls, q, scale, mask, causal_offset, align, window_left) -> "_Geom":
        return cls(float(q.shape[-1] ** -0.5 if scale is None else scale), mask != "none",
                   int(causal_offset) - (mask == "causal_strict"), align == "bottom_right",
                   -1 if window_left is None else int(window_left))


def _lens(q4, k4, cu_q, cu_k, max_q, max_k):
    """(n_docs, max_q, max_k) of the 4-D kernel view."""
    if cu_q is None:
        return q4.shape[0], q4.shape[1], k4.shape[1]
    return cu_q.numel() - 1, max_q, max_k


def _new(like: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """Output buffer. Under the interpreter (tests) it is poisoned with NaN so
    that an element a kernel fails to write shows up."""
    if INTERPRET:
        return like.new_full(tuple(shape), float("nan"), dtype=dtype)
    return like.new_empty(tuple(shape), dtype=dtype)


def _meta(q4, k4, cu_q, max_q, causal, bottom_right, window):
    d = q4.shape[-1]
    bd = block_d(d)
    return dict(
        GROUP=q4.shape[2] // k4.shape[2], HEAD_DIM=d, BLOCK_D=bd,
        IS_VARLEN=cu_q is not None, IS_CAUSAL=causal, BOTTOM_RIGHT=bottom_right,
        HAS_WINDOW=window >= 0, PAD_D=bd != d,
        UPCAST=INTERPRET and q4.dtype == torch.bfloat16,
        PREC="ieee" if q4.dtype == torch.float32 else "default",
    ), max(64, triton.next_power_of_2(max(max_q, 1)))


def _launch_fwd(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, offset,
                bottom_right, window, accumulate):
    n_docs, max_q, max_k = _lens(q, k, cu_q, cu_k, max_q, max_k)
    if q.numel() == 0 or n_docs == 0 or max_q == 0:
        return
    if k.shape[1] == 0 or max_k == 0:  # no key anywhere: nothing to add, or the empty result
        if not accumulate:
            out.zero_()
            lse.fill_(float("-inf"))
        return
    meta, bucket = _meta(q, k, cu_q, max_q, causal, bottom_right, window)
    cq = q if cu_q is None else cu_q  # unused pointer when dense
    ck = q if cu_k is None else cu_k

    def grid(m):
        return (triton.cdiv(max_q, m["BLOCK_M"]), q.shape[2], n_docs)

    with triton_target.device_guard(q):
        _fwd_kernel[grid](
            q, k, v, out, lse, cq, ck, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *out.stride()[:3], lse.stride(0), lse.stride(1), q.shape[1], k.shape[1], scale,
            offset, max(window, 0), bucket, ACCUMULATE=accumulate, **meta)


def _launch_bwd(dout, q, k, v, out, lse, delta, dlse, cu_q, cu_k, max_q, max_k, scale, causal,
                offset, bottom_right, window):
    dq, dk, dv = _new(q, q.shape), _new(k, k.shape), _new(v, v.shape)
    n_docs, max_q, max_k = _lens(q, k, cu_q, cu_k, max_q, max_k)
    if q.numel() == 0 or k.numel() == 0 or n_docs == 0 or max_q == 0 or max_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()  # no query meets any key
    meta, bucket = _meta(q, k, cu_q, max_q, causal, bottom_right, window)
    lse = lse.float().contiguous()
    b_mem, t_mem, hq, d = q.shape
    with triton_target.device_guard(q):
        if delta is None:
            delta = _new(lse, lse.shape)
            dl = None if dlse is None else dlse.float().contiguous()
            bm = 16 if INTERPRET else 64
            kern.attn_delta_kernel[(triton.cdiv(t_mem, bm), hq, b_mem)](
                out, dout, delta if dl is None else dl, delta, *out.stride()[:3],
                *dout.stride()[:3], delta.stride(0), delta.stride(1), t_mem, HEAD_DIM=d,
                BLOCK_D=meta["BLOCK_D"], BLOCK_M=bm, HAS_DLSE=dl is not None)
        else:
            delta = delta.float()
            delta = (delta if dlse is None else delta - dlse.float()).contiguous()
        cq = q if cu_q is None else cu_q
        ck = q if cu_k is None else cu_k
        common = (lse.stride(0), lse.stride(1), q.shape[1], k.shape[1], scale, offset,
                  max(window, 0), bucket)
        _dq_kernel[lambda m: (triton.cdiv(max_q, m["BLOCK_M"]), hq, n_docs)](
            q, k, v, dout, dq, lse, delta, cq, ck, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], *common, **meta)
        _dkdv_kernel[lambda m: (triton.cdiv(max_k, m["BLOCK_N"]), k.shape[2], n_docs)](
            q, k, v, dout, dk, dv, lse, delta, cq, ck, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *common,
            **meta)
    return dq, dk, dv


# ------------------------------------------------------------ torch.library ops
# The ops see the 4-D kernel view: dense [B, T, H, D], packed [1, total, H, D];
# row statistics [B, H, T]. Geometry travels as plain ints/floats/bools.
@torch.library.custom_op("seqpar::triton_attn_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
            max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, offset: int,
            bottom_right: bool, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = _new(q, q.shape)
    lse = _new(q, (q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    _launch_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                causal, offset, bottom_right, window, False)
    return out, lse


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, offset,
      bottom_right, window):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]),
                                             dtype=torch.float32)


@torch.library.custom_op("seqpar::triton_attn_fwd_acc", mutates_args=("acc_out", "acc_lse"))
def _fwd_acc_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, acc_out: torch.Tensor,
                acc_lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                scale: float, causal: bool, offset: int, bottom_right: bool, window: int) -> None:
    _launch_fwd(q, k, v, acc_out, acc_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, scale, causal, offset, bottom_right, window, True)


@_fwd_acc_op.register_fake
def _(q, k, v, acc_out, acc_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
      causal, offset, bottom_right, window):
    return None


@torch.library.custom_op("seqpar::triton_attn_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: Optional[torch.Tensor], lse: torch.Tensor, delta: Optional[torch.Tensor],
            dlse: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
            cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
            scale: float, causal: bool, offset: int, bottom_right: bool,
            window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_bwd(dout, q, k, v, out, lse, delta, dlse, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, scale, causal, offset, bottom_right, window)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, delta, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, scale, causal, offset, bottom_right, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *geometry = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
    ctx.geometry = geometry


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _bwd_op(_unit_last(dout), q, k, v, out, lse, None, dlse, cu_q, cu_k,
                         *ctx.geometry)
    return (dq, dk, dv) + (None,) * (2 + len(ctx.geometry))


torch.library.register_autograd("seqpar::triton_attn_fwd", _fwd_backward, setup_context=_fwd_setup)


# ------------------------------------------------------------------ public API
def _as4d(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else _unit_last(x if x.dim() == 4 else x.unsqueeze(0))


def _varlen(packed: PackedSeqs | None):
    if packed is None:
        return None, None, 0, 0
    return packed.cu_seqlens_q, packed.cu_seqlens_k, packed.max_seqlen_q, packed.max_seqlen_k


def triton_attention_forward(q, k, v, *, scale: float | None = None, mask: str = "none",
                             causal_offset: int = 0, align: str = "top_left",
                             window_left: int | None = None, packed: PackedSeqs | None = None,
                             acc: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Block attention forward -> ``(out, lse)`` (shapes and masks: module docstring).

    ``scale`` defaults to ``D ** -0.5``. Differentiable (autograd) when ``acc``
    is None. With ``acc=(acc_out, acc_lse)`` (fp32, shaped like ``out`` and
    ``lse``; a fresh accumulator is zeros and ``-inf``), the block's result is
    merged into them in place inside the kernel (``lse = logaddexp(acc_lse,
    lse_blk)``, ``out`` the matching weighted mean) and they are returned; no
    ``out`` in q's dtype is written. Raises ``ValueError`` before any launch.
    """
    _require(refusal(q, k, v, mask=mask, scale=scale, causal_offset=causal_offset, align=align,
                     window_left=window_left, packed=packed))
    g = _Geom.of(q, scale, mask, causal_offset, align, window_left)
    args = (*_varlen(packed), g.scale, g.causal, g.offset, g.bottom_right, g.window)
    q4, k4, v4 = _as4d(q), _as4d(k), _as4d(v)
    if acc is None:
        out, lse = _fwd_op(q4, k4, v4, *args)
        return (out, lse) if q.dim() == 4 else (out[0], lse[0])
    acc_out, acc_lse = acc
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
    for name, t, shape in (("acc_out", acc_out, tuple(q.shape)), ("acc_lse", acc_lse, lse_shape)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(f"triton attention: {name} must be a float32 tensor of shape {shape}")
        if t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"triton attention: {name} must be on {q.device} with unit last stride")
    ao = acc_out if acc_out.dim() == 4 else acc_out.unsqueeze(0)
    al = acc_lse if acc_lse.dim() == 3 else acc_lse.unsqueeze(0)
    _fwd_acc_op(q4, k4, v4, ao, al, *args)
    return acc_out, acc_lse


def triton_attention_backward(dout, q, k, v, out, lse, *, scale: float | None = None,
                              mask: str = "none", causal_offset: int = 0,
                              align: str = "top_left", window_left: int | None = None,
                              packed: PackedSeqs | None = None, delta=None):
    """Block attention backward -> ``(dq, dk, dv)`` (dk, dv with Hkv heads).

    ``out`` and ``lse`` are the FINAL merged values of the rows (over every
    block they attend to), so per-block gradients add up to the exact ones;
    ``out`` may be fp32 or q's dtype, or None when ``delta = rowsum(dout *
    out)`` (fp32, shaped like ``lse``) is given instead.
    """
    _require(refusal(q, k, v, mask=mask, scale=scale, causal_offset=causal_offset, align=align,
                     window_left=window_left, packed=packed, backward=True))
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
    checks = (("dout", dout, tuple(q.shape)), ("out", out, tuple(q.shape)),
              ("lse", lse, lse_shape), ("delta", delta, lse_shape))
    for name, t, shape in checks:
        if t is None and name in ("out", "delta"):
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.device != q.device:
            raise ValueError(f"triton attention: {name} must be a tensor of shape {shape} on "
                             f"{q.device}")
    if out is None and delta is None:
        raise ValueError("triton attention: backward needs out or delta = rowsum(dout * out)")
    g = _Geom.of(q, scale, mask, causal_offset, align, window_left)
    l4 = lse if q.dim() == 4 else lse.unsqueeze(0)
    d4 = delta if delta is None or q.dim() == 4 else delta.unsqueeze(0)
    dq, dk, dv = _bwd_op(_as4d(dout), _as4d(q), _as4d(k), _as4d(v), _as4d(out), l4, d4, None,
                         *_varlen(packed), g.scale, g.causal, g.offset, g.bottom_right, g.window)
    return (dq, dk, dv) if q.dim() == 4 else (dq[0], dk[0], dv[0])


__all__ = ["ALIGNS", "DTYPES", "INTERPRET", "MASKS", "MAX_HEAD_DIM", "PackedSeqs", "refusal",
           "triton_attention_backward", "triton_attention_forward"]
