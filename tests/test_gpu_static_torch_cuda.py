"""Static GPU checks of the ``torch_cuda`` backend: fake CUDA tensors on a simulated GPU.

Every block call seqpar makes through ``backend="torch_cuda"`` (``block_forward`` /
``block_backward`` and the varlen entry points) runs under ``FakeTensorMode`` with
``device="cuda"`` tensors while torch answers as an sm_75, sm_80, sm_86/89 or sm_90 GPU. The
tests check output shapes, dtypes and devices, and every call of torch's SDPA CUDA ops against
the layout contracts of the CUDA kernels (``tests/gpu_static/sdpa_contracts.py``), which torch's
fake kernels do not check: a violation means wrong results or a crash on a real GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from gpu_static import sdpa_contracts
from gpu_static.fake_cuda import cuda_tensor, fake_cuda

from seqpar.kernels import BACKEND_NAMES, Band, block_backward, block_forward, plan_block
from seqpar.kernels.flash import window_size
from seqpar.kernels.varlen import VarlenSegments, varlen_backward, varlen_forward

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
SHAPES = {"sq": (100, 100), "tq>tk": (100, 70), "tq<tk": (70, 100)}  # 100: not a multiple of 32
CAPS = {"sm75": (7, 5), "sm80": (8, 0), "sm90": (9, 0)}
FORWARD_OPS = {"_flash_attention_forward", "_scaled_dot_product_efficient_attention"}
BACKWARD_OPS = {"_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward"}


def _matrix():
    for (cn, cap), (dn, dt), hn, mask, sn, d in itertools.product(
        CAPS.items(), DTYPES.items(), HEADS, ("none", "causal"), SHAPES, (64, 128)
    ):
        if dt == torch.bfloat16 and cap < (8, 0):
            continue  # refused: test_bf16_refused_below_sm80
        yield pytest.param(cap, dt, hn, mask, sn, d, id=f"{cn}-{dn}-{hn}-{mask}-{sn}-d{d}")


def _run_block(cap, dt, heads, mask, shape, d, *, flash_sdp=True, layout="bthd", batch=2):
    """Forward then backward of one block on fake CUDA tensors; returns the contract record."""
    (hq, hkv), (tq, tk) = HEADS[heads], SHAPES[shape]
    with fake_cuda(cap, flash_sdp=flash_sdp) as contracts:

        def make(t, h):  # "bhtd": a [B, H, T, D] tensor seen as [B, T, H, D], as models hand it over
            if layout == "bhtd":
                return cuda_tensor(batch, h, t, d, dtype=dt).transpose(1, 2)
            return cuda_tensor(batch, t, h, d, dtype=dt)

        q, k, v = make(tq, hq), make(tk, hkv), make(tk, hkv)
        out, lse = block_forward(q, k, v, scale=d**-0.5, mask=mask, backend="torch_cuda")
        assert (out.shape, out.dtype, out.device.type) == (q.shape, dt, "cuda")
        assert (lse.shape, lse.dtype, lse.device.type) == ((batch, hq, tq), torch.float32, "cuda")
        out_in = make(tq, hq) if layout == "bhtd" else out  # a merged `out` in the caller's layout
        grads = block_backward(make(tq, hq), q, k, v, out_in, lse, scale=d**-0.5, mask=mask, backend="torch_cuda")
        for g, x in zip(grads, (q, k, v)):
            assert (g.shape, g.dtype, g.device.type) == (x.shape, dt, "cuda")
    return contracts


def _assert_clean(contracts):
    assert contracts.violations == []
    fwd = [c for c in contracts.calls if c in FORWARD_OPS]
    bwd = [c for c in contracts.calls if c in BACKWARD_OPS]
    assert len(fwd) == 1 and len(bwd) == 1, contracts.calls  # the kernels really ran


@pytest.mark.parametrize("cap, dt, heads, mask, shape, d", list(_matrix()))
def test_block_forward_backward(cap, dt, heads, mask, shape, d):
    _assert_clean(_run_block(cap, dt, heads, mask, shape, d))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_build_without_flash_kernel(dt, heads, mask):
    """Builds without torch's flash kernel (Windows, some ROCm) run half precision on the
    memory-efficient kernel, whose backward reads `out` with an implied row stride of H * D
    (non-causal GQA folds query heads into rows: the folded `out` must keep that stride)."""
    contracts = _run_block((8, 0), dt, heads, mask, "sq", 64, flash_sdp=False)
    _assert_clean(contracts)
    assert "_flash_attention_forward" not in contracts.calls


@pytest.mark.parametrize("cap", [(7, 5), (9, 0)], ids=["sm75", "sm90"])
@pytest.mark.parametrize("dt", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_strict"])
def test_inputs_in_bhtd_layout(cap, dt, heads, mask):
    """q/k/v/dout/out handed over as transposed [B, H, T, D] tensors (row stride D)."""
    _assert_clean(_run_block(cap, dt, heads, mask, "tq>tk", 64, layout="bhtd"))


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)], ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("heads", HEADS)
def test_head_dim_224_backward(cap, heads):
    """torch's flash backward raises for 192 < D <= 224 on sm_86/89/120/121: the memory-efficient
    backward serves those; the flash forward is fine everywhere."""
    contracts = _run_block(cap, torch.bfloat16, heads, "causal", "sq", 224, batch=1)
    _assert_clean(contracts)
    uses_flash_bwd = "_flash_attention_backward" in contracts.calls
    assert uses_flash_bwd == (cap in ((8, 0), (9, 0)))


def test_bf16_refused_below_sm80():
    with fake_cuda((7, 5)):
        q = cuda_tensor(1, 16, 2, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="bfloat16 needs compute capability >= 8.0"):
            block_forward(q, q, q, scale=0.125, backend="torch_cuda")


def test_unservable_case_lists_every_backend():
    """On a (simulated) GPU, a case nothing serves names every backend with its own reason."""
    with fake_cuda((8, 6)):
        q = cuda_tensor(1, 16, 2, 64, dtype=torch.int32)
        with pytest.raises(ValueError, match="no attention backend fits") as e:
            block_forward(q, q, q, scale=0.125, mask="causal")
    for name in BACKEND_NAMES:
        assert f"\n  {name}: " in str(e.value), str(e.value)


@pytest.mark.parametrize("cap", list(CAPS.values()), ids=list(CAPS))
@pytest.mark.parametrize("dt", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("heads", HEADS)
def test_varlen_entry_points(cap, dt, heads):
    """Packed streams (documents of 1, 37, 64 and 90 rows, causal, plus a non-causal segment against
    other keys), forward then backward: torch's flash varlen kernel where it runs (fp16/bf16 on
    sm_80+), else per-segment block calls."""
    hq, hkv = HEADS[heads]
    segs = VarlenSegments.build([(0, 1, 0, 1, "causal"), (1, 37, 1, 37, "causal"), (38, 64, 38, 64, "causal"),
                                 (102, 90, 102, 90, "causal"), (38, 64, 0, 38, "none")], tq=192, tk=192)
    with fake_cuda(cap) as contracts:
        q = cuda_tensor(1, 192, hq, 64, dtype=dt)
        k, v = cuda_tensor(1, 192, hkv, 64, dtype=dt), cuda_tensor(1, 192, hkv, 64, dtype=dt)
        out, lse = varlen_forward(q, k, v, segs, scale=0.125, backend="torch_cuda")
        assert (out.shape, out.dtype, lse.shape, lse.device.type) == (q.shape, dt, (1, hq, 192), "cuda")
        grads = varlen_backward(q, q, k, v, out, lse, segs, scale=0.125, backend="torch_cuda")
        for g, x in zip(grads, (q, k, v)):
            assert (g.shape, g.dtype, g.device.type) == (x.shape, dt, "cuda")
    assert contracts.violations == []
    forwards = sum(c in FORWARD_OPS for c in contracts.calls)
    if dt != torch.float32 and cap >= (8, 0):  # torch's flash kernels: one varlen call per packed call
        assert forwards == len(segs.packed_calls()) == 2  # the causal documents, the non-causal segment
    else:  # the memory-efficient kernel: per-segment block calls, stacked by shape
        assert forwards == len(segs.batches) >= 3


# ----------------------------------------------------------------------------- the checks themselves


@pytest.fixture
def fake_gpu():
    with fake_cuda():
        yield


def _meta(*shape, dtype=torch.float16):
    return cuda_tensor(*shape, dtype=dtype)


def test_contract_out_row_stride_of_efficient_backward(fake_gpu):
    """The layout seqpar once passed for non-causal GQA: out folded to [B, Hkv, g*T, D] contiguous,
    i.e. a [B, M, H, D] view with row stride D instead of H * D."""
    b, h, m, d = 2, 2, 100, 64
    q = _meta(b, m, h, d).transpose(1, 2)  # the kernels' view is contiguous
    lse = _meta(b, h, 128, dtype=torch.float32)
    bad = sdpa_contracts.efficient_backward((7, 5), q, q, q, q, None, _meta(b, h, m, d), lse, None, None,
                                            0.0, [True] * 3 + [False])
    assert any("M-stride 64 != num_heads * head_dim = 128" in v for v in bad), bad
    fine = sdpa_contracts.efficient_backward((7, 5), q, q, q, q, None, q, lse, None, None, 0.0, [True] * 3 + [False])
    assert fine == []
    fp32 = q.float()  # fp32: delta is computed outside the kernel from out's real strides
    assert sdpa_contracts.efficient_backward((7, 5), fp32, fp32, fp32, fp32, None, _meta(b, h, m, d).float(),
                                             lse, None, None, 0.0, [True] * 3 + [False]) == []


def test_contract_lse_layouts(fake_gpu):
    b, h, m, d = 2, 4, 100, 64
    q = _meta(b, m, h, d).transpose(1, 2)
    unpadded = sdpa_contracts.efficient_backward((8, 0), q, q, q, q, None, q, _meta(b, h, m, dtype=torch.float32),
                                                 None, None, 0.0, [True] * 3 + [False])
    assert any("kAlignLSE" in v for v in unpadded), unpadded
    strided = _meta(b, m, h, dtype=torch.float32).transpose(1, 2)
    flash = sdpa_contracts.flash_backward((9, 0), q, q, q, q, q, strided, None, None, m, m, 0.0, False, None, None)
    assert any("logsumexp must be contiguous" in v for v in flash), flash


def test_contract_flash_alignment_and_arch(fake_gpu):
    q = _meta(1, 2, 80, 64)
    k = _meta(1, 2, 60, 64)
    assert any("bottom-right" in v for v in sdpa_contracts.flash_forward((9, 0), q, k, k, 0.0, True))
    assert any("sm_80..sm_121" in v for v in sdpa_contracts.flash_forward((7, 5), q, q, q, 0.0, False))
    odd = _meta(1, 2, 81, 64).transpose(1, 2)[:, :, :, 1:]  # head dim not contiguous at offset 1
    assert sdpa_contracts.efficient_forward((8, 0), odd, odd, odd, None, True)  # stride / alignment flagged


def test_shim_indexing_matches_real_tensors():
    """The fake-CUDA shim's basic indexing gives the shapes, strides and offsets of real indexing."""
    real = torch.empty(3, 5, 4, 8)
    cases = [(slice(None), slice(1, None)), (Ellipsis, slice(None, 3)), (0,), (1, Ellipsis, 2), (None, 2),
             (slice(None), slice(None, None, 2)), (Ellipsis, None), (-1, slice(-3, -1))]
    expected = [(real[i].shape, real[i].stride(), real[i].storage_offset()) for i in cases]
    with fake_cuda():
        fake = cuda_tensor(3, 5, 4, 8, dtype=torch.float32)
        for idx, want in zip(cases, expected):
            b = fake[idx]
            assert (b.shape, b.stride(), b.storage_offset()) == want, idx
        t = fake.transpose(1, 2)
        assert t.contiguous().is_contiguous() and fake.contiguous() is fake
        fake[:, :2] = 0.0
        assert fake.to(torch.float16).dtype == torch.float16 and fake.to("cuda") is fake
        with pytest.raises(NotImplementedError):
            fake[torch.tensor([0, 1])]


# ----------------------------------------------------------------------------- torch's flash ops called directly


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records ``(op, k's shape, window_size_left, window_size_right, is_causal)`` of the flash calls."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_flash_attention_forward", "_flash_attention_backward"):
            k = args[2]
            causal = args[8] if name == "_flash_attention_forward" else args[11]
            self.calls.append((name, tuple(k.shape), kwargs.get("window_size_left"), kwargs.get("window_size_right"),
                               causal))
        return func(*args, **kwargs)


def _direct(tq, tk, hq, hkv, d, mask, dt=torch.bfloat16, cap=(9, 0)):
    """Forward and backward of one block through dispatch with torch_cuda forced; the flash calls."""
    with fake_cuda(cap) as contracts, _Shapes() as shapes:
        q = cuda_tensor(2, tq, hq, d, dtype=dt)
        k, v = cuda_tensor(2, tk, hkv, d, dtype=dt), cuda_tensor(2, tk, hkv, d, dtype=dt)
        out, lse = block_forward(q, k, v, scale=d**-0.5, mask=mask, backend="torch_cuda")
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dt, (2, hq, tq), torch.float32)
        acc = torch.empty(q.shape, dtype=torch.float32, device="cuda")
        grads = block_backward(acc, q, k, v, acc, lse, scale=d**-0.5, mask=mask, backend="torch_cuda")
        for g, x in zip(grads, (q, k, v)):
            assert (g.shape, g.dtype, g.device.type) == (x.shape, dt, "cuda")
    assert contracts.violations == []
    return shapes.calls


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq, hkv", [(8, 2), (8, 8)], ids=["gqa8/2", "mha8/8"])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_strict"])
@pytest.mark.parametrize("tq, tk", [(96, 96), (96, 48), (48, 96)], ids=["square", "half_tall", "half_wide"])
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_flash_direct_gqa_unexpanded(dt, tq, tk, mask, hq, hkv, d):
    """GQA K,V reach the kernel with Hkv heads (no expansion), one call each way; a top-left causal
    block keeps its alignment through the bottom-right window bound (right = Tq - Tk)."""
    calls = _direct(tq, tk, hq, hkv, d, mask, dt)
    assert all(c[1] == (2, c[1][1], hkv, d) for c in calls)
    plan = plan_block(tq, tk, mask)
    if plan.causal and plan.rows - plan.keys >= plan.keys:  # the half-tall causal block: split, next test
        assert len(calls) == 4
        return
    assert [c[0] for c in calls] == ["_flash_attention_forward", "_flash_attention_backward"]
    want = (-1, plan.rows - plan.keys) if plan.causal else (-1, -1)
    assert all(c[2:4] == want for c in calls), calls


def test_flash_direct_tall_causal_splits():
    """Top-left causal with Tq - Tk >= Tk: right = Tq - Tk >= Tk would be clamped to unbounded, so
    the square causal top and the unmasked rows below it run as two calls on disjoint rows."""
    calls = _direct(100, 40, 8, 2, 64, "causal")
    assert [c[2:] for c in calls] == [(-1, 0, True), (-1, -1, False)] * 2


@pytest.mark.parametrize("tq, tk, band, native", [
    (64, 64, Band(-16, 0), True),  # sliding window, square: (left, right) = (16, 0)
    (64, 96, Band(-8, 40), True),  # wide block, both edges
    (120, 40, Band(-30, 5), False),  # right = 5 + 80 >= Tk: clamped, so plain pieces
])
def test_flash_direct_windows(tq, tk, band, native):
    calls = _direct(tq, tk, 8, 2, 64, band)
    if native:
        assert len(calls) == 2 and calls[0][2:4] == window_size(tq, tk, band), calls
    else:
        assert all(c[3] is not None and c[3] < 40 for c in calls), calls  # pieces: each bound expressible


def test_flash_direct_not_below_sm80_or_fp32():
    """fp32 and sm_75 stay on the memory-efficient kernel."""
    for cap, dt in (((9, 0), torch.float32), ((7, 5), torch.float16)):
        assert _direct(64, 64, 4, 2, 64, "causal", dt=dt, cap=cap) == []


def test_varlen_clamped_window_runs_as_block_calls():
    """A packed call whose right window bound the kernel would clamp to unbounded (a tall document
    with a band) is refused by the varlen kernel: its segments run as block calls (pieces)."""
    from seqpar.kernels.varlen_packed import packed_backend

    segs = VarlenSegments.build([(0, 100, 0, 40, Band(-50, 0)), (100, 16, 40, 16, "causal")], tq=116, tk=56)
    (call,) = [c for c in segs.packed_calls() if not c.causal]
    assert (call.max_q, call.max_k, call.window) == (90, 40, (0, 50))  # reduced 90 x 40: right 50 >= 40
    with fake_cuda((9, 0)) as contracts:
        q = cuda_tensor(1, 116, 4, 64, dtype=torch.bfloat16)
        k = cuda_tensor(1, 56, 2, 64, dtype=torch.bfloat16)
        assert packed_backend(q, k, k, "torch_cuda", False, True, segs.packed_calls()) is None
        assert packed_backend(q, k, k, "torch_cuda", False, True, segs.packed_calls()[1:]).name == "torch_cuda"
        out, lse = varlen_forward(q, k, k, segs, scale=0.125, backend="torch_cuda")
    assert contracts.violations == [] and out.shape == q.shape
