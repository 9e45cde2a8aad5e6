"""Triton block attention (seqpar.kernels.triton_attention) against a float64 reference.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1,
set below before triton is imported): tiny shapes only, every mask, GQA,
padded head dims, packed documents, in-kernel accumulation, backward from the
merged out/lse, autograd, torch.compile and bad input. With CUDA the same
tests run on the GPU (compiled), and the ``gpu``-marked ones add larger shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must precede the first import of the kernels (triton decides at @jit time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from seqpar.kernels import triton_attention as ta  # noqa: E402
from seqpar.kernels.triton_attention import (  # noqa: E402
    PackedSeqs,
    triton_attention_backward,
    triton_attention_forward,
)
from seqpar.kernels.triton_attention_kernels import _span  # noqa: E402

if not HAS_CUDA and not ta.INTERPRET:
    pytest.skip("no CUDA and the kernels were imported without TRITON_INTERPRET=1",
                allow_module_level=True)

DEV = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# Error allowed relative to the largest reference magnitude. Outputs are
# rounded to the input dtype (0.5 ulp) and, as in FlashAttention, P and dS are
# rounded to it before the tensor-core dots: allow ~8 ulp of the dtype
# (fp16 ulp 2^-10, bf16 2^-7 at 1.0). fp32 runs IEEE fp32 dots with fp32
# softmax: observed ~3e-7 relative, allow 2e-5 for summation order at larger T.
RTOL = {torch.float32: 2e-5, torch.float16: 8 * 2**-10, torch.bfloat16: 8 * 2**-7}


def _rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype)


def _close(name, got, ref, dtype):
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    bound = RTOL[dtype] * max(ref.abs().max().item() if ref.numel() else 0.0, 1.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} ({dtype})"


def _close_lse(got, ref, dtype):
    dead = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), dead), "lse: rows with no key must be exactly -inf"
    _close("lse", got[~dead], ref[~dead], dtype)


def visible(tq, tk, mask="none", causal_offset=0, align="top_left", window_left=None):
    """[tq, tk] bool: which keys each query sees (the spec in the module docstring)."""
    i = torch.arange(tq).unsqueeze(1)
    j = torch.arange(tk).unsqueeze(0)
    off = causal_offset + (tk - tq if align == "bottom_right" else 0) - (mask == "causal_strict")
    vis = torch.ones(tq, tk, dtype=torch.bool)
    if mask != "none":
        vis &= j <= i + off
    if window_left is not None:
        vis &= j >= i + off - window_left
    return vis.to(DEV)


def ref_attention(q, k, v, vis, scale=None):
    """float64 reference: q [B,Tq,Hq,D], k/v [B,Tk,Hkv,D] -> out, lse; dead rows 0 / -inf.
    Differentiable (no NaN for dead rows)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[2] // k.shape[2]
    kd = k.double().repeat_interleave(g, 2)  # the reference may expand GQA; the kernel never does
    vd = v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kd) * scale
    alive = vis.any(-1)
    s = s.masked_fill(~vis, float("-inf")).masked_fill(~alive.unsqueeze(-1), 0.0)
    p = torch.softmax(s, -1) * alive.unsqueeze(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    lse = torch.logsumexp(s, -1).masked_fill(~alive, float("-inf"))
    return out, lse


def ref_grads(q, k, v, vis, dout, scale=None):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, _ = ref_attention(*leaves, vis, scale)
    return torch.autograd.grad(out, leaves, dout.double())


MASK_CASES = {
    # id: (Tq, Tk, mask, causal_offset, align, window_left)
    "none": (29, 45, "none", 0, "top_left", None),
    "causal-tl-tq<tk": (29, 45, "causal", 0, "top_left", None),
    "causal-tl-tq>tk": (45, 29, "causal", 0, "top_left", None),
    "causal-br-tq<tk": (29, 45, "causal", 0, "bottom_right", None),
    "causal-br-tq>tk": (45, 29, "causal", 0, "bottom_right", None),
    "strict-tl": (33, 33, "causal_strict", 0, "top_left", None),
    "strict-br": (20, 37, "causal_strict", 0, "bottom_right", None),
    "causal-offset+21": (30, 40, "causal", 21, "top_left", None),
    "causal-offset+14": (40, 60, "causal", 14, "top_left", None),  # diagonal just off a block edge
    "causal-offset-13-br": (40, 30, "causal", -13, "bottom_right", None),
    "window5-causal-br": (33, 47, "causal", 0, "bottom_right", 5),
    "window20-strict": (40, 40, "causal_strict", 0, "top_left", 20),
    "window7-none": (24, 40, "none", 3, "top_left", 7),
    "tq1-causal-br": (1, 17, "causal", 0, "bottom_right", None),
    "tk1-none": (19, 1, "none", 0, "top_left", None),
}


@pytest.mark.parametrize("case", list(MASK_CASES), ids=list(MASK_CASES))
def test_forward_masks(case):
    tq, tk, mask, off, align, win = MASK_CASES[case]
    gen = torch.Generator().manual_seed(1)
    q, k, v = _rand(2, tq, 4, 64, gen=gen), _rand(2, tk, 2, 64, gen=gen), _rand(2, tk, 2, 64, gen=gen)
    geo = dict(mask=mask, causal_offset=off, align=align, window_left=win)
    out, lse = triton_attention_forward(q, k, v, **geo)
    vis = visible(tq, tk, **geo)
    ro, rl = ref_attention(q, k, v, vis)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 4, tq)
    assert lse.dtype == torch.float32
    _close("out", out, ro, torch.float32)
    _close_lse(lse, rl, torch.float32)
    if case in ("strict-tl", "window5-causal-br", "causal-offset-13-br"):
        dout = _rand(*q.shape, gen=gen)
        grads = triton_attention_backward(dout, q, k, v, out, lse, **geo)
        for name, got, ref in zip("qkv", grads, ref_grads(q, k, v, vis, dout)):
            _close("d" + name, got, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("hkv,d", [(2, 64), (1, 80), (4, 24)], ids=["gqa2-d64", "mqa-d80", "mha-d24"])
def test_dtypes_gqa_head_dims(dtype, hkv, d):
    if dtype == torch.float16 and d == 24:
        pytest.skip("one padded-D case per half dtype is enough here")
    gen = torch.Generator().manual_seed(2)
    tq, tk = 35, 35
    q = _rand(1, tq, 4, d, dtype=dtype, gen=gen)
    k, v = _rand(1, tk, hkv, d, dtype=dtype, gen=gen), _rand(1, tk, hkv, d, dtype=dtype, gen=gen)
    out, lse = triton_attention_forward(q, k, v, mask="causal", scale=0.3)
    vis = visible(tq, tk, "causal")
    ro, rl = ref_attention(q, k, v, vis, scale=0.3)
    _close("out", out, ro, dtype)
    _close_lse(lse, rl, dtype)
    dout = _rand(*q.shape, dtype=dtype, gen=gen)
    grads = triton_attention_backward(dout, q, k, v, out, lse, mask="causal", scale=0.3)
    for name, got, ref, x in zip("qkv", grads, ref_grads(q, k, v, vis, dout, 0.3), (q, k, v)):
        assert got.shape == x.shape and got.dtype == dtype
        _close("d" + name, got, ref, dtype)


def _packed_case():
    # includes a length-1 query document against 3 keys, an empty key side
    # (rows see nothing) and a document with more queries than keys.
    lens_q, lens_k = [7, 1, 4, 20, 3], [12, 3, 0, 17, 3]
    return lens_q, lens_k, PackedSeqs.from_lengths(lens_q, lens_k, device=DEV)


@pytest.mark.parametrize("mask,align", [("none", "top_left"), ("causal", "bottom_right"),
                                        ("causal", "top_left")], ids=["none", "causal-br", "causal-tl"])
def test_packed_documents(mask, align):
    lens_q, lens_k, packed = _packed_case()
    gen = torch.Generator().manual_seed(3)
    q = _rand(sum(lens_q), 4, 64, gen=gen)
    k, v = _rand(sum(lens_k), 2, 64, gen=gen), _rand(sum(lens_k), 2, 64, gen=gen)
    dout = _rand(*q.shape, gen=gen)
    geo = dict(mask=mask, align=align)
    out, lse = triton_attention_forward(q, k, v, packed=packed, **geo)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    dq, dk, dv = triton_attention_backward(dout, q, k, v, out, lse, packed=packed, **geo)
    if mask == "none":  # [1, total, H, D] is accepted too
        out4, lse4 = triton_attention_forward(q[None], k[None], v[None], packed=packed, **geo)
        assert torch.equal(out4[0], out) and torch.equal(lse4[0], lse)
    if align == "bottom_right":  # the same block merged twice: out unchanged, lse + log 2
        acc = (torch.zeros(q.shape, device=DEV), torch.full(lse.shape, float("-inf"), device=DEV))
        for _ in range(2):
            triton_attention_forward(q, k, v, packed=packed, acc=acc, **geo)
        _close("acc out", acc[0], out, torch.float32)
        _close_lse(acc[1], lse + torch.log(torch.tensor(2.0)).item(), torch.float32)
    for b in range(len(lens_q)):
        qs = slice(packed.cu_q[b], packed.cu_q[b + 1])
        ks = slice(packed.cu_k[b], packed.cu_k[b + 1])
        vis = visible(lens_q[b], lens_k[b], **geo)
        qb, kb, vb = q[qs].unsqueeze(0), k[ks].unsqueeze(0), v[ks].unsqueeze(0)
        ro, rl = ref_attention(qb, kb, vb, vis)
        _close(f"out[doc {b}]", out[qs], ro[0], torch.float32)
        _close_lse(lse[:, qs], rl[0], torch.float32)
        rg = ref_grads(qb, kb, vb, vis, dout[qs].unsqueeze(0))
        for name, got, ref in zip("qkv", (dq[qs], dk[ks], dv[ks]), rg):
            _close(f"d{name}[doc {b}]", got, ref[0], torch.float32)


def test_accumulate_and_backward_from_merged():
    """A ring step: two key blocks merged in-kernel into fp32 (out, lse) equal one
    causal call; block backwards fed the merged out/lse add up to the full gradient."""
    gen = torch.Generator().manual_seed(4)
    t, t1 = 40, 17
    q, k, v = _rand(1, t, 4, 64, gen=gen), _rand(1, t, 2, 64, gen=gen), _rand(1, t, 2, 64, gen=gen)
    dout = _rand(*q.shape, gen=gen)
    acc = (torch.zeros(q.shape, device=DEV), torch.full((1, 4, t), float("-inf"), device=DEV))
    # block 2 first: keys t1.. are visible to query i iff j - t1 <= i - t1 (offset -t1)
    blocks = [(slice(t1, t), -t1), (slice(0, t1), 0)]
    for ks, off in blocks:
        res = triton_attention_forward(q, k[:, ks], v[:, ks], mask="causal", causal_offset=off,
                                       acc=acc)
        assert res[0] is acc[0] and res[1] is acc[1]
    one_out, one_lse = triton_attention_forward(q, k, v, mask="causal")
    _close("acc out vs one call", acc[0], one_out, torch.float32)
    _close_lse(acc[1], one_lse, torch.float32)
    vis = visible(t, t, "causal")
    ro, rl = ref_attention(q, k, v, vis)
    _close("acc out", acc[0], ro, torch.float32)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * acc[0]).sum(-1).transpose(1, 2).contiguous()
    for n, (ks, off) in enumerate(blocks):
        g = triton_attention_backward(dout, q, k[:, ks], v[:, ks], acc[0] if n else None, acc[1],
                                      mask="causal", causal_offset=off,
                                      delta=None if n else delta)
        dq += g[0]
        dk[:, ks] += g[1]
        dv[:, ks] += g[2]
    for name, got, ref in zip("qkv", (dq, dk, dv), ref_grads(q, k, v, vis, dout)):
        _close("d" + name, got, ref, torch.float32)


def test_autograd_through_out_and_lse():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (_rand(1, 21, 2, 32, gen=gen).requires_grad_() for _ in range(3))
    wo, wl = _rand(1, 21, 2, 32, gen=gen), _rand(1, 2, 21, gen=gen)
    out, lse = triton_attention_forward(q, k, v, mask="causal_strict")
    ((out * wo).sum() + (lse.masked_fill(torch.isinf(lse), 0) * wl).sum()).backward()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rl = ref_attention(*leaves, visible(21, 21, "causal_strict"))
    ((ro * wo.double()).sum() + (rl.masked_fill(torch.isinf(rl), 0) * wl.double()).sum()).backward()
    for name, x, ref in zip("qkv", (q, k, v), leaves):
        _close("d" + name, x.grad, ref.grad, torch.float32)


def test_torch_compile_and_fake():
    gen = torch.Generator().manual_seed(6)
    q, k, v = _rand(1, 18, 2, 16, gen=gen), _rand(1, 20, 1, 16, gen=gen), _rand(1, 20, 1, 16, gen=gen)
    geo = (None, None, 0, 0, 0.25, True, 0, True, -1)  # dense, causal bottom-right
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.seqpar.triton_attn_fwd.default, (q, k, v, *geo),
                          test_utils=checks)
    acc = (torch.zeros(q.shape, device=DEV), torch.full((1, 2, 18), float("-inf"), device=DEV))
    torch.library.opcheck(torch.ops.seqpar.triton_attn_fwd_acc.default, (q, k, v, *acc, *geo),
                          test_utils=checks)
    out, lse = torch.ops.seqpar.triton_attn_fwd(q, k, v, *geo)
    torch.library.opcheck(torch.ops.seqpar.triton_attn_bwd.default,
                          (out, q, k, v, out, lse, None, None, *geo), test_utils=checks)

    def loss(q, k, v):
        out, lse = triton_attention_forward(q, k, v, mask="causal", align="bottom_right")
        return out.square().sum() + lse.sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    val = compiled(*leaves)
    val.backward()
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_val = loss(*eager)
    ref_val.backward()
    torch.testing.assert_close(val, ref_val)
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad)


def test_bad_input_raises_before_launch():
    q, k, v = _rand(1, 8, 2, 64), _rand(1, 8, 2, 64), _rand(1, 8, 2, 64)
    with pytest.raises(ValueError, match="head dim 320"):
        triton_attention_forward(_rand(1, 8, 2, 320), _rand(1, 8, 2, 320), _rand(1, 8, 2, 320))
    with pytest.raises(ValueError, match="dtype"):
        triton_attention_forward(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="multiple of Hkv"):
        triton_attention_forward(_rand(1, 8, 3, 64), k, v)
    with pytest.raises(ValueError, match="mask"):
        triton_attention_forward(q, k, v, mask="sliding")
    with pytest.raises(ValueError, match="window_left"):
        triton_attention_forward(q, k, v, window_left=-2)
    with pytest.raises(ValueError, match="non-decreasing"):
        PackedSeqs.build([0, 5, 3, 8], [0, 2, 4, 8])
    with pytest.raises(ValueError, match="start at 0"):
        PackedSeqs.build(torch.tensor([1, 5, 8]), [0, 2, 8])
    with pytest.raises(ValueError, match="documents"):
        PackedSeqs.build([0, 5, 8], [0, 8])
    with pytest.raises(ValueError, match="shorter than the longest"):
        PackedSeqs.build([0, 5, 8], [0, 2, 8], max_seqlen_q=3)
    packed = PackedSeqs.build([0, 5, 9], [0, 2, 8], device=DEV)
    with pytest.raises(ValueError, match="total length"):  # q holds 8 tokens, cu ends at 9
        triton_attention_forward(q[0], k[0], v[0], packed=packed)
    with pytest.raises(ValueError, match="acc_out"):
        triton_attention_forward(q, k, v, acc=(torch.zeros(q.shape, dtype=torch.float16,
                                                           device=DEV), torch.zeros(1, 2, 8)))
    with pytest.raises(ValueError, match="out or delta"):
        triton_attention_backward(q, q, k, v, None, torch.zeros(1, 2, 8, device=DEV))


def test_dispatch_backend():
    from seqpar.kernels import dispatch
    from seqpar.kernels.triton_backend import TritonBackend

    be = TritonBackend()
    gen = torch.Generator().manual_seed(7)
    q, k, v = _rand(1, 20, 4, 64, gen=gen), _rand(1, 20, 2, 64, gen=gen), _rand(1, 20, 2, 64, gen=gen)
    assert be.refusal(q, k, v, "causal", False, True) is None
    assert be.refusal(q.double(), k.double(), v.double(), "none", False, True) is not None
    if not HAS_CUDA:  # interpreter: allowed on CPU, but never chosen automatically there
        assert be.rank(q.dtype) < dispatch.select_backend(q, k, v, mask="none").rank(q.dtype)
    out, lse = be.forward(q, k, v, scale=0.125, causal=True)
    ro, rl = ref_attention(q, k, v, visible(20, 20, "causal"), 0.125)
    _close("out", out, ro, torch.float32)
    dout = _rand(*q.shape, gen=gen)
    delta = (dout * out).sum(-1).transpose(1, 2)
    lse_inf = lse.clone()
    grads = be.backward(dout, q, k, v, None, lse_inf, scale=0.125, causal=True, delta=delta)
    for name, got, ref in zip("qkv", grads, ref_grads(q, k, v, visible(20, 20, "causal"), dout,
                                                     0.125)):
        _close("d" + name, got, ref, torch.float32)
    if "triton" in dispatch.BACKEND_NAMES:  # once registered in the dispatch table
        o2, _ = dispatch.block_forward(q, k, v, scale=0.125, mask="causal_strict", backend="triton")
        _close("dispatch out", o2, ref_attention(q, k, v, visible(20, 20, "causal_strict"),
                                                 0.125)[0], torch.float32)


@triton.jit
def _span_probe(P, O, BS: tl.constexpr, BO: tl.constexpr, HAS_LO: tl.constexpr,
                HAS_HI: tl.constexpr):
    i = tl.program_id(0) * 4
    a, u0, u1, e = _span(tl.load(P + i), BS, tl.load(P + i + 1), BO, tl.load(P + i + 2),
                         tl.load(P + i + 3), HAS_LO, HAS_HI)
    tl.store(O + i, a)
    tl.store(O + i + 1, u0)
    tl.store(O + i + 2, u1)
    tl.store(O + i + 3, e)


@pytest.mark.parametrize("bs,bo", [(16, 32), (32, 16)], ids=["16x32", "32x16"])
@pytest.mark.parametrize("has_lo,has_hi", [(False, True), (True, False), (True, True)],
                         ids=["causal", "window-only", "causal+window"])
def test_block_span_exhaustive(bs, bo, has_lo, has_hi):
    """The block-skipping logic shared by all kernels (_span) against brute force:
    no visible pair is skipped, the unmasked middle is fully visible, and no
    block without a visible pair is visited."""
    params = [(s0, length, lo, lo + width)
              for s0 in (0, 3 * bs) for length in (0, 17, 70)
              for lo in range(-50, 60, 9) for width in (0, 16, 33)]
    p = torch.tensor(params, dtype=torch.int32, device=DEV)
    o = torch.full_like(p, -999)
    _span_probe[(len(params),)](p, o, BS=bs, BO=bo, HAS_LO=has_lo, HAS_HI=has_hi)
    for (s0, length, lo, hi), (a, u0, u1, e) in zip(params, o.tolist()):
        s = torch.arange(s0, s0 + bs).unsqueeze(1)
        c = torch.arange(length).unsqueeze(0)
        vis = torch.ones(bs, length, dtype=torch.bool)
        if has_lo:
            vis &= c >= s + lo
        if has_hi:
            vis &= c <= s + hi
        where = (s0, length, lo, hi, (a, u0, u1, e))
        assert 0 <= a <= u0 <= u1 <= e and all(x % bo == 0 for x in (a, u0, u1, e)), where
        cols = vis.any(0).nonzero().flatten().tolist()
        assert all(a <= j < e for j in cols), ("visible key skipped", where)
        if u1 > u0:
            assert u1 <= length and bool(vis[:, u0:u1].all()), ("unmasked block not visible", where)
        for blk in range(a, e, bo):
            assert bool(vis[:, blk:blk + bo].any()), ("block with nothing visible visited", where)


# ------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["causal-br", "strict-tl", "window-br", "none"])
def test_gpu_large(d, dtype, case):
    tq, tk = 1000, 1537
    mask, align, win = {"causal-br": ("causal", "bottom_right", None),
                        "strict-tl": ("causal_strict", "top_left", None),
                        "window-br": ("causal", "bottom_right", 300),
                        "none": ("none", "top_left", None)}[case]
    gen = torch.Generator().manual_seed(8)
    q = _rand(2, tq, 8, d, dtype=dtype, gen=gen)
    k, v = _rand(2, tk, 2, d, dtype=dtype, gen=gen), _rand(2, tk, 2, d, dtype=dtype, gen=gen)
    geo = dict(mask=mask, align=align, window_left=win)
    out, lse = triton_attention_forward(q, k, v, **geo)
    vis = visible(tq, tk, **geo)
    ro, rl = ref_attention(q, k, v, vis)
    _close("out", out, ro, dtype)
    _close_lse(lse, rl, dtype)
    dout = _rand(*q.shape, dtype=dtype, gen=gen)
    grads = triton_attention_backward(dout, q, k, v, out, lse, **geo)
    for name, got, ref in zip("qkv", grads, ref_grads(q, k, v, vis, dout)):
        _close("d" + name, got, ref, dtype)


@pytest.mark.gpu
@gpu
def test_gpu_packed_accumulate():
    lens_q, lens_k = [1, 700, 333, 64, 1200], [5, 900, 1, 64, 1000]
    packed = PackedSeqs.from_lengths(lens_q, lens_k, device=DEV)
    gen = torch.Generator().manual_seed(9)
    q = _rand(sum(lens_q), 8, 128, dtype=torch.bfloat16, gen=gen)
    k = _rand(sum(lens_k), 4, 128, dtype=torch.bfloat16, gen=gen)
    v = _rand(sum(lens_k), 4, 128, dtype=torch.bfloat16, gen=gen)
    acc = (torch.zeros(q.shape, device=DEV), torch.full((8, sum(lens_q)), float("-inf"),
                                                        device=DEV))
    for _ in range(2):  # the same block twice: out unchanged, lse + log 2
        triton_attention_forward(q, k, v, mask="causal", align="bottom_right", packed=packed,
                                 acc=acc)
    out, lse = triton_attention_forward(q, k, v, mask="causal", align="bottom_right",
                                        packed=packed)
    for b in range(len(lens_q)):
        qs = slice(packed.cu_q[b], packed.cu_q[b + 1])
        ks = slice(packed.cu_k[b], packed.cu_k[b + 1])
        vis = visible(lens_q[b], lens_k[b], "causal", align="bottom_right")
        ro, rl = ref_attention(q[qs].unsqueeze(0), k[ks].unsqueeze(0), v[ks].unsqueeze(0), vis)
        _close(f"out[{b}]", out[qs], ro[0], torch.bfloat16)
        _close(f"acc out[{b}]", acc[0][qs], ro[0], torch.bfloat16)
        _close_lse(acc[1][:, qs], rl[0] + torch.log(torch.tensor(2.0, dtype=torch.float64)),
                   torch.bfloat16)


@pytest.mark.parametrize("band", [(-5, 0), (-3, 2), (-4, None), (-9, -2), (0, 6)],
                         ids=["causal_window", "both_edges", "lower_only", "below_diag", "upper_band"])
def test_dispatch_window_band_natively(band):
    """Dispatch hands a window band to the Triton kernel itself (caps.window: no pieces): forward
    and backward equal a float64 reference under the same band, for blocks of unequal sides."""
    from seqpar.kernels import Band, block_backward, block_forward, plan_block

    band = Band(*band)
    gen = torch.Generator().manual_seed(11)
    tq, tk = 19, 23
    q, dout = _rand(1, tq, 4, 32, gen=gen), _rand(1, tq, 4, 32, gen=gen)
    k, v = _rand(1, tk, 2, 32, gen=gen), _rand(1, tk, 2, 32, gen=gen)
    vis = torch.tensor([[band.sees(i, j) for j in range(tk)] for i in range(tq)])
    assert plan_block(tq, tk, band).window is not None  # the band cuts the block: a native launch
    out, lse = block_forward(q, k, v, scale=0.2, mask=band, backend="triton")
    ro, rl = ref_attention(q, k, v, vis, 0.2)
    _close("out", out, ro, torch.float32)
    _close_lse(lse, rl, torch.float32)
    grads = block_backward(dout, q, k, v, out, lse, scale=0.2, mask=band, backend="triton")
    for name, got, ref in zip("qkv", grads, ref_grads(q, k, v, vis, dout, 0.2)):
        _close("d" + name, got, ref, torch.float32)


# ----------------------------------------------------------------- packed and accumulate dispatch


def _spy(monkeypatch, name):
    """Record the calls of TritonBackend.<name> (the test fails where the method does not exist)."""
    from seqpar.kernels.triton_backend import TritonBackend

    calls, real = [], getattr(TritonBackend, name)

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TritonBackend, name, spy)
    return calls


def _segments_visible(segments, tq, tk):
    """[tq, tk] bool: the union of every segment's mask (top-left inside the segment)."""
    from seqpar.kernels.masks import as_band

    vis = torch.zeros(tq, tk, dtype=torch.bool)
    for s in segments.segments:
        band = as_band(s.mask)
        for i in range(s.q_len):
            for j in range(s.k_len):
                vis[s.q_start + i, s.k_start + j] |= band.sees(i, j)
    return vis.to(DEV)


@pytest.mark.parametrize("layout", ["disjoint_rows", "shared_rows"])
def test_varlen_dispatch_runs_the_triton_packed_kernels(monkeypatch, layout):
    """varlen_forward / varlen_backward with backend="triton" launch the Triton varlen kernels
    (caps.varlen: causal, none and flash-style window documents, bottom-right aligned) and equal a
    float64 reference; where the calls' rows are disjoint the kernel merges into the accumulator."""
    from seqpar.kernels import Band, VarlenSegments, new_accumulator, varlen_backward, varlen_forward

    docs = [(0, 9, 0, 9, "causal"), (9, 14, 9, 14, Band(-4, 0)), (23, 17, 23, 17, "none")]
    if layout == "shared_rows":  # rows 9:40 also see earlier documents' keys: calls share rows
        docs += [(9, 14, 0, 9, "causal_strict"), (23, 17, 0, 9, Band(-12, -2)), (23, 17, 9, 14, Band(-6, None))]
    segs = VarlenSegments.build(docs, tq=40, tk=40)
    fwd, bwd = _spy(monkeypatch, "varlen_forward"), _spy(monkeypatch, "varlen_backward")
    gen = torch.Generator().manual_seed(5)
    q, dout = _rand(1, 40, 4, 16, gen=gen), _rand(1, 40, 4, 16, gen=gen)
    k, v = _rand(1, 40, 2, 16, gen=gen), _rand(1, 40, 2, 16, gen=gen)
    vis = _segments_visible(segs, 40, 40)
    ro, rl = ref_attention(q, k, v, vis, 0.25)
    out, lse = varlen_forward(q, k, v, segs, scale=0.25, backend="triton")
    n = len(segs.packed_calls())
    assert len(fwd) == n
    _close("out", out, ro, torch.float32)
    _close_lse(lse, rl, torch.float32)
    acc = new_accumulator(q.shape, q.device)
    got = varlen_forward(q, k, v, segs, scale=0.25, backend="triton", acc=acc)
    assert got[0] is acc[0] and got[1] is acc[1]
    # the kernel merges into gathered accumulator rows (its own fresh one without acc=) where no
    # two calls share a row; else each call returns its (out, lse) and merge_ folds them
    assert [c["acc"] is not None for c in fwd] == [layout == "disjoint_rows"] * 2 * n
    _close("acc out", acc[0], ro, torch.float32)
    _close_lse(acc[1], rl, torch.float32)
    grads = varlen_backward(dout, q, k, v, out, lse, segs, scale=0.25, backend="triton")
    assert len(bwd) == n
    for name, got, ref in zip("qkv", grads, ref_grads(q, k, v, vis, dout, 0.25)):
        _close("d" + name, got, ref, torch.float32)


@pytest.mark.parametrize("mask", ["causal", "causal_strict", "none", (-5, 0)])
def test_block_forward_into_merges_in_the_triton_kernel(monkeypatch, mask):
    """block_forward_into with backend="triton" (caps.accumulate) merges a block into running fp32
    accumulators inside the kernel: equal to block_forward + merge_ and to the float64 reference of
    both blocks; rows the block does not reach keep their values."""
    from seqpar.kernels import Band, block_forward, block_forward_into, merge_, new_accumulator

    mask = Band(*mask) if isinstance(mask, tuple) else mask
    into = _spy(monkeypatch, "forward_into")
    gen = torch.Generator().manual_seed(9)
    q = _rand(1, 21, 4, 16, gen=gen)
    k1, v1, k2, v2 = (_rand(1, n, 2, 16, gen=gen) for n in (7, 7, 17, 17))
    acc = new_accumulator(q.shape, q.device)
    merge_(*acc, *block_forward(q, k1, v1, scale=0.3, mask="none", backend="triton"))
    want = tuple(x.clone() for x in acc)
    merge_(*want, *block_forward(q, k2, v2, scale=0.3, mask=mask, backend="triton"))
    assert block_forward_into(*acc, q, k2, v2, scale=0.3, mask=mask, backend="triton") is None
    assert len(into) == 1
    _close("acc out vs forward + merge_", acc[0], want[0], torch.float32)
    _close_lse(acc[1], want[1], torch.float32)
    vis2 = visible(21, 17, mask) if isinstance(mask, str) else \
        torch.tensor([[mask.sees(i, j) for j in range(17)] for i in range(21)]).to(DEV)
    vis = torch.cat([torch.ones(21, 7, dtype=torch.bool, device=DEV), vis2], dim=1)
    ro, rl = ref_attention(q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1), vis, 0.3)
    _close("acc out", acc[0], ro, torch.float32)
    _close_lse(acc[1], rl, torch.float32)
    with pytest.raises(ValueError, match="acc_out must be a torch.float32 tensor"):
        block_forward_into(acc[0].double(), acc[1], q, k2, v2, scale=0.3, mask=mask, backend="triton")
