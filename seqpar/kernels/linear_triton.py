"""Triton kernels for the intra-chunk part of gated linear attention (the heavy phases of
:mod:`seqpar.kernels.linear_chunk`); the state scans and the state terms stay batched torch matmuls.

Inputs are the chunked float32 tensors of :class:`~seqpar.kernels.linear_chunk.GLAPrep`:
``q, k`` ``[n, H, C, K]``, ``v, do`` ``[n, H, C, V]``, ``b`` (in-chunk cumulative log-decay)
``[n, H, C, K]``, ``[n, H, C, 1]`` or None. One program handles one sub-chunk of ``BC = 16`` rows of
one (chunk, head). Off-diagonal sub-blocks factor through the first position ``r`` of the query
sub-chunk (``e^{b_t - r} e^{r - b_s}``, both exponents <= 0); diagonal sub-blocks are evaluated exactly
one column (or row) at a time, as in flash-linear-attention's GLA kernels. Every ``tl.dot`` is float32
with ``input_precision="ieee"`` (no TF32), so results match the torch kernel to float32 rounding.

Runs on CUDA, or on CPU with ``TRITON_INTERPRET=1`` (slow; tests use tiny sizes). ``HAVE_TRITON`` is
False when triton cannot be imported.
"""

from __future__ import annotations

import os

import torch

from .triton_target import device_guard

# Whether the kernels below were decorated for Triton's CPU interpreter (decided at import time).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - triton missing or broken
    HAVE_TRITON = False

BC = 16

if HAVE_TRITON:

    @triton.jit
    def _decay_rows(b, z, rows, kk, mk, C: tl.constexpr, K: tl.constexpr, MODE: tl.constexpr):
        """Cumulative log-decay of ``rows``: ``[BC, BK]`` (per key) or ``[BC, 1]`` (scalar)."""
        if MODE == 2:
            x = tl.load(b + z * C * K + rows[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
        else:
            x = tl.load(b + z * C + rows)[:, None]
        return x

    @triton.jit
    def _decay_row(b, z, row, kk, mk, C: tl.constexpr, K: tl.constexpr, MODE: tl.constexpr):
        """Cumulative log-decay of one position: ``[1, BK]`` or ``[1, 1]``."""
        if MODE == 2:
            x = tl.load(b + z * C * K + row * K + kk[None, :], mask=mk[None, :], other=0.0)
        else:
            x = tl.load(b + z * C + row + tl.zeros([1, 1], dtype=tl.int32))
        return x

    @triton.jit
    def _gla_intra_fwd_kernel(q, k, v, b, o, scale, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                              BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, MODE: tl.constexpr):
        i = tl.program_id(0)
        z = tl.program_id(1)
        rows = i * BC + tl.arange(0, BC)
        kk = tl.arange(0, BK)
        vv = tl.arange(0, BV)
        mk = kk < K
        mv = vv < V
        q_i = tl.load(q + z * C * K + rows[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
        acc = tl.zeros([BC, BV], dtype=tl.float32)
        if MODE > 0:
            b_i = _decay_rows(b, z, rows, kk, mk, C, K, MODE)
            ref = _decay_row(b, z, i * BC, kk, mk, C, K, MODE)
            qr = q_i * tl.exp(b_i - ref)
        else:
            qr = q_i
        for j in range(0, i):
            cols = j * BC + tl.arange(0, BC)
            k_j = tl.load(k + z * C * K + cols[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            v_j = tl.load(v + z * C * V + cols[:, None] * V + vv[None, :], mask=mv[None, :], other=0.0)
            if MODE > 0:
                k_j = k_j * tl.exp(ref - _decay_rows(b, z, cols, kk, mk, C, K, MODE))
            a = tl.dot(qr, tl.trans(k_j), input_precision="ieee")
            acc += tl.dot(a, v_j, input_precision="ieee")
        for s in range(0, BC):
            col = i * BC + s
            k_s = tl.load(k + z * C * K + col * K + kk, mask=mk, other=0.0)[None, :]
            v_s = tl.load(v + z * C * V + col * V + vv, mask=mv, other=0.0)[None, :]
            prod = q_i * k_s
            if MODE > 0:
                prod = prod * tl.exp(tl.minimum(b_i - _decay_row(b, z, col, kk, mk, C, K, MODE), 0.0))
            a_col = tl.where(rows >= col, tl.sum(prod, axis=1), 0.0)
            acc += a_col[:, None] * v_s
        tl.store(o + z * C * V + rows[:, None] * V + vv[None, :], acc * scale, mask=mv[None, :])

    @triton.jit
    def _gla_intra_bwd_kernel(q, k, v, b, do, dq, dk, dv, scale, C: tl.constexpr, K: tl.constexpr,
                              V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              MODE: tl.constexpr):
        i = tl.program_id(0)
        z = tl.program_id(1)
        NS: tl.constexpr = C // BC
        rows = i * BC + tl.arange(0, BC)
        kk = tl.arange(0, BK)
        vv = tl.arange(0, BV)
        mk = kk < K
        mv = vv < V
        qk_off = z * C * K + rows[:, None] * K + kk[None, :]
        v_off = z * C * V + rows[:, None] * V + vv[None, :]
        k_i = tl.load(k + qk_off, mask=mk[None, :], other=0.0)
        v_i = tl.load(v + v_off, mask=mv[None, :], other=0.0)
        do_i = tl.load(do + v_off, mask=mv[None, :], other=0.0)
        b_i = tl.zeros([BC, 1], dtype=tl.float32)
        ref = tl.zeros([1, 1], dtype=tl.float32)
        if MODE > 0:
            b_i = _decay_rows(b, z, rows, kk, mk, C, K, MODE)
            ref = _decay_row(b, z, i * BC, kk, mk, C, K, MODE)
        # dq: rows of sub-chunk i against keys of earlier sub-chunks
        acc_q = tl.zeros([BC, BK], dtype=tl.float32)
        for j in range(0, i):
            cols = j * BC + tl.arange(0, BC)
            k_j = tl.load(k + z * C * K + cols[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            v_j = tl.load(v + z * C * V + cols[:, None] * V + vv[None, :], mask=mv[None, :], other=0.0)
            if MODE > 0:
                k_j = k_j * tl.exp(ref - _decay_rows(b, z, cols, kk, mk, C, K, MODE))
            da = tl.dot(do_i, tl.trans(v_j), input_precision="ieee") * scale
            acc_q += tl.dot(da, k_j, input_precision="ieee")
        if MODE > 0:
            acc_q = acc_q * tl.exp(b_i - ref)
        # dk, dv: keys of sub-chunk i against queries of later sub-chunks
        acc_k = tl.zeros([BC, BK], dtype=tl.float32)
        acc_v = tl.zeros([BC, BV], dtype=tl.float32)
        for p in range(i + 1, NS):
            prow = p * BC + tl.arange(0, BC)
            q_p = tl.load(q + z * C * K + prow[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            do_p = tl.load(do + z * C * V + prow[:, None] * V + vv[None, :], mask=mv[None, :], other=0.0)
            kr = k_i
            if MODE > 0:
                ref_p = _decay_row(b, z, p * BC, kk, mk, C, K, MODE)
                q_p = q_p * tl.exp(_decay_rows(b, z, prow, kk, mk, C, K, MODE) - ref_p)
                fk = tl.exp(ref_p - b_i)
                kr = k_i * fk
            a = tl.dot(q_p, tl.trans(kr), input_precision="ieee")                 # [t, s]
            da = tl.dot(do_p, tl.trans(v_i), input_precision="ieee") * scale       # [t, s]
            dk_p = tl.dot(tl.trans(da), q_p, input_precision="ieee")
            if MODE > 0:
                dk_p = dk_p * fk
            acc_k += dk_p
            acc_v += tl.dot(tl.trans(a), do_p, input_precision="ieee") * scale
        # diagonal sub-block, exactly: columns for dq, rows for dk and dv
        for s in range(0, BC):
            col = i * BC + s
            k_s = tl.load(k + z * C * K + col * K + kk, mask=mk, other=0.0)[None, :]
            v_s = tl.load(v + z * C * V + col * V + vv, mask=mv, other=0.0)[None, :]
            da_col = tl.where(rows >= col, tl.sum(do_i * v_s, axis=1) * scale, 0.0)
            e = k_s
            if MODE > 0:
                e = k_s * tl.exp(tl.minimum(b_i - _decay_row(b, z, col, kk, mk, C, K, MODE), 0.0))
            acc_q += da_col[:, None] * e
        for t in range(0, BC):
            row = i * BC + t
            q_t = tl.load(q + z * C * K + row * K + kk, mask=mk, other=0.0)[None, :]
            do_t = tl.load(do + z * C * V + row * V + vv, mask=mv, other=0.0)[None, :]
            e = q_t
            if MODE > 0:
                e = q_t * tl.exp(tl.minimum(_decay_row(b, z, row, kk, mk, C, K, MODE) - b_i, 0.0))
            keep = rows <= row
            da_row = tl.where(keep, tl.sum(v_i * do_t, axis=1) * scale, 0.0)
            a_row = tl.where(keep, tl.sum(k_i * e, axis=1), 0.0)
            acc_k += da_row[:, None] * e
            acc_v += a_row[:, None] * do_t * scale
        tl.store(dq + qk_off, acc_q, mask=mk[None, :])
        tl.store(dk + qk_off, acc_k, mask=mk[None, :])
        tl.store(dv + v_off, acc_v, mask=mv[None, :])


def _launch_args(q, v, b):
    n, hh, c, kd = q.shape
    assert c % BC == 0 and q.dtype == torch.float32, "chunks of a multiple of 16 rows, float32"
    mode = 0 if b is None else (1 if b.shape[-1] == 1 else 2)
    meta = dict(C=c, K=kd, V=v.shape[-1], BC=BC, BK=max(16, triton.next_power_of_2(kd)),
                BV=max(16, triton.next_power_of_2(v.shape[-1])), MODE=mode)
    return (c // BC, n * hh), (q if b is None else b.contiguous()), meta


def intra_fwd(q, k, v, b, scale: float) -> torch.Tensor:
    """Intra-chunk output ``scale * A @ v`` ``[n, H, C, V]`` (see :func:`linear_chunk.gla_intra`)."""
    grid, bb, meta = _launch_args(q, v, b)
    o = torch.empty_like(v)
    with device_guard(q):
        _gla_intra_fwd_kernel[grid](q.contiguous(), k.contiguous(), v.contiguous(), bb, o, float(scale), **meta)
    return o


def intra_bwd(q, k, v, b, do, scale: float):
    """Intra-chunk parts of ``(dq, dk, dv)`` (the decay factors held fixed; ``dg`` follows from
    ``q*dq - k*dk`` in :func:`linear_chunk.gla_bwd_finish`)."""
    grid, bb, meta = _launch_args(q, v, b)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with device_guard(q):
        _gla_intra_bwd_kernel[grid](q.contiguous(), k.contiguous(), v.contiguous(), bb, do.contiguous(),
                                    dq, dk, dv, float(scale), **meta)
    return dq, dk, dv
