"""``seqpar train`` (also ``python -m seqpar.train``): a transformers Llama trained with context
parallelism on packed real text.

The world of W ranks is a 2-D mesh ``(dp, cp)``: ``cp = --context-parallel`` ranks share each
sequence (seqpar attention over the ``cp`` axis), ``dp = W / cp`` groups take different sequences.
A step takes ``--batch-size`` sequences (global); every rank computes the loss of its tokens divided
by the global number of valid labels, and the gradients are summed over all W ranks, so a step is
the same computation whatever ``cp`` and ``dp`` are (up to fp32 rounding).

Launch: ``--nproc N`` spawns N local CPU ranks (gloo); under ``torchrun`` the launched ranks are
used (NCCL on GPUs, gloo on CPU); ``--nproc 1`` runs in this process. Checkpoints: see
:mod:`.ckpt`. Data: see :mod:`.data`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...comm.collectives import peer_errors
from ...comm.launch import launched_by_torchrun, launched_process_group, usable_cores
from ...comm.pool import WorkerPool
from ..hf import apply_context_parallel
from .ckpt import (
    load_checkpoint,
    model_fingerprint,
    resolve_resume,
    save_checkpoint,
)
from .config import (
    TrainConfig,
    global_batch,
    load_model_config,
    parse_args,
    validate,
    world_size_of,
)
from .data import PackedSequences, TextFiles
from .log import TrainLog, plot_losses, summary
from .step import Runtime, lr_at, maybe_crash, peak_memory_mib, static_step, sync


@dataclass
class TrainResult:
    """What rank 0 returns: one record per step (restored ones included), the last checkpoint.
    ``packed``: documents were packed with their boundaries kept (always, for every softmax method)."""

    history: list[dict] = field(default_factory=list)
    checkpoint: str | None = None
    start_step: int = 0
    packed: bool = True

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
    validate(cfg, world_size_of(cfg))
    if launched_by_torchrun():
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        with launched_process_group():
            result = _rank_main(cfg)
    elif cfg.nproc > 1:
        threads = cfg.threads or max(1, usable_cores() // cfg.nproc)
        with contextlib.closing(WorkerPool(cfg.nproc, threads_per_rank=threads)) as pool:
            result = pool.run(_rank_main, (cfg,), {}, timeout=cfg.timeout)[0]
    else:
        previous = torch.get_num_threads()
        torch.set_num_threads(cfg.threads or usable_cores())
        try:
            result = _rank_main(cfg)
        finally:
            torch.set_num_threads(previous)
    if result is not None and cfg.plot:
        plot_losses(result.history, cfg.plot)
    return result


# ----------------------------------------------------------------------------- one rank


def _setup(cfg: TrainConfig) -> Runtime:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cpu")
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):  # "nccl" or "cpu:gloo,cuda:nccl"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    cp = cfg.context_parallel
    dp, dp_rank, cp_group = world // cp, 0, None
    if world > 1 and not cfg.adaptive:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        cp_group, dp_rank = mesh["cp"], mesh.get_local_rank("dp")
    return Runtime(world, rank, dp, dp_rank, cp_group, device)


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
        from ...softmax.checkpoint import apply_checkpointing

        apply_checkpointing(model, mode="attention")
    return model


@dataclass
class _Run:
    """Everything one rank's training loop holds."""

    cfg: TrainConfig
    rt: Runtime
    data: PackedSequences
    model: torch.nn.Module
    params: list
    optimizer: torch.optim.Optimizer
    batch: int
    settings: dict
    fingerprint: dict
    result: TrainResult
    log: TrainLog
    runner: object = None  # the AdaptiveRunner of --adaptive


def _start(cfg: TrainConfig) -> _Run:
    """Data, model, optimizer, resumed state, log and the context-parallel attention of this rank."""
    rt = _setup(cfg)
    files = TextFiles.scan(cfg.data_dir, cfg.glob)
    model = _build_model(cfg, rt.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    batch = global_batch(cfg, rt.world)
    settings = {"data_root": files.root, "data_glob": cfg.glob, "data_fingerprint": files.fingerprint,
                "seq_len": cfg.seq_len, "batch_size": batch, "seed": cfg.seed}
    result, fingerprint = TrainResult(), model_fingerprint(model)
    resume_from = resolve_resume(cfg.resume, cfg.save)
    meta = load_checkpoint(resume_from, model, optimizer, fingerprint) if resume_from is not None else None
    if meta is not None:
        result.start_step, result.history = meta["step"], list(meta.get("history", []))
    log = TrainLog(cfg, rt.rank == 0, result.start_step, resume_from is not None)
    if meta is not None:
        changed = [k for k, v in settings.items() if meta.get("settings", {}).get(k) != v and k != "data_root"]
        log.info(f"resumed from {resume_from} at step {result.start_step} (saved with "
                 f"{meta.get('run', {}).get('context_parallel')}-way context parallelism)")
        if changed:
            log.info(f"warning: {', '.join(changed)} differ from the saved run: the data order is not the one "
                     "the interrupted run would have seen")
    run = _Run(cfg, rt, PackedSequences(files, cfg.seq_len, cfg.seed), model, params, optimizer, batch, settings,
               fingerprint, result, log)
    if cfg.adaptive:
        from .adaptive import AdaptiveRunner
        from .config import adaptive_models

        cluster, cost = adaptive_models(cfg, rt.world, model.config)
        run.runner = AdaptiveRunner(model, rt.world, rt.rank, cost_model=cost, cluster=cluster)
    else:
        apply_context_parallel(model, group=rt.cp_group, method=cfg.cp_method)
    mode = "adaptive" if cfg.adaptive else f"cp={cfg.context_parallel} ({cfg.cp_method}) x dp={rt.dp}"
    log.info(f"seqpar train: {rt.world} rank(s) on {rt.device.type}, {mode}; {sum(p.numel() for p in params):,} "
             f"parameters; {batch} x {cfg.seq_len} tokens per step; data {files.root} ({len(files.paths)} files, "
             f"{run.data.per_epoch} sequences per epoch, its last {run.data.unused} tokens unused)")
    log.event({"event": "start", "config": cfg.to_dict(), "world": rt.world, "packed": True,
               "start_step": result.start_step})
    return run


def _step(run: _Run, step: int, autocast):
    """Forward, backward and gradient sum of one step: ``(loss, plan or None)``."""
    cfg, rt = run.cfg, run.rt
    if run.runner is None:
        return static_step(cfg, rt, run.data, run.model, run.params, run.batch, step, autocast), None
    lengths = [cfg.seq_len] * run.batch  # the scheduler's executor: plan, GroupCache, train_step
    plan = run.runner.plan(lengths)
    maybe_crash(cfg, rt.rank, step)
    first = (step - 1) * run.batch
    loss = run.runner.step(plan, lengths, lambda i: run.data.sequence(first + i), run.params,
                           device=rt.device, autocast=autocast)
    return loss, plan


def _record(run: _Run, step: int, loss: float, plan, lr: float, grad_norm: float, dt: float, cpu_s: float) -> dict:
    """The step's record (peak memory the max over ranks, CPU seconds summed: on a shared machine wall
    time measures the neighbours too)."""
    cfg, rt = run.cfg, run.rt
    mem = torch.tensor([peak_memory_mib(rt.device)], device=rt.device)
    cpu = torch.tensor([cpu_s], dtype=torch.float64, device=rt.device)
    if rt.world > 1:
        with peer_errors(name="step record all-reduce"):
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)
    rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": run.batch * cfg.seq_len,
           "step_time_s": dt, "tokens_per_s": run.batch * cfg.seq_len / dt, "peak_mem_mib": float(mem[0]),
           "cpu_s": float(cpu[0]), "world": rt.world,
           "context_parallel": None if cfg.adaptive else cfg.context_parallel}
    if plan is not None:
        rec["groups"] = [[g.start, g.size, g.method, len(g.seqs)] for g in plan.groups]
    return rec


def _maybe_save(run: _Run, step: int) -> None:
    cfg = run.cfg
    if cfg.save and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
        meta = {"step": step, "model": run.fingerprint, "settings": run.settings, "history": run.result.history,
                "run": {"world": run.rt.world, "context_parallel": cfg.context_parallel,
                        "cp_method": cfg.cp_method, "adaptive": cfg.adaptive, "lr": cfg.lr,
                        "steps": cfg.steps, "dtype": cfg.dtype}}
        path = save_checkpoint(cfg.save, step, run.model, run.optimizer, meta)
        run.result.checkpoint = str(path)
        run.log.info(f"saved {path}")


def _rank_main(cfg: TrainConfig) -> TrainResult | None:
    run = _start(cfg)
    autocast = (torch.autocast(run.rt.device.type, dtype=getattr(torch, cfg.dtype)) if cfg.dtype != "float32"
                else contextlib.nullcontext())
    try:
        for step in range(run.result.start_step + 1, cfg.steps + 1):
            sync(run.rt.device)
            t0, c0 = time.perf_counter(), time.process_time()
            loss, plan = _step(run, step, autocast)
            clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, clip))
            lr = lr_at(cfg, step)
            for g in run.optimizer.param_groups:
                g["lr"] = lr
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            sync(run.rt.device)
            rec = _record(run, step, loss, plan, lr, grad_norm, time.perf_counter() - t0, time.process_time() - c0)
            run.result.history.append(rec)
            run.log.step(rec)
            _maybe_save(run, step)
        summary(run.log, run.result)
    finally:
        run.log.close()
    return run.result if run.rt.rank == 0 else None


__all__ = ["TrainResult", "main", "run", "train"]
