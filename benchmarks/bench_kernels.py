"""Block-attention kernel benchmark: seqpar's Triton kernel against torch's
fused SDPA backends (flash, efficient, cuDNN) and flash-attn (when installed).

FLOPs (explicit, the usual convention):
    forward          = 4 * B * Hq * Tq * Tk * D        (x 0.5 when causal)
    forward+backward = forward * (1 + 2.5)             (backward counted as 2.5x forward)
TFLOP/s = FLOPs / median time. The bf16 matmul rate of the same GPU is
measured once (8192^3) and each row reports its share of it (``pct_matmul``).

Writes ``benchmarks/results/bench_kernels_<gpu>.csv`` (one tidy row per
provider x mode x causal x T, with machine and versions) and a PNG plot next
to it, and prints a table. GPU only: without CUDA it says so and exits 0.

    python benchmarks/bench_kernels.py                         # T = 4K..128K, D=128, bf16
    python benchmarks/bench_kernels.py --seqlens 8192 --modes fwd --providers triton,sdpa_cudnn
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROVIDERS = ("triton", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    provider: str
    mode: str  # "fwd" or "fwd_bwd"
    causal: bool
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    dim: int
    dtype: str

    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.dim
        f *= 0.5 if self.causal else 1.0
        return f * (3.5 if self.mode == "fwd_bwd" else 1.0)


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda),
           "gpu": torch.cuda.get_device_name(), "host": platform.node()}
    for name in ("triton", "flash_attn"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # not installed, or a broken build
            out[name] = "-"
    return out


def _bench_ms(fn, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds of ``fn`` with CUDA events (at least 3 timed runs)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) * 1e3, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(3, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def matmul_tflops(dtype: torch.dtype) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = _bench_ms(lambda: a @ b, 50, 300)
    return 2 * n**3 / ms / 1e9


def _attention_fn(case: Case, q, k, v):
    """-> a callable computing the output [B, T, H, D] (differentiable), or raises."""
    causal = case.causal
    if case.provider == "triton":
        from seqpar.kernels.triton_attention import triton_attention_forward

        mask = "causal" if causal else "none"
        return lambda: triton_attention_forward(q, k, v, mask=mask)[0]
    if case.provider == "flash_attn":
        from flash_attn import flash_attn_func

        return lambda: flash_attn_func(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[case.provider]
    gqa = case.heads != case.kv_heads

    def run():
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                enable_gqa=gqa)
        return o.transpose(1, 2)

    return run


def run_case(case: Case, args) -> dict:
    dt = DTYPES[case.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (case.batch, case.seqlen, case.heads, case.dim)
    shape_kv = (case.batch, case.seqlen, case.kv_heads, case.dim)
    need_grad = case.mode == "fwd_bwd"
    q = torch.randn(shape_q, device="cuda", dtype=dt, generator=gen).requires_grad_(need_grad)
    k = torch.randn(shape_kv, device="cuda", dtype=dt, generator=gen).requires_grad_(need_grad)
    v = torch.randn(shape_kv, device="cuda", dtype=dt, generator=gen).requires_grad_(need_grad)
    attn = _attention_fn(case, q, k, v)
    if need_grad:
        dout = torch.randn(shape_q, device="cuda", dtype=dt, generator=gen)

        def step():
            q.grad = k.grad = v.grad = None
            attn().backward(dout)
    else:
        def step():
            with torch.no_grad():
                attn()
    ms = _bench_ms(step, args.warmup_ms, args.rep_ms)
    return {"ms": ms, "tflops": case.flops() / ms / 1e9}


def check_against_sdpa(case: Case) -> float | None:
    """Max |triton - sdpa| of the forward output at this shape (a sanity check)."""
    try:
        dt = DTYPES[case.dtype]
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(case.batch, case.seqlen, case.heads, case.dim, device="cuda", dtype=dt,
                        generator=gen)
        k = torch.randn(case.batch, case.seqlen, case.kv_heads, case.dim, device="cuda",
                        dtype=dt, generator=gen)
        v = torch.randn_like(k)
        with torch.no_grad():
            a = _attention_fn(dataclasses.replace(case, provider="triton"), q, k, v)()
            b = _attention_fn(dataclasses.replace(case, provider="sdpa_efficient"), q, k, v)()
        return (a.float() - b.float()).abs().max().item()
    except Exception as exc:  # report, never abort the sweep
        print(f"  check failed: {type(exc).__name__}: {exc}")
        return None


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'seqpar[bench]')")
        return
    modes = sorted({r["mode"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(len(modes), len(causals), squeeze=False,
                             figsize=(5.5 * len(causals), 4 * len(modes)))
    for i, mode in enumerate(modes):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for prov in PROVIDERS:
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows if r["provider"] == prov
                             and r["mode"] == mode and r["causal"] == causal and r["tflops"])
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=prov)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length T")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="4096,8192,16384,32768,65536,131072")
    p.add_argument("--batch-tokens", type=int, default=32768,
                   help="B = max(1, batch_tokens // T) (keeps the work per row similar)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--modes", default="fwd,fwd_bwd")
    p.add_argument("--causal", default="true,false")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--warmup-ms", type=float, default=100.0)
    p.add_argument("--rep-ms", type=float, default=400.0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--no-check", action="store_true", help="skip the triton-vs-SDPA output check")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; this benchmark times GPU kernels only. "
              "Nothing measured (exit 0).")
        return 0
    versions = _versions()
    providers = [p for p in args.providers.split(",") if p]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {PROVIDERS}")
    if "flash_attn" in providers and versions["flash_attn"] == "-":
        print("flash-attn not installed: skipping provider flash_attn")
        providers.remove("flash_attn")
    kv_heads = args.kv_heads or args.heads
    mm = matmul_tflops(DTYPES[args.dtype])
    print(f"{versions['gpu']}: measured {args.dtype} matmul {mm:.0f} TFLOP/s (8192^3)")
    rows: list[dict] = []
    for t in (int(x) for x in args.seqlens.split(",")):
        batch = max(1, args.batch_tokens // t)
        for causal in (c.strip().lower() == "true" for c in args.causal.split(",")):
            for mode in args.modes.split(","):
                for prov in providers:
                    case = Case(prov, mode, causal, batch, t, args.heads, kv_heads, args.dim,
                                args.dtype)
                    row = dataclasses.asdict(case)
                    row.update(flops=case.flops(), ms=None, tflops=None, pct_matmul=None,
                               status="ok", check_max_abs=None, matmul_tflops=round(mm, 1),
                               **versions)
                    try:
                        row.update(run_case(case, args))
                        row["pct_matmul"] = round(100 * row["tflops"] / mm, 1)
                        if prov == "triton" and mode == "fwd" and not args.no_check:
                            row["check_max_abs"] = check_against_sdpa(case)
                    except Exception as exc:  # unsupported shape, OOM, missing backend
                        row["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    finally:
                        torch.cuda.empty_cache()
                    rows.append(row)
                    tf = f"{row['tflops']:7.1f}" if row["tflops"] else "      -"
                    ms = f"{row['ms']:9.3f}" if row["ms"] else "        -"
                    print(f"T={t:>6} B={batch:>2} {'causal' if causal else 'full  '} "
                          f"{mode:<7} {prov:<15} {ms} ms {tf} TFLOP/s  {row['status']}",
                          flush=True)
    if not rows:
        print("nothing to measure (no seqlens, modes or providers selected)")
        return 0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "".join(c if c.isalnum() else "_" for c in versions["gpu"]).strip("_")
    csv_path = out_dir / f"bench_kernels_{tag}.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"csv: {csv_path}")
    plot(rows, out_dir / f"bench_kernels_{tag}.png",
         f"{versions['gpu']} | {args.dtype} D={args.dim} Hq={args.heads} Hkv={kv_heads} | "
         f"torch {versions['torch']} triton {versions['triton']} | matmul {mm:.0f} TFLOP/s")
    _summary(rows)
    return 0


def _summary(rows: list[dict]) -> None:
    """Triton vs the best SDPA backend per (mode, causal, T)."""
    print("\ntriton / best torch SDPA (>= 1.0 meets the issue-3 target):")
    keys = sorted({(r["mode"], r["causal"], r["seqlen"]) for r in rows})
    for mode, causal, t in keys:
        sel = [r for r in rows if (r["mode"], r["causal"], r["seqlen"]) == (mode, causal, t)
               and r["tflops"]]
        tri = [r["tflops"] for r in sel if r["provider"] == "triton"]
        sdpa = [r["tflops"] for r in sel if r["provider"].startswith("sdpa_")]
        if tri and sdpa:
            ratio = tri[0] / max(sdpa)
            print(f"  {mode:<7} {'causal' if causal else 'full  '} T={t:>6}: {ratio:5.2f}"
                  f"  ({tri[0]:.0f} vs {max(sdpa):.0f} TFLOP/s)")
        else:
            print(f"  {mode:<7} {'causal' if causal else 'full  '} T={t:>6}: incomplete")


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
