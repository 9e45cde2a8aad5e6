"""Ulysses (all-to-all to head shards) on real gloo ranks.

Every case compares the output and dq, dk, dv with a float64 single-device reference computed on
the same (rounded) inputs, and checks the bytes each rank sent against ALGORITHMS.md §8 in its
GQA-aware form: a KV head goes only to the ranks whose query heads use it.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.testing import run_distributed

from dist_utils import check_errors, global_inputs, reference_grads, rel_err, sdpa_grads



def query_heads(hq, u, m):
    """The query heads of Ulysses member m: Hq // U each, one more for the first Hq % U members
    (written independently of the library)."""
    sizes = [hq // u + (i < hq % u) for i in range(u)]
    start = sum(sizes[:m])
    return range(start, start + sizes[m])


def kv_heads_needed(hq, hkv, u, m):
    """KV heads used by the query heads of Ulysses member m."""
    return {head // (hq // hkv) for head in query_heads(hq, u, m)}


def ulysses_bytes(u, me, B, c, hq, hkv, d, esize):
    """``(forward, backward)`` bytes member ``me`` sends. Forward: q rows of every other member's
    query heads, out rows of its own heads to every other member, and c·D of k and of v per KV head
    per other member that needs it. Backward: dout like q, dq like out, and dk, dv of its own KV heads
    back to every other member. (Equal when U divides Hq and Hkv.)"""
    if u == 1:
        return 0, 0
    others = [m for m in range(u) if m != me]
    q = sum(len(query_heads(hq, u, m)) for m in others)
    out = (u - 1) * len(query_heads(hq, u, me))
    kv_fwd = 2 * sum(len(kv_heads_needed(hq, hkv, u, m)) for m in others)
    kv_bwd = 2 * (u - 1) * len(kv_heads_needed(hq, hkv, u, me))
    unit = B * c * d * esize
    return (q + out + kv_fwd) * unit, (q + out + kv_bwd) * unit


def run_sharded(method, causal, low, *, group=None, stats=None, layout=None, **kw):
    """Shard the global inputs, run fwd+bwd, gather output and gradients back (global order)."""
    layout = layout or {}
    q, k, v, dout = low
    ql, kl, vl, dl = (seqpar.shard(t, method=method, group=group, **layout) for t in (q, k, v, dout))
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    out = seqpar.attention(ql, kl, vl, method=method, causal=causal, stats=stats, group=group, **layout, **kw)
    out.backward(dl)
    assert out.dtype == q.dtype and ql.grad.dtype == q.dtype and kl.grad.dtype == k.dtype
    return [seqpar.unshard(t, method=method, group=group, **layout) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]


def errors(got, low, hi, causal, dtype):
    """Errors of (out, dq, dk, dv) against float64, and the bf16 single-device baseline errors."""
    ref = reference_grads(*hi, causal)
    errs = [rel_err(a, r) for a, r in zip(got, ref)]
    base = None if dtype == torch.float32 else [rel_err(a, r) for a, r in zip(sdpa_grads(*low, causal), ref)]
    return errs, base




def _case(causal, B, T, Hq, Hkv, D, dtype, seed):
    low, hi = global_inputs(B, T, Hq, Hkv, D, seed, dtype)
    stats = seqpar.CommStats()
    got = run_sharded("ulysses", causal, low, stats=stats)
    errs, base = errors(got, low, hi, causal, dtype)
    return {"errs": errs, "base": base, "fwd": stats.total("fwd"), "bwd": stats.total("bwd")}


def _run(n, causal, B, T, hq, hkv, d, dtype, seed=0):
    res = run_distributed(_case, n, causal, B, T, hq, hkv, d, dtype, seed=seed)
    check_errors(res, dtype)
    esize = torch.finfo(dtype).bits // 8
    for rank, r in enumerate(res):
        fwd, bwd = ulysses_bytes(n, rank, B, T // n, hq, hkv, d, esize)
        assert r["fwd"] == fwd, f"rank {rank}: forward sent {r['fwd']} bytes, formula says {fwd}"
        assert r["bwd"] == bwd, f"rank {rank}: backward sent {r['bwd']} bytes, formula says {bwd}"


def _cases():
    out = []
    for n in (2, 4):
        for causal in (True, False):
            for hq, hkv in ((4, 4), (8, 2)):
                for dtype in (torch.float32, torch.bfloat16):
                    d = 80 if (hkv == 2 and dtype == torch.float32) else 64
                    out.append(pytest.param(n, causal, hq, hkv, d, dtype,
                                            id=f"N{n}-{'causal' if causal else 'full'}-{'gqa' if hq != hkv else 'mha'}"
                                               f"-D{d}-{str(dtype)[6:]}"))
    return out


@pytest.mark.parametrize("n,causal,hq,hkv,d,dtype", _cases())
def test_ulysses(n, causal, hq, hkv, d, dtype):
    _run(n, causal, 2, 7 * n, hq, hkv, d, dtype, seed=n * 10 + hq)  # odd local length 7


# GQA routings: Hkv < N (heads shared by N/Hkv ranks), Hkv = 1, and query heads that do not split
# evenly over their KV heads on a rank (Hq=12, Hkv=6, N=4: 3 query heads over 2 KV heads each).
@pytest.mark.parametrize("hq,hkv,dtype", [(4, 1, torch.float32), (4, 1, torch.bfloat16), (12, 6, torch.float32),
                                          (24, 6, torch.bfloat16)],
                         ids=["hkv1-float32", "hkv1-bfloat16", "q12-kv6-float32", "q24-kv6-bfloat16"])
def test_gqa_routing(hq, hkv, dtype):
    _run(4, True, 1, 8, hq, hkv, 64, dtype, seed=hq + hkv)


# Head counts the Ulysses degree does not divide: uneven query-head shards and uneven all-to-all
# splits. SmolLM2-135M (9 q / 3 kv: 5+4 at N=2, 3+2+2+2 at N=4, a KV group straddling members),
# Qwen2.5-0.5B (14 / 2), SmolLM2-360M (15 / 5), and N=3.
@pytest.mark.parametrize("n,hq,hkv,dtype", [
    (2, 9, 3, torch.float32), (4, 9, 3, torch.float32), (2, 9, 3, torch.bfloat16), (4, 9, 3, torch.bfloat16),
    (4, 14, 2, torch.float32), (4, 15, 5, torch.float32), (3, 14, 2, torch.float32), (4, 5, 1, torch.bfloat16),
], ids=["smollm2-N2-float32", "smollm2-N4-float32", "smollm2-N2-bfloat16", "smollm2-N4-bfloat16",
        "q14-kv2-N4", "q15-kv5-N4", "q14-kv2-N3", "q5-kv1-N4-bfloat16"])
def test_uneven_heads(n, hq, hkv, dtype):
    _run(n, True, 1, 5 * n, hq, hkv, 64, dtype, seed=hq * n)


def test_uneven_heads_full_attention():
    _run(4, False, 2, 12, 9, 3, 80, torch.float32, seed=3)


def test_one_token_per_rank():
    _run(4, True, 3, 4, 8, 2, 64, torch.float32, seed=1)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)], ids=["gqa", "hkv1"])
def test_world_size_8(hq, hkv):
    _run(8, True, 1, 16, hq, hkv, 64, torch.float32, seed=8)


def _bad(kind):
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16)
    if kind == "heads":  # 3 query heads over 4 ranks: one rank would hold none
        seqpar.attention(q[:, :, :3], k[:, :, :1], v[:, :, :1], method="ulysses")
    elif kind == "usp_option":
        seqpar.attention(q[:, :, :4], k, v, method="ulysses", ring_method="ring")


@pytest.mark.parametrize("kind,match", [
    ("heads", r"q: Hq=3 query heads cannot be split over the 4 ranks .*ulysses_degree=2.*ring-family"),
    ("usp_option", "ring_method")])
def test_bad_input_raises_on_every_rank(kind, match):
    """Each rank raises the same ValueError before any communication: nothing hangs."""
    with pytest.raises(ValueError, match=match) as info:
        run_distributed(_bad, 4, kind, timeout=60)
    assert "[0, 1, 2, 3]" in str(info.value)
