"""Every CUDA attention backend on every block the ring schedules issue; writes the dispatch table.

    python benchmarks/gpu_backends.py --out DIR --table seqpar/kernels/dispatch_table.json   # a GPU
    python benchmarks/gpu_backends.py --table-from FILE.json --table OUT.json                # no GPU

The successor of ``gpu_kernel_times.py`` (which stays for the replay): for each distinct block of
``ring``, ``zigzag_ring``, ``striped_ring`` and ``token_ring`` at N = 8 ranks and 8K and 32K tokens
per GPU (:func:`seqpar.bench.schedule_trace.rank_events`), Llama-3-8B heads (32 query, 8 K,V heads,
D = 128) and, at 8K, D = 64 and D = 256 probes, bf16, plus a non-square causal block (8K x 4K), each
backend forced (``--backends``):

- forward: :func:`seqpar.kernels.block_forward_into` with lse, the executor's call (the merge into
  fp32 accumulators fused where the backend has one); backward: :func:`seqpar.kernels.block_backward`
  from an external merged out / lse;
- the first call of each (backend, block) timed apart (cuDNN builds a graph per shape, Triton and
  FlashAttention-4 compile per configuration), then the median of CUDA-event timings after warm-up,
  each queued behind ``gpu_kernel_times.hold`` (the GPU's time, not the host's launch), and TFLOP/s
  on the visible pairs (:func:`seqpar.tracing.block_flops`); a Triton row also records the autotune
  configuration each kernel ran (:func:`seqpar.kernels.triton_attention.tuned_configs`);
- correctness on the device against float64 (:func:`check_backend`): a query chunk against two key
  chunks (the previous one unmasked, its own causal), each a forced block call, merged with
  :func:`seqpar.kernels.merge_` like a ring's two steps; then both backwards from the merged out /
  lse, dq summed; out, lse, dq, dK, dV of a GQA 8/2 head layout against float64 autograd.

Writes ``DIR/gpu_backends.json`` (rows, correctness, machine, command) and, with ``--table``, the
dispatch table (:func:`seqpar.kernels.dispatch_table.build_table`: per case the backends that ran
every block, fastest first). ``--table-from`` rebuilds a table from an earlier JSON of this script
or of ``gpu_kernel_times.py`` (its ``forced_<backend>`` columns) without a GPU. ``--budget-s``
stops timing new blocks when exceeded (the JSON says which were left out). The JSON is rewritten
after every block (``complete`` false until the end), so a run stopped from outside keeps what it
timed; a block whose set-up fails is listed under ``failed`` and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from seqpar.bench.schedule_trace import Shape, rank_events  # noqa: E402
from seqpar.kernels import block_backward, block_forward, block_forward_into, merge_, new_accumulator  # noqa: E402
from seqpar.kernels.dispatch import select_backend  # noqa: E402
from seqpar.kernels.dispatch_table import DTYPE_NAMES, PASSES, TableKey, build_table, kind_of, shape_class  # noqa: E402
from seqpar.kernels.masks import plan_block  # noqa: E402

METHODS = ("ring", "zigzag_ring", "striped_ring", "token_ring")
BACKENDS = ("flash4", "flash_attn", "triton", "torch_cuda", "cudnn")
#: (tokens per rank, query heads, K,V heads, head dim): Llama-3-8B at 8K and 32K, D probes at 8K.
CONFIGS = ((8192, 32, 8, 128), (32768, 32, 8, 128), (8192, 32, 8, 64), (8192, 32, 8, 256))


def blocks(n: int, tokens: int, hq: int, hkv: int, d: int) -> list[tuple[int, int, str]]:
    """Distinct ``(rows, keys, mask)`` blocks of :data:`METHODS` at ``n`` ranks, and a causal
    ``tokens x tokens/2`` block (a non-square causal block after reduction)."""
    seen = {(tokens, tokens // 2, "causal")}
    s = Shape(tokens * n, heads=hq, kv_heads=hkv, head_dim=d)
    for method in METHODS:
        for r in range(n):
            for e in rank_events(method, n, r, s):
                if e["type"] == "compute":
                    seen.add((e["shape"][1], e["shape"][2], e["mask"]))
    return sorted(seen)


def flops(rows: int, keys: int, hq: int, d: int, mask: str, backward: bool) -> float:
    from seqpar.tracing import block_flops

    return float(block_flops(1, rows, keys, hq, d, mask, backward=backward))


def _inputs(rows, keys, hq, hkv, d, gen, dev="cuda", dt=torch.bfloat16):
    def rnd(*s):
        return torch.randn(*s, generator=gen).to(dev, dt)

    return rnd(1, rows, hq, d), rnd(1, keys, hkv, d), rnd(1, keys, hkv, d), rnd(1, rows, hq, d)


def time_block(block, cfg, backends, args, gen) -> dict:
    """One block, forward and backward, every backend forced: times, first calls, TFLOP/s."""
    from gpu_kernel_times import timed

    (rows, keys, mask), (tokens, hq, hkv, d) = block, cfg
    q, k, v, dout = _inputs(rows, keys, hq, hkv, d, gen)
    scale, plan = d ** -0.5, plan_block(rows, keys, mask)
    out, lse = block_forward(q, k, v, scale=scale, mask=mask, backend="triton" if "triton" in backends else None)
    acc = new_accumulator(q.shape, q.device)
    row = {"tokens_per_rank": tokens, "rows": rows, "keys": keys, "mask": mask, "heads": hq, "kv_heads": hkv,
           "head_dim": d, "dtype": "bf16", "kind": kind_of(plan), "shape": shape_class(plan.rows, plan.keys)}
    for backward in (False, True):
        p = PASSES[backward]
        calls = {
            False: lambda b: block_forward_into(*acc, q, k, v, scale=scale, mask=mask, backend=b),
            True: lambda b: block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, backend=b),
        }[backward]
        row[p] = {"chosen": select_backend(q, k, v, mask=mask, for_backward=backward).name,
                  "flops": flops(rows, keys, hq, d, mask, backward), "backends": {}}
        for name in backends:
            row[p]["backends"][name] = _time_one(calls, name, row[p]["flops"], args, timed)
    return row


def _time_one(call, name, flop, args, timed) -> dict:
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(name)
        torch.cuda.synchronize()
        first = 1e3 * (time.perf_counter() - t0)
        t = timed(lambda: call(name), args.warmup, args.reps)
    except (RuntimeError, ValueError, NotImplementedError) as exc:  # refused or failed: recorded
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    row = {**t, "first_ms": first, "tflops": flop / (t["median_ms"] * 1e-3) / 1e12}
    if name == "triton":  # which autotune configuration ran (the backward: dq's and dk/dv's)
        from seqpar.kernels.triton_attention import tuned_configs

        row["configs"] = tuned_configs()
    return row


def _dense64(q, k, v, visible, scale):
    """float64 attention with GQA by expansion (the reference): out, lse."""
    g = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(g, 2).transpose(1, 2) for x in (k, v))
    s = torch.matmul(q.transpose(1, 2), kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.softmax(s, -1), vv).transpose(1, 2), lse


def check_backend(name: str, d: int, t: int = 512, hq: int = 8, hkv: int = 2, device="cuda", seed=0) -> dict:
    """A ring's two steps for one query chunk with ``name`` forced, against float64 (module
    docstring): relative max errors of out, dq, dk, dv, absolute of lse; ``ok`` within bf16's."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = _inputs(t, 2 * t, hq, hkv, d, gen, device)
    scale = d ** -0.5
    steps = ((slice(0, t), "none"), (slice(t, 2 * t), "causal"))  # previous chunk, own chunk
    try:
        acc = new_accumulator(q.shape, q.device)
        for keys, mask in steps:
            merge_(*acc, *block_forward(q, k[:, keys], v[:, keys], scale=scale, mask=mask, backend=name))
        out, lse = acc[0].to(q.dtype), acc[1]
        grads = [block_backward(dout, q, k[:, ks], v[:, ks], acc[0], lse, scale=scale, mask=m, backend=name)
                 for ks, m in steps]
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return {"backend": name, "head_dim": d, "error": f"{type(exc).__name__}: {exc}"[:300]}
    dq = sum(g[0].double() for g in grads)
    dk, dv = (torch.cat([g[i] for g in grads], 1).double() for i in (1, 2))
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    i = torch.arange(t, device=device)[:, None]
    visible = torch.cat([torch.ones(t, t, dtype=torch.bool, device=device), torch.arange(t, device=device) <= i], 1)
    ref_out, ref_lse = _dense64(*leaves, visible, scale)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, leaves, dout.double())]
    errs = {n: float((got.double() - r).abs().max() / r.abs().max())
            for n, got, r in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref)}
    errs["lse_abs"] = float((lse.double() - ref_lse.detach()).abs().max())
    # bf16 rounds to 2^-8 relative; out, dq, dk, dv go through two roundings and a sum over 2t keys
    ok = max(errs[n] for n in ("out", "dq", "dk", "dv")) <= 2e-2 and errs["lse_abs"] <= 1e-2
    return {"backend": name, "head_dim": d, "tokens": t, "heads": [hq, hkv], "errors": errs, "ok": ok}


def _need(d: dict, names: tuple[str, ...], where: str) -> None:
    """Refuse a measurement JSON that lacks a field of a case (never guessed)."""
    missing = [n for n in names if n not in d]
    if missing:
        raise ValueError(f"{where} has no {', '.join(missing)}: the dispatch table needs every field of a "
                         "case; re-run the benchmark that wrote it")


def measurements(doc: dict) -> list[dict]:
    """``build_table`` input from a JSON of this script or of ``gpu_kernel_times.py``."""
    _need(doc, ("machine", "rows"), "the measurement JSON")
    _need(doc["machine"], ("capability",), "its 'machine'")
    cap = doc["machine"]["capability"]
    arch = f"sm{cap[0]}{cap[1]}"
    out = []
    for i, row in enumerate(doc["rows"]):
        if "event" in row:  # gpu_kernel_times.py: [b, rows, keys, hq, hkv, d], forced_<backend>
            _need(doc, ("dtype",), "the gpu_kernel_times JSON")
            _need(row, ("shape", "mask"), f"rows[{i}]")
            _, rows, keys, _, _, d = row["shape"]
            backward = row["event"] == "block_bwd"
            plan = plan_block(rows, keys, row["mask"])
            key = TableKey(arch, PASSES[backward], kind_of(plan), shape_class(plan.rows, plan.keys),
                           DTYPE_NAMES[getattr(torch, doc["dtype"])], d)
            times = {n[len("forced_"):]: t for n, t in row.items() if n.startswith("forced_")}
            out += [{**key.as_dict(), "rows": rows, "keys": keys, "block": row["mask"], "backend": n,
                     "ms": t.get("median_ms")} for n, t in times.items()]
            continue
        _need(row, ("kind", "shape", "dtype", "head_dim", "rows", "keys", "mask", *PASSES), f"rows[{i}]")
        for p in PASSES:
            key = TableKey(arch, p, row["kind"], row["shape"], row["dtype"], row["head_dim"])
            out += [{**key.as_dict(), "rows": row["rows"], "keys": row["keys"], "block": row["mask"],
                     "backend": n, "ms": t.get("median_ms")} for n, t in row[p]["backends"].items()]
    return out


def write_table(doc: dict, path: str, command: str) -> dict:
    table = build_table(measurements(doc), command)
    Path(path).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}: {len(table['cases'])} measured cases")
    return table


def _save(doc: dict, out: Path) -> None:
    """Write ``out/gpu_backends.json`` (after every block too: a run stopped from outside keeps what
    it timed, and ``--table-from`` can rebuild the table from it)."""
    tmp = out / "gpu_backends.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out / "gpu_backends.json")


def run(args, command: str, out: Path) -> dict:
    from gpu_kernel_times import _machine

    gen, t0 = torch.Generator().manual_seed(0), time.perf_counter()
    backends = [b for b in args.backends.split(",") if b]
    from seqpar.kernels.flash4 import installed_version

    doc = {"command": command, "machine": {**_machine(), "cudnn": torch.backends.cudnn.version(),
                                           "flash_attn_4": installed_version()},
           "world_size": args.world_size, "warmup": args.warmup,
           "reps": args.reps, "checks": [], "rows": [], "skipped": [], "failed": [], "complete": False}
    for b, d in ((b, d) for b in backends for d in (64, 128, 256)):
        doc["checks"].append(check_backend(b, d))
        print(doc["checks"][-1], flush=True)
        _save(doc, out)
    for cfg in CONFIGS:
        for block in blocks(args.world_size, *cfg):
            if time.perf_counter() - t0 > args.budget_s:
                doc["skipped"].append([*cfg, *block])
                continue
            try:
                row = time_block(block, cfg, backends, args, gen)
            except (RuntimeError, ValueError) as exc:  # e.g. the reference forward: later blocks still run
                doc["failed"].append([*cfg, *block, f"{type(exc).__name__}: {exc}"[:300]])
                print(f"{cfg} {block}: {doc['failed'][-1][-1]}", flush=True)
                continue
            doc["rows"].append(row)
            _save(doc, out)
            print(f"{cfg[0]:6d} D={cfg[3]:3d} {block[0]:6d}x{block[1]:<6d} {block[2]:13s} " + "  ".join(
                f"{p[:3]} {n} {r.get('median_ms', float('nan')):.3f}ms/{r.get('first_ms', float('nan')):.0f}"
                for p in PASSES for n, r in row[p]["backends"].items()), flush=True)
    doc["seconds"], doc["complete"] = time.perf_counter() - t0, True
    _save(doc, out)
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for gpu_backends.json (needs a CUDA device)")
    p.add_argument("--table", help="write the dispatch table here (e.g. seqpar/kernels/dispatch_table.json)")
    p.add_argument("--table-from", help="build the table from this earlier JSON instead of measuring")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=330.0, help="stop timing new blocks after this long")
    args = p.parse_args(argv)
    command = "python benchmarks/gpu_backends.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.table_from:
        if not args.table:
            p.error("--table-from needs --table")
        write_table(json.loads(Path(args.table_from).read_text()), args.table, command)
        return 0
    if not args.out:
        p.error("give --out DIR (measure on a GPU) or --table-from FILE --table OUT")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = run(args, command, out)
    print(f"wrote {out / 'gpu_backends.json'} in {doc['seconds']:.0f} s")
    if args.table:
        write_table(doc, args.table, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
