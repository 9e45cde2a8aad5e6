"""Sliding-window bands in the kernel layer: the band geometry (``seqpar.kernels.masks``), block and
varlen kernels under a band on every CPU backend against a dense float64 masked reference, and the
CUDA paths on fake CUDA tensors (torch_cuda through plain pieces under the SDPA layout contracts,
flash-attn's ``window_size`` through its real Python interface and the C++ checks' stand-in).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from gpu_static.fake_cuda import cuda_tensor, fake_cuda
from gpu_static.flash_stub import CI_VERSIONS, flash_attn_on_fake_gpu, interface_source

from seqpar.kernels import Band, block_backward, block_forward, plan_block, select_backend, window_band
from seqpar.kernels.masks import NAMED, band_pieces, visible_pairs
from seqpar.kernels.varlen import Segment, VarlenSegments, varlen_backward, varlen_forward

# fp32 kernels against float64: sums of <= 40 products of O(1) values, ~1e-6 relative; 1e-5 leaves
# room for the merge of pieces without hiding a wrong mask (errors of order 1e-1).
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def _visible(tq, tk, band):
    return {(i, j) for i in range(tq) for j in range(tk) if band.sees(i, j)}


def _bands(rng, count, span=24):
    out = []
    while len(out) < count:
        tq, tk = rng.randint(1, span), rng.randint(1, span)
        lo, hi = rng.choice([None, *range(-span, span)]), rng.choice([None, *range(-span, span)])
        if lo is None or hi is None or lo <= hi:
            out.append((tq, tk, Band(lo, hi)))
    return out


def test_plan_block_and_pieces_cover_every_band_exactly():
    """For 3000 random bands: the reduced sub-block keeps exactly the visible pairs, every kept row
    sees a key and every kept key is seen; the pieces of a window cover each visible pair once."""
    for tq, tk, band in _bands(random.Random(0), 3000):
        seen = _visible(tq, tk, band)
        assert visible_pairs(tq, tk, band) == len(seen)
        p = plan_block(tq, tk, band)
        if p.empty:
            assert not seen
            continue
        sub = p.window or NAMED["causal" if p.causal else "none"]
        kept = {(i + p.q_start, j + p.k_start) for i, j in _visible(p.rows, p.keys, sub)}
        assert kept == seen, (tq, tk, band, p)
        assert {i for i, _ in kept} == set(range(p.q_start, p.q_stop))
        assert {j for _, j in kept} == set(range(p.k_start, p.k_stop))
        if p.window is None:
            continue
        count: dict = {}
        for pc in band_pieces(p.rows, p.keys, p.window):
            r, c = pc.q1 - pc.q0, pc.k1 - pc.k0
            for i, j in _visible(r, c, NAMED[pc.mask]):
                at = (pc.q1 - 1 - i, pc.k1 - 1 - j) if pc.flip else (pc.q0 + i, pc.k0 + j)
                count[at] = count.get(at, 0) + 1
        assert set(count) == _visible(p.rows, p.keys, sub) and set(count.values()) == {1}, (tq, tk, band)


def test_named_masks_are_bands():
    for name, band in NAMED.items():
        for tq, tk in itertools.product((1, 3, 7), (1, 4, 7)):
            assert plan_block(tq, tk, name) == plan_block(tq, tk, band)
            assert visible_pairs(tq, tk, name) == len(_visible(tq, tk, band))
    with pytest.raises(ValueError, match="lo must be <= hi"):
        Band(3, 2)
    with pytest.raises(ValueError, match="mask="):
        plan_block(3, 3, "sliding")


@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "sym"])
def test_window_band_of_strided_pieces(stride, causal):
    """Pieces at global positions g + stride * i: the band holds exactly the pairs in the window."""
    for window, offset in itertools.product(range(1, 12), range(-30, 30)):
        band = window_band(offset, window, causal, stride)
        for i, j in itertools.product(range(7), range(7)):
            d = offset - stride * (j - i)
            want = 0 <= d < window if causal else abs(d) < window
            assert want == (band is not None and band.sees(i, j)), (window, offset, i, j, band)


def _reference(q, k, v, band, scale):
    """Dense float64 masked attention: out and lse of q [B, Tq, Hq, D] against k, v [B, Tk, Hkv, D]."""
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(g, 2)) * scale
    diag = torch.arange(k.shape[1])[None, :] - torch.arange(q.shape[1])[:, None]
    seen = (diag >= (band.lo if band.lo is not None else -10**9)) & (diag <= (band.hi if band.hi is not None else 10**9))
    s = s.masked_fill(~seen, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(g, 2)), torch.logsumexp(s, -1)


@pytest.mark.parametrize("backend", ["torch_cpu", "reference"])
def test_block_kernels_under_bands(backend):
    """60 random bands (both edges, one edge, empty rows and keys), GQA, fp32, forward and backward,
    against float64; the CPU op runs them as plain pieces, the reference natively."""
    rng = random.Random(1)
    assert select_backend(*(torch.zeros(1, 4, 2, 8),) * 3, mask=Band(-1, 0)).name == "torch_cpu"
    for tq, tk, band in _bands(rng, 60, span=40):
        gen = torch.Generator().manual_seed(tq * 100 + tk)
        q, dout = (torch.randn(2, tq, 4, 16, dtype=torch.float64, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, tk, 2, 16, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2))
        q.requires_grad_()
        ref, ref_lse = _reference(q, k, v, band, 0.25)
        ref.backward(dout)
        out, lse = block_forward(q.float(), k.float(), v.float(), scale=0.25, mask=band, backend=backend)
        assert (out.double() - ref).abs().max() <= TOL, (tq, tk, band)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse.double()[finite], ref_lse[finite], rtol=0, atol=TOL)
        grads = block_backward(dout.float(), q.float(), k.float(), v.float(), ref.detach().float(), ref_lse.float(),
                               scale=0.25, mask=band, backend=backend)
        for g, want in zip(grads, (q.grad, k.grad, v.grad)):
            assert (g.double() - want).abs().max() <= 10 * TOL, (tq, tk, band)


def test_varlen_under_bands():
    """Documents of 1, 5, 17 and 40 rows under a causal window of 6 and a symmetric one of 3, plus
    a band against another document's keys, stacked into batched block calls, against a float64
    softmax over the union of every row's segments."""
    segs = [Segment(0, 1, 0, 1, Band(-5, 0)), Segment(1, 5, 1, 5, Band(-5, 0)), Segment(6, 17, 6, 17, Band(-5, 0)),
            Segment(23, 40, 23, 40, Band(-2, 2)), Segment(23, 17, 6, 17, Band(14, 17))]
    desc = VarlenSegments.build(segs, tq=63, tk=63)
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 63, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 63, 2, 16, generator=gen) for _ in range(2))
    out, lse = varlen_forward(q, k, v, desc, scale=0.25)
    grads = varlen_backward(dout, q, k, v, out, lse, desc, scale=0.25)
    hidden = torch.ones(63, 63, dtype=torch.bool)
    for s in segs:
        for i, j in _visible(s.q_len, s.k_len, s.mask):
            hidden[s.q_start + i, s.k_start + j] = False
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    scores = torch.einsum("bihd,bjhd->bhij", qd, kd.repeat_interleave(2, 2)) * 0.25
    want = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores.masked_fill(hidden, float("-inf")), -1).nan_to_num(0.0),
                        vd.repeat_interleave(2, 2))
    assert (out.double() - want.detach()).abs().max() <= TOL
    want.backward(dout.double())
    for got, ref in zip(grads, (qd.grad, kd.grad, vd.grad)):
        assert (got.double() - ref).abs().max() <= 10 * TOL


WINDOW_SHAPES = {"sq": (100, 100, Band(-31, 0)), "both": (100, 100, Band(-20, 9)), "edge": (70, 100, Band(-10, None)),
                 "tall": (100, 40, Band(-59, 30))}


@pytest.mark.parametrize("shape", WINDOW_SHAPES)
@pytest.mark.parametrize("cap", [(8, 0), (9, 0), (7, 5)], ids=["sm80", "sm90", "sm75"])
def test_torch_cuda_windows_keep_the_contracts(shape, cap):
    """torch_cuda runs a band on torch's flash kernels with its bottom-right bounds (sm_80+, half
    precision) or as plain pieces (some on reversed rows and keys: the memory-efficient kernel, and
    bands whose right bound the flash kernel would clamp), every call under the kernels' layout
    contracts, shapes and dtypes as documented."""
    tq, tk, band = WINDOW_SHAPES[shape]
    with fake_cuda(cap) as contracts:
        q = cuda_tensor(2, tq, 4, 64, dtype=torch.float16)
        k, v = cuda_tensor(2, tk, 2, 64, dtype=torch.float16), cuda_tensor(2, tk, 2, 64, dtype=torch.float16)
        out, lse = block_forward(q, k, v, scale=0.125, mask=band, backend="torch_cuda")
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, torch.float16, (2, 4, tq), torch.float32)
        grads = block_backward(q, q, k, v, out, lse, scale=0.125, mask=band, backend="torch_cuda")
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert contracts.violations == []
    assert len(contracts.calls) >= 2


@pytest.fixture(scope="module")
def flash_release():
    source = interface_source(CI_VERSIONS[-1])
    if isinstance(source, str):
        pytest.skip(source)
    return CI_VERSIONS[-1], source


@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_flash_attn_window_size(flash_release, shape):
    """flash-attn serves a window natively: one launch each way with its (left, right) window; except
    a band whose right bound it would clamp to unbounded (``>= Tk``: "tall", reduced 99 x 40 with
    right = 89 hides keys 31.. from row 0), which runs as plain pieces."""
    tq, tk, band = WINDOW_SHAPES[shape]
    version, source = flash_release
    with flash_attn_on_fake_gpu(source, version, (9, 0)) as (ext, contracts):
        q = cuda_tensor(2, tq, 4, 64, dtype=torch.bfloat16)
        k, v = cuda_tensor(2, tk, 2, 64, dtype=torch.bfloat16), cuda_tensor(2, tk, 2, 64, dtype=torch.bfloat16)
        assert select_backend(q, k, v, mask=band).name == "flash_attn"
        out, lse = block_forward(q, k, v, scale=0.125, mask=band)
        block_backward(q, q, k, v, out, lse, scale=0.125, mask=band)
        segs = VarlenSegments.build([(0, 20, 0, 20, Band(-7, 0)), (20, 20, 20, 20, Band(-7, 0))], tq=tq, tk=tk)
        varlen_backward(q[:1], q[:1], k[:1], v[:1], *varlen_forward(q[:1], k[:1], v[:1], segs, scale=0.1), segs,
                        scale=0.1)
    if shape == "tall":
        assert ext.calls.count("fwd") >= 2 and ext.calls[-2:] == ["varlen_fwd", "varlen_bwd"], ext.calls
    else:  # (the pieces flash-attn refuses, non-square causal ones, go to torch_cuda)
        assert ext.calls == ["fwd", "bwd", "varlen_fwd", "varlen_bwd"] and contracts.calls == []
    assert contracts.violations == []
    assert segs.packed_calls()[0].window == (7, 0)
