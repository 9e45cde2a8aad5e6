"""Dispatch survives a backend whose kernel fails to compile or launch at first use.

A ``Broken`` backend (CPU, ranked above every real one) raises Triton's real ``OutOfResources``
or ``CompilationError`` from its forward or backward: dispatch demotes it for that case with one
warning and runs the next backend (torch_cpu), exactly; a forced ``backend="broken"`` raises;
bad input and other errors propagate. The flash-attn varlen path's fallback is checked on a
simulated GPU in ``tests/test_gpu_static_flash.py``.
"""

from __future__ import annotations

import ast
import warnings

import pytest
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import InterpreterError, OutOfResources, PTXASError

from seqpar.kernels import (
    FAILED_KERNELS,
    Backend,
    Capabilities,
    KernelCase,
    block_backward,
    block_forward,
    dispatch,
)
from seqpar.kernels.base import FLOAT_DTYPES, launch_failure
from seqpar.kernels.fallback import FailedKernels

SMEM = OutOfResources(120_000, 101_376, "shared memory")


class Broken(Backend):
    """torch_cpu's kernels, except that ``fail_forward`` / ``fail_backward`` are raised instead."""

    def __init__(self, name="broken", fail_forward=None, fail_backward=None, head_dims=None):
        self.name, self.fail_forward, self.fail_backward, self.head_dims = name, fail_forward, fail_backward, head_dims
        self.caps = Capabilities(devices=frozenset({"cpu"}), dtypes=FLOAT_DTYPES, priority=100)
        self.calls = {"forward": 0, "backward": 0}
        self.real = next(b for b in dispatch.BACKENDS if b.name == "torch_cpu")

    def forward(self, q, k, v, *, scale, causal):
        self.calls["forward"] += 1
        if self.fail_forward is not None and (self.head_dims is None or q.shape[-1] in self.head_dims):
            raise self.fail_forward
        return self.real.forward(q, k, v, scale=scale, causal=causal)

    def backward(self, dout, q, k, v, out, lse, *, scale, causal, delta):
        self.calls["backward"] += 1
        if self.fail_backward is not None:
            raise self.fail_backward
        return self.real.backward(dout, q, k, v, out, lse, scale=scale, causal=causal, delta=delta)


@pytest.fixture
def install(monkeypatch):
    """``install(*backends)`` puts backends in front of the real ones; demotions are forgotten after."""
    FAILED_KERNELS.clear()

    def put(*backends):
        monkeypatch.setattr(dispatch, "BACKENDS", (*backends, *dispatch.BACKENDS))
        return backends[0]

    yield put
    FAILED_KERNELS.clear()


def _qkv(d=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 24, 4, d, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 16, 2, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def _forward(q, k, v, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = block_forward(q, k, v, scale=0.2, mask="causal", **kw)
    return out, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_forward_failure_demotes_once_and_falls_back_exactly(install):
    broken = install(Broken(fail_forward=SMEM))
    q, k, v = _qkv()
    want = block_forward(q, k, v, scale=0.2, mask="causal", backend="torch_cpu")
    (out, lse), warned = _forward(q, k, v)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    (w,) = warned
    text = str(w.message)
    assert "'broken'" in text and "OutOfResources: out of resource: shared memory" in text and "float32 D=32" in text
    assert broken.calls["forward"] == 1 and len(FAILED_KERNELS) == 1
    (out2, _), warned2 = _forward(q, k, v)  # the demoted case: not retried, not warned again
    assert warned2 == [] and broken.calls["forward"] == 1 and torch.equal(out2, want[0])
    assert dispatch.select_backend(q, k, v, mask="causal").name == "torch_cpu"
    case = KernelCase.of(q, k, "causal", backward=False)
    assert FAILED_KERNELS.reason("broken", case).startswith("OutOfResources")


def test_demotion_is_per_case(install):
    broken = install(Broken(fail_forward=SMEM, head_dims={32}))
    _, warned = _forward(*_qkv(d=32))
    assert len(warned) == 1
    _, warned = _forward(*_qkv(d=16))  # another head dim: another kernel, still tried and served
    assert warned == [] and broken.calls["forward"] == 2
    _, warned = _forward(*_qkv(d=32, dtype=torch.float64))  # fp64: reference is preferred, broken unused
    assert warned == [] and broken.calls["forward"] == 2
    FAILED_KERNELS.clear()  # forgetting retries (and warns again)
    _, warned = _forward(*_qkv(d=32))
    assert len(warned) == 1 and broken.calls["forward"] == 3


def test_backward_failure_demotes_backward_only(install):
    src = "def kernel():\n    pass\n"
    err = CompilationError(src, ast.parse(src).body[0], "Cannot access global variable LOG2E")
    broken = install(Broken(fail_backward=err))
    q, k, v = _qkv()
    out, lse = block_forward(q, k, v, scale=0.2, mask="causal")
    dout = torch.randn_like(q)
    want = block_backward(dout, q, k, v, out, lse, scale=0.2, mask="causal", backend="torch_cpu")
    with pytest.warns(RuntimeWarning, match="'broken'.*backward.*CompilationError: at 1:0: .* LOG2E"):
        got = block_backward(dout, q, k, v, out, lse, scale=0.2, mask="causal")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    block_forward(q, k, v, scale=0.2, mask="causal")  # the forward case is not demoted
    assert broken.calls == {"forward": 2, "backward": 1}


def test_forced_backend_still_raises(install):
    broken = install(Broken(fail_forward=SMEM))
    q, k, v = _qkv()
    with pytest.raises(OutOfResources):
        block_forward(q, k, v, scale=0.2, backend="broken")
    assert len(FAILED_KERNELS) == 0
    _, warned = _forward(q, k, v)  # an earlier forced failure demoted nothing
    assert len(warned) == 1 and broken.calls["forward"] == 2
    with pytest.raises(OutOfResources):  # and forcing a demoted backend runs it (and raises) again
        block_forward(q, k, v, scale=0.2, mask="causal", backend="broken")


@pytest.mark.parametrize("error", [ValueError("q: bad input"), RuntimeError("CUDA error: an illegal memory access"),
                                   torch.cuda.OutOfMemoryError("CUDA out of memory"), InterpreterError("bug")],
                         ids=["value", "illegal_access", "oom", "interpreter"])
def test_other_errors_propagate(install, error):
    install(Broken(fail_forward=error))
    with pytest.raises(type(error)):
        block_forward(*_qkv(), scale=0.2)
    assert len(FAILED_KERNELS) == 0


def test_nothing_left_lists_every_backend(install, monkeypatch):
    first, second = Broken("broken1", fail_forward=SMEM), Broken("broken2", fail_forward=PTXASError("ptxas fatal"))
    monkeypatch.setattr(dispatch, "BACKENDS", (first, second))
    q, k, v = _qkv()
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="no attention backend fits") as e:
        block_forward(q, k, v, scale=0.2, mask="causal")
    assert "broken1: failed to compile or launch" in str(e.value) and "PTXASError: PTXAS error: ptxas fatal" in str(e.value)
    with pytest.raises(ValueError, match="no attention backend fits") as e:  # later: refused up front
        dispatch.select_backend(q, k, v, mask="causal")
    assert "broken1: failed to compile" in str(e.value) and "broken2: failed to compile" in str(e.value)


@pytest.mark.parametrize("error, demoted", [
    (SMEM, True),
    (PTXASError("ptxas fatal: Value 'sm_120a' is not defined"), True),
    (RuntimeError("CUDA error: no kernel image is available for execution on the device"), True),
    (RuntimeError("FlashAttention only supports Ampere GPUs or newer."), True),
    (RuntimeError("cutlassB: no kernel found to launch!"), True),
    (RuntimeError("This GPU does not have enough shared-memory (kernel requires 120 kb)"), True),
    (RuntimeError("CUDA error: too many resources requested for launch"), True),
    (RuntimeError("shape '[2, 4]' is invalid for input of size 7"), False),
    (ValueError("no kernel image is available"), False),
    (KeyError("x"), False),
], ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else str(x))
def test_launch_failure_classification(error, demoted):
    assert (launch_failure(error) is not None) == demoted


def test_record_is_bounded():
    record = FailedKernels()
    cases = [KernelCase("cpu", torch.float32, d, "none", False, False) for d in range(FailedKernels.MAX + 5)]
    for c in cases:
        record.record("b", c, "why")
    assert len(record) == FailedKernels.MAX
    assert record.reason("b", cases[0]) is None and record.reason("b", cases[-1]) == "why"
