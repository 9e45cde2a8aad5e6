"""Context-parallel inference: prefill time, decode latency per token and K,V bytes per rank against N.

Measured on this machine's CPU (gloo ranks of :class:`seqpar.comm.pool.WorkerPool`) at N = 1, 2, 4
for a random-weight Llama (GQA) run through ``ShardedCache`` exactly as ``generate()`` runs it (one
prefill forward with ``logits_to_keep=1``, then one forward per greedy token); N = 1 also runs the
unconverted model with transformers' ``DynamicCache`` (the single-device cache whose bytes the
per-rank K,V are compared with). GPU projections: the prefill's attention from the replay of the
method's schedule (:func:`seqpar.bench.simulate.step` on a machine profile), the decode step's
attention as the local kernel (K,V of T/N tokens read once from HBM) plus the combine collective on
the profile's links (:func:`seqpar.bench.replay.collective_seconds`: ring all-gather of (out, lse),
or the two all-reduces of the tree combine).

    python benchmarks/generate_bench.py            # writes benchmarks/results/generate.{json,md}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from seqpar.bench.machine import machine as machine_profile
from seqpar.bench.replay import collective_seconds
from seqpar.bench.schedule_trace import Shape
from seqpar.bench.simulate import step as replay_step
from seqpar.comm.pool import WorkerPool
from seqpar.integrations.hf.cache_ops import choose_combine, combine_seconds

RESULTS = Path(__file__).parent / "results"
CPU_MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=16384)


def _model(convert: bool, method: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqpar.integrations.hf import apply_context_parallel

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CPU_MODEL)).eval()
    return apply_context_parallel(model, method=method) if convert else model


def _run(model, cache, ids, new: int) -> tuple[float, list[float], list[int]]:
    """Prefill seconds, per-token decode seconds, tokens: what generate() does, step by step."""
    t0 = time.perf_counter()
    logits = model(input_ids=ids, cache=cache, logits_to_keep=1).logits
    prefill = time.perf_counter() - t0
    tokens, steps = [], []
    for _ in range(new):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        t0 = time.perf_counter()
        logits = model(input_ids=nxt, cache=cache, logits_to_keep=1).logits
        steps.append(time.perf_counter() - t0)
    return prefill, steps, tokens


def _choices(model, cache, ids, repeats: int, turn: int = 64, steps: int = 8) -> dict:
    """On a filled cache: a ``turn``-token second turn by K,V passing and by query passing, and
    ``steps`` decode steps with each combine (best of ``repeats``; the cache is cropped back after each)."""
    got = {}
    for mode in ("pass_kv", "pass_q"):
        cache.prefill, times = mode, []
        for _ in range(repeats):
            sent = cache.stats.total("prefill")
            t0 = time.perf_counter()
            model(input_ids=ids[:, :turn], cache=cache, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
            cache.crop(-turn)
        got[mode] = {"s": min(times), "bytes": cache.stats.total("prefill") - sent}
    nxt = ids[:, :1]
    for mode in ("allgather", "tree"):
        cache.decode_combine, times = mode, []
        sent = cache.stats.total("decode")
        for _ in range(steps):
            t0 = time.perf_counter()
            model(input_ids=nxt, cache=cache, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
        cache.crop(-steps)
        got[mode] = {"ms": 1e3 * statistics.median(times), "bytes_per_token": (cache.stats.total("decode") - sent) / steps}
    cache.prefill, cache.decode_combine = "auto", "auto"
    return got


def measure(T: int, new: int, method: str, repeats: int) -> dict:
    """One rank's measurement (run on every rank of the pool, or alone)."""
    from transformers import DynamicCache

    from seqpar.comm import CommStats
    from seqpar.integrations.hf import ShardedCache

    ids = torch.randint(4, CPU_MODEL["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    model = _model(True, method)
    with torch.no_grad():
        _run(model, ShardedCache(), ids[:, :64], 2)  # warm up: gloo's connections, threads
        best = None
        for _ in range(repeats):
            cache = ShardedCache(stats=CommStats())
            prefill, steps, tokens = _run(model, cache, ids, new)
            decode = statistics.median(steps)
            if best is None:
                best = {"prefill_s": prefill, "decode_s": decode, "tokens": tokens,
                        "kv_bytes": cache.kv_bytes(), "comm": cache.comm_summary(),
                        "combine": sorted({h["combine"] for h in cache.history if h["combine"]})}
            # the least disturbed repeat of each (the machine is shared): min prefill, min median step
            best["prefill_s"], best["decode_s"] = min(best["prefill_s"], prefill), min(best["decode_s"], decode)
        best["choices"] = _choices(model, cache, ids, repeats)
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            ref = _model(False, method)
            dyn = DynamicCache(config=ref.config)
            runs = [_run(ref, DynamicCache(config=ref.config), ids, new) for _ in range(repeats - 1)]
            rp, rs, rt = _run(ref, dyn, ids, new)
            best["single_device"] = {
                "prefill_s": min([rp] + [r[0] for r in runs]),
                "decode_s": min([statistics.median(rs)] + [statistics.median(r[1]) for r in runs]), "tokens": rt,
                "kv_bytes": sum(x.keys.numel() * 4 + x.values.numel() * 4 for x in dyn.layers)}
    return best


def cpu_rows(T: int, new: int, method: str, repeats: int, sizes=(1, 2, 4)) -> list[dict]:
    rows = []
    for n in sizes:
        if n == 1:
            torch.set_num_threads(1)
            per_rank = [measure(T, new, method, repeats)]
        else:
            with contextlib.closing(WorkerPool(n, threads_per_rank=1)) as pool:
                per_rank = pool.run(measure, (T, new, method, repeats), {}, timeout=1800)
        rows.append({"n": n, "prefill_s": max(r["prefill_s"] for r in per_rank),
                     "decode_ms_per_token": 1e3 * max(r["decode_s"] for r in per_rank),
                     "kv_bytes_per_rank": [r["kv_bytes"] for r in per_rank],
                     "prefill_comm_bytes": per_rank[0]["comm"]["prefill_bytes"],
                     "decode_comm_bytes_per_token": per_rank[0]["comm"]["decode_bytes_per_token"],
                     "combine": per_rank[0]["combine"], "tokens": per_rank[0]["tokens"],
                     "choices": {k: {f: max(r["choices"][k][f] for r in per_rank) if f in ("s", "ms") else
                                     per_rank[0]["choices"][k][f] for f in per_rank[0]["choices"][k]}
                                 for k in per_rank[0]["choices"]},
                     "single_device": per_rank[0].get("single_device")})
    return rows


def project(T: int, n: int, profile: str, method: str, *, heads=32, kv_heads=8, head_dim=128, layers=32,
            esize=2) -> dict:
    """GPU projection of the attention of one prefill and of one decode step (every layer)."""
    m = machine_profile(profile)
    shape = Shape(seq_len=T, heads=heads, kv_heads=kv_heads, head_dim=head_dim, esize=esize)
    prefill = replay_step(method, n, shape, m, forward_only=True).step_s * layers
    kv_local = 2 * (T // n) * kv_heads * head_dim * esize
    kernel = kv_local / m.kernels.hbm_bytes_per_s + m.kernels.launch_s
    partial = heads * (head_dim + 1) * 4
    members = list(range(n))

    def coll(kind: str, nbytes: int) -> float:
        return collective_seconds({"members": members, "kind": kind,
                                   "arrived": {r: (None, {"bytes": nbytes}) for r in members}}, m)

    gather = coll("all_gather", partial)
    hops = [m.link(members[i], members[(i + 1) % n]) for i in range(n)]
    bw, lat = min(b for b, _ in hops), max(t for _, t in hops)
    tree = combine_seconds(n, partial, heads * 4, latency=lat, bandwidth=bw)["tree"]
    choice = choose_combine(n, partial, heads * 4, latency=lat, bandwidth=bw)
    return {"profile": profile, "n": n, "seq_len": T, "prefill_attention_s": prefill,
            "decode_attention_ms": 1e3 * layers * (kernel + (gather if choice == "allgather" else tree)),
            "auto_combine": choice,
            "decode_kernel_ms": 1e3 * layers * kernel, "decode_allgather_ms": 1e3 * layers * gather,
            "decode_tree_ms": 1e3 * layers * tree, "kv_gb_per_rank": layers * kv_local / 1e9}


def _markdown(doc: dict) -> str:
    env, cpu = doc["environment"], doc["cpu"]
    single = cpu[0]["single_device"]
    lines = [
        "# Context-parallel inference: prefill, decode, K,V per rank", "",
        f"Command: `{doc['command']}`  ", f"Machine: {env['machine']}; torch {env['torch']}, transformers "
        f"{env['transformers']}, Python {env['python']}; {env['cores']} cores, shared with other work while measured "
        f"(load average {doc['load_average_before'][0]:.1f} before, {doc['load_average_after'][0]:.1f} after)", "",
        f"## CPU, measured (gloo, one thread per rank): Llama {CPU_MODEL['num_hidden_layers']} layers, hidden "
        f"{CPU_MODEL['hidden_size']}, {CPU_MODEL['num_attention_heads']} query / {CPU_MODEL['num_key_value_heads']} KV "
        f"heads, fp32, prompt {doc['seq_len']} tokens, {doc['new_tokens']} greedy tokens, method {doc['method']}", "",
        f"Single device, transformers' DynamicCache: prefill {single['prefill_s']:.3f} s, decode "
        f"{1e3 * single['decode_s']:.2f} ms/token, K,V {single['kv_bytes']:,} B.", "",
        "| N | prefill s | decode ms/token | K,V bytes per rank (max) | max / (single-device / N) | sent per prefill | "
        "sent per token | combine | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in cpu:
        worst = max(r["kv_bytes_per_rank"])
        lines.append(f"| {r['n']} | {r['prefill_s']:.3f} | {r['decode_ms_per_token']:.2f} | {worst:,} | "
                     f"{worst / (single['kv_bytes'] / r['n']):.3f} | {r['prefill_comm_bytes']:,} | "
                     f"{r['decode_comm_bytes_per_token']:,.0f} | {','.join(r['combine'])} | "
                     f"{r['tokens'] == single['tokens']} |")
    lines += ["", "Each choice forced on the filled cache (second turn of 64 tokens; 8 decode steps; slowest rank; "
              "bytes sent per rank):", "",
              "| N | K,V passing s | bytes | query passing s | bytes | all-gather ms/token | bytes | tree ms/token | bytes |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in cpu:
        c = r["choices"]
        lines.append(f"| {r['n']} | {c['pass_kv']['s']:.3f} | {c['pass_kv']['bytes']:,} | {c['pass_q']['s']:.3f} | "
                     f"{c['pass_q']['bytes']:,} | {c['allgather']['ms']:.2f} | {c['allgather']['bytes_per_token']:,.0f} | "
                     f"{c['tree']['ms']:.2f} | {c['tree']['bytes_per_token']:,.0f} |")
    lines += ["", "The CPU columns measure overheads, not speed-ups: the N ranks share the machine's cores with each "
              "other and with the load above, so each collective waits for ranks to be scheduled (milliseconds); "
              "per token every layer runs one combine. The bytes, the K,V per rank and the tokens are exact.", "",
              "## GPU projections (attention only; Llama-3-8B shape: 32 layers, 32 / 8 heads, d 128, bf16)", "",
              "| profile | T | N | prefill attention s (replay) | decode kernel ms | all-gather ms | tree ms | auto | "
              "decode attention ms/token | K,V GB per rank |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in doc["gpu"]:
        lines.append(f"| {p['profile']} | {p['seq_len']:,} | {p['n']} | {p['prefill_attention_s']:.2f} | "
                     f"{p['decode_kernel_ms']:.3f} | {p['decode_allgather_ms']:.3f} | {p['decode_tree_ms']:.3f} | "
                     f"{p['auto_combine']} | {p['decode_attention_ms']:.3f} | {p['kv_gb_per_rank']:.1f} |")
    lines += ["", "Per token, all 32 layers. Decode: the local kernel reads T/N tokens' K,V once from HBM (85% of "
              "peak); the all-gather of (out, lse) is timed as the replay times collectives (ring, N - 1 steps on the "
              "slowest hop); the tree combine as two all-reduces up and down a binary tree (4 log2 N steps, "
              "`cache_ops.combine_seconds`) on the same links; `auto` is ShardedCache's choice on those links. "
              "The rest of the model (GEMMs, the LM head) is not included.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--method", default="zigzag_ring")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "generate"))
    a = p.parse_args(argv)
    import transformers

    doc = {"command": "python benchmarks/generate_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "environment": {"machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "python": platform.python_version(),
                           "cores": len(os.sched_getaffinity(0))},
           "seq_len": a.seq_len, "new_tokens": a.new_tokens, "method": a.method,
           "load_average_before": list(os.getloadavg()),
           "cpu": cpu_rows(a.seq_len, a.new_tokens, a.method, a.repeats)}
    doc["load_average_after"] = list(os.getloadavg())
    doc["gpu"] = [project(T, n, "h100-nvlink-ib", a.method) for T in (131072, 1048576) for n in (1, 2, 4, 8, 16, 64)]
    Path(a.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    Path(a.out + ".md").write_text(_markdown(doc))
    print(_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
