"""FlashAttention-4's Hopper kernels compiled without a GPU from the calls seqpar makes
(:mod:`gpu_static.flash4_aot`: the real package's interface and CuTe DSL compiler on fake CUDA
tensors, launches replaced by nothing).

Needs the ``flash4`` extra (the pinned ``flash-attn-4`` and the CuTe DSL's CUDA libraries, about
95 MB of wheels); skipped where it is not installed, as in CI. The stand-in
checks of ``test_gpu_static_flash4.py`` run everywhere; this file shows that the kernels behind them
build for sm_90a: bf16, Llama-3-8B's heads (32 / 8), D = 128, every block kind the ring, zigzag,
striped, window and packed schedules issue, forward and backward (about 40 s on 2 cores). The whole
matrix (fp16, MHA, 8 / 2, D = 64 and 256): ``benchmarks/results/gpu_static/flash4_aot.md``.
"""

from __future__ import annotations

import pytest
from gpu_static import flash4_aot

MAIN = {"FlashAttentionForwardSm90", "FlashAttentionBackwardSm90"}  # the attention kernels proper


@pytest.fixture(scope="module")
def rows():
    why = flash4_aot.unavailable()
    if why:
        pytest.skip(why)
    return {r["case"]: r for r in flash4_aot.run(full=False, timeout=900)}


def test_every_block_kind_compiles_for_sm90a(rows):
    """Each seqpar call (forward and backward of one block) runs through the real interface and
    compiles; together they build both attention kernels, forward and backward, on wgmma."""
    assert [r["case"] for r in rows.values()] == [flash4_aot.case_id(c) for c in flash4_aot.cases(False)]
    failed = {name: r["error"] for name, r in rows.items() if r["error"]}
    assert not failed, failed
    kernels = [k for r in rows.values() for k in r["kernels"]]
    assert {k["kernel"] for k in kernels} >= MAIN | {"FlashAttentionBackwardPreprocess",
                                                     "FlashAttentionBackwardPostprocess"}
    main = [k for k in kernels if k["kernel"] in MAIN]
    assert main and all(k["mma"] == "wgmma" for k in main), main


def test_no_kernel_spills(rows):
    """Registers within the budget of each kernel: no stack frame and no local memory (a spill to
    local memory costs the kernel its speed on the GPU)."""
    kernels = [k for r in rows.values() for k in r["kernels"]]
    if any("registers" not in k for k in kernels):
        pytest.skip("no cuobjdump (it comes with Triton's NVIDIA backend)")
    spilled = [k for k in kernels if k["stack"] or k["local"]]
    assert not spilled, spilled


def test_the_first_block_builds_forward_and_backward(rows):
    """A diagonal (causal) block is the first call: its forward, the backward's preprocess (delta
    from out), its main kernel and its postprocess (dQ from fp32) all compile there."""
    first = [k["kernel"] for k in rows["bf16-llama3_8b_32x8-d128-diagonal"]["kernels"]]
    assert first[0] == "FlashAttentionForwardSm90" and "FlashAttentionBackwardSm90" in first, first
    assert "FlashAttentionBackwardPreprocess" in first and "FlashAttentionBackwardPostprocess" in first, first
