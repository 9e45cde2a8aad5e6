"""Numerics across ring sizes: bf16 and fp16 error against float64 for every method at N = 1, 2, 4, 8.

For each method (``seqpar.METHODS`` and ``seqpar.LINEAR_METHODS``) and low-precision dtype, the same
global inputs (rounded once to the dtype) run on N local gloo ranks (CPU); the output and every input
gradient are gathered and compared with a float64 computation on the same rounded inputs. Two errors
per tensor, the table shows the worst over out and the gradients:

- normwise ``||x - ref|| / ||ref||`` (Frobenius): the growth target applies to it. It averages the
  final rounding of every element to bf16/fp16, so what remains is the error the computation adds;
- elementwise ``max |x - ref| / max |ref|``: dominated by the final rounding of the one worst element
  (about half an ulp of the largest values), which flips between 0.5x and 2x of itself whenever the
  fp32 partial sums change order, so its ratio between two N measures that noise, not accumulation.

N = 1 is the same code on one device (no communication). ``growth`` = error(N=8) / error(N=2): an
exact sequence-parallel method should not lose accuracy as the ring grows (target <= 1.5x): the
partial softmax statistics are merged in fp32 and the dK/dV accumulators travel in fp32.
``--grad-comm-dtype input`` (dK/dV accumulators in the input dtype on the wire, rounded at every hop)
is the control that shows growth where it exists.

    python benchmarks/numerics.py                        # writes benchmarks/results/numerics.{md,csv}
    python benchmarks/numerics.py --seq-len 256 --ns 2,4 --out /tmp    # quick

Softmax: causal, B=1, ``--seq-len`` global tokens, 8 query heads and 4 KV heads (GQA; 8 so that
Ulysses can split heads over 8 ranks), head dim 32; usp uses ``ulysses_degree=1`` at N=2 and 2 above
(a ring axis at every N; at N=1 it is one device). Linear:
gated (per-head scalar log-decay), 8 heads, K = V = 32. CPU kernels compute in fp32 for both
low-precision dtypes; fp16 is supported on the CPU path (measured here, not assumed).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from pathlib import Path

import torch

import seqpar

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HQ, HKV, D = 8, 4, 32


def _inputs(T, dtype, seed, linear):
    """Global inputs rounded to ``dtype``, and the gradient of the loss w.r.t. the output."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if linear:
        x = [rnd(1, T, HQ, D), rnd(1, T, HQ, D), rnd(1, T, HQ, D),
             torch.nn.functional.logsigmoid(rnd(1, T, HQ) + 3), rnd(1, T, HQ, D)]
    else:
        x = [rnd(1, T, HQ, D), rnd(1, T, HKV, D), rnd(1, T, HKV, D), rnd(1, T, HQ, D)]
    return [t.to(dtype) for t in x]


def _usp_kw(method, n):
    """usp keeps a ring axis at every N (U=1, R=2 at N=2; U=2, R=N/2 above), so that its growth
    compares ring merges with ring merges, not pure Ulysses (exact, no merge) with a ring; an odd N
    is a ring of N with U=1."""
    if method != "usp" or n == 1:
        return {}
    return {"ulysses_degree": 1 if n == 2 or n % 2 else 2}


def _run(method, x, n, group_kw, grad_comm_dtype=None, window=None):
    """This rank's part: fwd + bwd, gathered back to global order (every rank gets everything)."""
    if method in seqpar.LINEAR_METHODS:
        q, k, v, g, dout = x
        rank = torch.distributed.get_rank() if n > 1 else 0
        t = q.shape[1] // n
        loc = [y[:, rank * t:(rank + 1) * t].clone().requires_grad_() for y in (q, k, v, g)]
        o, _ = seqpar.linear_attention(*loc, method=method)
        o.backward(dout[:, rank * t:(rank + 1) * t])
        parts = [o.detach()] + [y.grad for y in loc]
        return [seqpar.unshard(p, method=method) if n > 1 else p for p in parts]
    q, k, v, dout = x
    loc = [seqpar.shard(y, method=method, **group_kw) for y in (q, k, v, dout)]
    ql, kl, vl = (y.requires_grad_() for y in loc[:3])
    out = seqpar.attention(ql, kl, vl, method=method, causal=True, grad_comm_dtype=grad_comm_dtype, window=window,
                           **group_kw)
    out.backward(loc[3])
    return [seqpar.unshard(y, method=method, **group_kw) for y in (out.detach(), ql.grad, kl.grad, vl.grad)]


def _rank_all(methods, dtypes, T, seed, n, grad_comm_dtype=None, window=None):
    """On every rank: run every (method, dtype); rank 0 returns the gathered tensors."""
    rank = torch.distributed.get_rank() if n > 1 else 0
    out = {}
    for method in methods:
        for name in dtypes:
            x = _inputs(T, DTYPES[name], seed, method in seqpar.LINEAR_METHODS)
            try:
                gcd = grad_comm_dtype if method in seqpar.METHODS else None
                res = _run(method, x, n, _usp_kw(method, n), gcd, None if method in seqpar.LINEAR_METHODS else window)
            except Exception as exc:  # reported in the table (e.g. a dtype a CPU kernel lacks)
                res = f"{type(exc).__name__}: {exc}"
            out[(method, name)] = res if rank == 0 else None
    return out


def _sdpa(x, window=None):
    """torch's own scaled_dot_product_attention on one device, in the inputs' dtype (causal, and the
    window as a boolean mask): the plain low-precision attention a user would otherwise run."""
    import torch.nn.functional as F

    q, k, v, dout = *(y.clone().requires_grad_() for y in x[:3]), x[3]
    t = q.shape[1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    mask = (j <= i) & ((j > i - window) if window else True)
    o = F.scaled_dot_product_attention(*(y.transpose(1, 2) for y in (q, k, v)), attn_mask=mask,
                                       enable_gqa=True).transpose(1, 2)
    o.backward(dout)
    return [o.detach(), q.grad, k.grad, v.grad]


def _reference(method, x, window=None):
    """float64 output and gradients on the same rounded inputs."""
    from seqpar.softmax.reference import reference_attention
    from seqpar.linear import reference_linear_attention

    if method in seqpar.LINEAR_METHODS:
        q, k, v, g, dout = (y.double().clone().requires_grad_() for y in x)
        o, _ = reference_linear_attention(q, k, v, g)
        o.backward(dout.detach())
        return [o.detach(), q.grad, k.grad, v.grad, g.grad]
    q, k, v, dout = (y.double().clone().requires_grad_() for y in x)
    o = reference_attention(q, k, v, causal=True, window=window)
    o.backward(dout.detach())
    return [o.detach(), q.grad, k.grad, v.grad]


def _rel(a, b):
    """Elementwise: max |a - b| / max |b|."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rel_norm(a, b):
    """Normwise: ||a - b|| / ||b|| (Frobenius)."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def measure(methods, dtypes, ns, T, seed=0, progress=True, grad_comm_dtype=None, window=None):
    """Rows ``{method, dtype, N, norm_out, ..., norm, max_out, ..., max}``; N=1 runs in this process;
    N=0 is torch's SDPA on one device (softmax methods)."""
    from seqpar.testing import get_pool

    results = {1: _rank_all(methods, dtypes, T, seed, 1, grad_comm_dtype, window)}
    for n in ns:
        t0 = time.perf_counter()
        results[n] = get_pool(n).run(_rank_all, (methods, dtypes, T, seed, n, grad_comm_dtype, window),
                                     timeout=1800)[0]
        if progress:
            print(f"N={n}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows = []
    names = ("out", "dq", "dk", "dv", "dg")
    for method in methods:
        for name in dtypes:
            x = _inputs(T, DTYPES[name], seed, method in seqpar.LINEAR_METHODS)
            ref = _reference(method, x, None if method in seqpar.LINEAR_METHODS else window)
            for n in ((0,) if method in seqpar.METHODS else ()) + (1, *ns):
                got = _sdpa(x, window) if n == 0 else results[n][(method, name)]
                row = {"method": method, "dtype": name, "N": n, "T": T, "error": ""}
                if isinstance(got, str):
                    row["error"] = got
                else:
                    for key, a, b in zip(names, got, ref):
                        row[f"norm_{key}"] = _rel_norm(a, b)
                        row[f"max_{key}"] = _rel(a, b)
                    row["norm"] = max(row[f"norm_{key}"] for key in names[:len(ref)])
                    row["max"] = max(row[f"max_{key}"] for key in names[:len(ref)])
                rows.append(row)
    return rows


def _fmt(x):
    return "n/a" if x is None else f"{x:.2e}"


def _growth(by, method, dtype, lo, hi, key):
    a, b = by[(method, dtype, lo)], by[(method, dtype, hi)]
    return None if a["error"] or b["error"] else b[key] / a[key]


def write(rows, ns, out_dir: Path, command: str, seconds: float, load: str, grad_comm_dtype=None,
          window=None, name="numerics") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = ("out", "dq", "dk", "dv", "dg")
    keys = ["method", "dtype", "N", "T", *(f"norm_{p}" for p in parts), "norm", *(f"max_{p}" for p in parts),
            "max", "error"]
    with open(out_dir / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6e}" if isinstance(r.get(k), float) else r.get(k, "")) for k in keys})
    by = {(r["method"], r["dtype"], r["N"]): r for r in rows}
    lo, hi = min(ns), max(ns)
    lines = [
        "# Numerics: low-precision error against float64, by ring size",
        "",
        f"- command: `{command}`",
        f"- machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, gloo on CPU; "
        f"load average at the end: {load}",
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, seqpar {seqpar.__version__}",
        f"- run time: {seconds:.0f} s; raw rows (every tensor, both errors; N = 0: torch SDPA): `{name}.csv`",
        "- inputs: softmax causal{win}, T = {T} global, Hq = {HQ}, Hkv = {HKV}, D = {D} (usp: U=1 x R=2 at N=2, "
        "U=2 x R=N/2 above); linear: gated (scalar log-decay per head), H = {HQ}, K = V = {D}; "
        "grad_comm_dtype = {g}".format(T=rows[0]["T"], HQ=HQ, HKV=HKV, D=D, g=grad_comm_dtype,
                                       win=f", sliding window {window}" if window else ""),
        "- normwise error: max over out, dq, dk, dv (dg) of `||x - ref|| / ||ref||`, ref = float64 on the same "
        "rounded inputs; elementwise: `max|x - ref| / max|ref|` (dominated by the final rounding of one "
        "element, see the docstring of benchmarks/numerics.py)",
        f"- growth = error(N={hi}) / error(N={lo}); target <= 1.5x on the normwise error",
        "- SDPA: `torch.nn.functional.scaled_dot_product_attention` on one device in the same dtype (softmax "
        "methods; a boolean mask); `/ SDPA`: the largest error over N = 1.. against SDPA's (normwise | elementwise)",
        "",
        "| method | dtype | normwise SDPA | " + " | ".join(f"normwise N={n}" for n in (1, *ns)) +
        f" | growth N={hi} / N={lo} | <= 1.5x | elementwise N={lo} / N={hi} | elementwise growth | / SDPA |",
        "|---|---|" + "---|" * (len(ns) + 7),
    ]
    worst = worst_max = 0.0
    for method in dict.fromkeys(r["method"] for r in rows):
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            cells = []
            for n in (1, *ns):
                r = by[(method, dtype, n)]
                cells.append(f"error: {r['error'][:60]}" if r["error"] else _fmt(r["norm"]))
            g, gm = _growth(by, method, dtype, lo, hi, "norm"), _growth(by, method, dtype, lo, hi, "max")
            worst, worst_max = max(worst, g or 0.0), max(worst_max, gm or 0.0)
            ok = "n/a" if g is None else ("yes" if g <= 1.5 else "**no**")
            first, last = by[(method, dtype, lo)]["max"], by[(method, dtype, hi)]["max"]
            elem = "n/a" if gm is None else f"{_fmt(first)} / {_fmt(last)}"
            sdpa = by.get((method, dtype, 0))
            vs = [by[(method, dtype, n)] for n in (1, *ns) if not by[(method, dtype, n)]["error"]]
            rel = "n/a" if sdpa is None or not vs else \
                f"{max(r['norm'] for r in vs) / sdpa['norm']:.2f}x \\| {max(r['max'] for r in vs) / sdpa['max']:.2f}x"
            lines.append(f"| {method} | {dtype} | {_fmt(sdpa['norm']) if sdpa else 'n/a'} | " + " | ".join(cells) +
                         f" | {'n/a' if g is None else f'{g:.2f}x'} | {ok} | {elem} | "
                         f"{'n/a' if gm is None else f'{gm:.2f}x'} | {rel} |")
    lines += ["", f"Largest normwise growth: {worst:.2f}x; largest elementwise growth: {worst_max:.2f}x."]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--ns", default="2,4,8", help="ring sizes, comma-separated (N=1 is always run)")
    p.add_argument("--methods", default=",".join((*seqpar.METHODS, *seqpar.LINEAR_METHODS)))
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-comm-dtype", default=None, choices=[None, "fp32", "input"],
                   help="dK/dV accumulators on the wire (softmax methods); 'input' is the growth control")
    p.add_argument("--window", type=int, default=None, help="sliding window W of the softmax methods (causal)")
    p.add_argument("--name", default="numerics", help="stem of the written .md / .csv")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    ns = [int(x) for x in args.ns.split(",")]
    methods = args.methods.split(",")
    dtypes = args.dtypes.split(",")
    bad = [m for m in methods if m not in (*seqpar.METHODS, *seqpar.LINEAR_METHODS)] + \
        [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown method or dtype: {bad}")
    if any(args.seq_len % (2 * n * 2) for n in ns):
        p.error(f"--seq-len {args.seq_len} must be a multiple of 4N for every N (zigzag, usp 2 x N/2)")
    t0 = time.perf_counter()
    if args.window is not None and args.window < 1:
        p.error(f"--window {args.window} must be >= 1")
    rows = measure(methods, dtypes, ns, args.seq_len, args.seed, grad_comm_dtype=args.grad_comm_dtype,
                   window=args.window)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else "n/a"
    write(rows, ns, Path(args.out), " ".join(["python benchmarks/numerics.py", *(argv or sys.argv[1:])]),
          time.perf_counter() - t0, " ".join(load), args.grad_comm_dtype, args.window, args.name)
    print((Path(args.out) / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
