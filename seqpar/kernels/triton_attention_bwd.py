"""Triton backward kernels of the FlashAttention-class block attention: dq, and dk/dv summed over
the query heads of each kv head. They share the memory layout, the visibility rule and the
helpers (:func:`~seqpar.kernels.triton_attention_kernels._span`, ``_load``, ``_dot``, ...) of the
forward kernels in :mod:`seqpar.kernels.triton_attention_kernels`; host wrappers live in
:mod:`seqpar.kernels.triton_attention`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_attention_kernels import LOG2E, _doc, _dot, _load, _lowp, _span, _to_out, _visible


@triton.jit
def _row_stats(Lse, Delta, base, rows, ok):
    # Rows that saw no key anywhere carry lse = -inf (or +inf from the dispatch
    # layer): both must give p = 0, so use +inf in the exponent.
    lse = tl.load(Lse + base + rows, mask=ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(Delta + base + rows, mask=ok, other=0.0)
    return lse, delta


@triton.jit
def _dq_span(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, lo, hi,
             offs_m, offs_n, offs_d, d_ok, len_k, off, window, qk_scale,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
             HAS_WINDOW: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr,
             PREC: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n64 = tl.cast(start_n, tl.int64)
        kt = _load(k_base + n64 * stride_kt + offs_n[None, :] * stride_kt + offs_d[:, None],
                   cols[None, :] < len_k, d_ok[:, None], MASKED, PAD_D)
        vt = _load(v_base + n64 * stride_vt + offs_n[None, :] * stride_vt + offs_d[:, None],
                   cols[None, :] < len_k, d_ok[:, None], MASKED, PAD_D)
        s = _dot(q, kt, None, UPCAST, PREC) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, cols, len_k, off, window, IS_CAUSAL, HAS_WINDOW, True),
                         p, 0.0)
        dp = _dot(do, vt, None, UPCAST, PREC)
        ds = p * (dp - delta[:, None])
        dq = _dot(_lowp(ds, kt.dtype, UPCAST), tl.trans(kt), dq, UPCAST, PREC)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, Lse, Delta, CuQ, CuK,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_db, stride_dt, stride_dh,
    stride_gb, stride_gt, stride_gh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, sm_scale, causal_offset, window, seq_bucket,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """One program: dq of BLOCK_M query rows of one head (loops over key blocks)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q0, len_q, b_mem = _doc(CuQ, b, seqlen_q, IS_VARLEN)
    k0, len_k, _b = _doc(CuK, b, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    off = causal_offset
    if BOTTOM_RIGHT:
        off = off + len_k - len_q
    hk = h // GROUP
    bm = b_mem.to(tl.int64)
    qrow = q0.to(tl.int64)
    k_base = K + bm * stride_kb + k0.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = V + bm * stride_vb + k0.to(tl.int64) * stride_vt + hk * stride_vh

    ar_m = tl.arange(0, BLOCK_M)
    offs_m = m0 + ar_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < len_q
    qrow = qrow + m0  # from here on the q-side bases point at this block's first row
    q = _load(Q + bm * stride_qb + qrow * stride_qt + h * stride_qh
              + ar_m[:, None] * stride_qt + offs_d[None, :], row_ok[:, None], d_ok[None, :],
              True, PAD_D)
    do = _load(DO + bm * stride_db + qrow * stride_dt + h * stride_dh
               + ar_m[:, None] * stride_dt + offs_d[None, :], row_ok[:, None], d_ok[None, :],
               True, PAD_D)
    do = _lowp(do, Q.dtype.element_ty, UPCAST)  # dout may be fp32 (merged fp32 output)
    lse2, delta = _row_stats(Lse, Delta, bm * stride_lb + h * stride_lh + qrow, ar_m, row_ok)
    qk_scale = sm_scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    a, u0, u1, e = _span(m0, BLOCK_M, len_k, BLOCK_N, off - window, off, HAS_WINDOW, IS_CAUSAL)
    dq = _dq_span(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, a, u0,
                  offs_m, offs_n, offs_d, d_ok, len_k, off, window, qk_scale,
                  BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)
    dq = _dq_span(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, u0, u1,
                  offs_m, offs_n, offs_d, d_ok, len_k, off, window, qk_scale,
                  BLOCK_N, False, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)
    dq = _dq_span(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, u1, e,
                  offs_m, offs_n, offs_d, d_ok, len_k, off, window, qk_scale,
                  BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)
    dq = dq * sm_scale
    ptrs = DQ + bm * stride_gb + qrow * stride_gt + h * stride_gh
    ptrs = ptrs + ar_m[:, None] * stride_gt + offs_d[None, :]
    if PAD_D:
        tl.store(ptrs, _to_out(dq, DQ.dtype.element_ty, UPCAST), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(ptrs, _to_out(dq, DQ.dtype.element_ty, UPCAST), mask=row_ok[:, None])


@triton.jit
def _dkdv_span(dk, dv, k, v, q_base, do_base, Lse, Delta, l_base, stride_qt, stride_dt, lo, hi,
               offs_n, offs_m, offs_d, d_ok, len_q, off, window, qk_scale,
               BLOCK_M: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr,
               PREC: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        ok_m = rows < len_q
        m64 = tl.cast(start_m, tl.int64)
        qt = _load(q_base + m64 * stride_qt + offs_m[None, :] * stride_qt + offs_d[:, None],
                   ok_m[None, :], d_ok[:, None], MASKED, PAD_D)
        do = _load(do_base + m64 * stride_dt + offs_m[:, None] * stride_dt + offs_d[None, :],
                   ok_m[:, None], d_ok[None, :], MASKED, PAD_D)
        lse2, delta = _row_stats(Lse, Delta, l_base, rows, ok_m)
        st = _dot(k, qt, None, UPCAST, PREC) * qk_scale  # [BLOCK_N, BLOCK_M] = s^T
        pt = tl.math.exp2(st - lse2[None, :])
        if MASKED:
            pt = tl.where(_visible(offs_n, rows, len_q, off, window, IS_CAUSAL, HAS_WINDOW, False),
                          pt, 0.0)
        dv = _dot(_lowp(pt, k.dtype, UPCAST), _lowp(do, k.dtype, UPCAST), dv, UPCAST, PREC)
        dpt = _dot(v, tl.trans(_lowp(do, k.dtype, UPCAST)), None, UPCAST, PREC)
        dst = pt * (dpt - delta[None, :])
        dk = _dot(_lowp(dst, k.dtype, UPCAST), tl.trans(qt), dk, UPCAST, PREC)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, Lse, Delta, CuQ, CuK,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_db, stride_dt, stride_dh,
    stride_gkb, stride_gkt, stride_gkh,
    stride_gvb, stride_gvt, stride_gvh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, sm_scale, causal_offset, window, seq_bucket,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """One program: dk, dv of BLOCK_N keys of one kv head, summed over its GROUP
    query heads in registers (GQA without atomics and without expanding K/V)."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q0, len_q, b_mem = _doc(CuQ, b, seqlen_q, IS_VARLEN)
    k0, len_k, _b = _doc(CuK, b, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= len_k:
        return
    off = causal_offset
    if BOTTOM_RIGHT:
        off = off + len_k - len_q
    bm = b_mem.to(tl.int64)
    qrow = q0.to(tl.int64)
    krow = k0.to(tl.int64)
    ar_n = tl.arange(0, BLOCK_N)
    offs_n = n0 + ar_n
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    col_ok = offs_n < len_k
    krow = krow + n0  # the k-side bases point at this block's first key
    k = _load(K + bm * stride_kb + krow * stride_kt + hk * stride_kh
              + ar_n[:, None] * stride_kt + offs_d[None, :], col_ok[:, None], d_ok[None, :],
              True, PAD_D)
    v = _load(V + bm * stride_vb + krow * stride_vt + hk * stride_vh
              + ar_n[:, None] * stride_vt + offs_d[None, :], col_ok[:, None], d_ok[None, :],
              True, PAD_D)
    qk_scale = sm_scale * LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Query i sees key j iff i >= j - off (causal) and i <= j - off + window.
    a, u0, u1, e = _span(n0, BLOCK_N, len_q, BLOCK_M, -off, window - off, IS_CAUSAL, HAS_WINDOW)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + bm * stride_qb + qrow * stride_qt + h * stride_qh
        do_base = DO + bm * stride_db + qrow * stride_dt + h * stride_dh
        l_base = bm * stride_lb + h * stride_lh + qrow
        dk, dv = _dkdv_span(dk, dv, k, v, q_base, do_base, Lse, Delta, l_base, stride_qt,
                            stride_dt, a, u0, offs_n, offs_m, offs_d, d_ok, len_q, off, window,
                            qk_scale, BLOCK_M, True, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)
        dk, dv = _dkdv_span(dk, dv, k, v, q_base, do_base, Lse, Delta, l_base, stride_qt,
                            stride_dt, u0, u1, offs_n, offs_m, offs_d, d_ok, len_q, off, window,
                            qk_scale, BLOCK_M, False, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)
        dk, dv = _dkdv_span(dk, dv, k, v, q_base, do_base, Lse, Delta, l_base, stride_qt,
                            stride_dt, u1, e, offs_n, offs_m, offs_d, d_ok, len_q, off, window,
                            qk_scale, BLOCK_M, True, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)
    dk = dk * sm_scale
    ok = col_ok[:, None] & d_ok[None, :]
    dk_ptrs = DK + bm * stride_gkb + krow * stride_gkt + hk * stride_gkh
    dv_ptrs = DV + bm * stride_gvb + krow * stride_gvt + hk * stride_gvh
    dk_ptrs = dk_ptrs + ar_n[:, None] * stride_gkt + offs_d[None, :]
    dv_ptrs = dv_ptrs + ar_n[:, None] * stride_gvt + offs_d[None, :]
    tl.store(dk_ptrs, _to_out(dk, DK.dtype.element_ty, UPCAST), mask=ok)
    tl.store(dv_ptrs, _to_out(dv, DV.dtype.element_ty, UPCAST), mask=ok)
