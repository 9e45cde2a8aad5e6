"""The matrices of the ahead-of-time compilation suite (:mod:`gpu_static.aot`) and its results
files. ``cd tests && python3 -m gpu_static.aot_results [--full] [--results DIR]`` compiles the CI
part (or the whole matrix) and writes ``triton_aot_<ci|full>.{md,csv}`` to
``benchmarks/results/gpu_static/`` (or DIR)."""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

from gpu_static import aot


# ----------------------------------------------------------------------------- the matrices
def _dense(op, dtype, d, arch, configs="kept"):
    """The two dense layouts: causal GQA (4 query heads on 2 kv heads) and no mask, no GQA."""
    return [aot.Case(op, dtype, d, "dense", arch, True, True, configs),
            aot.Case(op, dtype, d, "dense", arch, False, False, configs)]


def ci_cases() -> list[aot.Case]:
    """The CI part (about 100 s on 2 cores): every attention kernel with every configuration kept
    for bf16 D = 128 on sm_90 and sm_80 and for fp16 D = 64 on sm_90; the packed, window,
    accumulate and lse-gradient paths with their first configuration; the configurations sm_89
    keeps for the bf16 D = 256 backward; one fp32 forward; the linear-attention chunk kernels."""
    cases = [aot.Case(op, "bf16", 128, "dense", arch) for op in ("attn_fwd", "attn_bwd") for arch in (90, 80)]
    cases += [aot.Case(op, "fp16", 64, "dense", 90, False, False) for op in ("attn_fwd", "attn_bwd")]
    paths = {"attn_fwd": ("packed", "window", "packed_window", "acc"),
             "attn_bwd": ("packed", "window", "packed_window", "dlse")}
    cases += [aot.Case(op, "bf16", 128, p, 90, configs="first") for op, ps in paths.items() for p in ps]
    # a window's lower edge alone (symmetric windows' blocks): the kernels with HAS_WINDOW, no IS_CAUSAL
    cases += [aot.Case(op, "bf16", 128, "window", 90, False, True, "first") for op in ("attn_fwd", "attn_bwd")]
    cases += [aot.Case("attn_bwd", "bf16", 256, "dense", 89),
              aot.Case("attn_fwd", "fp32", 64, "dense", 90, configs="first")]
    cases += [aot.Case(op, "fp32", 64, "mode2", 90) for op in ("linear_fwd", "linear_bwd")]
    return cases


def _tables_differ(op: str, dtype: str, d: int, arch: int, base: int) -> bool:
    from seqpar.kernels import triton_target as tt

    kernels = ("fwd",) if op == "attn_fwd" else ("dq", "dkdv")
    elem, block_d = (4 if dtype == "fp32" else 2), max(16, 1 << (d - 1).bit_length())
    return any(tt.fitting(k, elem, block_d, tt.Target.of(arch))
               != tt.fitting(k, elem, block_d, tt.Target.of(base)) for k in kernels)


def full_cases() -> list[aot.Case]:
    """The whole matrix (SEQPAR_GPU_STATIC_FULL=1): fp16 / bf16 / fp32 x head dims 16-256 x both
    dense layouts, forward and backward, on sm_90 and sm_80 with every configuration of the table
    (those pruned for the GPU's shared memory too), on sm_89 where pruning keeps a different set
    than on sm_80; every path for bf16 D = 64 and 128 and fp32 D = 64; the linear kernels (all decay
    modes, K = V = 64 and 128)."""
    dims = {"bf16": (16, 32, 64, 96, 128, 256), "fp16": (64, 128, 256), "fp32": (64, 128, 256)}
    cases = []
    for op in ("attn_fwd", "attn_bwd"):
        for dtype, ds in dims.items():
            for d in ds:
                for arch in (90, 80, 89):
                    if arch != 89 or _tables_differ(op, dtype, d, 89, 80):
                        cases += _dense(op, dtype, d, arch, "table")
    for dtype, d in (("bf16", 64), ("bf16", 128), ("fp32", 64)):
        for arch in (90, 80):
            paths = {"attn_fwd": ("packed", "window", "packed_window", "acc"),
                     "attn_bwd": ("packed", "window", "packed_window", "dlse", "delta")}
            cases += [aot.Case(op, dtype, d, p, arch) for op, ps in paths.items() for p in ps]
            cases += [aot.Case(op, dtype, d, "window", arch, False) for op in ("attn_fwd", "attn_bwd")]
    cases += [aot.Case(op, "fp32", d, mode, arch) for op in ("linear_fwd", "linear_bwd") for d in (64, 128)
              for mode in ("mode0", "mode1", "mode2") for arch in (90, 80)]
    return cases


def write_results(rows: list[dict], directory: Path, name: str, header: str) -> None:
    """``triton_aot_<name>.csv`` and ``.md`` (the header, a summary, one table row per variant)."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f"triton_aot_{name}.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=aot.FIELDS)
        w.writeheader()
        w.writerows(rows)
    cols = aot.FIELDS[:-1]
    lines = [header, "", *summary(rows), "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    for status, title in (("compile error", "Compile errors"),
                          ("refused", "Cases refused (dispatch picks another backend)")):
        listed = [f"- {r['kernel']} {r['arch']} {r['dtype']} D={r['D']} {r['case']} {r['config']}: "
                  f"{r['error'].strip().splitlines()[-1]}" for r in rows if r["status"] == status]
        if listed:
            lines += ["", f"{title}:", "", *listed]
    (directory / f"triton_aot_{name}.md").write_text("\n".join(lines) + "\n")


def summary(rows: list[dict]) -> list[str]:
    """Markdown lines: compile errors, shared-memory violations, estimate violations, spills."""
    kept = [r for r in rows if r["status"] not in ("pruned", "pruned (fits)", "refused")]
    default = [r for r in kept if r["arch"] == "sm_90" and r["dtype"] != "fp32" and r["D"] <= 128
               and r["kernel"] in aot.KERNELS]
    spills = sorted({(r["spill_bytes"], r["kernel"], r["arch"], r["dtype"], r["D"], r["config"])
                     for r in kept if r["spill_bytes"]}, reverse=True)
    under = [r for r in rows if None not in (r["smem_estimate"], r["smem_bytes"])
             and r["smem_estimate"] < r["smem_bytes"]]
    listed = "; ".join(f"{k} {a} {dt} D={d} {c}: {b} B" for b, k, a, dt, d, c in spills) or "none"
    on_mma = sorted({(r["kernel"], r["dtype"], r["D"], r["case"]) for r in default if r["mma"] == "mma"})
    groups = {(r["kernel"], r["dtype"], r["D"], r["case"]) for r in default}
    no_wgmma = groups - {(r["kernel"], r["dtype"], r["D"], r["case"]) for r in default if r["mma"] == "wgmma"}
    return [
        (f"- {len(rows)} rows (case x variant), {len(kept)} of them configurations the pruning keeps; "
         f"{sum(r['status'] == 'refused' for r in rows)} cases refused."),
        (f"- Compile errors: {sum(r['status'] == 'compile error' for r in rows)}. Kept configurations "
         f"above their GPU's shared memory: {sum(r['status'] == 'smem over limit' for r in rows)}. "
         f"Rows whose compiled shared memory exceeds the pruning's estimate: {len(under)}."),
        (f"- sm_90, fp16/bf16, D <= 128, kept configurations: {len(default)} variants, "
         f"{sum(bool(r['spill_bytes']) for r in default)} with spills."),
        (f"- Kept variants that spill ({len(spills)}, bytes of spill stores per thread, largest "
         f"first): {listed}."),
        (f"- sm_90, fp16/bf16, D <= 128: {len(groups)} kernel variants (kernel, dtype, D, case); "
         f"{len(on_mma)} with a kept configuration on Ampere's mma.sync, {len(no_wgmma)} with none on "
         "Hopper's wgmma (column `mma`)."),
    ]


def header(title: str, command: str, seconds: float) -> str:
    """Markdown preamble of a results file: what ran, where, with which versions."""
    import platform

    import torch
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    cpuinfo = Path("/proc/cpuinfo")
    models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
              if ln.startswith("model name")] if cpuinfo.exists() else []
    return "\n".join([
        f"# {title}",
        "",
        f"Command: `{command}` ({seconds:.0f} s wall, 2 worker processes).",
        (f"Machine: {models[0] if models else platform.processor()}, {os.cpu_count()} cores, no GPU "
         "(ahead-of-time compilation only)."),
        (f"Versions: Python {platform.python_version()}, torch {torch.__version__}, triton "
         f"{triton.__version__}, ptxas {get_ptxas(80).version} (sm_80, sm_89) and {get_ptxas(90).version} "
         "(sm_90), as bundled with triton."),
        f"Date: {time.strftime('%Y-%m-%d')}.",
        "",
        ("Shared memory per block: sm_90 232,448 B, sm_80 166,912 B, sm_89 101,376 B. `smem_bytes`: "
         "the compiled kernel's shared memory; `smem_estimate`: the bound the autotune pruning uses "
         "(`seqpar.kernels.triton_target.smem_estimate`); `spill_bytes`: ptxas's spill stores per "
         "thread; `mma`: the tensor-core instruction in the PTX (`wgmma`: Hopper's; `mma`: Ampere's "
         "mma.sync; `none`). Status `pruned` / `pruned (fits)`: dropped by the pruning for that GPU "
         "(not offered there, or above its shared memory; and whether the compiled kernel would in fact "
         "have fitted)."),
    ])


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the whole matrix (default: the CI part)")
    ap.add_argument("--results", type=Path, default=aot.REPO / "benchmarks/results/gpu_static")
    args = ap.parse_args()
    sys.path.insert(0, str(aot.REPO))  # this checkout's seqpar, not an installed one
    t0 = time.perf_counter()
    rows = aot.run_cases(full_cases() if args.full else ci_cases())
    name = "full" if args.full else "ci"
    command = "cd tests && python3 -m gpu_static.aot_results" + (" --full" if args.full else "")
    write_results(rows, args.results, name, header(f"Triton AOT compilation ({name} matrix)", command,
                                                   time.perf_counter() - t0))


if __name__ == "__main__":
    _main()
