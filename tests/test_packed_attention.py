"""Packed variable-length attention (``cu_seqlens``) for every softmax method, on gloo ranks.

Each distributed call runs a whole batch of random packings (seeded): 1-20 documents of 1-200
tokens (length 1 and lengths not divisible by N or 2N always included), causal and non-causal,
MHA and GQA, fp32 and bf16, so the process pool's start-up is paid once per (method, N). Output
and every gradient are compared with a float64 per-document reference; padding rows of the
local shards are poisoned with NaN (inputs and dout) and must give out 0 and gradient 0, so any
read of a padding row, or any attention across a document boundary, fails the test.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import seqpar
from seqpar.softmax.reference import reference_attention
from seqpar.testing import run_distributed

from dist_utils import rel_err, world

# fp32: the block kernels and the fp32 merge give ~1e-6 against float64 (measured <= 6e-7 on these
# sizes); bf16: inputs are the same bf16 values for both sides, so the error is the bf16 rounding
# of the output and gradients (eps 7.8e-3) plus fp32 accumulation: 2.5e-2 leaves ~3x headroom.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.5e-2}


def _lengths(rng: random.Random, n_docs: int, cap: int) -> list[int]:
    """Long-tailed document lengths in 1..200, always holding a 1 and an odd length, total <= cap."""
    lens = [1, rng.choice([7, 13, 31])] + [min(200, int(rng.paretovariate(1.2) * 6)) for _ in range(n_docs)]
    lens = [max(1, x) for x in lens]
    rng.shuffle(lens)
    while sum(lens) > cap and len(lens) > 1:
        lens.pop()
    return lens[:20]


def _per_doc_reference(q, k, v, dout, cu, causal):
    """float64 per-document reference: out and (dq, dk, dv), one small dense call per document."""
    q, k, v = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
    outs = [reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal) for a, b in zip(cu, cu[1:])]
    out = torch.cat(outs, dim=1)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    shapes = [(4, 4, 16), (4, 2, 16), (4, 1, 80)]  # (Hq, Hkv, D): MHA, GQA, MQA with D=80
    out = []
    for i, (causal, dtype) in enumerate([(True, torch.float32), (True, torch.bfloat16), (False, torch.float32),
                                         (True, torch.float32)]):
        lens = _lengths(rng, rng.randint(0, 18), cap=700)
        out.append((lens, causal, dtype, shapes[i % len(shapes)]))
    return out


def _poison(local, rank, layout_rows):
    """NaN in the padding rows of a local shard (a packed stream [1, t_local, ...])."""
    pad = torch.tensor([i for i, g in enumerate(layout_rows) if g < 0], dtype=torch.int64)
    x = local.clone()
    if pad.numel():
        x[:, pad] = float("nan")
    return x, pad


def _padding_rows(method, n, rank, cu, kw):
    """Indices (in the local stream) of padding rows, or None where the layout is composed (usp)."""
    if method == "usp":
        return None
    return seqpar.packed_layout(cu, method=method).local_index(rank)


def _batch(method, seed, kw):
    """Run every case of ``_cases`` on this rank; return the errors and padding checks."""
    rank, n = world()
    results = []
    for lens, causal, dtype, (hq, hkv, d) in _cases(seed, n):
        cu_list = [0, *itertools.accumulate(lens)]
        cu = torch.tensor(cu_list, dtype=torch.int32)
        T = cu_list[-1]
        gen = torch.Generator().manual_seed(seed + T)
        glob = [torch.randn(1, T, h, d, generator=gen, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv, hq)]
        local = [seqpar.shard(t, method=method, cu_seqlens=cu, **kw) for t in glob]
        rows = _padding_rows(method, n, rank, cu, kw)
        pad = None
        if rows is not None:
            poisoned = [_poison(t, rank, rows) for t in local]
            local, pad = [p[0] for p in poisoned], poisoned[0][1]
        ql, kl, vl = (t.requires_grad_() for t in local[:3])
        out = seqpar.attention(ql, kl, vl, method=method, causal=causal, cu_seqlens=cu, **kw)
        out.backward(local[3])
        pad_ok = True
        if pad is not None and pad.numel():
            pad_ok = all(bool((t[:, pad] == 0).all()) for t in (out.detach(), ql.grad, kl.grad, vl.grad))
        got = [seqpar.unshard(t, method=method, cu_seqlens=cu, **kw) for t in (out.detach(), ql.grad, kl.grad,
                                                                              vl.grad)]
        ref = _per_doc_reference(*glob, cu_list, causal)
        errs = [rel_err(a, b) for a, b in zip(got, ref)]
        results.append((lens, causal, str(dtype), errs, pad_ok, max(e / TOL[dtype] for e in errs)))
    return results


CONFIGS = [(m, n) for m in ("ring", "zigzag_ring", "striped_ring", "allgather_kv", "token_ring", "lightseq",
                            "ulysses") for n in (2, 4)] + [("zigzag_ring", 8), ("usp", 2), ("usp", 4)]


def _usp_kw(n):
    return {"ulysses_degree": 2, "ring_method": "zigzag_ring" if n == 4 else "striped_ring"}


@pytest.mark.parametrize("method,n", CONFIGS, ids=[f"{m}-N{n}" for m, n in CONFIGS])
def test_packed_matches_reference(method, n):
    kw = _usp_kw(n) if method == "usp" else {}
    res = run_distributed(_batch, n, method, 1000 * n + len(method), kw, timeout=240)
    for lens, causal, dtype, errs, pad_ok, worst in res[0]:
        assert pad_ok, f"padding rows got a non-zero output or gradient: lens={lens}"
        assert worst <= 1.0, f"{method} N={n} causal={causal} {dtype} lens={lens}: errors {errs}"


# ----------------------------------------------------------------------------- shard / unshard


def _roundtrip(methods, seed):
    rank, n = world()
    rng = random.Random(seed)
    ok = []
    for method in methods:
        kw = {"ulysses_degree": 2} if method == "usp" else {}
        for trial in range(3):
            lens = _lengths(rng, rng.randint(0, 18), cap=2000)
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
            T = int(cu[-1])
            gen = torch.Generator().manual_seed(T)  # the same global tensors on every rank
            for x, dim in ((torch.randn(1, T, 3, 5, generator=gen), 1), (torch.arange(T).reshape(1, T), 1),
                           (torch.randn(T, 2, generator=gen), 0), (torch.randn(2, 1, T, generator=gen), -1)):
                local = seqpar.shard(x, method=method, dim=dim, cu_seqlens=cu, **kw)
                back = seqpar.unshard(local, method=method, dim=dim, cu_seqlens=cu, **kw)
                ok.append((method, lens, dim, bool(torch.equal(back, x)) and back.dtype == x.dtype))
            pl = seqpar.packed_layout(cu, method=method, **kw)  # a prebuilt layout works the same
            local = seqpar.shard(x, method=method, dim=-1, cu_seqlens=pl, **kw)
            ok.append((method, lens, "layout", bool(torch.equal(
                seqpar.unshard(local, method=method, dim=-1, cu_seqlens=pl, **kw), x))))
    return ok


@pytest.mark.parametrize("n", [2, 4])
def test_shard_unshard_roundtrip_exact(n):
    methods = [m for m in seqpar.METHODS if m != "usp" or n == 4]
    for rank_res in run_distributed(_roundtrip, n, methods, n, timeout=120):
        for method, lens, dim, same in rank_res:
            assert same, f"{method} dim={dim} lens={lens}: unshard(shard(x)) != x"


# ----------------------------------------------------------------------------- bad input

BAD = {
    "not_zero": lambda T: torch.tensor([1, T], dtype=torch.int32),
    "not_increasing": lambda T: torch.tensor([0, 5, 5, T], dtype=torch.int32),
    "decreasing": lambda T: torch.tensor([0, 9, 4, T], dtype=torch.int32),
    "length": lambda T: torch.tensor([0, 4, T + 3], dtype=torch.int32),
    "dtype": lambda T: torch.tensor([0.0, 4.0, float(T)]),
    "rank_dependent": None,
}


def _bad(kind, method, where):
    rank, n = world()
    T = 24
    good = torch.tensor([0, 4, 11, T], dtype=torch.int32)
    cu = torch.tensor([0, 4 + rank, 11, T], dtype=torch.int32) if kind == "rank_dependent" else BAD[kind](T)
    if where == "shard":
        seqpar.shard(torch.zeros(1, T, 2, 4), method=method, cu_seqlens=cu)
    else:
        local = seqpar.shard(torch.zeros(1, T, 2, 4), method=method, cu_seqlens=good)
        if kind == "length":  # a stream that does not fit the offsets
            local = local[:, :-1]
            cu = good
        seqpar.attention(local, local, local, method=method, causal=True, cu_seqlens=cu)


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_cu_seqlens_raise_on_every_rank(kind):
    """ValueError on every rank before any communication (nothing hangs); a cu_seqlens that differs
    across ranks is caught by a cheap fingerprint all-gather, the same error on every rank."""
    for method, where in (("zigzag_ring", "attention"), ("ulysses", "attention"), ("striped_ring", "shard")):
        if kind == "rank_dependent" and where == "shard":
            continue  # shard is local: it cannot know what other ranks passed
        with pytest.raises(ValueError) as info:
            run_distributed(_bad, 2, kind, method, where, timeout=60)
        assert "cu_seqlens" in str(info.value) or "shape" in str(info.value)
