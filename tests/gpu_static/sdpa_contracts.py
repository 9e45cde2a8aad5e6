"""What torch's CUDA attention kernels assume about their arguments beyond what their fake/meta
kernels check, as functions of the real arguments (read from torch's sources, main branch, 2026):

- ``aten/src/ATen/native/transformers/cuda/attention.cu`` (``_efficient_attention_forward``,
  ``_scaled_dot_product_flash_attention_cuda``), ``attention_backward.cu``
  (``_efficient_attention_backward``, ``_flash_attention_backward``);
- ``mem_eff_attention/kernel_backward.h`` (``Params::o_strideM``, ``check_supported``,
  ``accumApplyLSEToSmem``), ``mem_eff_attention/kernel_forward.h``;
- ``flash_attn/flash_api.cpp`` (``mha_fwd``, ``mha_bwd``) and ``flash_bwd_kernel.h`` (lse read
  through a raw pointer at ``(b * h + head) * seqlen_q + row``);
- ``sdp_utils.cpp`` (``check_flash_attention_hardware_support``: sm80..sm121;
  ``check_mem_efficient_hardware_support``: sm50..sm121;
  ``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``).

The SDPA ops take ``[B, H, M, D]`` and hand the kernels the ``[B, M, H, D]`` view (``BMHK``);
strides below are of that view. Each check returns a list of violations (empty = fine).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)


def _bmhk(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _arch(cap) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def _on_cuda(**tensors) -> list[str]:
    return [f"{n} is on {t.device}, the kernel reads device memory" for n, t in tensors.items()
            if t is not None and t.device.type != "cuda"]


def _last_contiguous(**tensors) -> list[str]:
    return [f"{n}.stride(-1) = {t.stride(-1)}: the kernel needs a contiguous head dim"
            for n, t in tensors.items() if t.stride(-1) != 1]


def _aligned16(**tensors) -> list[str]:
    """The aligned cutlass kernels (the only bf16 ones; fp16/fp32 fall back to slow unaligned
    ones) need the B, M, H strides and the data pointer in multiples of 16 bytes
    (``kAlignmentQ/K/V``; ``check_supported``: ``CHECK_ALIGNED_PTR``, ``strideM % kMinimumAlignment``)."""
    bad = []
    for n, t in tensors.items():
        align = 16 // t.element_size()
        b = _bmhk(t)
        strides = {"B": b.stride(0), "M": b.stride(1), "H": b.stride(2)}
        sizes = {"B": b.shape[0], "M": b.shape[1], "H": b.shape[2]}
        for dim, s in strides.items():
            if sizes[dim] > 1 and s % align:
                bad.append(f"{n} {dim}-stride {s} is not a multiple of {align} elements (16 bytes)")
        if t.storage_offset() % align:
            bad.append(f"{n} starts at element {t.storage_offset()}, not 16-byte aligned")
    return bad


def _flash_common(cap, q, k, v, is_causal) -> list[str]:
    bad = []
    if not (8, 0) <= tuple(cap) <= (12, 1):
        bad.append(f"flash kernel runs on sm_80..sm_121, not {_arch(cap)}")
    if q.dtype not in HALF:
        bad.append(f"flash kernel needs fp16/bf16, got {q.dtype}")
    d = q.shape[-1]
    if d > 256 or d % 8:
        bad.append(f"flash kernel needs head dim % 8 == 0 and <= 256, got {d}")
    if q.shape[1] % k.shape[1]:
        bad.append(f"flash kernel needs Hq % Hkv == 0, got {q.shape[1]} and {k.shape[1]}")
    if is_causal and q.shape[2] != k.shape[2]:
        # flash-attn >= 2.1 aligns causal bottom-right; seqpar's causal is top-left.
        bad.append(f"causal with M={q.shape[2]} != N={k.shape[2]} is bottom-right aligned in the flash kernel")
    return bad + _on_cuda(q=q, k=k, v=v) + _last_contiguous(q=q, k=k, v=v)


def flash_forward(cap, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                  scale=None) -> list[str]:
    return _flash_common(cap, query, key, value, is_causal)


def _flash_bwd_lse_and_dim(logsumexp, want: tuple, d: int, cap) -> list[str]:
    """What FlashAttention-2's backward (mha_bwd / mha_varlen_bwd) requires of the logsumexp (contiguous
    float32 of shape ``want``: it reads it through a raw pointer), and the head dims it refuses on GPUs
    with less shared memory."""
    bad = []
    if logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != tuple(want) or not logsumexp.is_contiguous():
        bad.append(f"logsumexp must be contiguous float32 {list(want)} (read through a raw pointer), got "
                   f"{logsumexp.dtype} {tuple(logsumexp.shape)} strides {logsumexp.stride()}")
    narrow_smem = (8, 6) <= tuple(cap) <= (8, 9) or (12, 0) <= tuple(cap) <= (12, 1)
    if narrow_smem and 192 < d <= 224:
        bad.append(f"flash backward with head dim {d} in (192, 224] raises on {_arch(cap)}")
    return bad


def flash_backward(cap, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   dropout_p, is_causal, philox_seed, philox_offset, *, scale=None) -> list[str]:
    bad = _flash_common(cap, query, key, value, is_causal)
    bad += _on_cuda(grad_out=grad_out, out=out, logsumexp=logsumexp)
    # grad_out and out: _flash_attention_backward makes them contiguous itself.
    for n, t in (("out", out), ("grad_out", grad_out)):
        if t.dtype != query.dtype:
            bad.append(f"{n} dtype {t.dtype} != query dtype {query.dtype} (mha_bwd TORCH_CHECK)")
    return bad + _flash_bwd_lse_and_dim(logsumexp, tuple(query.shape[:3]), query.shape[-1], cap)


def _efficient_common(cap, q, k, v, attn_bias) -> list[str]:
    bad = []
    if not (5, 0) <= tuple(cap) <= (12, 1):
        bad.append(f"memory-efficient kernel runs on sm_50..sm_121, not {_arch(cap)}")
    if q.dtype not in (*HALF, torch.float32):
        bad.append(f"memory-efficient kernel needs fp16/bf16/fp32, got {q.dtype}")
    if q.dtype == torch.bfloat16 and tuple(cap) < (8, 0):
        bad.append(f"no bf16 memory-efficient kernel below sm_80 ({_arch(cap)})")
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        bad.append(f"memory-efficient kernel needs equal heads, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if attn_bias is not None:
        bad.append("seqpar never passes attn_bias: its strides would need checking too")
    return bad + _on_cuda(q=q, k=k, v=v) + _last_contiguous(q=q, k=k, v=v) + _aligned16(q=q, k=k, v=v)


def efficient_forward(cap, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                      *, scale=None) -> list[str]:
    bad = _efficient_common(cap, query, key, value, attn_bias)
    if not compute_log_sumexp:
        bad.append("compute_log_sumexp=False returns an empty lse")
    return bad


def efficient_backward(cap, grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                       dropout_p, grad_input_mask, is_causal=False, *, scale=None) -> list[str]:
    bad = _efficient_common(cap, query, key, value, attn_bias)
    bad += _on_cuda(grad_out=grad_out, out=out, logsumexp=logsumexp)
    b, h, m, dv = out.shape
    o = _bmhk(out)
    bad += _last_contiguous(out=out)
    if o.storage_offset() % (16 // o.element_size()):
        bad.append(f"out starts at element {o.storage_offset()}, not 16-byte aligned (CHECK_ALIGNED_PTR)")
    if query.dtype in HALF and m > 1 and o.stride(1) != h * dv:
        # Params::o_strideM() = head_dim_value * num_heads: out's row stride is implied, not passed;
        # for fp16/bf16 the kernel computes delta = rowsum(dO * O) itself from that layout.
        bad.append(f"out M-stride {o.stride(1)} != num_heads * head_dim = {h * dv}: the kernel reads out "
                   "in BMHK layout with an implied row stride (kernel_backward.h o_strideM) -> wrong delta")
    padded = (m + 31) // 32 * 32
    lse = logsumexp
    if lse.dtype != torch.float32 or lse.dim() != 3 or tuple(lse.shape[:2]) != (b, h) or lse.shape[2] < padded:
        bad.append(f"logsumexp must be float32 [{b}, {h}, >= {padded}] (rows read in blocks of 32, kAlignLSE), "
                   f"got {lse.dtype} {tuple(lse.shape)}")
    else:
        if lse.stride(2) != 1:
            bad.append(f"logsumexp row stride {lse.stride(2)} != 1")
        if h > 1 and lse.stride(1) % 8:
            bad.append(f"logsumexp head stride {lse.stride(1)} % 8 != 0 (LSE is not correctly aligned)")
        if b > 1 and lse.stride(0) % 8:
            bad.append(f"logsumexp batch stride {lse.stride(0)} % 8 != 0 (LSE is not correctly aligned)")
    return bad


def _bhmd(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` (or a packed ``[R, H, D]``) as the ``[B, H, M, D]`` view the SDPA checks take."""
    return (x if x.dim() == 4 else x.unsqueeze(0)).transpose(1, 2)


def _flash_window(q, k, is_causal, left, right) -> list[str]:
    """``mha_fwd`` / ``mha_bwd`` (``flash_api.cpp``): a bound ``>= Tk`` becomes ``-1`` (unbounded);
    on the right that shows keys the bound hid unless every row's bound reaches the last key
    (``Tk - Tq + right >= Tk - 1``), and ``is_causal`` sets ``right = 0``, bottom-right aligned."""
    tq, tk = q.shape[-3], k.shape[-3]
    left, right = -1 if left is None else left, -1 if right is None else right
    bad = []
    if is_causal and right not in (-1, 0):
        bad.append(f"is_causal with window_size_right={right}: the kernel sets right = 0")
    if right >= tk and tk - tq + right < tk - 1:
        bad.append(f"window_size_right={right} >= Tk={tk} is clamped to -1 (unbounded) but hides keys from "
                   f"the first rows of a {tq} x {tk} block: the kernel would show them")
    if left < -1 or right < -1:
        bad.append(f"window sizes must be >= -1, got ({left}, {right})")
    return bad


def flash_raw_forward(cap, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                      return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                      seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None) -> list[str]:
    """``aten._flash_attention_forward``: ``[B, T, H, D]`` (``[R, H, D]`` with ``cum_seq_q/k``)."""
    bad = _flash_common(cap, *(_bhmd(x) for x in (query, key, value)), False)
    bad += _flash_window(query, key, is_causal, window_size_left, window_size_right)
    if dropout_p or return_debug_mask or alibi_slopes is not None or block_table is not None:
        bad.append("seqpar never passes dropout, a debug mask, ALiBi or a block table")
    bad += _cu_seqlens(query, key, cum_seq_q, cum_seq_k, max_q, max_k)
    return bad


def flash_raw_backward(cap, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                       dropout_p, is_causal, philox_seed, philox_offset, *, scale=None, window_size_left=None,
                       window_size_right=None) -> list[str]:
    bad = _flash_common(cap, *(_bhmd(x) for x in (query, key, value)), False)
    bad += _flash_window(query, key, is_causal, window_size_left, window_size_right)
    bad += _on_cuda(grad_out=grad_out, out=out, logsumexp=logsumexp)
    for n, t in (("out", out), ("grad_out", grad_out)):
        if t.dtype != query.dtype or tuple(t.shape) != tuple(query.shape):
            bad.append(f"{n} must be {query.dtype} {tuple(query.shape)} (mha_bwd), got {t.dtype} {tuple(t.shape)}")
    hq = query.shape[-2]
    want = (hq, query.shape[0]) if cum_seq_q is not None else (query.shape[0], hq, query.shape[1])
    return bad + _flash_bwd_lse_and_dim(logsumexp, want, query.shape[-1], cap) + \
        _cu_seqlens(query, key, cum_seq_q, cum_seq_k, max_q, max_k)


def _cu_seqlens(q, k, cu_q, cu_k, max_q, max_k) -> list[str]:
    if cu_q is None and cu_k is None:
        if (max_q, max_k) != (q.shape[1], k.shape[1]):
            return [f"dense call with max_q, max_k = {max_q}, {max_k} != Tq, Tk = {q.shape[1]}, {k.shape[1]}"]
        return []
    bad = [] if q.dim() == 3 and k.dim() == 3 else ["packed calls take [R, H, D] streams"]
    for n, t in (("cum_seq_q", cu_q), ("cum_seq_k", cu_k)):
        if t is None or t.dtype != torch.int32 or not t.is_contiguous() or t.device.type != "cuda":
            bad.append(f"{n} must be a contiguous int32 CUDA tensor")
    return bad


def _cudnn_common(cap, q, k, v, attn_bias, dropout_p) -> list[str]:
    """torch's cuDNN attention (``cudnn/MHA.cpp``, ``sdp_utils.cpp`` ``check_cudnn_*``): sm_80 and
    newer, fp16/bf16, D % 8 == 0 and D <= 128 with the cuDNN torch 2.11 ships (9.19), Hq % Hkv == 0,
    a contiguous head dim; seqpar never passes a bias or dropout."""
    bad = []
    if tuple(cap) < (8, 0):
        bad.append(f"cuDNN fused attention runs on sm_80 and newer, not {_arch(cap)}")
    if q.dtype not in HALF:
        bad.append(f"cuDNN fused attention needs fp16/bf16, got {q.dtype}")
    d = q.shape[-1]
    if d > 128 or d % 8:
        bad.append(f"cuDNN 9.19 fused attention needs head dim % 8 == 0 and <= 128, got {d}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        bad.append(f"cuDNN needs Hq % Hkv == 0 and equal K, V heads, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if attn_bias is not None or dropout_p:
        bad.append("seqpar never passes attn_bias or dropout to cuDNN")
    return bad + _on_cuda(q=q, k=k, v=v) + _last_contiguous(q=q, k=k, v=v)


def cudnn_forward(cap, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                  return_debug_mask=False, *, scale=None) -> list[str]:
    bad = _cudnn_common(cap, query, key, value, attn_bias, dropout_p)
    if not compute_log_sumexp:
        bad.append("compute_log_sumexp=False returns no logsumexp")
    return bad


def cudnn_backward(cap, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                   cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None) -> list[str]:
    bad = _cudnn_common(cap, query, key, value, attn_bias, dropout_p)
    bad += _on_cuda(grad_out=grad_out, out=out, logsumexp=logsumexp) + _last_contiguous(grad_out=grad_out, out=out)
    b, h, m = query.shape[:3]
    for n, t in (("out", out), ("grad_out", grad_out)):
        if t.dtype != query.dtype or tuple(t.shape) != tuple(query.shape):
            bad.append(f"{n} must be {query.dtype} {tuple(query.shape)}, got {t.dtype} {tuple(t.shape)}")
    if out.stride() != grad_out.stride():
        bad.append(f"out strides {out.stride()} != grad_out strides {grad_out.stride()}: cuDNN's graph cache "
                   "keys on them (a new graph per layout)")
    if logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != (b, h, m, 1) or not logsumexp.is_contiguous():
        bad.append(f"logsumexp must be contiguous float32 [{b}, {h}, {m}, 1] (the forward's stats layout), got "
                   f"{logsumexp.dtype} {tuple(logsumexp.shape)} strides {logsumexp.stride()}")
    if cum_seq_q is not None or cum_seq_k is not None:
        bad.append("cum_seq_q/k select cuDNN's nested (varlen) path: seqpar's blocks are dense")
    if (max_q, max_k) != (m, key.shape[2]):
        bad.append(f"max_q, max_k = {max_q}, {max_k}: the dense path builds its graph with them, need {m}, {key.shape[2]}")
    return bad


CHECKS = {
    aten._flash_attention_forward.default: flash_raw_forward,
    aten._flash_attention_backward.default: flash_raw_backward,
    aten._scaled_dot_product_cudnn_attention.default: cudnn_forward,
    aten._scaled_dot_product_cudnn_attention_backward.default: cudnn_backward,
    aten._scaled_dot_product_flash_attention.default: flash_forward,
    aten._scaled_dot_product_flash_attention_backward.default: flash_backward,
    aten._scaled_dot_product_efficient_attention.default: efficient_forward,
    aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward,
}
