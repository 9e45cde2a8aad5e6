"""``seqpar train`` (also ``python -m seqpar.train``): a transformers Llama trained with context
parallelism on packed real text.

The world of W ranks is a 2-D mesh ``(dp, cp)``: ``cp = --context-parallel`` ranks share each
sequence (seqpar attention over the ``cp`` axis), ``dp = W / cp`` groups take different sequences.
A step takes ``--batch-size`` sequences (global); every rank computes the loss of its tokens divided
by the global number of valid labels, and the gradients are summed over all W ranks, so a step is
the same computation whatever ``cp`` and ``dp`` are (up to fp32 rounding).

Launch: ``--nproc N`` spawns N local CPU ranks (gloo); under ``torchrun`` the launched ranks are
used (NCCL on GPUs, gloo on CPU); ``--nproc 1`` runs in this process. Checkpoints: see
:mod:`.trainer_ckpt`. Data: see :mod:`.trainer_data`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.comm.groups import launched_process_group
from seqpar.testing import launched_by_torchrun, usable_cores

from .hf import IGNORE_INDEX, apply_context_parallel, packed_attention_supported, shard_inputs
from .trainer_ckpt import load_checkpoint, model_fingerprint, resolve_resume, save_checkpoint
from .trainer_config import (TrainConfig, global_batch, load_model_config,
                             parse_args, validate, world_size_of)
from .trainer_data import PackedSequences, TextFiles

_GRAD_BUCKET = 1 << 26  # elements per gradient all-reduce (256 MB of fp32)


@dataclass
class TrainResult:
    """What rank 0 returns: one record per step (restored ones included), the last checkpoint."""

    history: list[dict] = field(default_factory=list)
    checkpoint: str | None = None
    start_step: int = 0
    packed: bool = False

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.history}


# ----------------------------------------------------------------------------- entry points


def train(argv: list[str] | None = None) -> TrainResult | None:
    """Python entry: parse ``argv`` like the command line, train, return rank 0's :class:`TrainResult`
    (None on other ranks under torchrun)."""
    return run(parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    try:
        train(argv)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"seqpar train: error: {exc}", file=sys.stderr)
        return 2
    return 0


def run(cfg: TrainConfig) -> TrainResult | None:
    world = world_size_of(cfg)
    # a single-device probe, so it runs before any process group exists
    if dist.is_available() and dist.is_initialized():
        packed = (False, "torch.distributed was initialised before seqpar train could probe packed attention")
    else:
        packed = packed_attention_supported(cfg.cp_method)
    validate(cfg, world, packed[0])
    if launched_by_torchrun():
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        with launched_process_group():
            result = _rank_main(cfg, packed)
    elif cfg.nproc > 1:
        from seqpar.testing import get_pool  # a persistent pool of gloo ranks with timeouts

        threads = cfg.threads or max(1, usable_cores() // cfg.nproc)
        result = get_pool(cfg.nproc, threads_per_rank=threads).run(_rank_main, (cfg, packed), {},
                                                                   timeout=cfg.timeout)[0]
    else:
        previous = torch.get_num_threads()
        torch.set_num_threads(cfg.threads or usable_cores())
        try:
            result = _rank_main(cfg, packed)
        finally:
            torch.set_num_threads(previous)
    if result is not None and cfg.plot:
        _plot(result.history, cfg.plot)
    return result


# ----------------------------------------------------------------------------- one rank


@dataclass(frozen=True)
class _Runtime:
    world: int
    rank: int
    dp: int
    dp_rank: int
    cp_group: object
    device: torch.device


def _setup(cfg: TrainConfig) -> _Runtime:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cpu")
    if dist.is_initialized() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    cp = cfg.context_parallel
    dp, dp_rank, cp_group = world // cp, 0, None
    if world > 1 and not cfg.adaptive:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        cp_group, dp_rank = mesh["cp"], mesh.get_local_rank("dp")
    return _Runtime(world, rank, dp, dp_rank, cp_group, device)


def _build_model(cfg: TrainConfig, device: torch.device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)  # the same weights on every rank
    model = AutoModelForCausalLM.from_config(load_model_config(cfg.model_config))
    model = model.float().to(device).train()
    if cfg.checkpointing == "layer":
        if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.x on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.checkpointing == "attention":
        from seqpar.attention.checkpoint import apply_checkpointing

        apply_checkpointing(model, mode="attention")
    return model


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to --lr, then cosine down to 10% at the last step (a function of the step only)."""
    warmup = cfg.warmup if cfg.warmup is not None else min(10, cfg.steps // 10)
    if step <= warmup:
        return cfg.lr * step / max(warmup, 1)
    progress = (step - warmup) / max(cfg.steps - warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _all_reduce_grads(params: list[torch.nn.Parameter], extra: torch.Tensor) -> torch.Tensor:
    """Sum gradients (and ``extra``) over the world in flat buckets; returns the reduced ``extra``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return extra
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for p in params + [None]:
        if p is not None and (size + p.numel() <= _GRAD_BUCKET or not bucket):
            bucket.append(p)
            size += p.numel()
            continue
        flat = torch.cat([q.grad.reshape(-1).float() for q in bucket] + ([extra] if p is None else []))
        dist.all_reduce(flat)
        offset = 0
        for q in bucket:
            q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
            offset += q.numel()
        if p is None:
            return flat[offset:]
        bucket, size = [p], p.numel()
    return extra


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class _Log:
    """Rank 0's output: a progress bar, human lines, JSON lines."""

    def __init__(self, cfg: TrainConfig, active: bool, start: int, resumed: bool):
        self.active, self.cfg = active, cfg
        self.stream = sys.stderr if cfg.json == "-" else sys.stdout
        self.json = None
        if active and cfg.json:
            self.json = sys.stdout if cfg.json == "-" else open(cfg.json, "a" if resumed else "w")
        self.bar = None
        if active and cfg.progress and cfg.json != "-":
            with contextlib.suppress(ImportError):
                from tqdm.auto import tqdm

                self.bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True, leave=True)

    def info(self, message: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def event(self, record: dict) -> None:
        if self.json is not None:
            self.json.write(json.dumps(record) + "\n")
            self.json.flush()

    def step(self, rec: dict) -> None:
        if not self.active:
            return
        self.event(rec)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        if rec["step"] % self.cfg.log_every == 0 or rec["step"] == self.cfg.steps:
            self.info(f"step {rec['step']:>5}/{self.cfg.steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                      f"{rec['tokens_per_s']:,.0f} tok/s | {rec['step_time_s'] * 1e3:,.0f} ms | "
                      f"peak mem {rec['peak_mem_mib']:,.0f} MiB")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.json is not None and self.json is not sys.stdout:
            self.json.close()


def _rank_main(cfg: TrainConfig, packed: tuple[bool, str]) -> TrainResult | None:
    rt = _setup(cfg)
    packed_ok = packed[0]
    files = TextFiles.scan(cfg.data_dir, cfg.glob)
    data = PackedSequences(files, cfg.seq_len, cfg.seed)
    model = _build_model(cfg, rt.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    fingerprint = model_fingerprint(model)
    batch = global_batch(cfg, rt.world)
    settings = {"data_root": files.root, "data_glob": cfg.glob, "data_fingerprint": files.fingerprint,
                "seq_len": cfg.seq_len, "batch_size": batch, "seed": cfg.seed}

    result = TrainResult(packed=packed_ok)
    resume_from = resolve_resume(cfg.resume, cfg.save)
    if resume_from is not None:
        meta = load_checkpoint(resume_from, model, optimizer, fingerprint)
        result.start_step, result.history = meta["step"], list(meta.get("history", []))
        changed = [k for k, v in settings.items() if meta.get("settings", {}).get(k) != v and k != "data_root"]
    log = _Log(cfg, rt.rank == 0, result.start_step, resume_from is not None)
    if resume_from is not None:
        log.info(f"resumed from {resume_from} at step {result.start_step} (saved with "
                 f"{meta.get('run', {}).get('context_parallel')}-way context parallelism)")
        if changed:
            log.info(f"warning: {', '.join(changed)} differ from the saved run: the data order is not the one "
                     "the interrupted run would have seen")
    if not packed_ok:
        log.info(f"warning: packed attention is not available in this seqpar ({packed[1].split(';')[0]}); documents "
                 "in a sequence attend to each other (plain causal attention over the packed sequence)")

    runner = None
    if cfg.adaptive:
        from .trainer_adaptive import AdaptiveRunner

        from .trainer_config import adaptive_models

        cluster, cost = adaptive_models(cfg, rt.world, model.config)
        runner = AdaptiveRunner(model, rt.world, rt.rank, cost_model=cost, cluster=cluster)
    else:
        apply_context_parallel(model, group=rt.cp_group, method=cfg.cp_method)
    mode = "adaptive" if cfg.adaptive else f"cp={cfg.context_parallel} ({cfg.cp_method}) x dp={rt.dp}"
    log.info(f"seqpar train: {rt.world} rank(s) on {rt.device.type}, {mode}; {sum(p.numel() for p in params):,} "
             f"parameters; {batch} x {cfg.seq_len} tokens per step; data {files.root} ({len(files.paths)} files)")
    log.event({"event": "start", "config": cfg.to_dict(), "world": rt.world, "packed": packed_ok,
               "start_step": result.start_step})
    autocast = (torch.autocast(rt.device.type, dtype=getattr(torch, cfg.dtype)) if cfg.dtype != "float32"
                else contextlib.nullcontext())
    try:
        for step in range(result.start_step + 1, cfg.steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            plan = None
            if runner is None:
                loss = _static_step(cfg, rt, data, model, params, batch, step, packed_ok, autocast)
            else:  # the scheduler's executor: plan, GroupCache, train_step (see trainer_adaptive)
                lengths = [cfg.seq_len] * batch
                plan = runner.plan(lengths)
                _maybe_crash(cfg, rt, step)
                first = (step - 1) * batch
                loss = runner.step(plan, lengths, lambda i: data.sequence(first + i), params, packed=packed_ok,
                                   device=rt.device, autocast=autocast)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf))
            lr = _lr(cfg, step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            mem = torch.tensor([_peak_memory_mib(rt.device)], device=rt.device)
            # CPU seconds of all ranks: on a shared machine wall time measures the neighbours too
            cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64, device=rt.device)
            if rt.world > 1:
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
                dist.all_reduce(cpu)
            rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": batch * cfg.seq_len,
                   "step_time_s": dt, "tokens_per_s": batch * cfg.seq_len / dt, "peak_mem_mib": float(mem[0]),
                   "cpu_s": float(cpu[0]),
                   "world": rt.world, "context_parallel": None if cfg.adaptive else cfg.context_parallel}
            if plan is not None:
                rec["groups"] = [[g.start, g.size, g.method, len(g.seqs)] for g in plan.groups]
            result.history.append(rec)
            log.step(rec)
            if cfg.save and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
                meta = {"step": step, "model": fingerprint, "settings": settings, "history": result.history,
                        "run": {"world": rt.world, "context_parallel": cfg.context_parallel,
                                "cp_method": cfg.cp_method, "adaptive": cfg.adaptive, "lr": cfg.lr,
                                "steps": cfg.steps, "dtype": cfg.dtype}}
                path = save_checkpoint(cfg.save, step, model, optimizer, meta)
                result.checkpoint = str(path)
                log.info(f"saved {path}")
        _summary(log, result)
    finally:
        log.close()
    return result if rt.rank == 0 else None


def _maybe_crash(cfg: TrainConfig, rt: _Runtime, step: int) -> None:
    """--crash-at-step: fault injection on rank 0, mid-step (before the gradient all-reduce)."""
    if cfg.crash_at_step == step and rt.rank == 0:
        if dist.is_initialized():
            os._exit(17)  # die like a killed process
        raise RuntimeError(f"--crash-at-step: injected crash at step {step}")


def _static_step(cfg: TrainConfig, rt: _Runtime, data, model, params, batch: int, step: int, packed_ok: bool,
                 autocast) -> float:
    """One step at the fixed ``(dp, cp)`` mesh: this rank's data-parallel slice of the step's ``batch``
    sequences, sharded over its cp group; returns the global loss (gradients summed over the world)."""
    per_dp = batch // rt.dp
    first = (step - 1) * batch + rt.dp_rank * per_dp
    shards = []
    for s in range(first, first + per_dp):
        tokens, cu = data.sequence(s)
        shards.append(shard_inputs(tokens[None].to(rt.device), cu_seqlens=cu if packed_ok else None,
                                   group=rt.cp_group, method=cfg.cp_method))
    count = torch.tensor([float(sum(b.num_valid for b in shards))], dtype=torch.float64, device=rt.device)
    if rt.world > 1:
        dist.all_reduce(count)  # the global number of labels normalises every rank's share
    loss_sum = _forward_backward(model, shards, float(count.clamp(min=1)), autocast)
    _maybe_crash(cfg, rt, step)
    return float(_all_reduce_grads(params, loss_sum.float().reshape(1))[0]) / float(count.clamp(min=1))


def token_loss(model, shard, autocast) -> torch.Tensor:
    """Summed (fp32) next-token cross entropy of one sharded batch on this rank, in the graph."""
    with autocast:
        logits = model(**shard.model_kwargs()).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shard.labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _forward_backward(model, shards, count: float, autocast) -> torch.Tensor:
    """Backward of this rank's token losses / the global count; returns their (detached) sum."""
    loss_sum = None
    for b in shards:
        token_loss_sum = token_loss(model, b, autocast)
        (token_loss_sum / count).backward()  # this rank's share; gradients are summed over ranks after
        part = token_loss_sum.detach().double()
        loss_sum = part if loss_sum is None else loss_sum + part
    if loss_sum is None:  # an adaptive plan may leave a rank without sequences this step
        device = next(model.parameters()).device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    return loss_sum


def _summary(log: _Log, result: TrainResult) -> None:
    ran = [r for r in result.history if r["step"] > result.start_step]
    if not ran:
        log.info(f"nothing to do: the checkpoint is at step {result.start_step}")
        return
    timed = ran[1:] or ran  # the first step pays one-off start-up costs
    tps = sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)
    median = sorted(r["tokens_per_s"] for r in timed)[len(timed) // 2]  # robust on a shared machine
    per_cpu_s = sum(r["tokens"] for r in timed) / max(sum(r.get("cpu_s", 0.0) for r in timed), 1e-9)
    log.info(f"done: step {ran[-1]['step']}, loss {ran[0]['loss']:.4f} -> {ran[-1]['loss']:.4f}, "
             f"{median:,.0f} tok/s median ({tps:,.0f} mean) after step 1, {per_cpu_s:,.0f} tokens per CPU-second "
             f"(all ranks), peak mem {max(r['peak_mem_mib'] for r in ran):,.0f} MiB per rank")
    log.event({"event": "end", "tokens_per_s": tps, "tokens_per_s_median": median,
               "tokens_per_cpu_s": per_cpu_s, "final_loss": ran[-1]["loss"], "checkpoint": result.checkpoint})


def _plot(history: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("seqpar train: --plot needs matplotlib (pip install 'seqpar[bench]'); no plot written", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], marker="." if len(history) < 60 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("seqpar train")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["TrainResult", "main", "run", "train"]
