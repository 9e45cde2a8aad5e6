"""Time the replay's attention blocks on a real GPU and set them beside the GPU kernel model.

    python benchmarks/gpu_kernel_times.py --out DIR        # needs a CUDA device

The replay's comparison with ring-flash-attention's published table (``project_replay.py``,
``replay_ringflash.md``) prices every block of ``ring``, ``zigzag_ring`` and ``striped_ring`` at
N = 8, 8K tokens per GPU, Llama-3.1-8B heads (32 query, 8 K,V heads, D = 128), bf16, causal, and
the ideal's one-GPU causal 8K call, with FlashAttention-2 rates read off published figures
(:data:`seqpar.bench.machine._TABLES`). This script times each distinct block of those schedule
traces (:func:`seqpar.bench.schedule_trace.rank_events`) on this GPU, forward and backward:

- ``seqpar``: :func:`seqpar.kernels.block_forward` / :func:`~seqpar.kernels.block_backward`, the
  calls the executor makes (backend chosen by the dispatch, recorded per row);
- ``flash``: torch's FlashAttention-2 kernel alone through ``scaled_dot_product_attention``
  restricted to the flash backend, K,V heads grouped natively when torch allows it (else expanded,
  recorded): the stand-in for ring-flash-attention's ``flash_attn`` calls; a strictly causal block
  (striped_ring) runs as causal, which differs by one diagonal;
- ``merge``: seqpar's forward fold of a block into fp32 accumulators (:func:`seqpar.kernels.merge.merge_`)
  and the backward's fp32 accumulation of dq, dK, dV (``add_``);
- ``model``: the kernel model's time of the kernel alone (FLOPs / rate) and of the epilogue
  (bytes / HBM), :data:`seqpar.bench.machine.KERNELS` ``[h100-fa2]``.

Times are the median of CUDA-event timings after warm-up, each queued behind :func:`hold` (until
2026-11-26 they started on an idle GPU and so included the host's launch). Writes
``DIR/gpu_kernel_times.json`` (rows, machine, versions, command) and prints a table. ``project_replay.py --kernel-times FILE``
replays the ring-flash-attention comparison with these times in place of the published rates.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from seqpar.bench.machine import KERNELS
from seqpar.bench.schedule_trace import Shape, rank_events
from seqpar.kernels import block_backward, block_forward, block_forward_into, select_backend
from seqpar.kernels.merge import merge_, new_accumulator

LLAMA = {"heads": 32, "kv_heads": 8, "head_dim": 128, "esize": 2}
METHODS = ("ring", "zigzag_ring", "striped_ring")


def block_events(n: int, tokens_per_rank: int) -> list[dict]:
    """One compute event per distinct ``(name, shape, mask)`` of the three methods at ``n`` ranks, and of the
    ideal (one rank, ``tokens_per_rank`` tokens)."""
    seen: dict = {}
    runs = [(m, n, tokens_per_rank * n) for m in METHODS] + [("ring", 1, tokens_per_rank)]
    for method, world, seq in runs:
        s = Shape(seq, **LLAMA)
        for r in range(world):
            for e in rank_events(method, world, r, s):
                if e["type"] == "compute":
                    seen.setdefault((e["name"], tuple(e["shape"]), e.get("mask")), e)
    # a causal block that is not square (reduced top-left: packed documents, uneven shards), where
    # torch's op runs its memory-efficient kernel instead of the flash one: checks the dispatch order
    for name in ("block_fwd", "block_bwd"):
        e = next(iter(seen.values()))
        shape = [1, tokens_per_rank, tokens_per_rank // 2, *e["shape"][3:]]
        seen[(name, tuple(shape), "causal")] = {**e, "name": name, "shape": shape, "mask": "causal",
                                                "flops": _causal_flops(shape, name == "block_bwd")}
    return [seen[key] for key in sorted(seen, key=str)]


def _causal_flops(shape, bwd: bool) -> float:
    from seqpar.tracing import block_flops

    b, rows, cols, hq, _, d = shape
    return float(block_flops(b, rows, cols, hq, d, "causal", backward=bwd))


HOLD_CYCLES = 2_000_000  # about 1 ms at the H100's and H200's 1.98 GHz (hold())


def hold(stream=None) -> None:
    """Keep ``stream`` (the current one by default) busy for about 1 ms, so that the launches after
    it queue up behind it: a timing that starts after it holds the GPU's time, not the host's.
    Started on an idle GPU instead, a timing includes the host's launch of the call (on an H100,
    2026-11-26: 0.03-0.16 ms a FlashAttention-2 forward, 0.3-0.4 ms a backward through autograd,
    0.3-0.9 ms a Triton forward)."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(HOLD_CYCLES)


def timed(fn, warmup: int, reps: int, calls: int = 1) -> dict:
    """Median / min / max milliseconds per call of ``fn()`` by CUDA events, each timing ``calls``
    calls back to back queued behind :func:`hold`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hold()
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b) / calls)
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}


def _flash(q, k, v, causal: bool):
    """torch's flash kernel alone on ``[B, T, H, D]`` inputs; returns (fn of grad?, how GQA ran)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        try:
            sdpa(qh[:, :, :64], kh[:, :, :64], vh[:, :, :64], is_causal=causal, enable_gqa=g > 1)
            mode = "native GQA"
        except RuntimeError:
            kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
            mode = "K,V expanded"

    def run(grad_out=None):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            if grad_out is None:
                with torch.no_grad():
                    return sdpa(qh, kh, vh, is_causal=causal, enable_gqa=mode == "native GQA")
            out = sdpa(qh, kh, vh, is_causal=causal, enable_gqa=mode == "native GQA")
            return out, lambda: torch.autograd.grad(out, (qh, kh, vh), grad_out, retain_graph=True)

    return run, mode


def time_event(ev: dict, warmup: int, reps: int, gen: torch.Generator, backends=()) -> dict:
    name, shape, mask = ev["name"], tuple(ev["shape"]), ev["mask"]
    b, rows, cols, hq, hkv, d = shape
    dev, dt = torch.device("cuda"), torch.bfloat16

    def rnd(*s, grad=False):
        return torch.randn(*s, generator=gen).to(dev, dt).requires_grad_(grad)

    q, k, v = rnd(b, rows, hq, d), rnd(b, cols, hkv, d), rnd(b, cols, hkv, d)
    dout, scale, bwd = rnd(b, rows, hq, d), d ** -0.5, name == "block_bwd"
    row = {"event": name, "shape": list(shape), "mask": mask,
           "backend": select_backend(q, k, v, mask=mask, for_backward=bwd).name}
    out, lse = block_forward(q, k, v, scale=scale, mask=mask)
    if bwd:
        row["seqpar"] = timed(lambda: block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask), warmup, reps)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask)
        accs = [torch.zeros(x.shape, dtype=torch.float32, device=dev) for x in (dq, dk, dv)]
        row["merge"] = timed(lambda: [a.add_(x) for a, x in zip(accs, (dq, dk, dv))], warmup, reps)
    else:
        row["seqpar"] = timed(lambda: block_forward(q, k, v, scale=scale, mask=mask), warmup, reps)
        acc_out, acc_lse = new_accumulator(out.shape, dev)
        merge_(acc_out, acc_lse, out, lse)  # a second fold exercises the general (finite lse) path
        row["merge"] = timed(lambda: merge_(acc_out, acc_lse, out, lse), warmup, reps)
    for name_b in backends:  # each backend forced; forward: block_forward_into (fused merge where it has one)
        try:
            if bwd:
                fn = lambda b_=name_b: block_backward(dout, q, k, v, out, lse, scale=scale, mask=mask, backend=b_)
            else:
                fn = lambda b_=name_b: block_forward_into(acc_out, acc_lse, q, k, v, scale=scale, mask=mask,
                                                           backend=b_)
            row[f"forced_{name_b}"] = timed(fn, warmup, reps)
        except (RuntimeError, ValueError) as exc:
            row[f"forced_{name_b}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    qg, kg, vg = (x.detach().clone().requires_grad_(bwd) for x in (q, k, v))
    try:
        run, row["flash_gqa"] = _flash(qg, kg, vg, mask != "none")
        if bwd:
            _, grads = run(dout.transpose(1, 2))
            row["flash"] = timed(grads, warmup, reps)
        else:
            row["flash"] = timed(run, warmup, reps)
    except RuntimeError as exc:  # recorded, the others go on
        row["flash_error"] = f"{type(exc).__name__}: {exc}"[:300]
    km = KERNELS["h100-fa2"]
    length = (max(rows, 1) * max(cols, 1)) ** 0.5
    row["flops"] = ev["flops"]
    row["model_kernel_ms"] = 1e3 * ev["flops"] / km.rate("bwd" if bwd else "fwd", mask, length, d)
    row["model_epilogue_ms"] = 1e3 * km.epilogue_bytes(b, rows, cols, hq, hkv, d, bwd) / km.hbm_bytes_per_s
    row["model_total_ms"] = 1e3 * km.seconds(ev)
    return row


def _machine() -> dict:
    query = "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu"
    smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, check=False)
    import triton

    return {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "nvidia_smi": smi.stdout.strip(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "python": platform.python_version(), "host": platform.node()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_kernel_times.json")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--backends", default="triton,torch_cuda",
                   help="also time these backends forced (forward: block_forward_into, the executor's fused call)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time")
        return 0
    gen = torch.Generator().manual_seed(0)
    rows, t0 = [], time.perf_counter()
    before = _machine()
    for ev in block_events(args.world_size, args.tokens_per_rank):
        rows.append(time_event(ev, args.warmup, args.reps, gen, [b for b in args.backends.split(",") if b]))
        r = rows[-1]
        print(f"{r['event']:9s} {str(r['shape'][1:3]):14s} {r['mask']:13s} {r['backend']:10s} seqpar {r['seqpar']['median_ms']:7.3f} "
              f"flash {r.get('flash', {}).get('median_ms', float('nan')):7.3f} model {r['model_kernel_ms']:7.3f} "
              f"merge {r['merge']['median_ms']:6.3f} (model {r['model_epilogue_ms']:6.3f}) ms "
              + " ".join(f"{k[7:]} {v.get('median_ms', float('nan')):7.3f}" for k, v in r.items() if k.startswith("forced_")),
              flush=True)
    command = "python benchmarks/gpu_kernel_times.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc = {"command": command, "machine": before, "after": _machine()["nvidia_smi"], "world_size": args.world_size,
           "tokens_per_rank": args.tokens_per_rank, "shape": LLAMA, "dtype": "bfloat16", "warmup": args.warmup,
           "reps": args.reps, "seconds": time.perf_counter() - t0, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernel_times.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / 'gpu_kernel_times.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
