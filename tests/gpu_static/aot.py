"""Ahead-of-time compilation of every Triton kernel of seqpar for NVIDIA GPUs, without a GPU.

How a kernel variant is obtained: the real host wrappers (``triton_attention_forward`` /
``triton_attention_backward``, ``linear_triton.intra_fwd`` / ``intra_bwd``) run on CPU tensors while
:func:`capture` intercepts the launch: ``Autotuner.run`` prunes the configurations with the kernel's
own ``prune_configs_by`` (against the target's shared memory, through
``triton_target.device_target``) and hands each kept configuration to ``JITFunction.run``, which
records the arguments instead of launching. :func:`bind` then applies Triton's own binder
(argument types, divisibility-by-16 and ``== 1`` specialisations, constexprs) for the target's
backend, and :func:`compile_variant` calls ``triton.compile(ASTSource(...), target=GPUTarget("cuda",
arch, 32))``, which runs the ptxas bundled with Triton: registers and spills come from its log
(``TRITON_DUMP_PTXAS_LOG``), shared memory from the compiled kernel's metadata.

Kernels defined under ``TRITON_INTERPRET=1`` (as the test session does on CPU machines) cannot be
compiled, so the compilation runs in worker processes started without it (:func:`run_cases`);
workers take variants from one ordered list and claim each with an exclusive file, so each variant
is compiled once and the workers stay busy until the list is done. The matrices and the results
files are in :mod:`gpu_static.aot_results`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("kernel", "arch", "dtype", "D", "case", "config", "registers", "smem_bytes", "smem_estimate",
          "spill_bytes", "mma", "status", "seconds", "error")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of a host wrapper, compiled for one architecture.

    ``op``: ``attn_fwd`` / ``attn_bwd`` (triton_attention) or ``linear_fwd`` / ``linear_bwd``
    (linear_triton). ``d``: head dim (attention) or K = V (linear). ``path`` for attention:
    ``dense`` (mask per ``causal``, GQA 4:2 if ``gqa``), ``packed`` (varlen), ``window``
    (sliding window: with ``causal`` a band, else a lower edge only), ``packed_window`` (varlen
    with a window, bottom-right aligned, as packed dispatch calls it), ``acc`` (in-kernel accumulation), ``dlse`` (backward through the
    forward op's autograd, with a gradient on lse), ``delta`` (backward from delta alone); for linear:
    ``mode0`` (no decay), ``mode1`` (scalar decay), ``mode2`` (per-key decay). ``configs``: ``kept``
    (what pruning keeps for ``arch``), ``first`` (the first kept one) or ``table`` (every configuration
    of the table for the dtype and head dim, also those pruned for ``arch``, reported as ``pruned``).
    """

    op: str
    dtype: str
    d: int
    path: str
    arch: int
    causal: bool = True
    gqa: bool = True
    configs: str = "kept"

    @property
    def name(self) -> str:
        mask = ("causal" if self.causal else "none") + ("-gqa" if self.gqa else "")
        tail = f"{self.path}-{mask}" if self.op.startswith("attn") else self.path
        return f"{self.op}-{tail}"


@dataclasses.dataclass
class Launch:
    """One intercepted launch: the JIT function, its positional and keyword arguments, and the
    autotune configuration (``None`` for a kernel that is not autotuned); ``kept``: whether pruning
    keeps that configuration."""

    fn: object
    args: tuple
    kwargs: dict
    config: object = None
    kept: bool = True


# ----------------------------------------------------------------------------- worker side
def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


@contextlib.contextmanager
def capture(arch: int, whole_table: bool):
    """Within the block, Triton launches are recorded (into the yielded list), not run, and
    ``triton_target.device_target`` reports ``sm_<arch>`` for CPU tensors, so the wrappers' checks
    and the autotuners' pruning see that GPU. ``whole_table``: also record the configurations that
    pruning drops for this GPU's shared memory (those it would keep with no limit)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from seqpar.kernels import triton_target

    launches: list[Launch] = []
    state = {"target": triton_target.Target.of(arch)}

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    def tune(self, *args, **kwargs):
        # As Autotuner.run: prune only when there is a choice, then run each kept configuration.
        self.nargs = dict(zip(self.arg_names, args))
        kept = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        offered = kept
        if whole_table:
            target, state["target"] = state["target"], None
            offered = self.prune_configs(kwargs)
            state["target"] = target
        for cfg in offered:
            self.fn.run(*args, **kwargs, **cfg.all_kwargs())
            launches[-1].config, launches[-1].kept = cfg, cfg in kept
        self.nargs = None

    saved = (Autotuner.run, JITFunction.run, triton_target.device_target)
    Autotuner.run, JITFunction.run = tune, record
    triton_target.device_target = lambda device: state["target"] if device.type == "cpu" else None
    try:
        yield launches
    finally:
        Autotuner.run, JITFunction.run, triton_target.device_target = saved


def _drive_attention(case: Case) -> None:
    """Call the attention wrapper as seqpar does for ``case`` (CPU tensors; launches intercepted)."""
    import torch

    from seqpar.kernels import triton_attention as ta

    dt = _torch_dtype(case.dtype)
    b, t, hq, hkv = 2, 256, 4, (2 if case.gqa else 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, t, h, case.d, generator=g).to(dt) for h in (hq, hkv, hkv))
    kw = dict(mask="causal" if case.causal else "none")
    if case.path in ("packed", "packed_window"):
        packed = ta.PackedSeqs.from_lengths([100, 156], [100, 156])
        q, k, v = (x.reshape(b * t, x.shape[2], x.shape[3])[:256] for x in (q, k, v))
        kw["packed"] = packed
        if case.path == "packed_window":
            kw.update(window_left=32, align="bottom_right")
    elif case.path == "window":
        kw["window_left"] = 64
    if case.op == "attn_fwd":
        if case.path == "acc":
            acc = (torch.zeros(q.shape), torch.full((b, hq, t), float("-inf")))
            ta.triton_attention_forward(q, k, v, acc=acc, **kw)
        else:
            ta.triton_attention_forward(q, k, v, **kw)
        return
    if case.path == "dlse":
        q.requires_grad_()
        out, lse = ta.triton_attention_forward(q, k, v, **kw)
        torch.autograd.backward((out, lse), (torch.ones_like(out), torch.ones_like(lse)))
        return
    out = torch.randn(q.shape, generator=g)  # the merged fp32 accumulator, as the ring loops pass it
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else torch.randn(hq, q.shape[0])
    if case.path == "delta":
        ta.triton_attention_backward(q, q, k, v, None, lse, delta=torch.randn(lse.shape), **kw)
    else:
        ta.triton_attention_backward(q, q, k, v, out, lse, **kw)


def _drive_linear(case: Case) -> None:
    import torch

    from seqpar.kernels import linear_chunk as lc
    from seqpar.kernels import linear_triton as lt

    n, h, c = 2, 2, lc.CHUNK
    q, k, v, do = (torch.randn(n, h, c, case.d) for _ in range(4))
    b = {"mode0": None, "mode1": torch.randn(n, h, c, 1), "mode2": torch.randn(n, h, c, case.d)}[case.path]
    if case.op == "linear_fwd":
        lt.intra_fwd(q, k, v, b, 0.125)
    else:
        lt.intra_bwd(q, k, v, b, do, 0.125)


def launches_of(case: Case) -> list[Launch]:
    with capture(case.arch, case.configs == "table") as launches:
        (_drive_attention if case.op.startswith("attn") else _drive_linear)(case)
    if case.configs == "first":
        seen, firsts = set(), []
        for ln in launches:
            if ln.kept and ln.fn not in seen:
                seen.add(ln.fn)
                firsts.append(ln)
        return firsts
    return launches


def bind(launch: Launch, arch: int):
    """Triton's own binding of a recorded launch for ``arch``: ``(signature, constexprs, attrs,
    options)`` exactly as ``JITFunction.run`` would compile it on that GPU."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn, kwargs = launch.fn, dict(launch.kwargs)
    # The first lines of JITFunction.run: options it adds before binding.
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores")


def mma_kind(ptx: str) -> str:
    """The tensor-core instructions of a kernel's PTX: ``wgmma`` (Hopper's warpgroup MMA, sm_90's
    fast path), ``mma`` (``mma.sync``, Ampere's instruction: on sm_90 it leaves much of the tensor
    cores' rate unused), ``tcgen05`` (Blackwell's tensor-memory MMA, sm_100's fast path), ``none``
    (no tensor cores: fp32 IEEE dots, or no dot at all)."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "tcgen05.mma" in ptx:
        return "tcgen05"
    return "mma" if "mma.sync" in ptx else "none"


def compile_variant(fn, arch: int, signature, constexprs, attrs, options) -> dict:
    """Compile for ``sm_<arch>``; registers, spill bytes (stores), shared memory per block and the
    tensor-core instructions (:func:`mma_kind`)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs, attrs),
                                target=GPUTarget("cuda", arch, 32), options=options.__dict__)
    regs, spills = _REGS.search(log.getvalue()), _SPILLS.search(log.getvalue())
    if regs is None or spills is None:
        raise RuntimeError(f"no ptxas resource lines in the log: {log.getvalue()[-500:]!r}")
    return dict(registers=int(regs.group(1)), spill_bytes=int(spills.group(1)),
                smem_bytes=int(kernel.metadata.shared), mma=mma_kind(kernel.asm["ptx"]))


KERNELS = {"attn_fwd_kernel": "fwd", "attn_bwd_dq_kernel": "dq", "attn_bwd_dkdv_kernel": "dkdv"}


def _config_fields(ln: Launch, case: Case) -> dict:
    """``config`` (``BLOCK_MxBLOCK_N wW sS``) and the pruning's estimate of its shared memory."""
    from seqpar.kernels import triton_target

    c = ln.config
    if c is None:
        return dict(config="-", smem_estimate=None)
    cfg = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
    est = triton_target.smem_estimate(KERNELS[ln.fn.__name__], cfg, ln.kwargs["BLOCK_D"],
                                      4 if case.dtype == "fp32" else 2, case.arch)
    return dict(config=f"{cfg[0]}x{cfg[1]} w{cfg[2]} s{cfg[3]}", smem_estimate=est)


def _variants(case: Case):
    """(key, use row, compile arguments) of every variant of ``case``, without compiling. The key
    identifies what Triton would compile (function, target, signature, constexprs, attributes,
    options), so a variant shared by several cases is compiled once. A case the wrapper refuses
    for this GPU (no configuration fits its shared memory) gives one ``refused`` row and no key."""
    base = dict(arch=f"sm_{case.arch}", dtype=case.dtype, D=case.d, case=case.name)
    try:
        launches = launches_of(case)
    except ValueError as e:
        if "no configuration" not in str(e):
            raise
        yield None, dict(base, kernel=case.op, kept=False, key=None, config="-", smem_estimate=None,
                         refused=str(e)), None
        return
    for ln in launches:
        signature, constexprs, attrs, options = bind(ln, case.arch)
        key = repr((ln.fn.__name__, case.arch, signature, sorted(constexprs.items()),
                    sorted(attrs.items()), sorted(options.__dict__.items())))
        use = dict(base, kernel=ln.fn.__name__, kept=ln.kept, key=key, **_config_fields(ln, case))
        yield key, use, (ln.fn, case.arch, signature, constexprs, attrs, options)


def _compile_result(key: str, spec) -> dict:
    t0 = time.perf_counter()
    try:
        res = dict(compile_variant(*spec), error="")
    except Exception as e:  # noqa: BLE001 - reported per variant; the tests fail on any
        res = dict(registers=None, spill_bytes=None, smem_bytes=None, mma=None,
                   error=f"{type(e).__name__}: {str(e)[:3000]}")
    return dict(res, key=key, seconds=round(time.perf_counter() - t0, 2))


def worker(cases: list[Case], claims: Path, out: Path, report_uses: bool) -> None:
    """Compile every variant of ``cases`` that this worker claims first; append JSON lines to
    ``out``: ``{"use": ...}`` (every variant of every case, when ``report_uses``) and
    ``{"result": ...}`` (the variants compiled here)."""
    with out.open("a") as f:
        for case in cases:
            for key, use, spec in _variants(case):
                if report_uses:
                    f.write(json.dumps({"use": use}) + "\n")
                if key is None:
                    continue
                try:
                    fd = os.open(claims / hashlib.sha1(key.encode()).hexdigest(), os.O_CREAT | os.O_EXCL)
                except FileExistsError:
                    continue
                os.close(fd)
                f.write(json.dumps({"result": _compile_result(key, spec)}) + "\n")
                f.flush()


def status(row: dict, limit: int) -> str:
    """``ok``; ``compile error``; ``smem over limit`` (kept by pruning, yet above the GPU's
    shared memory); ``pruned`` / ``pruned (fits)`` (dropped by pruning for this GPU; whether the
    compiled kernel would in fact have fitted); ``refused`` (the wrapper refused the case)."""
    if row.get("refused"):
        return "refused"
    if row["error"]:
        return "compile error"
    if row["kept"]:
        return "ok" if row["smem_bytes"] <= limit else "smem over limit"
    return "pruned" if row["smem_bytes"] > limit else "pruned (fits)"


# ----------------------------------------------------------------------------- parent side
def _worker_env(cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(REPO), str(REPO / "tests")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), TRITON_CACHE_DIR=cache, OMP_NUM_THREADS="1",
               TRITON_DEFAULT_FP_FUSION="1")
    return env


def run_cases(cases: list[Case], workers: int = 2, timeout: float = 3600,
              module: str = "gpu_static.aot") -> list[dict]:
    """Compile every variant of ``cases`` in ``workers`` fresh processes (no TRITON_INTERPRET, an
    empty Triton cache so that ptxas runs and reports); one row per (case, variant)."""
    # Expensive cases first (fp32 compiles take 10-40x longer than fp16/bf16), so they overlap.
    order = sorted(cases, key=lambda c: (c.dtype != "fp32", c.op.startswith("attn")))
    with tempfile.TemporaryDirectory(prefix="seqpar-aot-") as tmp:
        tmp = Path(tmp)
        (tmp / "claims").mkdir()
        (tmp / "cases.json").write_text(json.dumps([dataclasses.asdict(c) for c in order]))
        procs = []
        for i in range(workers):
            cmd = [sys.executable, "-m", module, "--worker", str(tmp), str(i)]
            procs.append(subprocess.Popen(cmd, env=_worker_env(str(tmp / "cache")), cwd=REPO,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                logs.append(p.communicate()[0] + "\n[timed out]")
        for p, log in zip(procs, logs):
            if p.returncode != 0:
                raise RuntimeError(f"AOT worker failed (exit {p.returncode}):\n{log[-4000:]}")
        uses, results = [], {}
        for i in range(workers):
            for line in (tmp / f"out{i}.jsonl").read_text().splitlines():
                rec = json.loads(line)
                if "use" in rec:
                    uses.append(rec["use"])
                else:
                    results[rec["result"]["key"]] = rec["result"]
    from seqpar.kernels.triton_target import SMEM_PER_BLOCK

    rows = []
    missing = dict(registers=None, smem_bytes=None, spill_bytes=None, mma=None, seconds=None, error="")
    for use in uses:
        row = use | (missing if use["key"] is None else results[use["key"]])
        if row.get("refused"):
            row["error"] = row["refused"]
        row["status"] = status(row, SMEM_PER_BLOCK[int(row["arch"][3:])])
        rows.append({k: row[k] for k in FIELDS})
    return rows


def _main() -> None:
    """Worker entry point (``python -m gpu_static.aot --worker DIR INDEX``, started by run_cases)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("DIR", "INDEX"), required=True)
    tmp, index = ap.parse_args().worker
    cases = [Case(**c) for c in json.loads((Path(tmp) / "cases.json").read_text())]
    worker(cases, Path(tmp) / "claims", Path(tmp) / f"out{index}.jsonl", report_uses=index == "0")


if __name__ == "__main__":
    _main()
