"""Attention sinks (``seqpar.attention(sinks=)``, gpt-oss semantics) for every softmax method on gloo ranks.

Each distributed call runs, for one method at one N, dense causal fp32 (GQA), dense full bf16
(MQA, query heads that do not divide N for Ulysses at N=2 and 4) and packed causal fp32 documents
(padding rows poisoned with NaN). Compared with the float64 reference on the same rounded inputs:
out, dq, dk, dv and ds (each rank's ds is its share; their sum over the group is the gradient).
The bytes every rank sends equal those of the same call without sinks: sinks add no communication.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.softmax.reference import reference_attention
from seqpar.testing import run_distributed

from dist_utils import BF16_FACTOR, BF16_FLOOR, FP32_TOL, rel_err, world

# fp32: every path accumulates in fp32 and ds sums <= a few hundred fp32 terms: ~1e-6 against
# float64; 2e-5 as for the methods without sinks. bf16 (STYLE.md §12): at most 2x as far from
# float64 as the same reference computed in bf16 on one device, plus the floor of dist_utils
# (ds sums rows of both signs, so its relative error is larger than out's: ~2e-2 for both).
NAMES = ("out", "dq", "dk", "dv", "ds")


def method_options(method: str, n: int) -> dict:
    """usp: a 2x2 arrangement at N=4, the whole group as Ulysses axis at N=2, a pure ring axis at N=3."""
    if method != "usp":
        return {}
    return {4: {"ulysses_degree": 2, "ring_method": "zigzag_ring"}, 2: {"ulysses_degree": 2},
            3: {"ulysses_degree": 1, "ring_method": "striped_ring"}}[n]


def _inputs(B, T, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    glob = [torch.randn(B, T, h, d, generator=gen, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv, hq)]
    sinks = (torch.randn(hq, generator=gen, dtype=torch.float64) * 2).float()  # logits of order the scores'
    return glob, sinks


def _run(method, kw, glob, sinks, causal, cu):
    """Shard, fwd + bwd with ``sinks`` (or without, for None), gather back; returns the global
    (out, dq, dk, dv), ds summed over the group, the local padding check and the bytes sent."""
    rank, n = world()
    local = [seqpar.shard(t, method=method, cu_seqlens=cu, **kw) for t in glob]
    pad = None
    if cu is not None and method != "usp":  # poison padding rows: out and every gradient must stay 0 there
        rows = seqpar.packed_layout(cu, method=method).local_index(rank)
        pad = torch.tensor([i for i, g in enumerate(rows) if g < 0], dtype=torch.int64)
        for t in local:
            t[:, pad] = float("nan")
    ql, kl, vl = (t.requires_grad_() for t in local[:3])
    s = None if sinks is None else sinks.clone().requires_grad_()
    stats = seqpar.CommStats()
    out = seqpar.attention(ql, kl, vl, method=method, causal=causal, cu_seqlens=cu, sinks=s, stats=stats, **kw)
    out.backward(local[3])
    pad_ok = pad is None or all(bool((t[:, pad] == 0).all()) for t in (out.detach(), ql.grad, kl.grad, vl.grad))
    got = [seqpar.unshard(t, method=method, cu_seqlens=cu, **kw) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    ds = None
    if s is not None:
        ds = s.grad.clone()
        if n > 1:
            dist.all_reduce(ds)
    return got, ds, pad_ok, (stats.total("fwd"), stats.total("bwd"))


def _reference(glob, sinks, causal, cu, dtype=torch.float64):
    """out, dq, dk, dv, ds of the single-device reference computed in ``dtype``."""
    q, k, v = (t.detach().to(dtype).clone().requires_grad_() for t in glob[:3])
    s = sinks.to(dtype).clone().requires_grad_()
    out = reference_attention(q, k, v, causal=causal, cu_seqlens=cu, sinks=s)
    out.backward(glob[3].to(dtype))
    return out.detach(), q.grad, k.grad, v.grad, s.grad


def _bounds(glob, sinks, causal, cu, ref):
    """Allowed error of each of out, dq, dk, dv, ds (see the comment at the top)."""
    if glob[0].dtype == torch.float32:
        return [FP32_TOL] * 5
    low = _reference(glob, sinks, causal, cu, glob[0].dtype)
    return [BF16_FACTOR * rel_err(a, b) + BF16_FLOOR for a, b in zip(low, ref)]


def _cases(n):
    """(causal, dtype, (Hq, Hkv, D), packed lengths or None)."""
    return [(True, torch.float32, (6, 3, 16), None), (False, torch.bfloat16, (5, 1, 8), None),
            (True, torch.float32, (6, 2, 16), [5, 1, 11, 7, 2 + n])]


def _batch(method, seed):
    rank, n = world()
    kw = method_options(method, n)
    results = []
    for i, (causal, dtype, (hq, hkv, d), lens) in enumerate(_cases(n)):
        cu = None if lens is None else torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        T = 24 if cu is None else int(cu[-1])
        glob, sinks = _inputs(2 if cu is None else 1, T, hq, hkv, d, dtype, seed + i)
        got, ds, pad_ok, sent = _run(method, kw, glob, sinks, causal, cu)
        *_, plain = _run(method, kw, glob, None, causal, cu)
        ref = _reference(glob, sinks, causal, cu)
        errs = [rel_err(a, b) for a, b in zip([*got, ds], ref)]
        results.append({"case": (causal, str(dtype), hq, hkv, lens), "errs": errs,
                        "tol": _bounds(glob, sinks, causal, cu, ref),
                        "pad_ok": pad_ok, "sent": sent, "plain": plain})
    return results


CONFIGS = [(m, n) for m in seqpar.METHODS for n in (2, 3, 4)]


@pytest.mark.parametrize("method,n", CONFIGS, ids=[f"{m}-N{n}" for m, n in CONFIGS])
def test_sinks_match_reference(method, n):
    res = run_distributed(_batch, n, method, 100 * n + len(method), timeout=300)
    for rank, cases in enumerate(res):
        for r in cases:
            assert r["pad_ok"], f"rank {rank} {r['case']}: padding rows got a non-zero output or gradient"
            for name, e, tol in zip(NAMES, r["errs"], r["tol"]):
                assert e <= tol, f"rank {rank} {r['case']} {name}: error {e:.2e} > {tol:.1e}"
            assert r["sent"] == r["plain"], f"rank {rank} {r['case']}: sinks changed the bytes sent"


def test_sinks_gradient_by_finite_differences():
    """One device, float64: ds (and dq, dk, dv with sinks) against central differences."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, h, 8, dtype=torch.float64, generator=gen).requires_grad_() for h in (4, 2, 2))
    s = torch.randn(4, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda *x: seqpar.attention(*x[:3], causal=True, sinks=x[3]), (q, k, v, s))


def test_large_sinks_take_the_whole_row():
    """A sink far above every score takes the whole probability: out -> 0 (and ds -> 0); a sink far
    below leaves plain attention."""
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    plain = seqpar.attention(q, k, v, causal=True)
    low = seqpar.attention(q, k, v, causal=True, sinks=torch.full((2,), -60.0))
    high = seqpar.attention(q, k, v, causal=True, sinks=torch.full((2,), 60.0))
    assert torch.equal(low, plain)
    assert high.abs().max() < 1e-20


def test_sinks_under_attention_checkpointing():
    """seqpar.checkpoint replays the recorded (out', lse') of the sink-adjusted forward: the same
    gradients as without checkpointing."""
    gen = torch.Generator().manual_seed(1)
    leaves = [torch.randn(1, 8, h, 16, generator=gen).requires_grad_() for h in (4, 2, 2)]
    s = torch.randn(4, generator=gen).requires_grad_()
    dout = torch.randn(1, 8, 4, 16, generator=gen)

    def layer(q, k, v, s):
        return seqpar.attention(q * 2, k, v, causal=True, sinks=s)

    grads = []
    for wrap in (layer, lambda *x: seqpar.checkpoint(layer, *x)):
        grads.append(torch.autograd.grad(wrap(*leaves, s), (*leaves, s), dout))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- bad input

BAD = {"shape": lambda hq: torch.zeros(hq + 1), "dtype": lambda hq: torch.zeros(hq, dtype=torch.bfloat16),
       "2d": lambda hq: torch.zeros(1, hq), "type": lambda hq: [0.0] * hq}


def _bad(kind, method, packed):
    rank, n = world()
    T = 12
    cu = torch.tensor([0, 5, T], dtype=torch.int32) if packed else None
    kw = method_options(method, n)
    x = seqpar.shard(torch.zeros(1, T, 4, 8), method=method, cu_seqlens=cu, **kw)
    seqpar.attention(x, x, x, method=method, causal=True, cu_seqlens=cu, sinks=BAD[kind](4), **kw)


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_sinks_raise_on_every_rank(kind):
    """ValueError naming sinks and the expected [Hq] float32, on every rank, before any communication."""
    for method, packed in (("zigzag_ring", False), ("ulysses", True), ("usp", False)):
        with pytest.raises(ValueError, match=r"sinks: expected a float32 tensor \[Hq\] = \[4\]") as info:
            run_distributed(_bad, 2, kind, method, packed, timeout=60)
        assert "[0, 1]" in str(info.value)


def _sinks_on_rank_0_only():
    rank, _ = world()
    x = torch.zeros(1, 6, 4, 8)
    seqpar.attention(x, x, x, causal=True, sinks=torch.zeros(4) if rank == 0 else None, check_ranks=True)


def test_sinks_on_some_ranks_only_are_caught_by_check_ranks():
    """Sinks on one rank only would not hang (they add no communication) but would be silently
    wrong; the cross-rank agreement check names them."""
    with pytest.raises(ValueError, match="sinks"):
        run_distributed(_sinks_on_rank_0_only, 2, timeout=60)
