"""Static GPU checks of the ``flash_attn`` backend against flash-attn's real Python interface.

For each flash-attn release the ``flash`` extra admits, its ``flash_attn_interface.py`` (from
the PyPI sdist, cached outside the repository: ``tests/gpu_static/flash_stub.py``) runs over a
stand-in for the compiled extension that applies the C++ API's input checks, on fake CUDA
tensors of a simulated GPU. seqpar's ``FlashAttnBackend`` forward/backward and the varlen flash
path are driven through it. In CI: the oldest and the newest admitted release; every release
with ``SEQPAR_GPU_STATIC_FULL=1``. Without the cached sources and without network, skipped.
"""

from __future__ import annotations

import itertools
import sys
import types
import warnings
from pathlib import Path
from unittest import mock

import pytest
import tomllib
import torch
from gpu_static.fake_cuda import cuda_tensor, fake_cuda
from gpu_static.flash_stub import (
    ADMITTED,
    CI_VERSIONS,
    FlashExtension,
    flash_attn_on_fake_gpu,
    interface_source,
)
from packaging.requirements import Requirement

from seqpar.kernels import FAILED_KERNELS, block_backward, block_forward, plan_block
from seqpar.kernels.dispatch import select_backend
from seqpar.kernels.flash import (
    MAX_VERSION,
    MIN_VERSION,
    FlashAttnBackend,
    version_tuple,
)
from seqpar.kernels.varlen import VarlenSegments, varlen_backward, varlen_forward

ROOT = Path(__file__).resolve().parents[1]
#: flash-attn 2.x releases on PyPI (2026-11), newest first.
RELEASES = ("2.8.3.post2", "2.8.3.post1", "2.8.3", "2.8.2", "2.8.1", "2.8.0.post2", "2.7.4.post1", "2.7.3",
            "2.7.2.post1", "2.7.1.post4", "2.7.0.post2", "2.6.3", "2.6.2", "2.6.1", "2.6.0.post1", "2.5.9.post1",
            "2.5.0", "2.4.3.post1", "2.0.0.post1")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
SHAPES = {"sq": (100, 100), "tq>tk": (100, 70), "tq<tk": (70, 100)}


def _versions():
    for v in ADMITTED:
        marks = () if v in CI_VERSIONS else (pytest.mark.gpu_static_full,)
        yield pytest.param(v, marks=marks, id=v)


@pytest.fixture(scope="module", params=list(_versions()))
def release(request):
    """``(version, path of its cached flash_attn_interface.py)``; skips when unavailable."""
    source = interface_source(request.param)
    if isinstance(source, str):
        pytest.skip(source)
    return request.param, source


def test_extra_admits_exactly_what_the_code_accepts():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = (Requirement(r) for r in extras["flash"])
    assert req.name == "flash-attn"
    for v in RELEASES + ("3.0.0", "2.9.0"):
        accepted = MIN_VERSION <= version_tuple(v)[:2] < MAX_VERSION
        assert req.specifier.contains(v) == accepted, v
    assert tuple(v for v in RELEASES if req.specifier.contains(v)) == tuple(reversed(ADMITTED))


@pytest.mark.parametrize("version", ["2.6.3", "2.5.9.post1", "3.0.0"])
def test_refuses_versions_outside_the_extra(version):
    package = types.ModuleType("flash_attn")
    package.__version__, package.flash_attn_interface = version, types.ModuleType("flash_attn_interface")
    with fake_cuda((9, 0)), mock.patch.dict(sys.modules, {"flash_attn": package}):
        q = cuda_tensor(1, 16, 2, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=f"flash_attn {version} is not supported"):
            block_forward(q, q, q, scale=0.125, backend="flash_attn")


def _block_cases():
    for (dn, dt), hn, mask, sn, d in itertools.product(DTYPES.items(), HEADS, ("none", "causal", "causal_strict"),
                                                       SHAPES, (64, 128)):
        yield pytest.param(dt, hn, mask, sn, d, id=f"{dn}-{hn}-{mask}-{sn}-d{d}")


@pytest.mark.parametrize("dt, heads, mask, shape, d", list(_block_cases()))
def test_block_forward_backward(release, dt, heads, mask, shape, d):
    (hq, hkv), (tq, tk) = HEADS[heads], SHAPES[shape]
    plan = plan_block(tq, tk, mask)
    with flash_attn_on_fake_gpu(release[1], release[0], (9, 0)) as (ext, contracts):
        q = cuda_tensor(2, tq, hq, d, dtype=dt)
        k, v = cuda_tensor(2, tk, hkv, d, dtype=dt), cuda_tensor(2, tk, hkv, d, dtype=dt)
        if plan.causal and not plan.square:  # bottom-right causal kernel: refused, never run
            with pytest.raises(ValueError, match="causal only on square blocks"):
                select_backend(q, k, v, mask=mask, backend="flash_attn")
            return
        out, lse = block_forward(q, k, v, scale=d**-0.5, mask=mask, backend="flash_attn")
        assert (out.shape, out.dtype, out.device.type) == (q.shape, dt, "cuda")
        assert (lse.shape, lse.dtype, lse.device.type) == ((2, hq, tq), torch.float32, "cuda")
        # the merged fp32 accumulator of a ring loop as `out`, dout in fp32 too
        acc = torch.empty(q.shape, dtype=torch.float32, device="cuda")
        grads = block_backward(acc, q, k, v, acc, lse, scale=d**-0.5, mask=mask, backend="flash_attn")
        for g, x in zip(grads, (q, k, v)):
            assert (g.shape, g.dtype, g.device.type) == (x.shape, dt, "cuda")
    assert ext.calls == ["fwd", "bwd"] and contracts.calls == []


@pytest.mark.parametrize("dt", DTYPES.values(), ids=list(DTYPES))
@pytest.mark.parametrize("heads", HEADS)
def test_varlen_flash_path(release, dt, heads):
    """Documents of 1, 37, 64 and 90 rows (causal), a non-causal segment against earlier keys and
    a causal_strict one: one non-causal and one causal varlen launch each way."""
    hq, hkv = HEADS[heads]
    segs = VarlenSegments.build([(0, 1, 0, 1, "causal"), (1, 37, 1, 37, "causal"), (38, 64, 38, 64, "causal"),
                                 (102, 90, 102, 90, "causal_strict"), (38, 64, 0, 38, "none")], tq=192, tk=192)
    with flash_attn_on_fake_gpu(release[1], release[0], (8, 0)) as (ext, contracts):
        q = cuda_tensor(1, 192, hq, 64, dtype=dt)
        k, v = cuda_tensor(1, 192, hkv, 64, dtype=dt), cuda_tensor(1, 192, hkv, 64, dtype=dt)
        out, lse = varlen_forward(q, k, v, segs, scale=0.125)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dt, (1, hq, 192), torch.float32)
        grads = varlen_backward(q, q, k, v, out, lse, segs, scale=0.125)
        for g, x in zip(grads, (q, k, v)):
            assert (g.shape, g.dtype, g.device.type) == (x.shape, dt, "cuda")
    n = len(segs.packed_calls())
    assert ext.calls == ["varlen_fwd"] * n + ["varlen_bwd"] * n and n == 2
    assert contracts.calls == []


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_packed_calls_go_to_the_backend_with_caps_varlen(release, backward, monkeypatch):
    """Packed calls are dispatched by capability, not by name: on a simulated sm_90 the first-ranked
    backend serves them with its varlen kernel: flash-attn's where it is installed, seqpar's Triton
    kernel (caps.varlen) where it is not; a forced backend without a varlen kernel for the case leaves
    them to block calls."""
    pytest.importorskip("triton")
    from seqpar.kernels import triton_target
    from seqpar.kernels.varlen_packed import packed_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter ranks Triton last
    # the simulated GPU's properties carry no shared-memory size: sm_90's own table entry
    monkeypatch.setattr(triton_target, "device_target", lambda device: triton_target.Target.of(90))
    with flash_attn_on_fake_gpu(release[1], release[0], (9, 0)):
        q, k = cuda_tensor(1, 64, 4, 64, dtype=torch.bfloat16), cuda_tensor(1, 64, 2, 64, dtype=torch.bfloat16)
        assert packed_backend(q, k, k, None, backward, True).name == "flash_attn"
        assert packed_backend(q, k, k, "triton", backward, True).name == "triton"
        assert packed_backend(q, k, k, "cudnn", backward, True) is None  # no varlen kernel: block calls
        assert packed_backend(q, k, k, "torch_cuda", backward, True).name == "torch_cuda"  # flash varlen
        qf, kf = q.float(), k.float()  # torch_cuda's fp32 kernel has no varlen mode: block calls
        assert packed_backend(qf, kf, kf, "torch_cuda", backward, True) is None
    no_flash = {"flash_attn": None, "flash_attn.flash_attn_interface": None}  # import raises ImportError
    with fake_cuda((9, 0)), mock.patch.dict(sys.modules, no_flash):
        q, k = cuda_tensor(1, 64, 4, 64, dtype=torch.bfloat16), cuda_tensor(1, 64, 2, 64, dtype=torch.bfloat16)
        assert packed_backend(q, k, k, None, backward, True).name == "triton"
        with pytest.raises(ValueError, match="backend='flash_attn' cannot serve this varlen block"):
            packed_backend(q, k, k, "flash_attn", backward, True)


def test_varlen_kernel_failure_falls_back(release):
    """flash-attn's varlen kernels fail to launch (automatic choice): one warning per direction,
    then the per-segment path (flash-attn's dense kernels here) serves; forcing still raises."""
    segs = VarlenSegments.build([(0, 37, 0, 37, "causal"), (37, 64, 37, 64, "causal"), (37, 64, 0, 37, "none")],
                                tq=101, tk=101)
    no_image = RuntimeError("CUDA error: no kernel image is available for execution on the device")
    FAILED_KERNELS.clear()
    try:
        with flash_attn_on_fake_gpu(release[1], release[0], (9, 0)) as (ext, _):
            ext.fail = {"varlen_fwd": no_image, "varlen_bwd": no_image}
            q = cuda_tensor(1, 101, 4, 64, dtype=torch.bfloat16)
            k = cuda_tensor(1, 101, 2, 64, dtype=torch.bfloat16)
            with pytest.warns(RuntimeWarning, match="'flash_attn'.*varlen GQA forward.*no kernel image"):
                out, lse = varlen_forward(q, k, k, segs, scale=0.125)
            with pytest.warns(RuntimeWarning, match="'flash_attn'.*varlen GQA backward.*no kernel image"):
                varlen_backward(q, q, k, k, out, lse, segs, scale=0.125)
            assert ext.calls == ["varlen_fwd"] + ["fwd"] * 3 + ["varlen_bwd"] + ["bwd"] * 3
            ext.calls.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # demoted: no second warning, no second attempt
                varlen_backward(q, q, k, k, *varlen_forward(q, k, k, segs, scale=0.125), segs, scale=0.125)
            assert ext.calls == ["fwd"] * 3 + ["bwd"] * 3
            with pytest.raises(RuntimeError, match="no kernel image"):
                varlen_forward(q, k, k, segs, scale=0.125, backend="flash_attn")
    finally:
        FAILED_KERNELS.clear()


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0), (7, 5)], ids=lambda c: f"sm{c[0]}{c[1]}")
def test_gpu_rule(release, cap):
    """flash-attn < 2.7.3 runs on sm_8x/sm_90 only, later releases on any sm >= 80; seqpar refuses
    what the extension would reject instead of failing inside it."""
    version, source = release
    runs = cap >= (8, 0) if version_tuple(version) >= (2, 7, 3) else cap[0] == 8 or cap == (9, 0)
    with flash_attn_on_fake_gpu(source, version, cap) as (ext, _):
        q = cuda_tensor(1, 64, 2, 64, dtype=torch.float16)
        if runs:
            out, lse = block_forward(q, q, q, scale=0.125, mask="causal", backend="flash_attn")
            block_backward(q, q, q, q, out, lse, scale=0.125, mask="causal", backend="flash_attn")
            assert ext.calls == ["fwd", "bwd"]
        else:
            with pytest.raises(ValueError, match="flash_attn"):
                block_forward(q, q, q, scale=0.125, backend="flash_attn")
            assert ext.calls == []
            assert FlashAttnBackend().unavailable(q.device) is not None


def test_stand_in_applies_the_cpp_checks():
    """The stand-in rejects what flash_api.cpp rejects, and lse layouts the kernels cannot read."""
    ext = FlashExtension("2.8.3", (9, 0))
    with fake_cuda((9, 0)):
        q = cuda_tensor(2, 64, 4, 64, dtype=torch.float16)
        lse = torch.empty(2, 4, 64, dtype=torch.float32, device="cuda")
        ok = ext.bwd(q, q, q, q, q, lse, None, None, None, None, 0.0, 0.125, False, -1, -1, 0.0, False, None, None)
        assert [t.shape for t in ok[:3]] == [q.shape] * 3
        bad_cases = {
            "contiguous float32": {"lse": lse.transpose(1, 2).contiguous().transpose(1, 2)},
            "fp16 and bf16": {"q": q.float()},
            "multiple of 8": {"q": cuda_tensor(2, 64, 4, 60, dtype=torch.float16)},
            "contiguous last dimension": {"q": q.transpose(1, 3).contiguous().transpose(1, 3)},
        }
        for message, change in bad_cases.items():
            x = change.get("q", q)
            with pytest.raises(RuntimeError, match=message):
                ext.bwd(x, x, x, x, x, change.get("lse", lse), None, None, None, None, 0.0, 0.125, False,
                        -1, -1, 0.0, False, None, None)
        cu = torch.empty(3, dtype=torch.int64, device="cuda")
        with pytest.raises(RuntimeError, match="int32"):
            ext.varlen_fwd(q[0], q[0], q[0], None, cu, cu, None, None, None, None, 64, 64, 0.0, 0.125, False,
                           True, -1, -1, 0.0, False, None)
    with fake_cuda((10, 0)):
        q = cuda_tensor(1, 8, 1, 64, dtype=torch.float16)
        with pytest.raises(RuntimeError, match="Ampere"):
            FlashExtension("2.7.2.post1", (10, 0)).fwd(q, q, q, None, None, 0.0, 0.1, True, -1, 0, 0.0, False, None)


@pytest.mark.gpu_static_full
def test_download_on_cache_miss(tmp_path, monkeypatch):
    """A cold cache fetches the sdist with pip (no build) and keeps only the interface file."""
    monkeypatch.setenv("SEQPAR_CACHE_DIR", str(tmp_path))
    source = interface_source(CI_VERSIONS[-1])
    if isinstance(source, str):
        pytest.skip(source)
    assert source.is_relative_to(tmp_path) and "def _flash_attn_backward" in source.read_text()
    assert [p.name for p in source.parent.iterdir()] == ["flash_attn_interface.py"]
