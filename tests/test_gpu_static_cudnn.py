"""Static GPU checks of the ``cudnn`` backend (torch's cuDNN fused attention) and of the measured
dispatch table, on fake CUDA tensors of a simulated GPU (``tests/gpu_static/fake_cuda.py``).

Every call goes through seqpar's entry points with the backend forced (``block_forward`` /
``block_backward``, ``backend="cudnn"``): torch's meta kernels of
``aten._scaled_dot_product_cudnn_attention`` and its backward give the shapes, and
``tests/gpu_static/sdpa_contracts.py`` checks what cuDNN assumes beyond them (the stats layout
``[B, H, Tq, 1]``, one out / dout layout, ``max_q`` / ``max_k`` of the dense path, no varlen).
The measured order (:mod:`seqpar.kernels.dispatch_table`) is checked with a synthetic table.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from gpu_static.fake_cuda import cuda_tensor, fake_cuda

from seqpar.kernels import block_backward, block_forward, dispatch
from seqpar.kernels.dispatch import select_backend
from seqpar.kernels.dispatch_table import TABLE_PATH, DispatchTable, TableKey, build_table
from seqpar.kernels.masks import plan_block

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEADS = {"gqa8/2": (8, 2), "mha8/8": (8, 8)}
SHAPES = {"square": (96, 96), "half_tall": (96, 48), "half_wide": (48, 96)}  # the ring's half blocks
CAPS = {"sm80": (8, 0), "sm90": (9, 0)}
OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")


def _matrix():
    for (cn, cap), (dn, dt), hn, mask, sn, d in itertools.product(
            CAPS.items(), DTYPES.items(), HEADS, ("none", "causal", "causal_strict"), SHAPES, (64, 128)):
        yield pytest.param(cap, dt, hn, mask, sn, d, id=f"{cn}-{dn}-{hn}-{mask}-{sn}-d{d}")


def run_block(cap, dt, heads, mask, shape, d, backend="cudnn", batch=2):
    """Forward then backward of one block through dispatch on fake CUDA tensors; the contract record."""
    (hq, hkv), (tq, tk) = HEADS[heads], SHAPES[shape]
    with fake_cuda(cap) as contracts:
        q = cuda_tensor(batch, tq, hq, d, dtype=dt)
        k, v = cuda_tensor(batch, tk, hkv, d, dtype=dt), cuda_tensor(batch, tk, hkv, d, dtype=dt)
        out, lse = block_forward(q, k, v, scale=d**-0.5, mask=mask, backend=backend)
        assert (out.shape, out.dtype, out.device.type) == (q.shape, dt, "cuda")
        assert (lse.shape, lse.dtype, lse.device.type) == ((batch, hq, tq), torch.float32, "cuda")
        acc = torch.empty(q.shape, dtype=torch.float32, device="cuda")  # a ring's merged fp32 out and dout
        grads = block_backward(acc, q, k, v, acc, lse, scale=d**-0.5, mask=mask, backend=backend)
        for g, x in zip(grads, (q, k, v)):
            assert (g.shape, g.dtype, g.device.type) == (x.shape, dt, "cuda")
    return contracts


@pytest.mark.parametrize("cap, dt, heads, mask, shape, d", list(_matrix()))
def test_block_forward_backward(cap, dt, heads, mask, shape, d):
    contracts = run_block(cap, dt, heads, mask, shape, d)
    assert contracts.violations == []
    assert contracts.calls == list(OPS)  # one forward and one backward, nothing expanded or split


@pytest.mark.parametrize("why, cap, dt, d, cudnn", [
    ("head dim 256 > 128", (9, 0), torch.bfloat16, 256, 91900),
    ("head dim 76 is not a multiple of 8", (9, 0), torch.bfloat16, 76, 91900),
    ("dtype float32 not in", (9, 0), torch.float32, 64, 91900),
    ("needs compute capability >= 8.0", (7, 5), torch.float16, 64, 91900),
    ("no cuDNN", (9, 0), torch.bfloat16, 64, None),
    ("cuDNN 8907 < 9.0", (9, 0), torch.bfloat16, 64, 8907),
])
def test_refusals_name_the_reason(why, cap, dt, d, cudnn):
    with fake_cuda(cap, cudnn=cudnn):
        q = cuda_tensor(1, 32, 4, d, dtype=dt)
        with pytest.raises(ValueError, match="backend='cudnn' cannot serve") as e:
            block_forward(q, q, q, scale=0.125, backend="cudnn")
    assert why in str(e.value)


def test_not_chosen_without_measurement():
    """Unmeasured, cuDNN ranks below torch_cuda: automatic dispatch keeps the earlier order."""
    with fake_cuda((9, 0)):
        q = cuda_tensor(1, 64, 4, 128, dtype=torch.bfloat16)
        k = cuda_tensor(1, 64, 2, 128, dtype=torch.bfloat16)
        chosen = select_backend(q, k, k, mask="causal", backend=None)
    assert chosen.name != "cudnn"


# ----------------------------------------------------------------------------- the measured order


def _table(*cases) -> DispatchTable:
    return DispatchTable.from_json({"command": "synthetic", "cases": [
        {"arch": a, "direction": p, "kind": kd, "shape": s, "dtype": "bf16", "head_dim": 128, "order": o}
        for a, p, kd, s, o in cases]})


def test_table_orders_dispatch(monkeypatch):
    """A synthetic table: cuDNN first for sm90 causal square forwards, torch_cuda for their
    backward; an unmeasured case (tall blocks, sm80, D = 64) keeps the ranked order."""
    monkeypatch.setattr(dispatch, "TABLE", _table(("sm90", "forward", "causal", "square", ["cudnn", "torch_cuda"]),
                                                  ("sm90", "backward", "causal", "square", ["torch_cuda", "cudnn"])))

    def chosen(cap, tq, tk, d, backward):
        with fake_cuda(cap):
            q = cuda_tensor(1, tq, 8, d, dtype=torch.bfloat16)
            k = cuda_tensor(1, tk, 2, d, dtype=torch.bfloat16)
            return select_backend(q, k, k, mask="causal", for_backward=backward).name

    assert chosen((9, 0), 64, 64, 128, False) == "cudnn"
    assert chosen((9, 0), 64, 64, 128, True) == "torch_cuda"
    monkeypatch.setattr(dispatch, "TABLE", DispatchTable.load(TABLE_PATH.with_name("absent.json")))
    unmeasured = {case: chosen(*case) for case in [((9, 0), 64, 32, 128, False), ((8, 0), 64, 64, 128, False),
                                                    ((9, 0), 64, 64, 64, False)]}
    monkeypatch.setattr(dispatch, "TABLE", _table(("sm90", "forward", "causal", "square", ["cudnn"])))
    assert {case: chosen(*case) for case in unmeasured} == unmeasured


def test_table_order_skips_backends_that_refuse(monkeypatch):
    """Capabilities still decide: a listed backend that refuses the block (cuDNN with D = 256) is
    passed over with its reason, the next one serves."""
    monkeypatch.setattr(dispatch, "TABLE", DispatchTable.from_json({"cases": [
        {"arch": "sm90", "direction": "forward", "kind": "none", "shape": "square", "dtype": "bf16",
         "head_dim": 256, "order": ["cudnn", "torch_cuda"]}]}))
    with fake_cuda((9, 0)):
        q = cuda_tensor(1, 64, 4, 256, dtype=torch.bfloat16)
        assert select_backend(q, q, q, mask="none").name == "torch_cuda"


def test_table_key_of_block():
    with fake_cuda((9, 0)):
        q = cuda_tensor(1, 96, 8, 128, dtype=torch.bfloat16)
        assert TableKey.of(q, plan_block(96, 48, "causal"), True) == TableKey("sm90", "backward", "causal", "tall",
                                                                               "bf16", 128)
        assert TableKey.of(q, plan_block(96, 96, "causal_strict"), False).shape == "square"  # 95 x 95 reduced
    assert TableKey.of(torch.empty(1, 4, 2, 8), plan_block(4, 4, "none"), False) is None  # CPU: never ordered


def test_build_table_sums_blocks_and_drops_failures():
    key = {"arch": "sm90", "direction": "forward", "kind": "none", "shape": "tall", "dtype": "bf16", "head_dim": 128}
    rows = [{**key, "rows": 8192, "keys": 4096, "backend": "triton", "ms": 1.0},
            {**key, "rows": 8192, "keys": 4096, "backend": "cudnn", "ms": 0.7},
            {**key, "rows": 8192, "keys": 4096, "backend": "flash4", "ms": None},  # failed: dropped
            {**key, "rows": 16384, "keys": 8192, "backend": "triton", "ms": 3.0},
            {**key, "rows": 16384, "keys": 8192, "backend": "cudnn", "ms": 3.5},
            {**key, "rows": 16384, "keys": 8192, "backend": "flash4", "ms": 0.1}]
    doc = build_table(rows, "python benchmarks/gpu_kernel_times.py ...")
    (case,) = doc["cases"]
    assert case["order"] == ["triton", "cudnn"] and case["ms"] == {"triton": 4.0, "cudnn": 4.2}
    assert DispatchTable.from_json(json.loads(json.dumps(doc))).order(TableKey(**key)) == ("triton", "cudnn")


@pytest.mark.parametrize("bad, match", [({"arch": "h100"}, "arch="), ({"kind": "band"}, "kind="),
                                        ({"order": ["triton", "triton"]}, "distinct")])
def test_table_rejects_malformed_cases(bad, match):
    case = {"arch": "sm90", "direction": "forward", "kind": "none", "shape": "tall", "dtype": "bf16",
            "head_dim": 128, "order": ["triton"], **bad}
    with pytest.raises(ValueError, match=match):
        DispatchTable.from_json({"cases": [case]})


def test_committed_table_names_registered_backends():
    table = DispatchTable.load()
    assert table.command.startswith("python benchmarks/gpu_backends.py"), table.command
    assert table.orders, "the committed table is empty"
    for key, order in table.orders.items():
        assert set(order) <= set(dispatch.BACKEND_NAMES), (key, order)


def test_arrange_keeps_unlisted_backends_in_place():
    """Listed backends take the table's order in the places they held; an unlisted one (e.g.
    flash_attn, not installed where the table was measured) keeps its place."""
    from types import SimpleNamespace

    ranked = [SimpleNamespace(name=n) for n in ("flash_attn", "triton", "torch_cuda", "cudnn", "torch_cpu")]
    table = _table(("sm90", "forward", "none", "square", ["cudnn", "torch_cuda", "triton"]))
    key = TableKey("sm90", "forward", "none", "square", "bf16", 128)
    assert [b.name for b in table.arrange(ranked, key)] == ["flash_attn", "cudnn", "torch_cuda", "triton", "torch_cpu"]
    assert [b.name for b in table.arrange(ranked, None)] == [b.name for b in ranked]


@pytest.mark.parametrize("message, demoted", [
    ("cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the graph.", True),
    ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED", True),
    ("cuDNN Frontend error: [cudnn_frontend] Error: CUDNN_STATUS_EXECUTION_FAILED", False),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", False),
    ("CUDA error: an illegal memory access was encountered", False),
    ("CUDA error: no kernel image is available for execution on the device", True),
])
def test_graph_refusals_demote(message, demoted):
    """cuDNN refusing a graph for a case is a launch failure (dispatch demotes cudnn for it); a failed
    run, an allocation failure or a memory fault propagate."""
    from seqpar.kernels.cudnn import CudnnBackend

    assert (CudnnBackend().launch_failure(RuntimeError(message)) is not None) == demoted
    assert CudnnBackend().launch_failure(ValueError(message)) is None


def test_table_first_cudnn_demoted_on_graph_refusal(monkeypatch):
    """Measured first but refused by cuDNN at graph build on this machine: the block runs on the
    next backend with a warning, and later blocks of the case skip cudnn (demotion survives the table)."""
    from seqpar.kernels.fallback import FAILED_KERNELS

    monkeypatch.setattr(dispatch, "TABLE", _table(("sm90", "forward", "causal", "square", ["cudnn", "torch_cuda"])))
    cudnn = next(b for b in dispatch.BACKENDS if b.name == "cudnn")

    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the graph.")

    monkeypatch.setattr(cudnn, "forward", refuse)
    try:
        with fake_cuda((9, 0)):
            q = cuda_tensor(1, 64, 8, 128, dtype=torch.bfloat16)
            k = cuda_tensor(1, 64, 2, 128, dtype=torch.bfloat16)
            assert select_backend(q, k, k, mask="causal").name == "cudnn"
            with pytest.warns(RuntimeWarning, match="'cudnn' attention kernel failed"):
                out, lse = block_forward(q, k, k, scale=0.1, mask="causal")
            assert out.shape == q.shape and lse.shape == (1, 8, 64)
            assert select_backend(q, k, k, mask="causal").name != "cudnn"
    finally:
        FAILED_KERNELS.clear()
