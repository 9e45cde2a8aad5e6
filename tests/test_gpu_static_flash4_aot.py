"""FlashAttention-4's Hopper and Blackwell kernels compiled without a GPU from the calls seqpar makes
(:mod:`gpu_static.flash4_aot`: the real package's interface and CuTe DSL compiler on fake CUDA
tensors, launches replaced by nothing).

Needs the ``flash4`` extra (the pinned ``flash-attn-4`` and the CuTe DSL's CUDA libraries, about
95 MB of wheels); skipped where it is not installed, as in CI. The stand-in
checks of ``test_gpu_static_flash4.py`` run everywhere; this file shows that the kernels behind them
build for sm_90a and sm_100a: bf16, Llama-3-8B's heads (32 / 8), D = 128, every block kind the ring,
zigzag, striped, window and packed schedules issue, forward and backward (about 100 s on 2 cores).
The whole matrix (fp16, MHA, 8 / 2, D = 64 and 256):
``benchmarks/results/gpu_static/flash4_aot_sm90.md`` and ``flash4_aot_sm100.md``.
"""

from __future__ import annotations

import pytest
from gpu_static import flash4_aot

MAIN = {90: ("FlashAttentionForwardSm90", "FlashAttentionBackwardSm90"),  # the attention kernels proper
        100: ("FlashAttentionForwardSm100", "FlashAttentionBackwardSm100")}
MMA = {90: "wgmma", 100: "tcgen05"}  # Hopper's warpgroup MMA, Blackwell's tensor-memory MMA


@pytest.fixture(scope="module", params=[90, 100], ids=["sm90a", "sm100a"])
def compiled(request):
    why = flash4_aot.unavailable()
    if why:
        pytest.skip(why)
    arch = request.param
    return arch, {r["case"]: r for r in flash4_aot.run(full=False, arch=arch, timeout=900)}


def test_every_block_kind_compiles(compiled):
    """Each seqpar call (forward and backward of one block) runs through the real interface and
    compiles; together they build both attention kernels, forward and backward, on the
    architecture's fast tensor-core instruction."""
    arch, rows = compiled
    assert list(rows) == [flash4_aot.case_id(c) for c in flash4_aot.cases(False, arch)]
    failed = {name: r["error"] for name, r in rows.items() if r["error"]}
    assert not failed, failed
    refused = {name: r["refused"] for name, r in rows.items() if r["refused"]}
    if arch == 100:  # FlashAttention-4 would assert in that backward: seqpar refuses it, the forward runs
        assert list(refused) == ["bf16-llama3_8b_32x8-d256-band"], refused
        assert "runs no local window" in refused["bf16-llama3_8b_32x8-d256-band"]
        assert rows["bf16-llama3_8b_32x8-d256-band"]["kernels"][0]["kernel"] == MAIN[arch][0]
    else:
        assert not refused, refused
    kernels = [k for r in rows.values() for k in r["kernels"]]
    assert {k["kernel"] for k in kernels} >= {*MAIN[arch], "FlashAttentionBackwardPreprocess",
                                              "FlashAttentionBackwardPostprocess"}
    main = [k for k in kernels if k["kernel"] in MAIN[arch]]
    assert main and all(k["mma"] == MMA[arch] for k in main), main


def test_no_local_memory(compiled):
    """No kernel reads or writes local memory beyond its stack frame, and on Hopper none has a stack
    frame: registers hold everything (a spill to local memory costs a kernel its speed). Blackwell's
    backward keeps an 8-16 B frame (benchmarks/results/gpu_static/flash4_aot_sm100.md)."""
    arch, rows = compiled
    kernels = [k for r in rows.values() for k in r["kernels"]]
    if any("registers" not in k for k in kernels):
        pytest.skip("no cuobjdump (it comes with Triton's NVIDIA backend)")
    assert not [k for k in kernels if k["local"]], kernels
    if arch == 90:
        assert not [k for k in kernels if k["stack"]], kernels


def test_the_first_block_builds_forward_and_backward(compiled):
    """A diagonal (causal) block is the first call: its forward, the backward's preprocess (delta
    from out), its main kernel and its postprocess (dQ from fp32) all compile there."""
    arch, rows = compiled
    first = [k["kernel"] for k in rows["bf16-llama3_8b_32x8-d128-diagonal"]["kernels"]]
    assert first[0] == MAIN[arch][0] and MAIN[arch][1] in first, first
    assert "FlashAttentionBackwardPreprocess" in first and "FlashAttentionBackwardPostprocess" in first, first
