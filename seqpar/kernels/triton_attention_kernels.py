"""Triton kernels of the FlashAttention-class block attention (forward with lse,
accumulation, delta preprocessing) and the helpers the backward kernels
(:mod:`seqpar.kernels.triton_attention_bwd`) share. Host wrappers, validation and the
``torch.library`` ops live in :mod:`seqpar.kernels.triton_attention`.

Memory layout seen by every kernel: ``[B_mem, T_mem, H, D]`` with unit stride
on D; row statistics (lse, delta) ``[B_mem, H, T_mem]`` with unit stride on T.
Dense batches use ``B_mem = B`` and document ``b`` is batch row ``b``; packed
documents use ``B_mem = 1`` and document ``b`` is rows
``cu_seqlens[b]:cu_seqlens[b+1]`` (so the grid's last axis is the document).

Visibility of key ``j`` to query ``i`` (positions inside one document):
``j <= i + off`` if ``IS_CAUSAL`` and ``j >= i + off - window`` if
``HAS_WINDOW``, with ``off = causal_offset (+ len_k - len_q if BOTTOM_RIGHT)``.
Scores are kept in base 2 (``qk_scale = scale * log2(e)``) so the softmax
uses ``exp2``; lse is returned in natural log.

Every program splits its counterpart range into a masked head, an unmasked
middle and a masked tail (:func:`_span`), so only blocks that cross a mask
boundary or the end of the sequence pay for the element-wise mask.
"""

from __future__ import annotations

import triton
import triton.language as tl

# constexpr: the compiler rejects plain float globals in @jit code (the interpreter accepts them).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _span(s0, BS: tl.constexpr, L, BO: tl.constexpr, lo_delta, hi_delta,
          HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """Counterpart blocks for own rows ``[s0, s0 + BS)``.

    Counterpart ``c`` is visible to own ``s`` iff ``0 <= c < L``,
    ``c >= s + lo_delta`` (if HAS_LO) and ``c <= s + hi_delta`` (if HAS_HI).
    Returns block-aligned ``(a, u0, u1, e)``: blocks in ``[a, u0)`` and
    ``[u1, e)`` need the element mask, blocks in ``[u0, u1)`` are fully visible
    to every own row.
    """
    zero = s0 * 0
    part_lo = zero
    full_lo = zero
    part_hi = zero + L
    full_hi = zero + L
    if HAS_LO:
        part_lo = tl.maximum(s0 + lo_delta, 0)
        full_lo = tl.maximum(s0 + (BS - 1) + lo_delta, 0)
    if HAS_HI:
        part_hi = tl.minimum(tl.maximum(s0 + BS + hi_delta, 0), L)
        full_hi = tl.minimum(tl.maximum(s0 + 1 + hi_delta, 0), L)
    a = (part_lo // BO) * BO
    e = tl.where(part_hi > part_lo, ((part_hi + BO - 1) // BO) * BO, a)
    u0 = tl.minimum(tl.maximum(((full_lo + BO - 1) // BO) * BO, a), e)
    u1 = tl.minimum(tl.maximum((full_hi // BO) * BO, u0), e)
    return a, u0, u1, e


@triton.jit
def _load(ptrs, row_ok, d_ok, ROWS: tl.constexpr, PAD_D: tl.constexpr):
    """Load a tile, masking rows (if ROWS) and padded head-dim columns (if PAD_D)."""
    if ROWS:
        if PAD_D:
            x = tl.load(ptrs, mask=row_ok & d_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok, other=0.0)
    else:
        if PAD_D:
            x = tl.load(ptrs, mask=d_ok, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PREC: tl.constexpr):
    # UPCAST: the CPU interpreter (triton 3.9) returns garbage for tl.dot on
    # bf16 operands, so there both operands go through fp32.
    if UPCAST:
        y = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif PREC == "ieee":  # fp32 inputs: exact fp32 products rather than tf32
        y = tl.dot(a, b, acc, input_precision="ieee")
    else:
        y = tl.dot(a, b, acc)
    return y


@triton.jit
def _lowp(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """Round an fp32 operand to the input dtype for a tensor-core dot. Under
    UPCAST (the interpreter with bf16, whose fp32->bf16 cast truncates) keep
    fp32: the dot runs in fp32 there anyway."""
    if UPCAST:
        y = x
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _to_out(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """Cast an fp32 tile for a store, rounding to nearest even. GPUs do that in
    ``.to``; the interpreter truncates fp32 -> bf16, so round by hand there."""
    if UPCAST and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _visible(rows, cols, len_c, off, window, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
             COLS_ARE_KEYS: tl.constexpr):
    """Element mask of a tile (rows x cols); ``len_c`` bounds the counterpart index."""
    if COLS_ARE_KEYS:
        i = rows[:, None]
        j = cols[None, :]
        ok = j < len_c
    else:  # rows are keys, cols are queries (transposed tiles of the dk/dv kernel)
        i = cols[None, :]
        j = rows[:, None]
        ok = i < len_c
    if IS_CAUSAL:
        ok = ok & (j <= i + off)
    if HAS_WINDOW:
        ok = ok & (j >= i + (off - window))
    return ok


@triton.jit
def _doc(Cu, b, seqlen, IS_VARLEN: tl.constexpr):
    """(first memory row, length, memory batch index) of document ``b``."""
    if IS_VARLEN:
        start = tl.load(Cu + b)
        length = tl.load(Cu + b + 1) - start
        b_mem = b * 0
    else:
        start = b * 0
        length = b * 0 + seqlen
        b_mem = b
    return start, length, b_mem


@triton.jit
def _fwd_span(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi,
              offs_m, offs_n, offs_d, d_ok, len_k, off, window, qk_scale,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr,
              PREC: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n64 = tl.cast(start_n, tl.int64)
        kt = _load(k_base + n64 * stride_kt + offs_n[None, :] * stride_kt + offs_d[:, None],
                   cols[None, :] < len_k, d_ok[:, None], MASKED, PAD_D)
        s = _dot(q, kt, None, UPCAST, PREC) * qk_scale
        if MASKED:
            ok = _visible(offs_m, cols, len_k, off, window, IS_CAUSAL, HAS_WINDOW, True)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing visible so far keeps m = -inf; shift by 0 to avoid -inf - -inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(v_base + n64 * stride_vt + offs_n[:, None] * stride_vt + offs_d[None, :],
                  cols[:, None] < len_k, d_ok[None, :], MASKED, PAD_D)
        acc = _dot(_lowp(p, v.dtype, UPCAST), v, acc * alpha[:, None], UPCAST, PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _store_fwd(acc, l_i, m_i, o_ptrs, l_ptrs, row_ok, d_ok, out_dtype: tl.constexpr,
               ACCUMULATE: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr):
    """Normalise a finished query block and store it: ``out`` and natural-log ``lse`` (rows that
    saw no key: 0 and -inf). ACCUMULATE: ``o_ptrs`` / ``l_ptrs`` hold a running fp32 (out, lse)
    and the block is merged into it (``lse = logaddexp``, ``out`` the matching weighted mean)."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    if ACCUMULATE:
        old_l = tl.load(l_ptrs, mask=row_ok, other=float("-inf"))
        old_o = _load(o_ptrs, row_ok[:, None], d_ok[None, :], True, PAD_D).to(tl.float32)
        mx = tl.maximum(old_l, lse)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w_old = tl.math.exp2((old_l - mx) * LOG2E)
        w_new = tl.math.exp2((lse - mx) * LOG2E)
        tot = w_old + w_new
        tot_safe = tl.where(tot > 0.0, tot, 1.0)
        out = (old_o * w_old[:, None] + out * w_new[:, None]) / tot_safe[:, None]
        lse = tl.where(tot > 0.0, mx + tl.math.log2(tot_safe) * LN2, float("-inf"))
    if PAD_D:
        tl.store(o_ptrs, _to_out(out, out_dtype, UPCAST), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(o_ptrs, _to_out(out, out_dtype, UPCAST), mask=row_ok[:, None])
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def attn_fwd_kernel(
    Q, K, V, Out, Lse, CuQ, CuK,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, sm_scale, causal_offset, window, seq_bucket,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, ACCUMULATE: tl.constexpr, PAD_D: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one head of one document.

    ACCUMULATE: ``Out``/``Lse`` hold a running fp32 (out, lse); the block's
    result is merged into them in place instead of overwriting them.
    """
    # Heaviest causal query blocks (the last ones) are launched first.
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
    q_base = Q + bm * stride_qb + q0.to(tl.int64) * stride_qt + h * stride_qh
    k_base = K + bm * stride_kb + k0.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = V + bm * stride_vb + k0.to(tl.int64) * stride_vt + hk * stride_vh
    o_base = Out + bm * stride_ob + q0.to(tl.int64) * stride_ot + h * stride_oh
    l_base = Lse + bm * stride_lb + h * stride_lh + q0.to(tl.int64)

    ar_m = tl.arange(0, BLOCK_M)
    offs_m = m0 + ar_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < len_q
    m64 = tl.cast(m0, tl.int64)
    q = _load(q_base + m64 * stride_qt + ar_m[:, None] * stride_qt + offs_d[None, :],
              row_ok[:, None], d_ok[None, :], True, PAD_D)
    qk_scale = sm_scale * LOG2E
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)

    a, u0, u1, e = _span(m0, BLOCK_M, len_k, BLOCK_N, off - window, off, HAS_WINDOW, IS_CAUSAL)
    acc, l_i, m_i = _fwd_span(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, a, u0,
                              offs_m, offs_n, offs_d, d_ok, len_k, off, window, qk_scale,
                              BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)
    acc, l_i, m_i = _fwd_span(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, u0, u1,
                              offs_m, offs_n, offs_d, d_ok, len_k, off, window, qk_scale,
                              BLOCK_N, False, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)
    acc, l_i, m_i = _fwd_span(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, u1, e,
                              offs_m, offs_n, offs_d, d_ok, len_k, off, window, qk_scale,
                              BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, PAD_D, UPCAST, PREC)

    o_ptrs = o_base + m64 * stride_ot + ar_m[:, None] * stride_ot + offs_d[None, :]
    _store_fwd(acc, l_i, m_i, o_ptrs, l_base + offs_m, row_ok, d_ok, Out.dtype.element_ty,
               ACCUMULATE, PAD_D, UPCAST)


@triton.jit
def attn_delta_kernel(
    Out, DOut, Dlse, Delta,
    stride_ob, stride_ot, stride_oh,
    stride_db, stride_dt, stride_dh,
    stride_lb, stride_lh, seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """delta = rowsum(dout * out) in fp32 (minus dlse when lse itself has a gradient)."""
    t0 = tl.cast(tl.program_id(0) * BLOCK_M, tl.int64)
    ar = tl.arange(0, BLOCK_M)
    t = t0 + ar
    h = tl.program_id(1)
    b = tl.cast(tl.program_id(2), tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (t[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    o_base = Out + b * stride_ob + h * stride_oh + t0 * stride_ot
    d_base = DOut + b * stride_db + h * stride_dh + t0 * stride_dt
    o = tl.load(o_base + ar[:, None] * stride_ot + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(d_base + ar[:, None] * stride_dt + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = b * stride_lb + h * stride_lh + t
    if HAS_DLSE:
        # d lse / d s = p, so a gradient on lse enters ds = p * (dp - delta) as -dlse.
        delta -= tl.load(Dlse + row, mask=t < seqlen, other=0.0)
    tl.store(Delta + row, delta, mask=t < seqlen)
