"""Every block shape the Triton attention kernels' autotune tables offer, forward and backward,
against a float64 reference.

The autotuner picks one configuration per launch on a GPU by timing, so a block shape that is
wrong only where its tiles meet the masks (BLOCK_N > BLOCK_M in the dk/dv kernel's causal spans,
a 128-key tile crossing a document or window edge) would be found only when a GPU happens to pick
it. Here each (BLOCK_M, BLOCK_N) of the fp16 / bf16 tables for D <= 128
(:data:`seqpar.kernels.triton_target.CONFIGS`) is forced in turn, in Triton's CPU interpreter
(warps and stages do not change what the interpreter computes; the ahead-of-time suite compiles
each full configuration for sm_90 and sm_80), over lengths that cross several tiles of each
shape: causal (both alignments, with an offset), a sliding window, no mask, packed documents,
GQA 4:2, D = 128, float32 inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the kernels

triton = pytest.importorskip("triton")

from seqpar.kernels import triton_attention as ta  # noqa: E402
from seqpar.kernels import triton_attention_bwd as kern_bwd  # noqa: E402
from seqpar.kernels import triton_attention_kernels as kern  # noqa: E402
from seqpar.kernels import triton_target as tt  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and not ta.INTERPRET:
    pytest.skip("no CUDA and the kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)
interpreter = pytest.mark.skipif(HAS_CUDA, reason="the interpreter's cases (on a GPU: the gpu case below)")

# The float64 reference, the visibility rule and the tolerances per dtype (fp32: 2e-5 relative;
# bf16: 8 ulp) of the kernels' own tests: a wrong mask or a skipped tile is off by O(1).
from test_triton_attention import _close, ref_attention, ref_grads, visible  # noqa: E402
KEY = ["seq_bucket", "GROUP", "HEAD_DIM", "IS_VARLEN", "IS_CAUSAL", "HAS_WINDOW"]


def _shapes(kernel: str) -> list[tuple[int, int]]:
    return sorted({(m, n) for (width, bound), cfgs in tt.CONFIGS[kernel].items()
                   if width == "half" and bound <= 128 for m, n, _w, _s in cfgs})


def _force(monkeypatch, kernel: str, shape: tuple[int, int], warps: int = 4, stages: int = 1) -> None:
    """Make ``kernel`` ("fwd", "dq", "dkdv") run one configuration."""
    jit = {"fwd": kern.attn_fwd_kernel, "dq": kern_bwd.attn_bwd_dq_kernel,
           "dkdv": kern_bwd.attn_bwd_dkdv_kernel}[kernel]
    extra = dict(fwd=(["ACCUMULATE"], ["Out", "Lse"])).get(kernel, ([], None))
    cfg = triton.Config({"BLOCK_M": shape[0], "BLOCK_N": shape[1]}, num_warps=warps, num_stages=stages)
    tuned = triton.autotune([cfg], key=KEY + extra[0], restore_value=extra[1])(jit)
    monkeypatch.setattr(ta, {"fwd": "_fwd_kernel", "dq": "_dq_kernel", "dkdv": "_dkdv_kernel"}[kernel],
                        tuned)


def _forced(monkeypatch, kernel: str, shape: tuple[int, int]) -> None:
    """``kernel`` at ``shape``, the other two at 64x64 (a shape of their tables, itself checked
    here): the interpreter's time grows with the number of tiles, and 16x16 made a case ~40 s."""
    for other in ("fwd", "dq", "dkdv"):
        _force(monkeypatch, other, shape if other == kernel else (64, 64))


# (Tq, Tk, mask, causal_offset, align, window_left): every case crosses tiles of 128 keys and of
# 16-128 queries, with diagonals that cut tiles off their corners.
CASES = {
    "causal-tl": (150, 290, "causal", 0, "top_left", None),
    "causal-br": (290, 150, "causal", 0, "bottom_right", None),
    "causal-offset": (200, 260, "causal", 37, "top_left", None),
    "window": (260, 260, "causal", 0, "bottom_right", 70),
    "none": (140, 200, "none", 0, "top_left", None),
}


def _run_dense(case: str, dtype=torch.float32, device="cpu"):
    tq, tk, mask, off, align, window = CASES[case]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, tq, 4, 128, generator=gen)
    k, v = (torch.randn(1, tk, 2, 128, generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen)
    q, k, v, dout = (x.to(device, dtype) for x in (q, k, v, dout))
    geo = dict(mask=mask, causal_offset=off, align=align, window_left=window)
    out, lse = ta.triton_attention_forward(q, k, v, **geo)
    grads = ta.triton_attention_backward(dout, q, k, v, out, lse, **geo)
    vis = visible(tq, tk, mask, off, align, window)
    refs = (ref_attention(q, k, v, vis)[0], *ref_grads(q, k, v, vis, dout))
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), refs):
        _close(name, got, ref, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,shape", [(k, s) for k in ("fwd", "dq", "dkdv") for s in _shapes(k)],
                         ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))
@interpreter
def test_every_table_block_shape_matches_float64(monkeypatch, kernel, shape):
    _forced(monkeypatch, kernel, shape)
    for case in CASES:
        _run_dense(case)


@interpreter
@pytest.mark.parametrize("shape", [(16, 128), (16, 64)], ids=["16x128", "16x64"])
@pytest.mark.parametrize("case", ["causal-br", "window", "none"])
def test_hopper_dkdv_shapes_match_float64(monkeypatch, shape, case):
    """The dk/dv shapes added for Hopper (:data:`~seqpar.kernels.triton_target.HOPPER_ONLY`: more
    keys than query rows per tile, so the causal spans cut several query steps of one key tile);
    every shape of every table: the slow matrix above."""
    _forced(monkeypatch, "dkdv", shape)
    _run_dense(case)


@interpreter
@pytest.mark.parametrize("shape", [(16, 128), (16, 64)], ids=["16x128", "16x64"])
def test_hopper_dkdv_shapes_on_packed_documents(monkeypatch, shape):
    """The dk/dv shapes added for Hopper (:data:`~seqpar.kernels.triton_target.HOPPER_ONLY`) on
    packed documents (bottom-right causal, as packed dispatch launches them), one document longer
    than a tile, one shorter, one with no keys."""
    _forced(monkeypatch, "dkdv", shape)
    lens_q, lens_k = [150, 9, 4, 133], [170, 9, 0, 140]
    packed = ta.PackedSeqs.from_lengths(lens_q, lens_k)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q), 4, 128, generator=gen)
    k, v = (torch.randn(sum(lens_k), 2, 128, generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen)
    geo = dict(mask="causal", align="bottom_right", packed=packed)
    out, lse = ta.triton_attention_forward(q, k, v, **geo)
    dq, dk, dv = ta.triton_attention_backward(dout, q, k, v, out, lse, **geo)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        vis = visible(lq, lk, "causal", 0, "bottom_right")
        refs = ref_grads(q[None, q0:q0 + lq], k[None, k0:k0 + lk], v[None, k0:k0 + lk], vis, dout[None, q0:q0 + lq])
        for name, got, ref in zip(("dq", "dk", "dv"), (dq[q0:q0 + lq], dk[k0:k0 + lk], dv[k0:k0 + lk]), refs):
            _close(f"{name} of document {lq}x{lk}", got[None], ref, torch.float32)
        q0, k0 = q0 + lq, k0 + lk
@interpreter
def test_tuned_configs_name_what_ran(monkeypatch):
    """The kernel benchmark's record of the autotune choice names the configuration each kernel ran."""
    _forced(monkeypatch, "dkdv", (16, 128))
    _run_dense("none")
    assert ta.tuned_configs() == {"fwd": "64x64 w4 s1", "dq": "64x64 w4 s1", "dkdv": "16x128 w4 s1"}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("config", sorted(c for (_k, _w, _b, c) in tt.HOPPER_ONLY), ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("case", ["causal-br", "window", "none"])
def test_gpu_hopper_dkdv_configurations(monkeypatch, config, case):
    """Each Hopper-only dk/dv configuration compiled for the device (wgmma), forced, bf16, against
    float64 (the autotuner would run only the fastest; the causal variants' pruning leaves one out,
    forced here all the same: spills cost time, not correctness)."""
    m, n, warps, stages = config
    _force(monkeypatch, "dkdv", (m, n), warps, stages)
    _run_dense(case, torch.bfloat16, "cuda")
