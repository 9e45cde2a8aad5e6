"""Block backward with a gradient on the lse (``seqpar.attention(..., return_lse=True)``'s dlse), at
the kernel level: the executor hands each block ``delta' = rowsum(dout * out) - dlse`` either as a
surrogate ``out`` (:func:`seqpar.softmax.foreign.kernel_out`, for kernels that derive delta from out:
torch's CPU / CUDA ops, cuDNN) or, where a row has ``dout = 0`` and ``delta' != 0`` (a loss of the lse
alone), as ``delta`` with ``out=None`` (kernels that take delta: the reference and Triton kernels).

Each case checks dq, dk, dv of the loss ``(out * dout).sum() + (lse * dlse).sum()`` of one block
against float64 autograd (tests/test_kernels.py's ``dense``; rows that see no key have lse -inf and
get no gradient). Tolerances as test_kernels.py's ``check``: fp32 within 1e-5 of the largest
gradient; bf16 within twice plain bf16 torch's error plus half a bf16 ulp. The CPU cases run in CI;
the CUDA ones (``-m gpu``) run in a GPU session (benchmarks/gpu_session_backends.sh).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import check, dense, make_qkv, visible

from seqpar.kernels import block_backward, block_forward
from seqpar.softmax.foreign import kernel_out


def _case(backend, mask, dtype, device, silent_rows, hq=8, hkv=2, tq=23, tk=17):
    q, k, v = (x.to(device) for x in make_qkv(2, tq, tk, hq, hkv, 64, dtype, seed=12))
    gen = torch.Generator().manual_seed(13)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    if silent_rows:  # every third row only in the lse's term (its dout is 0)
        dout[:, ::3] = 0
    dout = dout.to(device)
    dlse = torch.randn(2, hq, tq, generator=gen).to(device)
    scale = 0.125
    out, lse = block_forward(q, k, v, scale=scale, mask=mask, backend=backend)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2) - dlse
    surrogate = kernel_out(dout, delta, lse)
    assert (surrogate is None) == silent_rows, "kernel_out must refuse exactly the rows only delta carries"
    grads = block_backward(dout, q, k, v, surrogate, lse, scale=scale, mask=mask, backend=backend,
                           delta=delta if surrogate is None else None)

    vis = visible(tq, tk, mask, device=device)

    def run(qq, kk, vv, do, dl):
        leaves = [x.detach().clone().requires_grad_() for x in (qq, kk, vv)]
        o, lse_ = dense(*leaves, scale, vis)
        seen = torch.isfinite(lse_)
        loss = (o * do).sum() + (torch.where(seen, lse_, torch.zeros_like(lse_)) * dl).sum()
        loss.backward()
        return [x.grad for x in leaves]

    truth = run(q.double(), k.double(), v.double(), dout.double(), dlse.double())
    plain = run(q, k, v, dout, dlse.to(dtype)) if dtype != torch.float32 else [None] * 3
    for name, got, t, p in zip(("dq", "dk", "dv"), grads, truth, plain):
        check(name, got, t, p)


@pytest.mark.parametrize("silent_rows", [False, True], ids=["surrogate_out", "delta_only"])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("backend", ["reference", "torch_cpu"])
def test_cpu_backward_with_lse_grad(backend, mask, silent_rows):
    if backend == "torch_cpu" and silent_rows:
        pytest.skip("torch_cpu derives delta from out: the executor sends such rows to the reference kernel")
    _case(backend, mask, torch.float32, "cpu", silent_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("silent_rows", [False, True], ids=["surrogate_out", "delta_only"])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("backend", ["torch_cuda", "cudnn", "triton"])
def test_cuda_backward_with_lse_grad(backend, mask, silent_rows):
    if backend != "triton" and silent_rows:
        pytest.skip(f"{backend} derives delta from out: the executor sends such rows to the Triton kernel")
    _case(backend, mask, torch.bfloat16, "cuda", silent_rows)


def test_cpu_delta_only_rows_dispatch_to_a_kernel_that_takes_delta():
    """With ``out=None`` (the rows only delta carries) automatic dispatch picks a kernel that works
    from delta and gets the float64 gradients."""
    _case(None, "causal", torch.float32, "cpu", True)
