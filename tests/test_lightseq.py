"""lightseq (DistAttn's balanced causal schedule, ALGORITHMS.md §3) on real gloo ranks.

Output and dq, dk, dv against a float64 reference at world sizes 1-5 (odd and even), causal and
not, MHA and GQA, fp32 and bf16; the bytes each rank sends, helper traffic included, against the
schedule of §3 written out independently here; and the load balance of the schedule.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.softmax import plans
from seqpar.softmax.lightseq import lightseq_plan
from seqpar.testing import run_distributed

from test_token_ring import check_errors, compare


def lightseq_bytes(n, r, B, c, Hq, Hkv, D, esize, causal, grad_size=4):
    """Bytes rank r sends. Causal (§3): at step t = 1..⌊N/2⌋ rank r sends its K,V to r+t when
    r+t < N, else its queries to the helper r+t-N when helpers work at t (N - t > t); a helper
    (r < t) returns (out, lse) of the heavy rank's queries. Backward fetches the same way (queries
    with dout, lse, delta), normal ranks return dK,dV of the fetched K,V, helpers return dq.
    Non-causal runs the plain ring."""
    kv = 2 * B * c * Hkv * D
    if n == 1:
        return {"fwd": 0, "bwd": 0}
    if not causal:  # the ring: K,V N-1 hops; dK,dV (fp32) N hops
        return {"fwd": (n - 1) * kv * esize, "bwd": (n - 1) * kv * esize + n * kv * grad_size}
    q, lse = B * c * Hq * D, B * c * Hq
    fwd = bwd = 0
    for t in range(1, n // 2 + 1):
        helpers = t < n - t
        if r + t < n:
            fwd += kv * esize
            bwd += kv * esize
        elif helpers:
            fwd += q * esize
            bwd += 2 * q * esize + 2 * lse * 4
        if r >= t:
            bwd += kv * grad_size
        elif helpers:
            fwd += q * esize + lse * 4
            bwd += q * grad_size
    return {"fwd": fwd, "bwd": bwd}


def _cases():
    out = []
    for n in (1, 2, 3, 4, 5):
        for causal in (True, False):
            combos = [(4, 4, 64, torch.float32), (8, 2, 64, torch.bfloat16)]
            if n == 5 and causal:
                combos.append((8, 2, 80, torch.float32))
            for hq, hkv, d, dtype in combos:
                out.append(pytest.param(n, causal, hq, hkv, d, dtype,
                                        id=f"N{n}-{'causal' if causal else 'full'}-{'gqa' if hq != hkv else 'mha'}"
                                           f"-D{d}-{str(dtype)[6:]}"))
    return out


@pytest.mark.parametrize("n,causal,hq,hkv,d,dtype", _cases())
def test_lightseq(n, causal, hq, hkv, d, dtype):
    B, T = 2, 7 * n  # 7 tokens per rank: odd local length (contiguous layout allows it)
    res = run_distributed(compare, n, "lightseq", causal, B, T, hq, hkv, d, dtype, seed=n * 10 + hq, channels=False)
    check_errors(res, dtype)
    esize = torch.finfo(dtype).bits // 8
    for rank, r in enumerate(res):
        want = lightseq_bytes(n, rank, B, T // n, hq, hkv, d, esize, causal)
        for phase in ("fwd", "bwd"):
            got = r["stats"].total(phase)
            assert got == want[phase], f"rank {rank} {phase}: sent {got} bytes, formula says {want[phase]}"


def test_helper_traffic_and_channels():
    """N=5 with TokenRingGroups (results on their own communicator): helper returns are counted
    under their own name: rank 0 helps at t=1 and t=2, rank 1 at t=2, the others never."""
    B, T, hq, d = 1, 15, 4, 64
    res = run_distributed(compare, 5, "lightseq", True, B, T, hq, hq, d, torch.float32, seed=2)
    check_errors(res, torch.float32)
    c = T // 5
    for rank, r in enumerate(res):
        helps = sum(1 for t in (1, 2) if rank < t)
        assert r["stats"].total("fwd", "lightseq_out") == helps * B * c * (hq * d + hq) * 4
        assert r["stats"].total("bwd", "lightseq_out") == helps * B * c * hq * d * 4


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_schedule_consistent(n):
    """Host-only: moves pair up, operands are held when used, every allowed pair computed once."""
    for causal in (True, False):
        plans.verify(lightseq_plan, n, 3, causal, "contiguous")


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_schedule_bound(n):
    """The busiest rank works (N+1)/2 blocks for even N (bound N/(N+1) of the ideal) and every
    rank N/2 blocks for odd N (bound 1); a plain contiguous ring's busiest rank works N - 1/2."""
    c = 4
    works = [lightseq_plan(r, n, c, True).work(c) / (c * c) for r in range(n)]
    ideal = n / 2  # N²/2 blocks of work over N ranks
    if n % 2:
        assert works == [ideal] * n
    else:
        assert max(works) == (n + 1) / 2
    assert sum(works) == n * ideal


def test_prefetch_is_one_step_ahead():
    """Each fetch is posted one step before the step that computes with it."""
    n, c = 5, 4
    for r in range(n):
        sched = lightseq_plan(r, n, c, True)
        for i, step in enumerate(sched.steps):
            for task in step.tasks:
                if task.q or task.kv:
                    recv = [m for m in sched.steps[i - 1].moves if not m.send and m.what in ("q", "kv")]
                    assert recv and recv[0].owner == (task.q or task.kv)


def _bad_method_option():
    q = torch.randn(1, 4, 2, 8)
    seqpar.attention(q, q, q, method="lightseq", causal="yes")


def test_bad_input_raises_everywhere():
    with pytest.raises(ValueError, match="causal"):
        run_distributed(_bad_method_option, 3, timeout=30)
