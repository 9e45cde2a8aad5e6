"""The Triton intra-chunk kernels of linear attention against the torch kernel and the float64
recurrence. Without CUDA they run in Triton's CPU interpreter (slow: tiny sizes only)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

lt = pytest.importorskip("seqpar.kernels.linear_triton")
if not lt.HAVE_TRITON:
    pytest.skip("triton is not importable", allow_module_level=True)
if not torch.cuda.is_available() and not lt.INTERPRET:
    pytest.skip("no CUDA and the kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

from seqpar.kernels import linear_chunk as lc  # noqa: E402
from seqpar.linear import linear_attention, reference_linear_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# float32 against float32 with a different summation order: ~1e-7 relative; 1e-5 leaves room
# without hiding a wrong mask or decay factor (those give errors of order 1e-1).
TOL = 1e-5


@pytest.mark.parametrize("mode", ["key", "scalar", "none"])
def test_intra_kernels_match_torch(mode):
    gen = torch.Generator().manual_seed(1)
    n, h, c, k, v = 1, 1, 64, 20, 12  # K, V not powers of two: masked lanes

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(DEV)

    q, kk, vv, do = rnd(n, h, c, k), rnd(n, h, c, k), rnd(n, h, c, v), rnd(n, h, c, v)
    b = None
    if mode != "none":
        b = F.logsigmoid(rnd(n, h, c, k if mode == "key" else 1) * 2).cumsum(2)
    p = lc.GLAPrep(q, kk, vv, b, 0.3, lc.make_layout((n * c,), c))
    assert _rel(lt.intra_fwd(q, kk, vv, b, 0.3), lc.gla_intra(p)) < TOL
    got = lt.intra_bwd(q, kk, vv, b, do, 0.3)
    ref = lc.gla_bwd_intra(p, do, torch.zeros(n, h, k, v, device=DEV))
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        assert _rel(a, r) < TOL, name


def test_linear_attention_triton_backend_end_to_end():
    gen = torch.Generator().manual_seed(2)
    B, T, H, K, V = 1, 70, 1, 16, 16  # two chunks, the second one padded

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    x = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V), F.logsigmoid(rnd(B, T, H, K) + 2), rnd(B, H, K, V)]
    ref_in = [t.clone().requires_grad_() for t in x]
    o, ht = reference_linear_attention(*ref_in[:4], initial_state=ref_in[4])
    w, u = rnd(*o.shape), rnd(*ht.shape)
    ref = torch.autograd.grad((o * w).sum() + (ht * u).sum(), ref_in)
    ins = [t.float().to(DEV).requires_grad_() for t in x]
    o2, ht2 = linear_attention(*ins[:4], initial_state=ins[4], output_final_state=True, backend="triton")
    got = torch.autograd.grad((o2.double() * w.to(DEV)).sum() + (ht2.double() * u.to(DEV)).sum(), ins)
    assert _rel(o2, o) < TOL and _rel(ht2, ht) < TOL
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dh0"), got, ref):
        assert _rel(a, r) < TOL, name
