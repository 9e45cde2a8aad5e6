"""Reference block attention: plain torch matmuls, any device, any float dtype.

Computes in float32 (float64 for float64 inputs) and materialises the
``[B, Hq, Tq, Tk]`` score matrix, so it is meant for checking and for cases no
fused kernel serves, not for speed.

GQA without expanding K/V: the ``g = Hq / Hkv`` query heads that share a
key/value head are folded into the query length, ``q -> [B, Hkv, g*Tq, D]``,
so one batched matmul per kv head serves the whole group and dK/dV come out
with Hkv heads directly (the group sum is part of the matmul).
"""

from __future__ import annotations

import torch

from .base import FLOAT_DTYPES, Backend, Capabilities, lse_dtype


def _fold_q(x: torch.Tensor, hkv: int, acc: torch.dtype) -> torch.Tensor:
    """``[B, T, Hq, D]`` -> ``[B, Hkv, g*T, D]`` in ``acc`` (row ``gi*T + t``)."""
    b, t, hq, d = x.shape
    g = hq // hkv
    return x.to(acc).view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)


def _unfold_q(x: torch.Tensor, t: int) -> torch.Tensor:
    """``[B, Hkv, g*T, D]`` -> ``[B, T, Hq, D]``."""
    b, hkv, gt, d = x.shape
    g = gt // t
    return x.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


def _fold_rows(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """Row statistics ``[B, Hq, T]`` -> ``[B, Hkv, g*T]`` (a view: Hq = Hkv*g)."""
    b, hq, t = x.shape
    return x.reshape(b, hkv, (hq // hkv) * t)


def _kv(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``[B, Tk, Hkv, D]`` -> ``[B, Hkv, Tk, D]`` in ``acc``."""
    return x.to(acc).transpose(1, 2)


def _scores(qf, kf, scale: float, causal: bool, tq: int, window=None) -> torch.Tensor:
    """Scaled scores ``[B, Hkv, g*Tq, Tk]`` with top-left causal or ``window`` band masking (-inf)."""
    s = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)
    lo, hi = (window.lo, window.hi) if window is not None else (None, 0 if causal else None)
    if lo is not None or hi is not None:
        tk = kf.shape[-2]
        diag = torch.arange(tk, device=s.device).unsqueeze(0) - torch.arange(tq, device=s.device).unsqueeze(1)
        hidden = torch.zeros_like(diag, dtype=torch.bool)
        if hi is not None:
            hidden |= diag > hi
        if lo is not None:
            hidden |= diag < lo
        s.masked_fill_(hidden.repeat(s.shape[-2] // tq, 1), float("-inf"))  # same mask for each of the g heads
    return s


class ReferenceBackend(Backend):
    """Plain-torch block attention; fits every case (lowest priority except float64)."""

    name = "reference"
    caps = Capabilities(
        devices=frozenset(),
        dtypes=FLOAT_DTYPES,
        priority=0,
        preferred_dtypes=frozenset({torch.float64}),
        window=True,
        value_dim=True,  # plain matmuls: D_v is P @ V's width
    )

    def forward(self, q, k, v, *, scale, causal, window=None):
        acc = lse_dtype(q.dtype)
        hkv, tq = k.shape[2], q.shape[1]
        s = _scores(_fold_q(q, hkv, acc), _kv(k, acc), scale, causal, tq, window)
        lse = torch.logsumexp(s, dim=-1)
        # The plan guarantees every row sees a key; still never form -inf - -inf.
        p = torch.exp(s - torch.where(torch.isneginf(lse), float("inf"), lse).unsqueeze(-1))
        out = torch.matmul(p, _kv(v, acc))
        b, hq = q.shape[0], q.shape[2]
        return _unfold_q(out, tq).to(q.dtype), lse.view(b, hq, tq)

    def backward(self, dout, q, k, v, out, lse, *, scale, causal, delta, window=None):
        acc = lse_dtype(q.dtype)
        hkv, tq = k.shape[2], q.shape[1]
        qf = _fold_q(q, hkv, acc)
        kf, vf = _kv(k, acc), _kv(v, acc)
        dof = _fold_q(dout, hkv, acc)
        if delta is None:
            delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, Hq, Tq]
        s = _scores(qf, kf, scale, causal, tq, window)
        # P with the FINAL lse of the row: block gradients then add up exactly.
        p = torch.exp(s - _fold_rows(lse.to(acc), hkv).unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), dof)
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        ds = p.mul_(dp.sub_(_fold_rows(delta.to(acc), hkv).unsqueeze(-1)))
        dq = torch.matmul(ds, kf).mul_(scale)
        dk = torch.matmul(ds.transpose(-1, -2), qf).mul_(scale)
        return (
            _unfold_q(dq, tq).to(q.dtype),
            dk.transpose(1, 2).to(k.dtype).contiguous(),
            dv.transpose(1, 2).to(v.dtype).contiguous(),
        )
