"""Every entry point on CUDA tensors over a real NCCL process group (GPU only).

The lent GPU machines have one device, and NCCL refuses two ranks on one device, so the multi-rank
NCCL paths stay proven by the fake-NCCL checks (tests/test_gpu_static_nccl.py). What one GPU can
prove is the rest of a user's NCCL setup: a group created with ``backend="nccl"`` alone (which
cannot carry CPU tensors), CUDA inputs, and every method's executor with the kernels the dispatch
picks on the device, forward and backward. A one-rank group issues no collective (the agreement's
device all-reduce is skipped as for any single-rank group), so no NCCL kernel runs here. Each
case runs in a one-rank worker (``run_distributed``), creates a one-rank NCCL group beside its gloo
world, and compares output and gradients with a float64 CPU reference on the same rounded inputs;
tolerances as in tests/dist_utils.py (softmax) and tests/test_linear.py (linear), whose reasons
those files give.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar.linear import reference_linear_attention
from seqpar.methods import LINEAR_METHODS, METHODS
from seqpar.testing import run_distributed
from seqpar.tracing import Trace

from dist_utils import check_errors, global_inputs, reference_grads, rel_err, sdpa_grads

pytestmark = pytest.mark.gpu

# linear attention: at most 2x a single-device fp32 recurrence's error plus a floor (tests/test_linear.py)
LINEAR_FACTOR, LINEAR_FLOOR = 2.0, {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def _nccl_group():
    """A one-rank group on NCCL alone, and the CUDA device of this rank."""
    torch.cuda.set_device(0)
    return dist.new_group([0], backend="nccl"), torch.device("cuda", 0)


def _agreement(tr: Trace) -> list[tuple]:
    """The rank agreement's traced collectives: (kind, bytes) of each."""
    return [(e["kind"], e["bytes"]) for e in tr.to_dict()["events"]
            if e.get("chan") == "check_ranks" and e["type"] == "coll"]


def _softmax_on_rank(method, causal, dtype, shape, seed):
    group, dev = _nccl_group()
    try:
        low, hi = global_inputs(*shape, seed, dtype)
        q, k, v, dout = (t.to(dev) for t in low)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        tr = Trace()
        out = seqpar.attention(q, k, v, group=group, method=method, causal=causal, trace=tr)
        out.backward(dout)
        torch.cuda.synchronize()
        got = [t.cpu() for t in (out.detach(), q.grad, k.grad, v.grad)]
        agreement = _agreement(tr)
        ref = reference_grads(*hi, causal)
        base = None if dtype == torch.float32 else [rel_err(a, r) for a, r in zip(sdpa_grads(*low, causal), ref)]
        return {"errs": [rel_err(a, r) for a, r in zip(got, ref)], "base": base, "agreement": agreement,
                "dtypes": [str(t.dtype) for t in got], "device": out.device.type}
    finally:
        dist.destroy_process_group(group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("method", METHODS)
def test_softmax_method_on_a_one_rank_nccl_group(method, causal, dtype):
    """B = 2, T = 322 (not a multiple of any tile), 8 query / 2 K,V heads, D = 64."""
    res = run_distributed(_softmax_on_rank, 1, method, causal, dtype, (2, 322, 8, 2, 64), 7)
    assert res[0]["device"] == "cuda" and set(res[0]["dtypes"]) == {str(dtype)}
    assert res[0]["agreement"] == []  # a one-rank group agrees with itself: no collective is issued
    check_errors(res, dtype)


def _linear_on_rank(method, dtype, backend, seed):
    group, dev = _nccl_group()
    try:
        gen = torch.Generator().manual_seed(seed)
        b, t, h, dk, dv = 2, 200, 4, 32, 48
        x = {n: torch.randn(b, t, h, d, generator=gen, dtype=torch.float64)
             for n, d in (("q", dk), ("k", dk), ("v", dv))}
        x["g"] = F.logsigmoid(torch.randn(b, t, h, dk, generator=gen, dtype=torch.float64) + 3)
        x = {n: v.to(dtype) for n, v in x.items()}
        w = torch.randn(b, t, h, dv, generator=gen, dtype=torch.float64)
        u = torch.randn(b, h, dk, dv, generator=gen, dtype=torch.float64)

        def run(inputs, fn, **kw):
            ins = {n: v.clone().requires_grad_() for n, v in inputs.items()}
            o, ht = fn(ins["q"], ins["k"], ins["v"], ins["g"], **kw)
            loss = (o.double() * w.to(o.device)).sum() + (ht.double() * u.to(o.device)).sum()
            grads = torch.autograd.grad(loss, [ins[n] for n in ("q", "k", "v", "g")])
            return [o.detach().cpu(), ht.detach().cpu()] + [gr.cpu() for gr in grads]

        tr = Trace()
        got = run({n: v.to(dev) for n, v in x.items()}, seqpar.linear_attention, group=group, method=method,
                  output_final_state=True, trace=tr, backend=backend)
        torch.cuda.synchronize()
        ref = run({n: v.double() for n, v in x.items()}, reference_linear_attention)
        # the tolerance baseline: the recurrence in fp32 on the same inputs, rounded to the dtype
        base = [b_.to(dtype) for b_ in run({n: v.float() for n, v in x.items()}, reference_linear_attention)]
        return {"errs": [rel_err(a, r) for a, r in zip(got, ref)], "base": [rel_err(a, r) for a, r in zip(base, ref)],
                "agreement": _agreement(tr),
                "computes": sum(e["type"] == "compute" for e in tr.to_dict()["events"])}
    finally:
        dist.destroy_process_group(group)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", LINEAR_METHODS)
def test_linear_method_on_a_one_rank_nccl_group(method, dtype, backend):
    """Output, final state and the gradients of q, k, v and the per-channel decay g, with each of
    seqpar's kernels named (automatic would hand a one-rank call to flash-linear-attention where it
    is installed, and nothing of seqpar's would run)."""
    r = run_distributed(_linear_on_rank, 1, method, dtype, backend, 11)[0]
    assert r["agreement"] == [] and r["computes"] > 0
    for name, e, b in zip(("o", "final state", "dq", "dk", "dv", "dg"), r["errs"], r["base"]):
        bound = LINEAR_FACTOR * b + LINEAR_FLOOR[dtype]
        assert e <= bound, f"{method} {name}: error {e:.2e} > {bound:.2e}"


def _bad_input_on_rank():
    group, dev = _nccl_group()
    try:
        q = torch.randn(1, 64, 4, 32, device=dev)
        k = torch.randn(1, 64, 3, 32, device=dev)  # 4 query heads cannot share 3 K,V heads
        try:
            seqpar.attention(q, k, k, group=group, method="zigzag_ring")
        except ValueError as exc:
            return str(exc)
        return None
    finally:
        dist.destroy_process_group(group)


def test_bad_input_raises_on_an_nccl_group():
    """A bad input on CUDA tensors over an NCCL-only group raises ValueError naming the problem (one
    rank: the local check; the all-reduce that carries it across ranks is not issued)."""
    msg = run_distributed(_bad_input_on_rank, 1)[0]
    assert msg is not None and "head" in msg.lower()
