"""Shared helpers for distributed tests: global inputs, references, error metrics."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar.softmax.reference import reference_attention


# fp32: every path accumulates in fp32; products of O(1) values summed over <= a few hundred keys
# round at ~1e-7 relative, so 2e-5 of the largest magnitude leaves room without hiding a wrong mask,
# block or head routing (those give errors of order 1e-1).
FP32_TOL = 2e-5
# bf16: a method may be at most 2x as far from float64 as a single-device bf16 SDPA on the same
# inputs (STYLE.md §12); the small floor absorbs cases where the baseline is unusually lucky.
BF16_FACTOR, BF16_FLOOR = 2.0, 2e-3


def check_errors(res, dtype):
    """Assert each rank's errors of (out, dq, dk, dv): ``res[rank]["errs"]`` against float64 and,
    for low precision, ``res[rank]["base"]`` (the single-device same-dtype baseline's errors)."""
    for rank, r in enumerate(res):
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            e = r["errs"][i]
            if dtype == torch.float32:
                assert e <= FP32_TOL, f"rank {rank} {name}: error {e:.2e} > {FP32_TOL:.0e}"
            else:
                bound = BF16_FACTOR * r["base"][i] + BF16_FLOOR
                assert e <= bound, f"rank {rank} {name}: error {e:.2e} > 2 x single-device bf16 {r['base'][i]:.2e}"


def rel_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """max |actual - ref| / max |ref|: a scale-free error that is 0 only for an exact match."""
    actual = actual.double()
    ref = ref.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return float((actual - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def global_inputs(B, T, Hq, Hkv, D, seed, dtype):
    """The same random global q, k, v, dout on every rank, rounded to ``dtype`` (returned as float64
    copies of the rounded values too, so the reference sees exactly what the method sees)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, T, Hq, D), (B, T, Hkv, D), (B, T, Hkv, D), (B, T, Hq, D)]
    low = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    return low, [t.double() for t in low]


def reference_grads(q, k, v, dout, causal, cu_seqlens=None):
    """Output and (dq, dk, dv) of the single-device reference, computed in q's dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def sdpa_grads(q, k, v, dout, causal):
    """Single-device torch SDPA in the inputs' dtype: the baseline error a low-precision method is
    allowed to be compared with (same dtype, one device)."""
    qt, kt, vt = (t.detach().clone().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    out.backward(dout.transpose(1, 2))
    return out.detach().transpose(1, 2), qt.grad.transpose(1, 2), kt.grad.transpose(1, 2), vt.grad.transpose(1, 2)


def run_method(method, causal, low, *, stats=None, group=None, **kw):
    """Shard the global low-precision inputs, run seqpar attention fwd+bwd, gather everything back."""
    q, k, v, dout = low
    ql, kl, vl, dl = (seqpar.shard(t, method=method, group=group) for t in (q, k, v, dout))
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    out = seqpar.attention(ql, kl, vl, method=method, causal=causal, stats=stats, group=group, **kw)
    out.backward(dl)
    assert out.dtype == q.dtype and ql.grad.dtype == q.dtype and kl.grad.dtype == k.dtype
    gathered = [seqpar.unshard(t, method=method, group=group) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    return gathered


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def case_geometry(lens, method: str, b: int = 2, t: int = 24):
    """``(b, t, cu_seqlens list or None, extra call kwargs)`` of a test case: dense ``[b, t]`` when
    ``lens`` is None, else packed documents of these lengths in one row (``cu_seqlens`` as a tensor;
    a first entry ``"stream"``: the stream layout's ``seqpar.packed_layout(..., split="stream")``)."""
    if lens is None:
        return b, t, None, {}
    stream = lens[0] == "stream"
    cu = [0, *itertools.accumulate(lens[stream:])]
    extra = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    if stream:
        extra["cu_seqlens"] = seqpar.packed_layout(cu, method=method, split="stream")
    return 1, cu[-1], cu, extra
