"""Static GPU checks of the ``flash4`` backend against FlashAttention-4's real Python interface.

The pinned release's ``flash_attn/cute/interface.py`` (from its PyPI wheel, cached outside the
repository: ``tests/gpu_static/flash4_stub.py``) gives ``_flash_attn_fwd`` / ``_flash_attn_bwd``
their real parameter lists and input asserts over a stand-in for the CuTe DSL kernels, on fake CUDA
tensors of a simulated sm_90 / sm_100 GPU; seqpar's ``Flash4Backend`` is driven through dispatch
with ``backend="flash4"`` (block calls, windows, packed documents). Without the cached source and
without network, skipped.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
from pathlib import Path
from unittest import mock

import pytest
import tomllib
import torch
from gpu_static.fake_cuda import cuda_tensor, fake_cuda
from gpu_static.flash4_stub import REAL, _functions, flash4_on_fake_gpu, interface_source, returned_names
from packaging.requirements import Requirement

from seqpar.kernels import Band, block_backward, block_forward, plan_block
from seqpar.kernels.flash4 import DISTRIBUTION, VERSION, head_dim_refusal
from seqpar.kernels.varlen import VarlenSegments, varlen_backward, varlen_forward

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEADS = {"gqa8/2": (8, 2), "mha8/8": (8, 8)}
SHAPES = {"square": (96, 96), "half_tall": (96, 48), "half_wide": (48, 96)}
CAPS = {"sm90": (9, 0), "sm100": (10, 0)}


@pytest.fixture(scope="module")
def source():
    path = interface_source(VERSION)
    if isinstance(path, str):
        pytest.skip(path)
    return path


def test_extra_pins_the_version_the_code_accepts():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = (Requirement(r) for r in extras["flash4"])
    assert req.name == DISTRIBUTION and str(req.specifier) == f"=={VERSION}"


def test_real_functions_return_what_the_stand_in_returns(source):
    """The stand-in's return shapes rest on these: the forward returns (out, lse, ...), the backward
    (dq, dk, dv) (plus dsink with a learnable sink, which seqpar never passes)."""
    fns = _functions(source.read_text())
    assert set(REAL) <= set(fns)
    assert all(r[:2] == ["out", "lse"] for r in returned_names(fns["_flash_attn_fwd"])), \
        returned_names(fns["_flash_attn_fwd"])
    assert all(r[:3] == ["dq", "dk", "dv"] for r in returned_names(fns["_flash_attn_bwd"]))


def _cases():
    for (cn, cap), (dn, dt), hn, mask, sn, d in itertools.product(
            CAPS.items(), DTYPES.items(), HEADS, ("none", "causal", "causal_strict"), SHAPES, (64, 128)):
        yield pytest.param(cap, dt, hn, mask, sn, d, id=f"{cn}-{dn}-{hn}-{mask}-{sn}-d{d}")


def _block(kernels, cap, dt, heads, mask, tq, tk, d):
    (hq, hkv) = HEADS[heads]
    q = cuda_tensor(2, tq, hq, d, dtype=dt)
    k, v = cuda_tensor(2, tk, hkv, d, dtype=dt), cuda_tensor(2, tk, hkv, d, dtype=dt)
    out, lse = block_forward(q, k, v, scale=d**-0.5, mask=mask, backend="flash4")
    assert (out.shape, out.dtype, out.device.type) == (q.shape, dt, "cuda")
    assert (lse.shape, lse.dtype, lse.device.type) == ((2, hq, tq), torch.float32, "cuda")
    acc = torch.empty(q.shape, dtype=torch.float32, device="cuda")  # a ring's merged out and dout
    grads = block_backward(acc, q, k, v, acc, lse, scale=d**-0.5, mask=mask, backend="flash4")
    for g, x in zip(grads, (q, k, v)):
        assert (g.shape, g.dtype, g.device.type) == (x.shape, dt, "cuda")


@pytest.mark.parametrize("cap, dt, heads, mask, shape, d", list(_cases()))
def test_block_forward_backward(source, cap, dt, heads, mask, shape, d):
    """One call each way for every reduced block: a top-left causal block of any shape becomes the
    bottom-right band (None, Tq - Tk) (``causal`` itself when square)."""
    tq, tk = SHAPES[shape]
    with flash4_on_fake_gpu(source, VERSION, cap) as kernels:
        _block(kernels, cap, dt, heads, mask, tq, tk, d)
    plan = plan_block(tq, tk, mask)
    causal, local, left, right = plan.causal and plan.square, plan.causal and not plan.square, None, None
    if local:
        right = plan.rows - plan.keys
    assert kernels.calls == [("fwd", causal, local, left, right, False), ("bwd", causal, local, left, right, False)]


@pytest.mark.parametrize("tq, tk, band, want", [
    (64, 64, Band(-16, 0), (False, True, 16, 0)),
    (64, 96, Band(-8, 40), (False, True, 40, 8)),
    (120, 40, Band(-30, 5), (False, True, 0, 35)),  # rows 70.. see nothing: reduced to 70 x 40
])
def test_windows_run_natively(source, tq, tk, band, want):
    with flash4_on_fake_gpu(source, VERSION) as kernels:
        _block(kernels, (9, 0), torch.bfloat16, "gqa8/2", band, tq, tk, 64)
    plan = plan_block(tq, tk, band)
    assert [c[1:5] for c in kernels.calls] == [want] * 2, (plan, kernels.calls)


def test_varlen_entry_points(source):
    """Packed documents (1, 37, 64, 90 rows, causal) and a non-causal segment: varlen calls."""
    segs = VarlenSegments.build([(0, 1, 0, 1, "causal"), (1, 37, 1, 37, "causal"), (38, 64, 38, 64, "causal"),
                                 (102, 90, 102, 90, "causal"), (38, 64, 0, 38, "none")], tq=192, tk=192)
    with flash4_on_fake_gpu(source, VERSION) as kernels:
        q = cuda_tensor(1, 192, 8, 64, dtype=torch.bfloat16)
        k, v = (cuda_tensor(1, 192, 2, 64, dtype=torch.bfloat16) for _ in range(2))
        out, lse = varlen_forward(q, k, v, segs, scale=0.125, backend="flash4")
        assert (out.shape, lse.shape, lse.dtype) == (q.shape, (1, 8, 192), torch.float32)
        grads = varlen_backward(q, q, k, v, out, lse, segs, scale=0.125, backend="flash4")
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert kernels.calls and all(c[-1] for c in kernels.calls), kernels.calls
    assert {c[0] for c in kernels.calls} == {"fwd", "bwd"}


@pytest.mark.parametrize("cap, d, backward, why", [
    ((9, 0), 192, True, "Hopper backward is tested for D <= 128"),
    ((10, 0), 192, False, "runs 8..128 or 256 there"),
    ((9, 0), 264, False, "needs a multiple of 8 in 8..256"),
])
def test_head_dim_refusals(source, cap, d, backward, why):
    assert why in head_dim_refusal(d, cap, backward)
    with flash4_on_fake_gpu(source, VERSION, cap):
        q = cuda_tensor(1, 32, 4, d, dtype=torch.bfloat16)
        out, lse = (q, torch.zeros(1, 4, 32, device="cuda")) if backward else (None, None)
        with pytest.raises(ValueError, match="backend='flash4' cannot serve"):
            if backward:
                block_backward(q, q, q, q, out, lse, scale=0.1, backend="flash4")
            else:
                block_forward(q, q, q, scale=0.1, backend="flash4")


@pytest.mark.parametrize("tq, tk, mask", [(64, 64, Band(-16, 0)), (64, 32, "causal"), (32, 64, Band(-8, 40))],
                         ids=["window", "causal_non_square", "band"])
def test_blackwell_d256_backward_refuses_local_blocks(source, tq, tk, mask):
    """FlashAttention-4's Blackwell backward at D = 256 asserts no local mode (found by compiling
    seqpar's calls for sm_100a, benchmarks/results/gpu_static/flash4_aot_sm100.md): a window band or a
    non-square causal block is refused for the backward and served for the forward; a square causal
    block and D = 128 are served both ways."""
    with flash4_on_fake_gpu(source, VERSION, (10, 0)) as kernels:
        q = cuda_tensor(1, tq, 4, 256, dtype=torch.bfloat16)
        k = cuda_tensor(1, tk, 4, 256, dtype=torch.bfloat16)
        out, lse = block_forward(q, k, k, scale=0.1, mask=mask, backend="flash4")
        with pytest.raises(ValueError, match="runs no local window"):
            block_backward(out, q, k, k, out, lse, scale=0.1, mask=mask, backend="flash4")
        block_backward(out[:, :tk], q[:, :tk], k, k, out[:, :tk], lse[..., :tk], scale=0.1, mask="causal",
                       backend="flash4")  # square: FlashAttention-4's causal mode
        q, k = cuda_tensor(1, tq, 4, 128, dtype=torch.bfloat16), cuda_tensor(1, tk, 4, 128, dtype=torch.bfloat16)
        out, lse = block_forward(q, k, k, scale=0.1, mask=mask, backend="flash4")  # D = 128: its local mode
        block_backward(out, q, k, k, out, lse, scale=0.1, mask=mask, backend="flash4")
    assert [c[0] for c in kernels.calls] == ["fwd", "bwd", "fwd", "bwd"], kernels.calls


def test_blackwell_d256_packed_window_backward_runs_per_segment(source):
    """Packed documents with a window at D = 256 on Blackwell: the forward is one varlen call, the
    backward's varlen kernel is refused (local mode), so a forced flash4 backward names the reason."""
    segs = VarlenSegments.build([(0, 40, 0, 40, Band(-8, 0)), (40, 24, 40, 24, Band(-8, 0))], tq=64, tk=64)
    with flash4_on_fake_gpu(source, VERSION, (10, 0)) as kernels:
        q = cuda_tensor(1, 64, 4, 256, dtype=torch.bfloat16)
        out, lse = varlen_forward(q, q, q, segs, scale=0.1, backend="flash4")
        with pytest.raises(ValueError, match="runs no local window"):
            varlen_backward(out, q, q, q, out, lse, segs, scale=0.1, backend="flash4")
    assert [(c[0], c[-1]) for c in kernels.calls] == [("fwd", True)], kernels.calls


def test_failures_that_demote():
    """What an automatic choice demotes (the next backend runs, one warning): the CuTe DSL's compile
    errors and FlashAttention-4's own asserts (unimplemented configurations); not an assert of any
    other code, nor a plain error."""
    from seqpar.kernels.flash4 import Flash4Backend

    def raised(code: str, filename: str) -> BaseException:
        try:
            exec(compile(code, filename, "exec"), {})  # noqa: S102 - a frame in that file
        except BaseException as exc:  # noqa: BLE001
            return exc
        raise AssertionError("did not raise")

    dsl_error = type("DSLRuntimeError", (RuntimeError,), {"__module__": "cutlass.base_dsl.common"})
    backend = Flash4Backend()
    assert backend.launch_failure(dsl_error("ICE\nmore")) == "DSLRuntimeError: ICE"
    inside = raised("assert False, 'hd256 does not support local attention'",
                    str(Path("site-packages", "flash_attn", "cute", "interface.py")))
    want = "AssertionError in FlashAttention-4: hd256 does not support local attention"
    assert backend.launch_failure(inside) == want
    assert backend.launch_failure(raised("assert False, 'x'", str(Path("seqpar", "kernels", "flash4.py")))) is None
    assert backend.launch_failure(raised("raise TypeError('x')", str(Path("flash_attn", "cute", "a.py")))) is None


def test_refuses_other_versions_and_gpus(source):
    with flash4_on_fake_gpu(source, VERSION, installed="4.0.0b35"):
        q = cuda_tensor(1, 32, 4, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="flash-attn-4 4.0.0b35 is not supported: seqpar needs exactly"):
            block_forward(q, q, q, scale=0.1, backend="flash4")
    with flash4_on_fake_gpu(source, VERSION, (8, 0)):
        q = cuda_tensor(1, 32, 4, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="sm_90 and sm_100/110 only"):
            block_forward(q, q, q, scale=0.1, backend="flash4")
    with fake_cuda((9, 0)), _not_installed():
        q = cuda_tensor(1, 32, 4, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"pip install 'seqpar\[flash4\]'"):
            block_forward(q, q, q, scale=0.1, backend="flash4")


@contextlib.contextmanager
def _not_installed():
    """``flash-attn-4`` absent, also where the extra is installed."""
    from seqpar.kernels.flash4 import installed_version

    real = importlib.metadata.version

    def version_of(name):
        if name == DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    installed_version.cache_clear()
    try:
        with mock.patch("importlib.metadata.version", version_of):
            yield
    finally:
        installed_version.cache_clear()


def test_stand_in_rejects_what_the_real_interface_rejects(source):
    """The stand-in is strict where the real function is: an unknown keyword is a TypeError (the real
    parameter list), fp32 fails the dtype assert."""
    from gpu_static.flash4_stub import stand_in

    module, _ = stand_in(source, (9, 0))
    with fake_cuda((9, 0)):
        q = cuda_tensor(1, 16, 2, 64, dtype=torch.bfloat16)
        with pytest.raises(TypeError):
            module._flash_attn_fwd(q, q, q, window_size=(1, 1))
        with pytest.raises(AssertionError, match="fp16/bf16"):
            module._flash_attn_fwd(q.float(), q.float(), q.float(), return_lse=True)
