"""The executor's own memory traffic: the backward adds each block's dq, dK, dV into the first result
that covers every row instead of into a zero-filled accumulator, as ring-flash-attention starts its
sums (benchmarks/peer_side_by_side.py counts every op's writes against the peer's). A zero fill as
large as a gradient in the backward of a dense ring step is overhead the peer does not have."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import seqpar
from seqpar.testing import run_distributed

from dist_utils import rel_err

T, HQ, HKV, D = 96, 4, 2, 16
FILLS = {"zeros", "zero_", "fill_", "new_zeros", "zeros_like", "full", "new_full"}


class _Fills(TorchDispatchMode):
    """Records the sizes of the tensors zero- or constant-filled while active (bare fills of
    accumulators; kernels' internal fills are smaller than a [B, T_local, H, D] gradient here), and
    the dtypes of the tensors summed into in place (the accumulators: fp32 for bf16 input)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.sums: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in FILLS and isinstance(out, torch.Tensor):
            self.sizes.append(out.numel())
        if func.overloadpacket.__name__ == "add_":
            self.sums.add(out.dtype)
        return out


def _backward_fills(method: str, dtype: torch.dtype) -> tuple[list[int], int, float]:
    torch.manual_seed(0)
    full = [torch.randn(1, T, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ)]
    q, k, v, dout = (seqpar.shard(x, method=method) for x in full)
    qs, ks, vs = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out = seqpar.attention(qs, ks, vs, method=method, causal=True)
    with _Fills() as fills:
        out.backward(dout.to(dtype))
    # the gradients stay exact: against the float64 run of the same inputs
    q64, k64, v64 = (x.clone().requires_grad_() for x in (q, k, v))
    seqpar.attention(q64, k64, v64, method=method, causal=True).backward(dout)
    err = max(rel_err(a.grad, b.grad) for a, b in ((qs, q64), (ks, k64), (vs, v64)))
    return fills.sizes, ks.numel(), err, fills.sums


@pytest.mark.parametrize("method,n", [("ring", 2), ("zigzag_ring", 2), ("zigzag_ring", 3), ("striped_ring", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_fills_no_gradient_sized_accumulator(method, n, dtype):
    for rank, (sizes, kv_numel, err, sums) in enumerate(run_distributed(_backward_fills, n, method, dtype, timeout=120)):
        big = [s for s in sizes if s >= kv_numel]
        assert not big, f"{method} N={n} rank {rank}: zero-filled {big} elements (dK is {kv_numel})"
        # a result taken as the accumulator is cast first: every sum is in fp32, never in bf16
        assert sums <= {torch.float32}, f"{method} N={n} rank {rank}: summed in place in {sums}"
        # fp32: sums of a few fp32 blocks, ~1e-7 relative; bf16: the blocks' bf16 rounding, ~4e-3
        assert err < (2e-6 if dtype == torch.float32 else 2e-2), f"{method} N={n} rank {rank}: error {err:.1e}"
