"""Tests of the block-attention kernel layer ``seqpar.kernels``.

Every backend is checked against a float64 dense softmax written here (K/V
heads repeated and an explicit -inf-style mask: deliberately the simplest
possible code, sharing nothing with the kernels), forward (out, lse) and
backward (dq, dk, dv through torch.autograd on that reference).

Tolerances follow the dtype:
- float32: 1e-5 of the largest reference magnitude. fp32 has eps 1.2e-7; a
  block sums at most ~D + Tk terms of O(1) (< 128 here), so the accumulated
  rounding stays below ~1e-6 relative; 1e-5 leaves ~10x margin and still
  catches any real bug (wrong mask, scale or lse give errors > 1e-2).
- bfloat16: at most 2x the error of the same computation done in plain torch
  bfloat16 (same inputs, float64 as truth), plus a floor of half a bf16 ulp
  of the largest reference value (2^-9 relative: the rounding of the output
  itself, which a plain computation can dodge by luck on a small tensor).
"""

from __future__ import annotations


import pytest
import torch

from seqpar.kernels import (
    BACKEND_NAMES,
    MASKS,
    Band,
    BlockPlan,
    available_backends,
    block_backward,
    block_forward,
    check_qkv,
    merge_,
    new_accumulator,
    plan_block,
    select_backend,
)

CPU_BACKENDS = ("reference", "torch_cpu")
HEADS = {"mha8": (8, 8), "gqa8x2": (8, 2), "mqa8x1": (8, 1)}
LENGTHS = {"q17k17": (17, 17), "q9k23": (9, 23), "q23k9": (23, 9), "q1k13": (1, 13)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_REL = 1e-5  # see the module docstring
BF16_FLOOR_REL = 2.0**-9  # half a bf16 ulp, relative to the largest reference value


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These tensors are tiny: intra-op threads only add OpenMP overhead, and on
    a busy 2-core machine (load 4) this file took 175 s with 2 threads versus
    15 s with 1. Restored afterwards so other test modules are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- helpers


def visible(tq: int, tk: int, mask: str, device="cpu") -> torch.Tensor:
    """[tq, tk] bool: may query i see key j (top-left aligned)."""
    i = torch.arange(tq, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    if isinstance(mask, Band):  # lo <= j - i <= hi
        seen = torch.ones(tq, tk, dtype=torch.bool, device=device)
        if mask.lo is not None:
            seen &= j - i >= mask.lo
        if mask.hi is not None:
            seen &= j - i <= mask.hi
        return seen
    if mask == "none":
        return torch.ones(tq, tk, dtype=torch.bool, device=device)
    if mask == "causal":
        return j <= i
    assert mask == "causal_strict"
    return j < i


def dense(q, k, v, scale, vis):
    """Plain softmax attention in the dtype of q (float64 for the truth).

    q [B,Tq,Hq,D], k/v [B,Tk,Hkv,D] (repeated to Hq here: test-only code),
    vis [Tq,Tk] bool. Rows with no visible key give out 0, lse -inf.
    Masked scores are filled with the dtype's most negative finite number,
    not -inf, so fully masked rows stay NaN-free under autograd; those rows
    are then zeroed through a multiplication (zero gradient).
    """
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = s.masked_fill(~vis, torch.finfo(s.dtype).min)
    row_any = vis.any(-1)  # [Tq]
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv) * row_any.view(1, -1, 1, 1).to(q.dtype)
    lse = torch.logsumexp(s, dim=-1).masked_fill(~row_any, float("-inf"))
    return out, lse


def make_qkv(b, tq, tk, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, tq, hq, d, generator=gen).to(dtype)
    k = torch.randn(b, tk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, tk, hkv, d, generator=gen).to(dtype)
    return q, k, v


def max_err(a, b):
    """max |a - b| over entries where b is finite; -inf entries must match exactly."""
    a, b = a.double(), b.double()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), "-inf rows differ"
    fin = torch.isfinite(b)
    assert torch.isfinite(a[fin]).all(), "non-finite values where the reference is finite"
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def scale_of(x):
    x = x.double()
    fin = torch.isfinite(x)
    return max(x[fin].abs().max().item(), 1.0) if fin.any() else 1.0


def check(name, got, truth, plain=None):
    """Compare with the float64 truth; ``plain`` is the same-dtype plain-torch result."""
    err, ref = max_err(got, truth), scale_of(truth)
    if plain is None:
        bound = FP32_REL * ref
    else:
        bound = 2 * max_err(plain, truth) + BF16_FLOOR_REL * ref
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (ref scale {ref:.3g})"


# ----------------------------------------------------------------------------- forward / backward grid

GRID = [
    pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys()),
    pytest.mark.parametrize("tq,tk", LENGTHS.values(), ids=LENGTHS.keys()),
    pytest.mark.parametrize("d", (64, 80), ids=("d64", "d80")),
    pytest.mark.parametrize("hq,hkv", HEADS.values(), ids=HEADS.keys()),
    pytest.mark.parametrize("mask", MASKS),
    pytest.mark.parametrize("backend", CPU_BACKENDS),
]


def grid(fn):
    for mark in GRID:
        fn = mark(fn)
    return fn


@grid
def test_forward(backend, mask, hq, hkv, d, tq, tk, dtype):
    q, k, v = make_qkv(2, tq, tk, hq, hkv, d, dtype)
    scale = d**-0.5
    out, lse = block_forward(q, k, v, scale=scale, mask=mask, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, hq, tq) and lse.dtype == torch.float32
    vis = visible(tq, tk, mask)
    t_out, t_lse = dense(q.double(), k.double(), v.double(), scale, vis)
    if dtype == torch.float32:
        check("out", out, t_out)
        check("lse", lse, t_lse)
    else:
        p_out, p_lse = dense(q, k, v, scale, vis)
        check("out", out, t_out, p_out)
        check("lse", lse, t_lse, p_lse)
    # rows that see nothing: exactly 0 / -inf
    empty = ~vis.any(-1)
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[:, :, empty]).all()


@grid
def test_backward(backend, mask, hq, hkv, d, tq, tk, dtype):
    q, k, v = make_qkv(2, tq, tk, hq, hkv, d, dtype, seed=1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = d**-0.5
    out, lse = block_forward(q, k, v, scale=scale, mask=mask, backend=backend)
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, backend=backend)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    vis = visible(tq, tk, mask)

    def grads(qq, kk, vv, do):
        leaves = [x.detach().clone().requires_grad_() for x in (qq, kk, vv)]
        o, _ = dense(*leaves, scale, vis)
        o.backward(do)
        return [x.grad for x in leaves]

    truth = grads(q.double(), k.double(), v.double(), dout.double())
    plain = grads(q, k, v, dout) if dtype != torch.float32 else [None] * 3
    for name, got, t, p in zip(("dq", "dk", "dv"), (dq, dk, dv), truth, plain):
        check(name, got, t, p)


# ----------------------------------------------------------------------------- more paths


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask", MASKS)
def test_float64(backend, mask):
    """float64 in, float64 out and lse; the reference is exact to ~1e-12."""
    q, k, v = make_qkv(1, 11, 7, 4, 2, 16, torch.float64)
    out, lse = block_forward(q, k, v, scale=0.3, mask=mask, backend=backend)
    assert out.dtype == lse.dtype == torch.float64
    t_out, t_lse = dense(q, k, v, 0.3, visible(11, 7, mask))
    assert max_err(out, t_out) < 1e-12 and max_err(lse, t_lse) < 1e-12


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("tq,tk", [(13, 13), (5, 1)], ids=["q13k13", "q5k1"])
def test_float16(backend, mask, tq, tk):
    """fp16 (torch_cpu runs it in fp32 and rounds): same 2x-plain rule as bf16."""
    q, k, v = make_qkv(2, tq, tk, 8, 2, 80, torch.float16, seed=12)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(13)).half()
    out, lse = block_forward(q, k, v, scale=0.1, mask=mask, backend=backend)
    grads = block_backward(dout, q, k, v, out, lse, scale=0.1, mask=mask, backend=backend)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    vis = visible(tq, tk, mask)

    def run(qq, kk, vv, do):
        leaves = [x.detach().clone().requires_grad_() for x in (qq, kk, vv)]
        o, l = dense(*leaves, 0.1, vis)
        o.backward(do)
        return [o.detach(), l.detach()] + [x.grad for x in leaves]

    truth = run(q.double(), k.double(), v.double(), dout.double())
    plain = run(q, k, v, dout)
    for name, got, t, p in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), truth, plain):
        check(name, got, t, p)


def test_backward_from_delta_matches_out():
    """The reference backward accepts out=None with delta = rowsum(dout*out)."""
    q, k, v = make_qkv(2, 13, 10, 8, 2, 32, torch.float32)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    out, lse = block_forward(q, k, v, scale=0.2, mask="causal")
    delta = (dout * out).sum(-1).transpose(1, 2)
    with_out = block_backward(dout, q, k, v, out, lse, scale=0.2, mask="causal", backend="reference")
    with_delta = block_backward(dout, q, k, v, None, lse, scale=0.2, mask="causal", delta=delta)
    assert select_backend(q, k, v, mask="causal", for_backward=True, has_out=False).name == "reference"
    for a, b in zip(with_out, with_delta):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)], ids=["gqa8x2", "mha4"])
def test_split_keys_merge_and_summed_backward(backend, hq, hkv):
    """Two key blocks merged with merge_ equal the full block; their backward
    passes, given the merged out/lse, add up to the full gradient."""
    q, k, v = make_qkv(2, 11, 19, hq, hkv, 64, torch.float32, seed=4)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    scale, cut = 0.125, 7
    acc_out, acc_lse = new_accumulator(q.shape, q.device)
    for ks in (slice(0, cut), slice(cut, None)):
        o, l = block_forward(q, k[:, ks], v[:, ks], scale=scale, backend=backend)
        merge_(acc_out, acc_lse, o, l)
    vis = visible(11, 19, "none")
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    t_out, t_lse = dense(*leaves, scale, vis)
    check("merged out", acc_out, t_out)
    check("merged lse", acc_lse, t_lse)
    t_out.backward(dout.double())
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for ks in (slice(0, cut), slice(cut, None)):
        gq, gk, gv = block_backward(
            dout, q, k[:, ks], v[:, ks], acc_out, acc_lse, scale=scale, backend=backend
        )
        dq += gq
        dks.append(gk)
        dvs.append(gv)
    check("dq", dq, leaves[0].grad)
    check("dk", torch.cat(dks, 1), leaves[1].grad)
    check("dv", torch.cat(dvs, 1), leaves[2].grad)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("t_global", [16, 17], ids=["T16", "T17"])
def test_striped_two_ranks_causal(backend, t_global):
    """Causal attention over tokens striped on 2 "ranks" (token i on rank i % 2)
    is rebuilt from causal and causal_strict blocks (Tq != Tk when T is odd):
    rank r's query slot i, key slot j of rank s sees it iff s*1 + 2j <= r + 2i."""
    hq, hkv, d, scale = 8, 2, 64, 0.125
    q, k, v = make_qkv(2, t_global, t_global, hq, hkv, d, torch.float32, seed=6)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    idx = [torch.arange(r, t_global, 2) for r in (0, 1)]
    # (query rank, key rank) -> mask: same rank or earlier key rank: causal; later key rank: strict
    masks = {(0, 0): "causal", (0, 1): "causal_strict", (1, 0): "causal", (1, 1): "causal"}
    merged = {}
    for r in (0, 1):
        acc_out, acc_lse = new_accumulator(q[:, idx[r]].shape, q.device)
        for s in (0, 1):
            o, l = block_forward(
                q[:, idx[r]], k[:, idx[s]], v[:, idx[s]], scale=scale, mask=masks[r, s], backend=backend
            )
            merge_(acc_out, acc_lse, o, l)
        merged[r] = (acc_out, acc_lse)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    t_out, t_lse = dense(*leaves, scale, visible(t_global, t_global, "causal"))
    t_out.backward(dout.double())
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r in (0, 1):
        check(f"out rank {r}", merged[r][0], t_out[:, idx[r]])
        check(f"lse rank {r}", merged[r][1], t_lse[:, :, idx[r]])
        for s in (0, 1):
            gq, gk, gv = block_backward(
                dout[:, idx[r]], q[:, idx[r]], k[:, idx[s]], v[:, idx[s]], *merged[r],
                scale=scale, mask=masks[r, s], backend=backend,
            )
            dq[:, idx[r]] += gq
            dk[:, idx[s]] += gk
            dv[:, idx[s]] += gv
    check("dq", dq, leaves[0].grad)
    check("dk", dk, leaves[1].grad)
    check("dv", dv, leaves[2].grad)


# ----------------------------------------------------------------------------- fully masked rows, poison


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fully_masked_block(backend, dtype):
    """causal_strict with Tq = 1: nothing visible -> out 0, lse -inf, zero grads."""
    q, k, v = make_qkv(2, 1, 5, 4, 2, 16, dtype)
    out, lse = block_forward(q, k, v, scale=0.25, mask="causal_strict", backend=backend)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    grads = block_backward(torch.ones_like(q), q, k, v, out, lse, scale=0.25, mask="causal_strict", backend=backend)
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_invisible_inputs_never_read(backend):
    """Poison what a mask hides with NaN: it must not leak. causal_strict never
    reads query/dout row 0; causal with Tq < Tk never reads keys >= Tq."""
    q, k, v = make_qkv(2, 6, 9, 4, 2, 16, torch.float32)
    q[:, 0] = float("nan")
    dout = torch.randn(q.shape)
    dout[:, 0] = float("nan")
    out, lse = block_forward(q, k, v, scale=0.25, mask="causal_strict", backend=backend)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.isneginf(lse[..., 0]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[..., 1:]).all()
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=0.25, mask="causal_strict", backend=backend)
    assert torch.equal(dq[:, 0], torch.zeros_like(dq[:, 0]))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    # keys 5.. are seen by no row of causal_strict with Tq = 6: exact zero grads
    assert torch.equal(dk[:, 5:], torch.zeros_like(dk[:, 5:]))

    q, k, v = make_qkv(2, 6, 9, 4, 2, 16, torch.float32, seed=1)
    k[:, 6:] = float("nan")
    v[:, 6:] = float("nan")
    out, lse = block_forward(q, k, v, scale=0.25, mask="causal", backend=backend)
    t_out, t_lse = dense(q.double(), k[:, :6].double(), v[:, :6].double(), 0.25, visible(6, 6, "causal"))
    check("out", out, t_out)
    check("lse", lse, t_lse)
    dq, dk, dv = block_backward(torch.randn(q.shape), q, k, v, out, lse, scale=0.25, mask="causal", backend=backend)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dv[:, 6:], torch.zeros_like(dv[:, 6:]))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backward_rows_with_neg_inf_final_lse(backend):
    """A row whose FINAL lse is -inf (it saw nothing anywhere) contributes
    nothing: dq row 0, no NaN, and dk/dv equal the backward without that row."""
    q, k, v = make_qkv(2, 7, 5, 4, 1, 16, torch.float32, seed=8)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    out, lse = block_forward(q, k, v, scale=0.25, backend=backend)
    out[:, 3] = 0.0
    lse[:, :, 3] = float("-inf")
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=0.25, backend=backend)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:, 3], torch.zeros_like(dq[:, 3]))
    keep = [0, 1, 2, 4, 5, 6]
    _, dk2, dv2 = block_backward(
        dout[:, keep], q[:, keep], k, v, out[:, keep], lse[:, :, keep], scale=0.25, backend=backend
    )
    torch.testing.assert_close(dk, dk2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dv, dv2, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- merge_


def _partial(b, t, h, d, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, h, d, generator=gen).to(dtype), torch.randn(b, h, t, generator=gen)


def test_merge_matches_logaddexp_formula():
    o1, l1 = _partial(2, 5, 3, 8, 0)
    o2, l2 = _partial(2, 5, 3, 8, 1)
    acc_out, acc_lse = o1.clone(), l1.clone()
    merge_(acc_out, acc_lse, o2, l2)
    l = torch.logaddexp(l1.double(), l2.double())
    w1 = torch.exp(l1.double() - l).transpose(1, 2).unsqueeze(-1)
    w2 = torch.exp(l2.double() - l).transpose(1, 2).unsqueeze(-1)
    check("out", acc_out, w1 * o1.double() + w2 * o2.double())
    check("lse", acc_lse, l)


def test_merge_with_neg_inf_rows_is_exact():
    b, t, h, d = 1, 4, 2, 8
    acc_out, acc_lse = new_accumulator((b, t, h, d), "cpu")
    assert acc_out.dtype == acc_lse.dtype == torch.float32
    assert torch.equal(acc_out, torch.zeros(b, t, h, d)) and torch.isneginf(acc_lse).all()
    o, l = _partial(b, t, h, d, 2, torch.bfloat16)
    # per (h, t) row: t=0 both -inf, t=1 block -inf, t=2 accumulator -inf, t=3 both finite
    l[:, :, 0] = float("-inf")
    o[:, 0] = 0
    l[:, :, 1] = float("-inf")
    o[:, 1] = 0
    merge_(acc_out, acc_lse, o, l)  # empty accumulator takes the block exactly
    assert torch.equal(acc_out, o.float()) and torch.equal(acc_lse, l)
    prev_out, prev_lse = _partial(b, t, h, d, 3)
    prev_lse[:, :, 0] = float("-inf")
    prev_out[:, 0] = 0
    prev_lse[:, :, 2] = float("-inf")
    prev_out[:, 2] = 0
    acc_out, acc_lse = prev_out.clone(), prev_lse.clone()
    merge_(acc_out, acc_lse, o, l)
    assert not acc_out.isnan().any() and not acc_lse.isnan().any()
    assert torch.equal(acc_out[:, 0], torch.zeros_like(acc_out[:, 0])) and torch.isneginf(acc_lse[..., 0]).all()
    assert torch.equal(acc_out[:, 1], prev_out[:, 1]) and torch.equal(acc_lse[..., 1], prev_lse[..., 1])
    assert torch.equal(acc_out[:, 2], o[:, 2].float()) and torch.equal(acc_lse[..., 2], l[..., 2])
    assert torch.isfinite(acc_lse[..., 3]).all()


def test_merge_into_views_leaves_the_rest_untouched():
    """merge_ on slices of a NaN-poisoned buffer writes exactly the slice."""
    buf_out = torch.full((2, 10, 3, 8), float("nan"))
    buf_lse = torch.full((2, 3, 10), float("nan"))
    rows = slice(2, 7)
    buf_out[:, rows], buf_lse[:, :, rows] = new_accumulator((2, 5, 3, 8), "cpu")
    o, l = _partial(2, 5, 3, 8, 4)
    merge_(buf_out[:, rows], buf_lse[:, :, rows], o, l)
    assert torch.equal(buf_out[:, rows], o) and torch.equal(buf_lse[:, :, rows], l)
    assert buf_out[:, :2].isnan().all() and buf_out[:, 7:].isnan().all()
    assert buf_lse[..., :2].isnan().all() and buf_lse[..., 7:].isnan().all()


def test_new_accumulator_float64_and_errors():
    o, l = new_accumulator(torch.Size([1, 3, 2, 4]), "cpu", dtype=torch.float64)
    assert o.dtype == l.dtype == torch.float64 and l.shape == (1, 2, 3)
    with pytest.raises(ValueError, match="dtype"):
        new_accumulator((1, 3, 2, 4), "cpu", dtype=torch.bfloat16)
    acc_out, acc_lse = new_accumulator((1, 3, 2, 4), "cpu")
    with pytest.raises(ValueError, match="lse"):
        merge_(acc_out, acc_lse, torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2))


# ----------------------------------------------------------------------------- dispatch


def test_dispatch_defaults():
    q, k, v = make_qkv(1, 4, 4, 4, 2, 16, torch.float32)
    assert select_backend(q, k, v, mask="causal").name == "torch_cpu"
    assert select_backend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask="none").name == "torch_cpu"
    q64, k64, v64 = q.double(), k.double(), v.double()
    assert select_backend(q64, k64, v64, mask="causal_strict").name == "reference"
    assert select_backend(q64, k64, v64, mask="none", backend="torch_cpu").name == "torch_cpu"
    names = available_backends()
    assert "reference" in names and "torch_cpu" in names
    assert available_backends(include_unavailable=True) == list(BACKEND_NAMES)
    assert {"flash_attn", "torch_cuda", "torch_cpu", "reference"} <= set(BACKEND_NAMES)


def test_dispatch_errors():
    q, k, v = make_qkv(1, 4, 4, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="backend='nope'") as e:
        block_forward(q, k, v, scale=0.25, backend="nope")
    assert all(n in str(e.value) for n in BACKEND_NAMES)
    for name in ("torch_cuda", "flash_attn"):
        with pytest.raises(ValueError, match=f"backend='{name}'.*cpu"):
            block_forward(q, k, v, scale=0.25, backend=name)
    out, lse = block_forward(q, k, v, scale=0.25)
    delta = torch.zeros_like(lse)
    with pytest.raises(ValueError, match="torch_cpu.*needs `out`"):
        block_backward(q, q, k, v, None, lse, scale=0.25, backend="torch_cpu", delta=delta)
    with pytest.raises(ValueError, match="out.*delta"):
        block_backward(q, q, k, v, None, lse, scale=0.25)
    with pytest.raises(ValueError, match="mask"):
        block_forward(q, k, v, scale=0.25, mask="bottom_right")
    with pytest.raises(ValueError, match="lse"):
        block_backward(q, q, k, v, out, lse[..., :2], scale=0.25)
    with pytest.raises(ValueError, match="scale"):
        block_forward(q, k, v, scale=float("nan"))


def test_dispatch_lists_every_refusal():
    """Nothing serves int32: one error naming every backend with its reason."""
    q = torch.ones(1, 4, 2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="no attention backend fits") as e:
        select_backend(q, q, q, mask="none")
    msg = str(e.value)
    for name in BACKEND_NAMES:
        assert f"  {name}: " in msg, msg
    assert "int32" in msg


# ----------------------------------------------------------------------------- validation


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "q,k,v,pattern",
    [
        (_t(2, 4, 4), _t(2, 4, 4, 8), _t(2, 4, 4, 8), r"^q must be 4-D"),
        (_t(2, 4, 4, 8), _t(2, 4, 8), _t(2, 4, 4, 8), r"^k must be 4-D"),
        (_t(2, 4, 4, 8), _t(2, 4, 4, 8), _t(2, 4, 4, 8, 1), r"^v must be 4-D"),
        (_t(2, 4, 4, 8), _t(2, 4, 4, 8), _t(1, 4, 4, 8), r"^k .* and v .* differ in batch"),
        (_t(2, 4, 4, 8), _t(2, 4, 4, 8), _t(2, 5, 4, 8), r"^k .* and v .* differ in sequence length"),
        (_t(2, 4, 4, 8), _t(2, 4, 2, 8), _t(2, 4, 4, 8), r"^k .* and v .* differ in heads"),
        (_t(2, 4, 4, 8), _t(3, 4, 4, 8), _t(3, 4, 4, 8), r"^q batch 2 != k batch 3"),
        (_t(2, 4, 4, 8), _t(2, 4, 4, 16), _t(2, 4, 4, 16), r"^q head dim 8 != k head dim 16"),
        (_t(2, 4, 6, 8), _t(2, 4, 4, 8), _t(2, 4, 4, 8), r"^q has 6 heads and k has 4"),
        (_t(2, 4, 4, 8), _t(2, 4, 4, 8, dtype=torch.float64), _t(2, 4, 4, 8, dtype=torch.float64), r"^k dtype"),
        (_t(2, 4, 4, 8), _t(2, 4, 4, 8, device="meta"), _t(2, 4, 4, 8, device="meta"), r"^k is on meta"),
    ],
    ids=["q3d", "k3d", "v5d", "kv_batch", "kv_seq", "kv_heads", "qk_batch", "qk_dim", "heads", "dtype", "device"],
)
def test_check_qkv_errors(q, k, v, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_qkv(q, k, v)
    with pytest.raises(ValueError, match=pattern):
        block_forward(q, k, v, scale=0.1)


def test_check_qkv_takes_a_value_head_dim_of_its_own():
    """V's head dim may differ from Q and K's (MLA: DeepSeek-V3's 192 / 128); the output takes V's."""
    q, k, v = torch.randn(2, 4, 4, 8), torch.randn(2, 4, 4, 8), torch.randn(2, 4, 4, 16)
    check_qkv(q, k, v)
    out, lse = block_forward(q, k, v, scale=0.1)
    assert out.shape == (2, 4, 4, 16) and lse.shape[-1] == 4


def test_plan_block():
    assert plan_block(5, 8, "causal") == BlockPlan(q_start=0, k_stop=5, causal=True, tq=5, tk=8)
    p = plan_block(6, 9, "causal_strict")
    assert (p.q_start, p.k_stop, p.causal, p.square) == (1, 5, True, True)
    assert plan_block(1, 4, "causal_strict").empty
    assert not plan_block(9, 3, "causal").square


# ----------------------------------------------------------------------------- GPU


def _gpu_case(backend, mask, hq, hkv, tq, tk, dtype):
    q, k, v = (x.cuda() for x in make_qkv(2, tq, tk, hq, hkv, 64, dtype, seed=10))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(11)).to(dtype).cuda()
    scale = 0.125
    vis = visible(tq, tk, mask, device="cuda")
    out, lse = block_forward(q, k, v, scale=scale, mask=mask, backend=backend)
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, backend=backend)

    def run(qq, kk, vv, do):
        leaves = [x.detach().clone().requires_grad_() for x in (qq, kk, vv)]
        o, l = dense(*leaves, scale, vis)
        o.backward(do)
        return [o.detach(), l.detach()] + [x.grad for x in leaves]

    truth = run(q.double(), k.double(), v.double(), dout.double())
    plain = run(q, k, v, dout) if dtype != torch.float32 else [None] * 5
    for name, got, t, p in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), truth, plain):
        check(name, got, t, p)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("tq,tk", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("hq,hkv", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("mask", MASKS)
def test_torch_cuda(mask, hq, hkv, tq, tk, dtype):
    _gpu_case("torch_cuda", mask, hq, hkv, tq, tk, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tq,tk", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("hq,hkv", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("mask", MASKS)
def test_flash_attn(mask, hq, hkv, tq, tk, dtype):
    pytest.importorskip("flash_attn.flash_attn_interface")  # flash-attn 2 (flash-attn-4 ships flash_attn.cute only)
    q = torch.empty(1, tq, hq, 64, dtype=dtype, device="cuda")
    k = torch.empty(1, tk, hkv, 64, dtype=dtype, device="cuda")
    if select_backend(q, k, k, mask=mask).name != "flash_attn":
        pytest.skip("flash_attn refuses this block (non-square causal); covered by torch_cuda")
    _gpu_case("flash_attn", mask, hq, hkv, tq, tk, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tq,tk", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("hq,hkv", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("backend", ["cudnn", "flash4"])
def test_fused_backends(backend, mask, hq, hkv, tq, tk, dtype):
    """torch's cuDNN attention and FlashAttention-4 forced: forward, and backward from the merged
    out / lse, against float64 (skipped with the backend's reason where it refuses, e.g. flash4 not
    installed)."""
    q = torch.empty(1, tq, hq, 64, dtype=dtype, device="cuda")
    k = torch.empty(1, tk, hkv, 64, dtype=dtype, device="cuda")
    from seqpar.kernels.cudnn import CudnnBackend
    from seqpar.kernels.flash4 import Flash4Backend

    why = {"cudnn": CudnnBackend, "flash4": Flash4Backend}[backend]().refusal(q, k, k, mask, True, True)
    if why:
        pytest.skip(f"{backend} refuses here: {why}")
    _gpu_case(backend, mask, hq, hkv, tq, tk, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tq,tk,mask", [(40, 40, Band(-9, 0)), (23, 61, Band(-5, 30)), (61, 20, Band(-12, 3)),
                                        (64, 20, "causal"), (41, 20, "causal")],
                         ids=["window", "wide_band", "tall_band_pieces", "tall_causal_split", "tall_causal"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 8)], ids=["gqa8x2", "mha8"])
def test_torch_cuda_direct_flash(tq, tk, mask, hq, hkv):
    """torch's flash ops called directly: bands through their bottom-right bounds (or pieces where the
    kernel's clamping cannot express them), a tall causal block split in two, GQA unexpanded."""
    _gpu_case("torch_cuda", mask, hq, hkv, tq, tk, torch.bfloat16)


@pytest.mark.gpu
def test_cuda_dispatch_per_pass(monkeypatch):
    """A bf16 block: forward on flash_attn, else the Triton kernel (its merge is fused), else torch's
    op; backward on flash_attn, else torch's flash kernel (TorchCUDABackend.rank: measured faster
    than the Triton backward on an H100); float64 on the reference."""
    from seqpar.kernels import dispatch
    from seqpar.kernels.dispatch_table import DispatchTable

    monkeypatch.setattr(dispatch, "TABLE", DispatchTable.from_json({}))  # the ranked order, unmeasured
    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16, device="cuda")
    fused = "triton" if "triton" in available_backends() else "torch_cuda"
    assert select_backend(q, q, q, mask="causal").name in ("flash4", "flash_attn", fused)
    assert select_backend(q, q, q, mask="causal", for_backward=True).name in ("flash4", "flash_attn", "torch_cuda")
    assert select_backend(q.double(), q.double(), q.double(), mask="causal").name == "reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_ranks_per_pass(dtype, monkeypatch):
    """The order dispatch tries the CUDA backends in (compiled Triton, not the interpreter): the
    Triton kernel first for every forward, for the fp32 backward and for blocks torch's flash
    kernel cannot take (causal and not square, windows); torch's op first for the fp16 / bf16
    backward of the others; flash_attn above both."""
    from seqpar.kernels.flash import FlashAttnBackend
    from seqpar.kernels.masks import Band, plan_block
    from seqpar.kernels.torch_ops import TorchCUDABackend
    from seqpar.kernels.triton_backend import TritonBackend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fa, tr, tc = FlashAttnBackend(), TritonBackend(), TorchCUDABackend()
    half = dtype != torch.float32
    flash_kinds = [plan_block(64, 64, "none"), plan_block(64, 32, "none"), plan_block(64, 64, "causal")]
    other_kinds = [plan_block(64, 32, "causal"), plan_block(64, 64, Band(-8, 0)), None]
    for plan in flash_kinds + other_kinds:
        assert fa.rank(dtype, False, plan) > tr.rank(dtype, False, plan) > tc.rank(dtype, False, plan)
        torch_first = half and plan in flash_kinds
        assert (tc.rank(dtype, True, plan) > tr.rank(dtype, True, plan)) == torch_first, plan
        assert fa.rank(dtype, True, plan) > max(tc.rank(dtype, True, plan), tr.rank(dtype, True, plan))
