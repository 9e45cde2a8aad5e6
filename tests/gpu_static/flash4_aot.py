"""FlashAttention-4's kernels compiled for Hopper (sm_90a) and Blackwell (sm_100a) without a GPU,
from the calls seqpar's ``flash4`` backend makes.

The pinned ``flash-attn-4``'s real ``_flash_attn_fwd`` / ``_flash_attn_bwd`` run on fake CUDA
tensors of a simulated sm_90 / sm_100 GPU (:mod:`.fake_cuda`), called by seqpar through dispatch
(``block_forward`` / ``block_backward`` / ``varlen_*`` with ``backend="flash4"``). Three seams are
replaced, nothing between them: ``to_cute_tensor`` returns the CuTe DSL's fake tensors with the
layout the real conversion gives the compiler (dynamic shapes, dynamic strides but the leading one,
the base pointer's alignment); the SM count, which FlashAttention-4's kernel choices and persistent
schedulers ask for (``FLASH_ATTENTION_NUM_SMS``, ``cutlass.utils.HardwareInfo``), is the simulated
GPU's (H100 SXM 132, B200 148); and a compiled kernel's launch does nothing. The interface's asserts,
its tile, pipeline and GQA-packing choices and the CuTe DSL's compilation through NVVM and ptxas to a
cubin are the real code. Each cubin's registers, stack frame and local memory come from
``cuobjdump -res-usage`` (the one bundled with Triton), its tensor-core instructions from its PTX
(:func:`gpu_static.aot.mma_kind`).

What this does not show: that a kernel's shared memory fits the GPU (the CuTe DSL checks that in the
launch, replaced here), nor any result: it proves that the kernels build, not that they run.

Runs in its own process (the CuTe DSL reads its target from ``CUTE_DSL_ARCH`` once, at import)::

    cd tests && python -m gpu_static.flash4_aot [--arch 90|100] [--full] [--results ../benchmarks/results/gpu_static]

needs ``pip install 'seqpar[flash4]' 'nvidia-cutlass-dsl[cu13]'`` (no GPU), and writes one row per
seqpar call: the kernels it compiled (a call whose kernels an earlier call compiled lists none).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

HEADS = {"llama3_8b_32x8": (32, 8), "mha8": (8, 8), "gqa8x2": (8, 2)}
SMS = {90: 132, 100: 148}  # the simulated GPUs' SM counts: H100 SXM, B200
#: the blocks the schedules issue (rows, keys, mask): a ring's diagonal and full blocks, zigzag's half
#: blocks, striped's strictly causal diagonal, a causal block with more rows than keys (a tall
#: piece: FlashAttention-4's local mode), a sliding window's band, packed documents
BLOCKS = {"diagonal": (256, 256, "causal"), "full": (256, 256, "none"), "half_tall": (256, 128, "none"),
          "half_wide": (128, 256, "none"), "strict": (256, 256, "causal_strict"),
          "causal_tall": (256, 128, "causal"), "band": (256, 256, "band"), "packed": (256, 256, "packed")}


def cases(full: bool, arch: int = 90) -> list[dict]:
    """The quick set: bf16, Llama-3-8B's heads, D = 128, every block kind (on Blackwell also the
    D = 256 band, whose backward seqpar refuses). The full set adds fp16, MHA and 8/2 GQA, D = 64 and
    256 (on Hopper the forward only: seqpar refuses FlashAttention-4's Hopper backward above 128)."""
    dtypes, heads, dims = ("bf16",), ("llama3_8b_32x8",), (128,)
    if full:
        dtypes, heads, dims = ("bf16", "fp16"), tuple(HEADS), (64, 128, 256)
    out = [dict(dtype=dt, heads=h, d=d, block=b, backward=d <= 128 or arch >= 100)
           for dt, h, d, b in itertools.product(dtypes, heads, dims, BLOCKS)]
    if not full and arch >= 100:  # the backward seqpar refuses there (flash4.local_refusal)
        out.append(dict(dtype="bf16", heads="llama3_8b_32x8", d=256, block="band", backward=True))
    return out


def case_id(case: dict) -> str:
    return f"{case['dtype']}-{case['heads']}-d{case['d']}-{case['block']}"


# ----------------------------------------------------------------------------- in the worker process
def _cuobjdump() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


def resources(folder: Path) -> dict:
    """Registers, stack and local bytes of the cubin in ``folder`` and its PTX's tensor-core kind."""
    from gpu_static.aot import mma_kind

    (cubin,), (ptx,) = list(folder.glob("*.cubin")), list(folder.glob("*.ptx"))
    row = {"mma": mma_kind(ptx.read_text())}
    tool = _cuobjdump()
    if tool:
        text = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
        fields = dict(f.split(":", 1) for line in text.splitlines() if "REG:" in line for f in line.split())
        row.update(registers=int(fields["REG"]), stack=int(fields["STACK"]), local=int(fields["LOCAL"]))
    return row


@contextlib.contextmanager
def compiling(dump: Path, capability=(9, 0)):
    """Fake CUDA on a simulated ``capability`` GPU, the real FlashAttention-4 compiling every kernel
    it would launch (into ``dump``), launches doing nothing. Yields the list of compiled kernels."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import cute_dsl_utils, interface, tile_scheduler
    from flash_attn.cute.cache_utils import JITCache
    from gpu_static.fake_cuda import fake_cuda

    dtypes = {"torch.bfloat16": cutlass.BFloat16, "torch.float16": cutlass.Float16,
              "torch.float32": cutlass.Float32, "torch.int32": cutlass.Int32}

    def fake_tensor(t, assumed_align=16, leading_dim=-1, fully_dynamic=False, enable_tvm_ffi=True):
        """What ``from_dlpack(t, assumed_align).mark_layout_dynamic(leading_dim)`` gives the compiler:
        dynamic shapes, dynamic 64-bit strides but the leading one (1), the base pointer's alignment."""
        if t is None:
            return None
        lead = None if fully_dynamic else (t.ndim - 1 if leading_dim == -1 else leading_dim)
        stride = tuple(1 if i == lead else cute.sym_int64() for i in range(t.ndim))
        return cute.runtime.make_fake_tensor(dtypes[str(t.dtype)], tuple(cute.sym_int() for _ in t.shape),
                                             stride=stride, assumed_align=assumed_align)

    compiled, real_compile, folders = [], cute.compile, itertools.count()

    def compile_and_keep(fn, *args, options: str = "", **kwargs):
        folder = dump / f"{next(folders):04d}"
        folder.mkdir(parents=True)
        start = time.perf_counter()
        real_compile(fn, *args, options=f"{options} --keep-cubin --keep-ptx --dump-dir={folder}", **kwargs)
        compiled.append({"kernel": type(fn).__name__, "compile_s": round(time.perf_counter() - start, 2),
                         **resources(folder)})
        return lambda *a, **k: None  # the launch: nothing runs without a GPU

    caches = [f for f in vars(interface).values() if callable(f) and hasattr(f, "compile_cache")]
    with contextlib.ExitStack() as stack:
        for f in caches:  # in-memory caches of this run only: nothing read from or written to disk
            stack.enter_context(mock.patch.object(f, "compile_cache", JITCache()))
        for module in (interface, cute_dsl_utils):
            stack.enter_context(mock.patch.object(module, "to_cute_tensor", fake_tensor))
        stack.enter_context(mock.patch.object(cute, "compile", compile_and_keep))
        # persistent schedulers size their grid from the SM count, asked of the driver while tracing
        hardware = _simulated_hardware(capability)
        for module in (cutlass.utils, cutlass.utils.hardware_info, tile_scheduler):
            stack.enter_context(mock.patch.object(module, "HardwareInfo", hardware))
        stack.enter_context(fake_cuda(capability))
        yield compiled


def _simulated_hardware(capability):
    """``cutlass.utils.HardwareInfo`` answering as the simulated GPU (H100 SXM: 132 SMs; B200: 148;
    one cluster per ``cluster_size`` SMs: the driver's occupancy answer for one CTA per SM). Only
    grid sizes of persistent schedulers follow from it, not the kernels' code."""
    sms = SMS[capability[0] * 10 + capability[1]]

    class SimulatedHardware:
        def __init__(self, device_id: int = 0):
            self.device_id = device_id

        def get_device_multiprocessor_count(self) -> int:
            return sms

        def get_max_active_clusters(self, cluster_size: int, stream=None) -> int:
            return sms // cluster_size

    return SimulatedHardware


def _drive(case: dict) -> None:
    """seqpar's calls for one case: forward (and backward) of one block through dispatch."""
    import torch
    from gpu_static.fake_cuda import cuda_tensor

    from seqpar.kernels import Band, block_backward, block_forward
    from seqpar.kernels.varlen import VarlenSegments, varlen_backward, varlen_forward

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case["dtype"]]
    (hq, hkv), d = HEADS[case["heads"]], case["d"]
    tq, tk, mask = BLOCKS[case["block"]]
    q = cuda_tensor(1, tq, hq, d, dtype=dt)
    k, v = cuda_tensor(1, tk, hkv, d, dtype=dt), cuda_tensor(1, tk, hkv, d, dtype=dt)
    if mask == "packed":  # three causal documents and a non-causal segment
        segs = VarlenSegments.build([(0, 100, 0, 100, "causal"), (100, 60, 100, 60, "causal"),
                                     (160, 96, 160, 96, "causal"), (160, 96, 0, 100, "none")], tq=tq, tk=tk)
        out, lse = varlen_forward(q, k, v, segs, scale=d**-0.5, backend="flash4")
        if case["backward"]:
            varlen_backward(out, q, k, v, out, lse, segs, scale=d**-0.5, backend="flash4")
        return
    mask = Band(-64, 0) if mask == "band" else mask
    out, lse = block_forward(q, k, v, scale=d**-0.5, mask=mask, backend="flash4")
    if case["backward"]:
        block_backward(out.float(), q, k, v, out.float(), lse, scale=d**-0.5, mask=mask, backend="flash4")


def worker(case_list: list[dict], dump: Path, arch: int) -> list[dict]:
    rows = []
    with compiling(dump, (arch // 10, arch % 10)) as compiled:
        for case in case_list:
            before, start = len(compiled), time.perf_counter()
            error = refused = None
            try:
                _drive(case)
            except Exception as exc:  # a row says what failed or what seqpar refused; the others still run
                if isinstance(exc, ValueError) and "cannot serve" in str(exc):
                    refused = str(exc).strip()[:400]  # seqpar's refusal, before FlashAttention-4 is called
                else:
                    error = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
            rows.append({"case": case_id(case), **case, "seconds": round(time.perf_counter() - start, 2),
                         "kernels": compiled[before:], "error": error, "refused": refused})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------- the caller's side
def unavailable() -> str | None:
    """Why this machine cannot run the compilation (the pinned package missing), or None."""
    import importlib.metadata

    from seqpar.kernels.flash4 import DISTRIBUTION, VERSION

    try:
        importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"{DISTRIBUTION} is not installed (pip install 'seqpar[flash4]' 'nvidia-cutlass-dsl[cu13]')"
    code = ("import importlib.metadata as m, flash_attn.cute.interface, quack.compile_utils; "
            "print(m.version('flash-attn-4'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if res.returncode:
        return f"flash-attn-4 not importable here: {res.stderr.strip().splitlines()[-1:]}"
    if res.stdout.strip() != VERSION:
        return f"flash-attn-4 {res.stdout.strip()} installed, seqpar pins {VERSION}"
    return None


def run(full: bool, arch: int = 90, timeout: float = 3600) -> list[dict]:
    """One worker process over the cases for ``sm_<arch>a`` (90: Hopper, 100: Blackwell; cubins and
    PTX in a temporary folder); its rows."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="seqpar_flash4_aot_") as dump:
        return _run(full, Path(dump), arch, timeout)


def _run(full: bool, dump: Path, arch: int, timeout: float) -> list[dict]:
    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CUTE_DSL_ARCH=f"sm_{arch}a", FLASH_ATTENTION_ARCH=f"sm_{arch}a",
               FLASH_ATTENTION_NUM_SMS=str(SMS[arch]),  # its kernel choices (fake_cuda's GPU says 108)
               PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-W", "ignore", "-m", "gpu_static.flash4_aot", "--worker", "--dump", str(dump),
           "--arch", str(arch)]
    cmd += ["--full"] if full else []
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tests)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode or len(rows) != len(cases(full, arch)):
        raise RuntimeError(f"worker exited {res.returncode} after {len(rows)} rows: {res.stderr[-3000:]}")
    return rows


def report(rows: list[dict], full: bool, arch: int, seconds: float) -> str:
    """The results page: one line per seqpar call, one per kernel it compiled."""
    import platform

    import cutlass
    import torch

    kernels = [k for r in rows for k in r["kernels"]]
    mmas = sorted({k["mma"] for k in kernels} - {"none"})
    lines = [f"# FlashAttention-4 (flash-attn-4 {rows and _version()}) compiled for sm_{arch}a, no GPU",
             "",
             f"`cd tests && python -m gpu_static.flash4_aot --arch {arch}{' --full' if full else ''} --results DIR` "
             "(`tests/gpu_static/flash4_aot.py`: what is real and what is replaced). "
             f"Python {platform.python_version()}, "
             f"torch {torch.__version__}, CuTe DSL {cutlass.__version__}; {seconds:.0f} s on this machine.",
             "",
             f"{len(rows)} seqpar calls (forward and backward of one block through dispatch with "
             f"`backend=\"flash4\"`; on sm_90 the forward alone above D = 128), "
             f"{sum(bool(r['error']) for r in rows)} failed, {sum(bool(r['refused']) for r in rows)} with a part "
             f"(the backward) refused by seqpar before FlashAttention-4 is called (the reason in the row; the "
             f"forward ran); {len(kernels)} kernels compiled, "
             + ", ".join(f"{sum(k['mma'] == m for k in kernels)} on {m}" for m in mmas) + "; "
             f"{sum(k.get('stack', 0) > 0 for k in kernels)} with a stack frame, "
             f"{sum(k.get('local', 0) > 0 for k in kernels)} with local memory (cuobjdump's STACK and LOCAL "
             "bytes per thread). A call whose kernels an earlier call compiled (the same compile key) lists none.",
             "",
             "| call | s | kernel | compile s | registers | stack | local | mma |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['case']} | {r['seconds']} "
        if r["error"]:
            lines.append(f"{head}| FAILED: {r['error'][:200]} | | | | | |")
        if r["refused"]:
            lines.append(f"{head}| refused: {r['refused'].split(': ', 1)[-1][:200]} | | | | | |")
        for i, k in enumerate(r["kernels"]):
            lines.append(f"{head if i == 0 else '| | '}| {k['kernel']} | {k['compile_s']} | {k.get('registers', '')} "
                         f"| {k.get('stack', '')} | {k.get('local', '')} | {k['mma']} |")
        if not r["kernels"] and not r["error"] and not r["refused"]:
            lines.append(f"{head}| (compiled by an earlier call) | | | | | |")
    return "\n".join(lines) + "\n"


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("flash-attn-4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--arch", type=int, choices=(90, 100), default=90, help="sm_90a (Hopper) or sm_100a")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dump", type=Path, help=argparse.SUPPRESS)  # the worker's folder
    parser.add_argument("--results", type=Path, help="write flash4_aot.{md,json} here "
                        "(benchmarks/results/gpu_static)")
    args = parser.parse_args()
    if args.worker:
        worker(cases(args.full, args.arch), args.dump, args.arch)
        return
    why = unavailable()
    if why:
        sys.exit(why)
    start = time.perf_counter()
    rows = run(args.full, args.arch)
    if args.results:
        name = f"flash4_aot_sm{args.arch}"
        (args.results / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.results / f"{name}.md").write_text(report(rows, args.full, args.arch, time.perf_counter() - start))
    print(f"{len(rows)} calls, {sum(len(r['kernels']) for r in rows)} kernels compiled, "
          f"{sum(bool(r['error']) for r in rows)} failed")


if __name__ == "__main__":
    main()
