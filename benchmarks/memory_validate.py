"""Measured peak memory of one training step against ``seqpar memory``'s prediction (CPU, gloo ranks).

Each configuration trains a small transformers Llama for two steps on ``world`` local gloo ranks,
set up by :func:`seqpar.integrations.parallelize.parallelize`: context-parallel attention over the
``cp`` axis, activation checkpointing as ``seqpar train --checkpointing``, FSDP2 ``fully_shard`` on
every decoder layer and the root over all ``dp x cp`` ranks (``MixedPrecisionPolicy(param_dtype,
reduce_dtype=float32)`` for bfloat16); the full-logits or the chunked loss; AdamW. The second step
is measured (the first creates AdamW's state):

- **static**: the bytes of the tensors a rank holds between steps, read from the tensors
  themselves: its parameter shards (fp32) and AdamW's ``exp_avg``, ``exp_avg_sq`` (and ``step``).
- **step**: every allocation and free of torch's CPU allocator during forward + loss, backward and
  the optimizer step, recorded by ``torch.profiler`` with ``profile_memory=True`` per phase
  (:class:`seqpar.bench.memory.PeakMemory`'s event walk); the peak of the running sum of live bytes.

Measured peak = static + the largest (live bytes at a phase's start + that phase's peak). This
counts what the plan counts (tensor storage through torch's allocator: parameters, gradients,
optimizer state, saved activations, communication buffers, kernel scratch) and excludes what it
does not: the Python interpreter and its objects, gloo's own transport buffers, glibc arenas
and other process overheads (the process' RSS is larger by those, and by what the allocator
keeps mapped). The peak is the largest over the ranks (the plan predicts the busiest rank).

    python benchmarks/memory_validate.py            # the committed validation set (~several minutes)
    python benchmarks/memory_validate.py --quick    # one small configuration

Writes benchmarks/results/memory_validation.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import torch

#: the validated model and configurations: (world, cp, method, checkpointing, dtype, seq, loss_chunk);
#: loss_chunk 0: context_parallel_loss over the full logits, else seqpar.integrations.loss's chunks;
#: method "usp:2": usp with a Ulysses degree of 2 (and a ring across)
MODEL = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 6,
         "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 65536}
CASES = (
    (2, 2, "zigzag_ring", "none", "float32", 8192, 0),
    (4, 4, "ring", "layer", "float32", 16384, 0),
    (4, 2, "allgather_kv", "attention", "float32", 8192, 0),
    (2, 2, "ulysses", "none", "bfloat16", 8192, 0),
    (4, 2, "zigzag_ring", "layer", "bfloat16", 16384, 0),
    (2, 2, "zigzag_ring", "attention", "bfloat16", 8192, 1024),
    (2, 2, "token_ring", "none", "float32", 8192, 1024),
    (4, 4, "usp:2", "none", "float32", 8192, 1024),
    (2, 2, "zigzag_ring", "layer", "bfloat16", 8192, 1024),
)
QUICK = ({"hidden_size": 256, "intermediate_size": 640, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 16384},
         (2, 2, "zigzag_ring", "none", "float32", 4096, 0))


def _method(spec: str) -> tuple[str, dict]:
    """``"usp:2"`` -> ``("usp", {"ulysses_degree": 2})``."""
    name, _, degree = spec.partition(":")
    return name, ({"ulysses_degree": int(degree)} if degree else {})


def _phase(fn):
    """(result, peak, end) of ``fn()``: allocator bytes live at the peak and at the end, relative to the start
    (the running sum of the profiler's ``[memory]`` events, as :func:`seqpar.bench.memory.allocation_peak`)."""
    from torch.profiler import ProfilerActivity, profile

    from seqpar.bench.memory import allocation_peak

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    end = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return result, allocation_peak(prof), end


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def build(config: dict, cp: int, method: str, checkpointing: str, dtype: str):
    """A Llama from ``config`` set up by :func:`seqpar.integrations.parallelize.parallelize` on a (dp, cp)
    mesh of every rank (attention over cp, checkpointing, FSDP2 over dp x cp); returns
    ``(model, optimizer, cp_group)``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqpar.integrations.parallelize import parallelize

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, attention_dropout=0.0, tie_word_embeddings=False)).train()
    name, options = _method(method)
    parallelize(model, mesh, cp_method=name, checkpointing=checkpointing,
                dtype=None if dtype == "float32" else dtype, **options)
    # foreach=False: one parameter's temporaries at a time (torch's default on CPU; the plan's "cpu" device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    return model, opt, model.seqpar_cp_group


def _measure_rank(config: dict, cp: int, method: str, checkpointing: str, dtype: str, seq: int,
                  loss_chunk: int = 0) -> dict:
    import torch.distributed as dist

    from seqpar.integrations.hf import context_parallel_loss, shard_inputs

    model, opt, cp_group = build(config, cp, method, checkpointing, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (1, seq), generator=g)
    batch = shard_inputs(ids, group=cp_group, method=_method(method)[0])
    held = {}

    def forward():
        if loss_chunk:  # the chunked loss: this rank's token-loss sum / the global label count
            from seqpar.integrations.loss import causal_lm_loss

            kwargs = batch.model_kwargs()
            count = torch.tensor(float(seq - 1))  # every label but the last is valid
            held["loss"] = causal_lm_loss(model, kwargs.pop("input_ids"), batch.labels, chunk_size=loss_chunk,
                                          **kwargs) / count
        else:  # the full logits, kept by the caller until backward is done (as a training loop does)
            held["logits"] = model(**batch.model_kwargs()).logits
            held["loss"] = context_parallel_loss(held["logits"], batch.labels, group=cp_group)

    def backward():
        held.pop("loss").backward()
        held.clear()

    def step(measure: bool) -> dict:
        phases = {}
        run = _phase if measure else (lambda fn: (fn(), 0, 0))
        _, phases["forward"], live_f = run(forward)
        _, phases["backward"], live_b = run(backward)
        _, phases["optimizer"], _ = run(lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
        return {"peaks": phases, "starts": {"forward": 0, "backward": live_f, "optimizer": live_f + live_b}}

    step(False)  # AdamW's state exists from the first step on
    static = _storage_bytes(list(model.parameters()) + [t for s in opt.state.values() for t in s.values()
                                                          if isinstance(t, torch.Tensor)])
    m = step(True)
    peak_phase = max(m["peaks"], key=lambda p: m["starts"][p] + m["peaks"][p])
    peak = static + m["starts"][peak_phase] + m["peaks"][peak_phase]
    dist.barrier()
    return {"static": static, "peak": peak, "peak_phase": peak_phase, **m}


def predict(config: dict, world: int, cp: int, method: str, checkpointing: str, dtype: str, seq: int,
            loss_chunk: int = 0):
    from seqpar.bench.memory_plan import ModelShape, Setup, plan

    name, options = _method(method)
    return plan(ModelShape.from_dict(config), Setup(seq=seq, world=world, cp=cp, method=name,
                                                    checkpointing=checkpointing, dtype=dtype, loss_chunk=loss_chunk,
                                                    device="cpu", **options))


def validate(config: dict, case: tuple, timeout: float = 900.0) -> dict:
    """One configuration: measured on ``world`` gloo ranks and predicted; the row of the results."""
    from seqpar.comm.pool import WorkerPool

    world, cp, method, checkpointing, dtype, seq, loss_chunk = case
    t0 = time.perf_counter()
    threads = max(1, (os.cpu_count() or 2) // world)
    with contextlib.closing(WorkerPool(world, threads_per_rank=threads)) as pool:
        ranks = pool.run(_measure_rank, (config, cp, method, checkpointing, dtype, seq, loss_chunk), {},
                         timeout=timeout)
    busiest = max(ranks, key=lambda r: r["peak"])
    p = predict(config, world, cp, method, checkpointing, dtype, seq, loss_chunk)
    return {"world": world, "cp": cp, "dp": world // cp, "method": method, "checkpointing": checkpointing,
            "dtype": dtype, "seq": seq, "loss_chunk": loss_chunk, "measured": busiest["peak"],
            "measured_phase": busiest["peak_phase"],
            "measured_static": busiest["static"], "measured_phases": busiest["peaks"],
            "measured_starts": busiest["starts"], "predicted": p.peak, "predicted_phase": p.peak_phase,
            "predicted_components": p.components(), "error": p.peak / busiest["peak"] - 1,
            "seconds": round(time.perf_counter() - t0, 1)}


def _machine() -> dict:
    import transformers

    return {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform()}


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def write_results(rows: list[dict], config: dict, command: str, out_dir: str, meta: dict | None = None) -> None:
    """benchmarks/results/memory_validation.{json,md} (``meta``: the run's, when rewriting)."""
    meta = meta or {"command": command, "model": config, **_machine(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "memory_validation.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    mib = 2**20
    lines = [
        "# seqpar memory against measured peaks (CPU, gloo ranks)", "",
        f"Command: `{command}` ({meta['date']}; {meta['platform']}, {meta['cpus']} CPUs, Python "
        f"{meta['python']}, torch {meta['torch']}, transformers {meta['transformers']})"
        + "".join(f", then `{c}`" for c in meta.get("then", [])) + ".", "",
        f"Model: a transformers Llama, {json.dumps(config)}, untied head. One training step (the second: AdamW's "
        "state exists) set up by `seqpar.integrations.parallelize` (context-parallel attention over cp, "
        "checkpointing, FSDP2 over dp x cp, MixedPrecisionPolicy for bfloat16), the loss either "
        "`context_parallel_loss` over the full logits (kept by the caller until backward ends) or "
        "`seqpar.integrations.loss.causal_lm_loss` in chunks, AdamW. Measured: the tensors a rank holds between steps "
        "(parameter shards, AdamW state), plus the peak of live bytes of torch's CPU allocator during the step "
        "(torch.profiler `profile_memory=True`: every allocation and free, summed in time order) - the busiest "
        "rank. It excludes the Python interpreter, gloo's own buffers and glibc arenas, which the plan does not "
        "count either. The profiler rather than a TorchDispatchMode storage tracker: it sees every allocation of "
        "the CPU allocator, also those made inside kernels and collectives that never surface as a Python-visible "
        "tensor (the attention kernel's scratch, FSDP2's all-gather and reduce-scatter buffers), and its running "
        "sum is exact per event, unlike the process' RSS, which glibc's arenas and what they keep mapped blur. "
        "Predicted: `seqpar memory` with `--device cpu` (no forward prefetch, reduce-scatters finished before the "
        "next layer, AdamW one parameter at a time) and the run's `--loss-chunk` (0 = full logits).", "",
        "| world | cp | dp | method | checkpointing | dtype | tokens | loss | measured MiB | measured at "
        "| predicted MiB | predicted at | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['cp']} | {r['dp']} | {r['method']} | {r['checkpointing']} | {r['dtype']} "
                     f"| {r['seq']} | {'chunks of %d' % r['loss_chunk'] if r['loss_chunk'] else 'full logits'} "
                     f"| {r['measured'] / mib:.1f} | {r['measured_phase']} | {r['predicted'] / mib:.1f} "
                     f"| {r['predicted_phase']} | {_pct(r['error'])} |")
    worst = max(abs(r["error"]) for r in rows)
    lines += ["", f"Largest error: {100 * worst:.1f}% (target: within 10%).", "",
              "Where the plan is short: bfloat16 with a checkpointed layer and the chunked loss (rows 6 and 9). "
              "There the measured peak also varies from run to run: the last row's configuration measured "
              "146.4, 152.7 and 155.9 MB in three runs (-2.6% to -8.5% against the plan; the largest is "
              "still within 10%). The allocator timeline of its backward (autograd node by "
              "node) puts the peak inside the recomputed layer's MLP, in the backward of `SiLU(gate) * up`: "
              "31 MiB over the node's start at 4096 tokens a rank, where the plan's MLP transient (the gradients "
              "of the product's two inputs, e·I each, and the residual gradient) is 19 MiB. The plan does not "
              "model that excess, and whether a GPU shows it is not measured here (no GPU in this run). "
              "Rows are regenerated with `python benchmarks/memory_validate.py --rewrite` when the "
              "plan changes (predictions only) and `--only I,J` to measure cases again."]
    with open(os.path.join(out_dir, "memory_validation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _repredict(row: dict) -> dict:
    """``row`` with the current plan's prediction (the measurement stays)."""
    case = (row["world"], row["cp"], row["method"], row["checkpointing"], row["dtype"], row["seq"], row["loss_chunk"])
    p = predict(MODEL, *case)
    return {**row, "predicted": p.peak, "predicted_phase": p.peak_phase, "predicted_components": p.components(),
            "error": p.peak / row["measured"] - 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small configuration")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--only", default=None, help="comma-separated indices into CASES: measure these again and "
                    "replace their rows in --out's JSON")
    ap.add_argument("--rewrite", action="store_true", help="predict again for the measured rows in --out's JSON "
                    "(the plan changed, the measurements did not) and rewrite the table")
    args = ap.parse_args(argv)
    path = os.path.join(args.out, "memory_validation.json")
    if args.rewrite or args.only:
        with open(path) as f:
            saved = json.load(f)
        rows = [_repredict(r) for r in saved["rows"]]
        for i in ([int(x) for x in args.only.split(",")] if args.only else []):
            row = validate(MODEL, CASES[i])
            key = lambda r: (r["world"], r["cp"], r["method"], r["checkpointing"], r["dtype"], r["seq"],  # noqa: E731
                             r["loss_chunk"])
            rows = [r for r in rows if key(r) != key(row)] + [row]
        order = {c: i for i, c in enumerate(CASES)}
        rows.sort(key=lambda r: order.get((r["world"], r["cp"], r["method"], r["checkpointing"], r["dtype"],
                                           r["seq"], r["loss_chunk"]), len(order)))
        meta = saved["meta"]
        meta["then"] = meta.get("then", []) + ["python benchmarks/memory_validate.py " + " ".join(
            sys.argv[1:] if argv is None else argv)]
        write_results(rows, MODEL, meta["command"], args.out, meta)
        return 0 if all(abs(r["error"]) < 0.10 for r in rows) else 1
    config, cases = (QUICK[0], QUICK[1:]) if args.quick else (MODEL, CASES)
    rows = []
    for case in cases:
        row = validate(config, case)
        print(f"{case}: measured {row['measured'] / 2**20:.1f} MiB ({row['measured_phase']}), predicted "
              f"{row['predicted'] / 2**20:.1f} MiB ({row['predicted_phase']}), {_pct(row['error'])}, "
              f"{row['seconds']} s", flush=True)
        rows.append(row)
    if not args.quick:
        write_results(rows, config, "python benchmarks/memory_validate.py", args.out)
    return 0 if all(abs(r["error"]) < 0.10 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
