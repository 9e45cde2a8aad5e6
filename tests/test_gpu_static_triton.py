"""Static GPU checks of seqpar's Triton kernels, without a GPU.

- Ahead-of-time compilation (:mod:`gpu_static.aot`) of every kernel through the real host wrappers
  for sm_90, sm_80 and sm_89: no compile error, every configuration the pruning keeps within the
  GPU's shared memory, the pruning's estimate never below what Triton allocates, no spills on sm_90
  for fp16/bf16 with D <= 128. The CI part (``aot_results.ci_cases``) runs here; the whole matrix
  (``full_cases``) with SEQPAR_GPU_STATIC_FULL=1. With SEQPAR_GPU_STATIC_RESULTS=DIR both write their
  table to DIR (``triton_aot_ci`` / ``triton_aot_full``, .md and .csv).
- The refusal when no configuration fits a GPU, the pruning per GPU, and the device guard of every
  launch (fake CUDA tensors on cuda:1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import time
from pathlib import Path

import pytest
import torch

from seqpar.kernels import triton_target as tt

triton = pytest.importorskip("triton")


def _aot_unavailable() -> str | None:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return "triton has no NVIDIA backend (no ptxas) here"
    from triton.runtime.jit import JITFunction

    if not hasattr(JITFunction, "_pack_args"):  # the binder API the harness replays (triton 3.9)
        return f"triton {triton.__version__} lacks JITFunction._pack_args"
    return None


aot_only = pytest.mark.skipif(_aot_unavailable() is not None, reason=str(_aot_unavailable()))


def _compile(cases, name: str, timeout: float) -> list[dict]:
    from gpu_static import aot, aot_results

    t0 = time.perf_counter()
    rows = aot.run_cases(cases, timeout=timeout)
    out = os.environ.get("SEQPAR_GPU_STATIC_RESULTS")
    if out:
        title = f"Triton AOT compilation ({name} matrix)"
        command = "SEQPAR_GPU_STATIC_RESULTS=DIR python3 -m pytest -q tests/test_gpu_static_triton.py"
        if name == "full":
            command = "SEQPAR_GPU_STATIC_FULL=1 " + command
        aot_results.write_results(rows, Path(out), name,
                                  aot_results.header(title, command, time.perf_counter() - t0))
    return rows


@pytest.fixture(scope="module")
def ci_rows():
    from gpu_static import aot_results

    return _compile(aot_results.ci_cases(), "ci", timeout=1800)


@pytest.fixture(scope="module")
def full_rows():
    from gpu_static import aot_results

    return _compile(aot_results.full_cases(), "full", timeout=6 * 3600)


def _describe(rows) -> str:
    return "\n".join(f"{r['kernel']} {r['arch']} {r['dtype']} D={r['D']} {r['case']} {r['config']}: "
                     f"{r['status']} smem={r['smem_bytes']} est={r['smem_estimate']} "
                     f"spill={r['spill_bytes']} "
                     f"{(r['error'] or '').strip()[-300:]}" for r in rows)


def _check(rows) -> None:
    """The targets: 0 compile errors, 0 kept configurations above the GPU's shared memory, the
    pruning's estimate an upper bound of every compiled size, 0 spills on sm_90 for the kept fp16 /
    bf16 configurations with D <= 128, and on sm_90 every fp16 / bf16 attention-kernel variant with
    a kept configuration on wgmma (the autotuner can only pick what the table offers)."""
    errors = [r for r in rows if r["status"] == "compile error"]
    assert not errors, "compile errors:\n" + _describe(errors)
    over = [r for r in rows if r["status"] == "smem over limit"]
    assert not over, "kept configurations above the GPU's shared memory:\n" + _describe(over)
    under = [r for r in rows if r["smem_estimate"] is not None and r["smem_estimate"] < r["smem_bytes"]]
    assert not under, "the pruning's estimate is below the compiled shared memory:\n" + _describe(under)
    spills = [r for r in rows if r["arch"] == "sm_90" and r["dtype"] in ("bf16", "fp16") and r["D"] <= 128
              and r["status"] == "ok" and r["config"] != "-" and r["spill_bytes"]]
    assert not spills, "default fp16/bf16 configurations spill on sm_90:\n" + _describe(spills)
    slow = ampere_only(rows)
    assert not slow, "variants with no kept configuration on Hopper's wgmma:\n" + "\n".join(slow)


def ampere_only(rows) -> list[str]:
    """The sm_90 fp16 / bf16 attention-kernel variants (kernel, case, dtype, D) none of whose kept
    configurations compiles to wgmma: every one would run Ampere's mma.sync on a Hopper GPU (as the
    dk/dv kernel at D = 128 did while its table held BLOCK_N = 32 only)."""
    from gpu_static import aot

    groups: dict[tuple, set] = {}
    for r in rows:
        if (r["arch"] == "sm_90" and r["dtype"] in ("bf16", "fp16") and r["kernel"] in aot.KERNELS
                and r["status"] == "ok"):
            groups.setdefault((r["kernel"], r["case"], r["dtype"], r["D"]), set()).add(r["mma"])
    return [" ".join(map(str, key)) + f": {sorted(kinds)}" for key, kinds in groups.items()
            if "wgmma" not in kinds]


@aot_only
def test_aot_ci_matrix_compiles_within_limits(ci_rows):
    _check(ci_rows)


@aot_only
def test_aot_ci_matrix_covers_every_kernel_path_and_gpu(ci_rows):
    seen = {(r["kernel"], r["case"].split("-")[1]) for r in ci_rows}
    for kernel in ("attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel", "attn_delta_kernel"):
        for path in ("dense", "packed", "window", "packed_window"):
            assert (kernel, path) in seen, f"{kernel} was not compiled on the {path} path"
    assert ("attn_fwd_kernel", "acc") in seen and ("attn_delta_kernel", "dlse") in seen
    lower_edge = {r["kernel"] for r in ci_rows if r["case"].startswith(("attn_fwd-window-none", "attn_bwd-window-none"))}
    assert lower_edge >= {"attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"}
    assert {r["kernel"] for r in ci_rows} >= {"_gla_intra_fwd_kernel", "_gla_intra_bwd_kernel"}
    assert {r["arch"] for r in ci_rows} == {"sm_90", "sm_80", "sm_89"}
    assert {r["dtype"] for r in ci_rows} == {"bf16", "fp16", "fp32"}
    # Every configuration the pruning keeps for bf16 D = 128 on sm_90 was compiled.
    dq = {r["config"] for r in ci_rows if r["kernel"] == "attn_bwd_dq_kernel" and r["arch"] == "sm_90"
          and r["D"] == 128 and r["case"] == "attn_bwd-dense-causal-gqa"}
    assert dq == {f"{m}x{n} w{w} s{s}" for m, n, w, s in tt.fitting("dq", 2, 128, tt.Target.of(90))}


@aot_only
@pytest.mark.gpu_static_full
@pytest.mark.timeout(6 * 3600)
def test_aot_full_matrix_compiles_within_limits(full_rows):
    _check(full_rows)
    assert {r["arch"] for r in full_rows} == {"sm_90", "sm_80", "sm_89"}
    # The wrappers refuse only the fp32 D = 256 backward on sm_89 (101,376 B hold no such tile).
    refused = {(r["kernel"], r["arch"], r["dtype"], r["D"]) for r in full_rows if r["status"] == "refused"}
    assert refused == {("attn_bwd", "sm_89", "fp32", 256)}


# ----------------------------------------------------------------------------------- no compiling
def test_pruning_keeps_what_fits_each_gpu():
    sm90, sm80, sm89 = (tt.Target.of(a) for a in (90, 80, 89))
    for kernel in tt.CONFIGS:
        for elem in (2, 4):
            for block_d in (16, 32, 64, 128, 256):
                for target in (sm90, sm80, sm89):
                    for cfg in tt.fitting(kernel, elem, block_d, target):
                        assert tt.smem_estimate(kernel, cfg, block_d, elem, target.arch) <= target.smem
    # fp16/bf16 up to D = 256 and fp32 up to D = 128 fit sm_86/89 both ways; fp32 D = 256 forward only.
    for kernel in ("fwd", "dq", "dkdv"):
        assert tt.fitting(kernel, 2, 256, sm89) and tt.fitting(kernel, 4, 128, sm89)
        assert tt.fitting(kernel, 4, 256, sm80)
    assert tt.fitting("fwd", 4, 256, sm89)
    assert not tt.fitting("dq", 4, 256, sm89) and not tt.fitting("dkdv", 4, 256, sm89)
    # sm_90 keeps every fp16/bf16 configuration up to D = 128; sm_89 drops the larger ones.
    for kernel in tt.CONFIGS:
        for block_d in (64, 128):
            assert tt.fitting(kernel, 2, block_d, sm90) == tt.table(kernel, 2, block_d)
    assert (128, 64, 8, 3) in tt.fitting("fwd", 2, 128, sm80)
    assert (128, 64, 8, 3) not in tt.fitting("fwd", 2, 128, sm89)


def _qkv(dtype, d, device="cpu"):
    return (torch.zeros(1, 64, h, d, dtype=dtype, device=device) for h in (4, 2, 2))


def test_refusal_names_the_gpu_and_the_smallest_requirement(monkeypatch):
    from seqpar.kernels import triton_attention as ta
    from seqpar.kernels.dispatch import select_backend

    # The CPU tensors stand for a GPU with compute capability 8.6.
    monkeypatch.setattr(tt, "device_target", lambda device: tt.Target.of(86))
    q, k, v = _qkv(torch.float32, 256)
    need = tt.smem_estimate("dq", (16, 32, 4, 2), 256, 4, 86)
    assert ta.refusal(q, k, v, backward=True) == (
        "no configuration of the dq kernel fits the shared memory of sm_86 (101,376 B per block): "
        f"the smallest needs {need:,} B")
    assert need == 102_464
    assert ta.refusal(q, k, v) is None  # its forward fits
    with pytest.raises(ValueError, match="no configuration of the dq kernel fits .* of sm_86"):
        ta.triton_attention_backward(q, q, k, v, q, torch.zeros(1, 4, 64))
    if ta.INTERPRET:  # the backend serves CPU tensors only under the interpreter
        with pytest.raises(ValueError, match=r"backend='triton' cannot serve.*no configuration .* sm_86"):
            select_backend(q, k, v, mask="none", backend="triton", for_backward=True)
    for dtype, d in ((torch.bfloat16, 256), (torch.float32, 128)):  # these fit sm_86 now
        q, k, v = _qkv(dtype, d)
        assert ta.refusal(q, k, v) is None and ta.refusal(q, k, v, backward=True) is None


def test_pruner_raises_rather_than_launch_what_cannot_fit(monkeypatch):
    monkeypatch.setattr(tt, "device_target", lambda device: tt.Target.of(86))
    q = torch.zeros(1, 64, 4, 256)
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in tt.all_configs("dq")]
    with pytest.raises(ValueError, match="dq kernel fits the shared memory of sm_86"):
        tt.pruner("dq")(configs, {"Q": q}, BLOCK_D=256)
    kept = tt.pruner("dq")(configs, {"Q": q.to(torch.bfloat16)}, BLOCK_D=256)
    tiles = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
    assert tiles == [(32, 32, 4, 2)]


def test_pruner_leaves_out_what_spills_in_one_variant_only(monkeypatch):
    """The packed windowed dq kernel (bf16, D = 128) spills at 64x64 with 4 warps on sm_90 (the AOT
    suite measured 4 B per thread at the 255-register cap): pruned there, kept for every other variant."""
    monkeypatch.setattr(tt, "device_target", lambda device: tt.Target.of(90))
    q = torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16)
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in tt.all_configs("dq")]

    def tiles(**meta):
        kept = tt.pruner("dq")(configs, {"Q": q}, BLOCK_D=128, **meta)
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}

    full = set(tt.fitting("dq", 2, 128, tt.Target.of(90)))
    assert tiles(IS_VARLEN=True, HAS_WINDOW=True) == full - {(64, 64, 4, 3)}
    for meta in ({}, {"IS_VARLEN": True, "HAS_WINDOW": False}, {"IS_VARLEN": False, "HAS_WINDOW": True}):
        assert tiles(**meta) == full


def test_hopper_dkdv_configurations_offered_on_sm90_only_and_in_table_order(monkeypatch):
    """The dk/dv kernel's wgmma configurations at D = 128 (:data:`tt.HOPPER_ONLY`) are offered on
    sm_90 first, in the table's order (the autotuner's list is the union of every table); on sm_80
    and sm_89 (where they spill and run mma.sync) not at all; the causal variants leave out 16x128
    with 2 stages (spills on sm_90), the others keep it."""
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in tt.all_configs("dkdv")]
    q = torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16)
    hopper = [c for c in tt.table("dkdv", 2, 128) if ("dkdv", "half", 128, c) in tt.HOPPER_ONLY]
    assert hopper == [(16, 128, 8, 2), (16, 128, 8, 1), (16, 64, 8, 2)]

    def kept(arch, **meta):
        monkeypatch.setattr(tt, "device_target", lambda device: tt.Target.of(arch))
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                for c in tt.pruner("dkdv")(configs, {"Q": q}, BLOCK_D=128, **meta)]

    assert kept(90) == tt.table("dkdv", 2, 128)
    for meta in ({"IS_CAUSAL": True}, {"IS_CAUSAL": True, "IS_VARLEN": True, "HAS_WINDOW": True}):
        assert kept(90, **meta) == [c for c in tt.table("dkdv", 2, 128) if c != (16, 128, 8, 2)]
    for arch in (80, 89):
        assert kept(arch) == [c for c in tt.table("dkdv", 2, 128) if c not in hopper]
    assert tt.HOPPER_ONLY.isdisjoint({("dkdv", "half", 64, c) for c in tt.table("dkdv", 2, 64)})


def test_device_target_reads_the_device(monkeypatch):
    class Props:
        shared_memory_per_block_optin = 101_376

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    assert tt.device_target(torch.device("cuda", 0)) == tt.Target(89, 101_376)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: object())  # older torch
    assert tt.device_target(torch.device("cuda", 0)) == tt.Target(89, 101_376)
    assert tt.device_target(torch.device("cpu")) is None


class _DeviceLog:
    """Stands in for torch.cuda.device (entered devices) and for kernels (the device at launch)."""

    def __init__(self):
        self.current, self.launches = [], []

    def device(self, dev):
        log = self

        @contextlib.contextmanager
        def enter():
            log.current.append(torch.device(dev).index)
            try:
                yield
            finally:
                log.current.pop()

        return enter()

    def kernel(self, name):
        log = self

        class Kernel:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    log.launches.append((name, log.current[-1] if log.current else None))

                return launch

        return Kernel()


def test_every_launch_runs_on_the_tensors_device(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from seqpar.kernels import linear_triton as lt
    from seqpar.kernels import triton_attention as ta
    from seqpar.kernels import triton_attention_kernels as kern

    log = _DeviceLog()
    monkeypatch.setattr(torch.cuda, "device", log.device)
    for mod, name in ((lt, "_gla_intra_fwd_kernel"), (lt, "_gla_intra_bwd_kernel"), (ta, "_fwd_kernel"),
                      (ta, "_dq_kernel"), (ta, "_dkdv_kernel"), (kern, "attn_delta_kernel")):
        monkeypatch.setattr(mod, name, log.kernel(name))
    with FakeTensorMode():
        x = torch.empty(2, 2, 64, 16, device="cuda:1")
        lt.intra_fwd(x, x, x, None, 0.25)
        lt.intra_bwd(x, x, x, None, x, 0.25)
        q, k, v = _qkv(torch.bfloat16, 64, "cuda:1")
        out, lse = torch.empty_like(q), torch.empty(1, 4, 64, device="cuda:1")
        ta._launch_fwd(q, k, v, out, lse, None, None, 0, 0, 0.125, True, 0, False, -1, False)
        ta._launch_bwd(q, q, k, v, out, lse, None, None, None, None, 0, 0, 0.125, True, 0, False, -1)
    assert [n for n, _ in log.launches] == ["_gla_intra_fwd_kernel", "_gla_intra_bwd_kernel", "_fwd_kernel",
                                            "attn_delta_kernel", "_dq_kernel", "_dkdv_kernel"]
    assert all(dev == 1 for _, dev in log.launches), log.launches


def test_dispatch_skips_triton_where_nothing_fits_the_gpu(monkeypatch):
    """On an sm_86 GPU (fake CUDA tensors), fp32 D = 256 backward: dispatch passes over Triton to the next
    backend (torch_cuda); were none to fit, the error would list Triton's reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from seqpar.kernels import reference, torch_ops
    from seqpar.kernels.dispatch import select_backend

    class Props:
        shared_memory_per_block_optin = 101_376

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    reason = "no configuration of the dq kernel fits the shared memory of sm_86 (101,376 B per block)"
    with FakeTensorMode():
        q, k, v = _qkv(torch.float32, 256, "cuda:0")
        assert select_backend(q, k, v, mask="causal", for_backward=True).name == "torch_cuda"
        with pytest.raises(ValueError, match=re.escape(reason)):
            select_backend(q, k, v, mask="causal", backend="triton", for_backward=True)
        for backend in (torch_ops.TorchCUDABackend, reference.ReferenceBackend):  # as if they could not
            monkeypatch.setattr(backend, "extra_refusal", lambda *a: "refused for this test")
        with pytest.raises(ValueError, match=r"no attention backend fits") as err:
            select_backend(q, k, v, mask="causal", for_backward=True)
        assert f"triton: {reason}" in str(err.value)
        q, k, v = _qkv(torch.bfloat16, 256, "cuda:0")  # fits sm_86: Triton serves it
        assert select_backend(q, k, v, mask="causal", for_backward=True).name == "triton"
