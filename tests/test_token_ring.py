"""token_ring on real gloo ranks (ALGORITHMS.md §2).

Output and dq, dk, dv against a float64 single-device reference on the same rounded inputs, at
world sizes 1-5 (odd ones included), causal and not, MHA and GQA, fp32 and bf16; the bytes of
both traffic directions against the formulas; and the busiest link per step against the ring's.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.softmax import plans
from seqpar.comm import TokenRingGroups
from seqpar.softmax.token_ring import token_ring_plan
from seqpar.testing import run_distributed

from dist_utils import BF16_FACTOR, BF16_FLOOR, check_errors, global_inputs, reference_grads, rel_err, sdpa_grads



def run_parallel(method, causal, low, *, stats=None, channels=True, **kw):
    """Shard, run fwd+bwd with ``TokenRingGroups`` (or the plain world group), gather back; shard and
    unshard take the same ``group`` as the attention."""
    group = TokenRingGroups() if channels else None
    ql, kl, vl, dl = (seqpar.shard(t, method=method, group=group) for t in low)
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    out = seqpar.attention(ql, kl, vl, method=method, causal=causal, stats=stats, group=group, **kw)
    out.backward(dl)
    assert out.dtype == ql.dtype and ql.grad.dtype == ql.dtype and kl.grad.dtype == kl.dtype
    return [seqpar.unshard(t, method=method, group=group) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]


def compare(method, causal, B, T, Hq, Hkv, D, dtype, seed, channels=True):
    """Runs on every rank: errors of out, dq, dk, dv, the bf16 baseline, and the CommStats."""
    low, hi = global_inputs(B, T, Hq, Hkv, D, seed, dtype)
    stats = seqpar.CommStats()
    got = run_parallel(method, causal, low, stats=stats, channels=channels)
    ref = reference_grads(*hi, causal)
    base = None if dtype == torch.float32 else [rel_err(a, r) for a, r in zip(sdpa_grads(*low, causal), ref)]
    return {"errs": [rel_err(a, r) for a, r in zip(got, ref)], "base": base, "stats": stats}




def token_ring_bytes(n, r, B, c, Hq, D, esize, causal, grad_size=4):
    """Bytes rank r sends, from ALGORITHMS.md §2 (written out here, independent of the schedule).

    Query rows: non-causal (N-1)·c; causal, queries move toward r-1 and only the second half
    travels after the wrap: rank r >= 1 sends N-r full and r-1 half, rank 0 only halves.
    Output rows: non-causal (N-1)·c; causal, the N-1-r owners after r get full rows, the r before
    it half. A query row is Hq·D elements (input dtype); an output row adds Hq fp32 lse; a backward
    bundle row is q and dout (input dtype) plus lse and delta (fp32); a dq row is Hq·D in fp32.
    """
    h = c // 2
    if n == 1:
        q_rows = out_rows = 0
    elif not causal:
        q_rows = out_rows = (n - 1) * c
    else:
        q_rows = (n - 1) * h if r == 0 else (n - r) * c + (r - 1) * h
        out_rows = (n - 1 - r) * c + r * h
    return {
        ("fwd", "token_ring_q"): q_rows * B * Hq * D * esize,
        ("fwd", "token_ring_out"): out_rows * B * (Hq * D * esize + Hq * 4),
        ("bwd", "token_ring_q"): q_rows * B * (2 * Hq * D * esize + 2 * Hq * 4),
        ("bwd", "token_ring_out"): out_rows * B * Hq * D * grad_size,
    }


def check_bytes(res, n, B, T, Hq, D, dtype, causal):
    esize = torch.finfo(dtype).bits // 8
    for rank, r in enumerate(res):
        want = token_ring_bytes(n, rank, B, T // n, Hq, D, esize, causal)
        stats = r["stats"]
        for (phase, prim), nbytes in want.items():
            got = stats.total(phase, prim)
            assert got == nbytes, f"rank {rank} {phase} {prim}: sent {got} bytes, formula says {nbytes}"
        assert stats.total() == sum(want.values()), f"rank {rank}: K,V or dK,dV moved: {stats.as_dict()}"


def _cases():
    out = []
    for n in (1, 2, 3, 4, 5):
        for causal in (True, False):
            combos = [(4, 4, 64, torch.float32), (8, 2, 64, torch.bfloat16)]
            if n == 3:
                combos.append((8, 2, 80, torch.float32))
            for hq, hkv, d, dtype in combos:
                out.append(pytest.param(n, causal, hq, hkv, d, dtype,
                                        id=f"N{n}-{'causal' if causal else 'full'}-{'gqa' if hq != hkv else 'mha'}"
                                           f"-D{d}-{str(dtype)[6:]}"))
    return out


@pytest.mark.parametrize("n,causal,hq,hkv,d,dtype", _cases())
def test_token_ring(n, causal, hq, hkv, d, dtype):
    B, T = 2, 12 * n  # 12 tokens per rank: zigzag chunks of 6, causal halves of 6 on the wire
    res = run_distributed(compare, n, "token_ring", causal, B, T, hq, hkv, d, dtype, seed=n * 10 + hq)
    check_errors(res, dtype)
    check_bytes(res, n, B, T, hq, d, dtype, causal)


def test_plain_group_and_tiny_shards():
    """Without TokenRingGroups both directions share the world group (tagged streams); two tokens
    per rank (causal halves of one row) and batch 3 with a single KV head."""
    res = run_distributed(compare, 3, "token_ring", True, 3, 6, 4, 1, 64, torch.float32, seed=4, channels=False)
    check_errors(res, torch.float32)
    check_bytes(res, 3, 3, 6, 4, 64, torch.float32, True)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_schedule_consistent(n):
    """Host-only: moves pair up across ranks, operands are held when used, every allowed
    (query, key) pair is computed exactly once."""
    for causal in (True, False):
        plans.verify(token_ring_plan, n, 4, causal, "zigzag")


def test_schedule_balanced():
    """Causal: every step after the diagonal is half a block on every rank."""
    for n in (2, 3, 5, 8):
        works = {token_ring_plan(r, n, 8, True).work(8) for r in range(n)}
        assert works == {32 + (n - 1) * 32}, works


def _grad_comm_input():
    low, hi = global_inputs(1, 24, 4, 2, 32, 9, torch.bfloat16)
    stats = seqpar.CommStats()
    got = run_parallel("token_ring", True, low, stats=stats, grad_comm_dtype="input")
    errs = [rel_err(a, r) for a, r in zip(got, reference_grads(*hi, True))]
    return errs, [rel_err(a, r) for a, r in zip(sdpa_grads(*low, True), reference_grads(*hi, True))], stats


def test_grad_comm_dtype_input_halves_dq_bytes():
    """dq partials may travel in the input dtype: one block's dq each, rounded once."""
    for rank, (errs, base, stats) in enumerate(run_distributed(_grad_comm_input, 3)):
        want = token_ring_bytes(3, rank, 1, 8, 4, 32, 2, True, grad_size=2)[("bwd", "token_ring_out")]
        assert stats.total("bwd", "token_ring_out") == want
        for e, b in zip(errs, base):
            assert e <= BF16_FACTOR * b + BF16_FLOOR


def _link_per_step(method, group_kind):
    low, _ = global_inputs(1, 32, 4, 4, 16, 0, torch.float32)
    stats = seqpar.CommStats()
    run_parallel(method, False, low, stats=stats, channels=group_kind == "channels")
    return stats.busiest_link_per_step("fwd")


def test_busiest_link_about_half_of_ring():
    """MHA: per step a ring sends K and V (2·c·d) to one neighbour; TokenRing sends Q (c·d) one way
    and one partial output (c·(d + Hq)) the other."""
    c, hq, d = 8, 4, 16
    ring = run_distributed(_link_per_step, 4, "zigzag_ring", "plain")
    tr = run_distributed(_link_per_step, 4, "token_ring", "channels")
    for a, b in zip(ring, tr):
        assert a == 2 * c * hq * d * 4
        assert b == c * (hq * d + hq) * 4
        assert b / a < 0.55


def _bad_groups():
    TokenRingGroups("world")


def test_bad_group_raises_everywhere():
    with pytest.raises(ValueError, match="group"):
        run_distributed(_bad_groups, 2, timeout=30)


def _odd_local_length():
    q = torch.randn(1, 5, 2, 8)
    seqpar.attention(q, q, q, method="token_ring", group=TokenRingGroups())


def test_odd_local_length_raises_everywhere():
    with pytest.raises(ValueError, match="zigzag"):
        run_distributed(_odd_local_length, 2, timeout=30)
