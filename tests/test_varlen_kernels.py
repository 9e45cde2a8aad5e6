"""Tests of the packed variable-length kernels ``seqpar.kernels.varlen``.

Every case is checked against a float64 dense softmax written here: the union of the
segments' visible (query, key) pairs as one ``[Tq, Tk]`` mask (segments sharing rows
use disjoint keys, so union and merge agree), K/V heads repeated, gradients through
torch.autograd. Tolerances follow the dtype:

- float32: 1e-5 of the largest reference magnitude. A row sums at most ~D + Tk O(1)
  terms (< 256 here), so fp32 rounding (eps 1.2e-7) stays ~1e-6 relative; 1e-5 leaves
  ~10x margin, while a wrong mask, offset or merge gives errors > 1e-2.
- bfloat16: at most 2x the error of the same computation in plain bf16 torch (same
  inputs, float64 as truth), plus half a bf16 ulp of the largest value (2^-9 relative:
  the rounding of the output itself, which a small plain computation may dodge by luck).
"""

from __future__ import annotations

import random

import pytest
import torch

from seqpar.kernels import block_forward
from seqpar.kernels.varlen import Segment, VarlenSegments, varlen_backward, varlen_forward, visible_pairs
from packed_utils import gathered_segments, ring_steps
from seqpar.layouts import PackedLayout

FP32_REL = 1e-5
BF16_FLOOR_REL = 2.0**-9
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = {"mha4": (4, 4), "gqa4x2": (4, 2)}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors on a shared 2-core machine: intra-op threads only add overhead
    (the geometry checks ran 10-100x slower with 2 threads under load). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- reference


def vis_of(segs: VarlenSegments) -> torch.Tensor:
    """``[Tq, Tk]`` bool: union of every segment's visible pairs (top-left masks)."""
    vis = torch.zeros(segs.tq, segs.tk, dtype=torch.bool)
    for s in segs.segments:
        i = torch.arange(s.q_len).unsqueeze(1)
        j = torch.arange(s.k_len).unsqueeze(0)
        m = {"none": torch.ones(s.q_len, s.k_len, dtype=torch.bool), "causal": j <= i, "causal_strict": j < i}[s.mask]
        vis[s.q_start:s.q_start + s.q_len, s.k_start:s.k_start + s.k_len] |= m
    return vis


def dense(q, k, v, scale, vis):
    """Plain masked softmax attention in q's dtype on ``[1, T, H, D]`` streams.

    Masked scores get the dtype's most negative finite value (not -inf), so rows with
    no key stay NaN-free under autograd; those rows are zeroed by a multiplication.
    """
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = s.masked_fill(~vis, torch.finfo(s.dtype).min)
    row_any = vis.any(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv) * row_any.view(1, -1, 1, 1).to(q.dtype)
    return out, torch.logsumexp(s, -1).masked_fill(~row_any, float("-inf"))


def dense_grads(q, k, v, dout, scale, vis):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = dense(*leaves, scale, vis)
    out.backward(dout)
    return out.detach(), lse, *[x.grad for x in leaves]


def err(a, b):
    a, b = a.double(), b.double()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), "-inf rows differ"
    fin = torch.isfinite(b)
    assert torch.isfinite(a[fin]).all(), "non-finite values where the reference is finite"
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def check(name, got, truth, plain=None):
    fin = torch.isfinite(truth)
    ref = max(truth.double()[fin].abs().max().item(), 1.0) if fin.any() else 1.0
    bound = FP32_REL * ref if plain is None else 2 * err(plain, truth) + BF16_FLOOR_REL * ref
    e = err(got, truth)
    assert e <= bound, f"{name}: max error {e:.3g} > bound {bound:.3g}"


def rand(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def run_and_check(segs, hq, hkv, d, dtype, backend=None, seed=0, device="cpu"):
    q, dout = rand((1, segs.tq, hq, d), dtype, seed), rand((1, segs.tq, hq, d), dtype, seed + 1)
    k, v = rand((1, segs.tk, hkv, d), dtype, seed + 2), rand((1, segs.tk, hkv, d), dtype, seed + 3)
    scale = d**-0.5
    on = [x.to(device) for x in (q, k, v, dout)]
    out, lse = varlen_forward(*on[:3], segs, scale=scale, backend=backend)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (1, hq, segs.tq)
    dq, dk, dv = (x.cpu() for x in varlen_backward(on[3], *on[:3], out, lse, segs, scale=scale, backend=backend))
    out, lse = out.cpu(), lse.cpu()
    vis = vis_of(segs)
    truth = dense_grads(q.double(), k.double(), v.double(), dout.double(), scale, vis)
    plain = dense_grads(q, k, v, dout, scale, vis) if dtype != torch.float32 else [None] * 5
    for name, got, t, p in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), truth, plain):
        check(name, got, t, p)
    rows, keys = ~vis.any(1), ~vis.any(0)  # uncovered: exactly 0 / -inf / 0
    assert not out[:, rows].any() and torch.isneginf(lse[..., rows]).all() and not dq[:, rows].any()
    assert not dk[:, keys].any() and not dv[:, keys].any()


# ----------------------------------------------------------------------------- cases

# rows 0..6 see keys 0..11 causally AND keys 30..34 fully (overlapping rows, merged);
# unequal q/k lengths; a strict segment of one row (sees nothing); rows 27.. and
# keys 35.. are covered by no segment.
MIXED = VarlenSegments.build(
    [(0, 7, 0, 12, "causal"), (7, 9, 12, 3, "none"), (16, 1, 15, 5, "causal_strict"),
     (17, 10, 20, 10, "causal_strict"), (0, 7, 30, 5, "none"), (9, 3, 26, 2, "causal")],
    tq=40, tk=50)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("hq,hkv", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("backend", (None, "reference", "torch_cpu"), ids=("auto", "reference", "torch_cpu"))
def test_mixed_segments(backend, hq, hkv, dtype):
    run_and_check(MIXED, hq, hkv, 16, dtype, backend)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("mask", ("causal", "none"))
def test_per_document(mask, dtype):
    """Per-document self-attention of a packing with a length-1 document and repeated lengths."""
    lens = [5, 1, 17, 5, 5, 1, 33, 2]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    segs = VarlenSegments.from_cu_seqlens(cu, mask=mask)
    # equal shapes share one batched block call: 8 documents, 5 distinct lengths
    assert len(segs.batches) == len(set(lens))
    run_and_check(segs, 4, 2, 16, dtype, seed=3)


def test_d80_and_single_rows():
    segs = VarlenSegments.build([(0, 1, 0, 1, "causal"), (1, 1, 1, 4, "none"), (2, 3, 5, 1, "causal")], 5, 6)
    run_and_check(segs, 2, 1, 80, torch.float32, seed=5)


def test_descriptor_and_plans():
    assert visible_pairs(5, 3, "causal") == 1 + 2 + 3 * 3
    assert visible_pairs(5, 3, "causal_strict") == 0 + 1 + 2 + 3 + 3
    assert visible_pairs(1, 4, "causal_strict") == 0
    assert MIXED.pairs == int(vis_of(MIXED).sum())
    # rows of one batch are disjoint; the same-shape segments on shared rows go to two batches
    two = VarlenSegments.build([(0, 4, 0, 4), (0, 4, 4, 4), (4, 4, 8, 4)], 8, 12)
    assert sorted(len(b.q_starts) for b in two.batches) == [1, 2]
    calls = MIXED.packed_calls()  # varlen launches: square causal docs, disjoint rows per launch
    for c in calls:
        rows = [r for s, n in c.q_rows for r in range(s, s + n)]
        assert len(rows) == len(set(rows)) and c.cu_q[-1] == len(rows)
        if c.causal:
            assert all(n == m for (_, n), (_, m) in zip(c.q_rows, c.k_rows))
    covered = torch.zeros(40, 50, dtype=torch.bool)
    for c in calls:
        for (qs, qn), (ks, kn) in zip(c.q_rows, c.k_rows):
            i, j = torch.arange(qn).unsqueeze(1), torch.arange(kn).unsqueeze(0)
            covered[qs:qs + qn, ks:ks + kn] |= (j <= i) if c.causal else torch.ones(qn, kn, dtype=torch.bool)
    assert torch.equal(covered, vis_of(MIXED))
    t1 = MIXED.packed_tensors(0, "cpu")
    assert MIXED.packed_tensors(0, "cpu") is t1 and t1[2].dtype == torch.int32  # cached
    assert MIXED == VarlenSegments.build(MIXED.segments, 40, 50)


def test_accumulator_form():
    """``acc=`` merges in place: two halves of the keys give the whole."""
    q, k, v = rand((1, 6, 2, 8), torch.float32, 0), rand((1, 8, 2, 8), torch.float32, 1), rand((1, 8, 2, 8), torch.float32, 2)
    whole = VarlenSegments.build([(0, 6, 0, 8, "none")], 6, 8)
    halves = [VarlenSegments.build([(0, 6, 0, 4, "none")], 6, 8), VarlenSegments.build([(0, 6, 4, 4, "none")], 6, 8)]
    ref_out, ref_lse = varlen_forward(q, k, v, whole, scale=0.3)
    acc = (torch.zeros(1, 6, 2, 8), torch.full((1, 2, 6), float("-inf")))
    for h in halves:
        got = varlen_forward(q, k, v, h, scale=0.3, acc=acc)
    assert got[0] is acc[0]
    assert (acc[0] - ref_out).abs().max() < 1e-6 and (acc[1] - ref_lse).abs().max() < 1e-6


@pytest.mark.parametrize("kind", ("contiguous", "zigzag", "striped"))
def test_ring_emulation(kind):
    """Every rank's packed ring plan, run back to back on one process (fp32, N=3), equals
    per-document causal attention of the global stream; dK/dV summed over the ranks that
    used each shard. Also checks the all-gathered form for one rank."""
    n, hq, hkv, d = 3, 2, 1, 8
    rng = random.Random(7)
    lens = tuple([1, 2, 7] + [rng.randint(1, 40) for _ in range(5)])
    pl = PackedLayout(kind, n, lens)
    T, t = pl.total_tokens, pl.t_local
    q, k, v, dout = (rand((1, T, h, d), torch.float32, i) for i, h in enumerate((hq, hkv, hkv, hq)))
    idx = [torch.tensor(pl.local_index(r)) for r in range(n)]

    def local(x, r):  # padded local stream, padding rows poisoned with NaN: never read
        out = torch.full((1, t, *x.shape[2:]), float("nan"))
        real = idx[r] >= 0
        out[0, real] = x[0, idx[r][real]]
        return out

    ql, kl, vl, dl = ([local(x, r) for r in range(n)] for x in (q, k, v, dout))
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    outs = []
    for r in range(n):
        plan = ring_steps(pl, r, causal=True)
        acc = (torch.zeros(1, t, hq, d), torch.full((1, hq, t), float("-inf")))
        for j, segs in plan:
            varlen_forward(ql[r], kl[j], vl[j], segs, scale=0.35, acc=acc)
        outs.append(acc)
        g = gathered_segments(pl, r, causal=True)
        o2, l2 = varlen_forward(ql[r], torch.cat(kl, 1), torch.cat(vl, 1), g, scale=0.35)
        assert torch.allclose(o2, acc[0], atol=1e-6) and torch.allclose(l2, acc[1], atol=1e-6)
        pad = idx[r] < 0
        assert not acc[0][0, pad].any() and torch.isneginf(acc[1][0][:, pad]).all()
        dq_r = torch.zeros(1, t, hq, d)
        for j, segs in plan:
            gq, gk, gv = varlen_backward(dl[r], ql[r], kl[j], vl[j], acc[0], acc[1], segs, scale=0.35)
            dq_r += gq
            real_j = idx[j] >= 0
            assert not gk[0, ~real_j].any() and not gv[0, ~real_j].any()
            dk[0, idx[j][real_j]] += gk[0, real_j]
            dv[0, idx[j][real_j]] += gv[0, real_j]
        assert not dq_r.isnan().any() and not dq_r[0, pad].any()
        dq[0, idx[r][~pad]] = dq_r[0, ~pad]
    vis = torch.zeros(T, T, dtype=torch.bool)
    for a, b in zip(pl.cu_seqlens, pl.cu_seqlens[1:]):
        vis[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    t_out, t_lse, t_dq, t_dk, t_dv = dense_grads(q.double(), k.double(), v.double(), dout.double(), 0.35, vis)
    out = torch.zeros(q.shape)
    lse = torch.zeros(1, hq, T)
    for r, (o, l) in enumerate(outs):
        real = idx[r] >= 0
        out[0, idx[r][real]] = o[0, real]
        lse[0][:, idx[r][real]] = l[0][:, real]
    for name, got, truth in (("out", out, t_out), ("lse", lse, t_lse), ("dq", dq, t_dq), ("dk", dk, t_dk),
                             ("dv", dv, t_dv)):
        check(name, got, truth)


def test_bad_input():
    q, k = torch.zeros(1, 40, 2, 8), torch.zeros(1, 50, 2, 8)
    with pytest.raises(ValueError, match="rows"):
        varlen_forward(q[:, :30], k, k, MIXED, scale=0.1)
    with pytest.raises(ValueError, match="batch"):
        varlen_forward(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), MIXED, scale=0.1)
    with pytest.raises(ValueError, match="unknown"):
        varlen_forward(q, k, k, MIXED, scale=0.1, backend="nope")
    with pytest.raises(ValueError, match="flash_attn"):
        varlen_forward(q, k, k, MIXED, scale=0.1, backend="flash_attn")
    with pytest.raises(ValueError, match=r"segments\[0\]"):
        VarlenSegments.build([(0, 5, 48, 3)], 40, 50)
    with pytest.raises(ValueError, match="mask"):
        VarlenSegments.build([(0, 5, 0, 3, "bottom_right")], 40, 50)
    with pytest.raises(ValueError, match="out"):
        varlen_backward(q, q, k, k, None, torch.zeros(1, 2, 40), MIXED, scale=0.1)


def test_delta_and_grad_acc_forms():
    """Backward from ``delta`` alone, and accumulation into fp32 ``grad_acc``, match the plain form."""
    q, dout = rand((1, 40, 2, 8), torch.float32, 0), rand((1, 40, 2, 8), torch.float32, 1)
    k, v = rand((1, 50, 1, 8), torch.float32, 2), rand((1, 50, 1, 8), torch.float32, 3)
    out, lse = varlen_forward(q, k, v, MIXED, scale=0.3)
    ref = varlen_backward(dout, q, k, v, out, lse, MIXED, scale=0.3)
    delta = (dout * out).sum(-1).transpose(1, 2)
    got = varlen_backward(dout, q, k, v, None, lse, MIXED, scale=0.3, delta=delta)
    acc = tuple(torch.ones_like(x) for x in (q, k, v))
    summed = varlen_backward(dout, q, k, v, out, lse, MIXED, scale=0.3, grad_acc=acc)
    assert all(a is b for a, b in zip(summed, acc))
    for r, g, a in zip(ref, got, summed):
        assert torch.allclose(r, g, atol=1e-6) and torch.allclose(r + 1, a, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("flash_attn", "torch_cuda", None))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_cuda(backend, dtype):
    """CUDA paths (flash-attn varlen when installed, per-segment torch CUDA ops) vs float64."""
    if backend == "flash_attn":
        pytest.importorskip("flash_attn.flash_attn_interface")  # flash-attn 2 (flash-attn-4 ships flash_attn.cute only)
    run_and_check(MIXED, 4, 2, 64, dtype, backend, device="cuda")
    run_and_check(VarlenSegments.from_cu_seqlens([0, 1, 9, 40], mask="causal"), 4, 2, 64, dtype, backend,
                  device="cuda")


def test_block_forward_unchanged_by_import():
    """Sanity: the varlen module adds no state to the dense kernels."""
    q = rand((1, 4, 2, 8), torch.float32, 0)
    out, lse = block_forward(q, q, q, scale=0.5, mask="causal")
    segs = VarlenSegments(4, 4, (Segment(0, 4, 0, 4, "causal"),))
    o2, l2 = varlen_forward(q, q, q, segs, scale=0.5)
    assert torch.allclose(out, o2) and torch.allclose(lse, l2)
