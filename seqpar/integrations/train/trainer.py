"""``seqpar train`` (also ``python -m seqpar.train``): a transformers decoder trained with context
parallelism on packed real text, its parameters, gradients and optimizer state sharded with FSDP2.

The world of W ranks is a 2-D mesh ``(dp, cp)``: ``cp = --context-parallel`` ranks share each
sequence (seqpar attention over the ``cp`` axis), ``dp = W / cp`` groups take different sequences.
The model is built on the meta device and set up by :func:`seqpar.integrations.parallelize`
(attention, checkpointing, compile, FSDP2 over all W ranks); its shards are filled from ``--model
DIR`` or a seeded random init (:mod:`.build`). A step takes ``--batch-size`` sequences (global);
every rank back-propagates the loss of its tokens divided by the global number of valid labels and
FSDP2 sums the gradients over all W ranks, so a step is the same computation whatever ``cp`` and
``dp`` are (up to fp32 rounding). Gradients are clipped on their global norm.

Launch: ``--nproc N`` spawns N local CPU ranks (gloo); under ``torchrun`` the launched ranks are
used (NCCL on GPUs, gloo on CPU); ``--nproc 1`` runs in this process (no sharding, autocast for
``--dtype``). ``--dtype float16`` scales the loss dynamically (:func:`.step.make_scaler`; a step whose
gradients overflow is skipped on every rank and recorded as ``skipped``). Checkpoints: see :mod:`.ckpt`.
Data: see :mod:`.data` and :mod:`.tokens`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...comm.collectives import peer_errors
from ...comm.launch import launched_by_torchrun, launched_process_group, usable_cores
from ...comm.pool import WorkerPool
from . import rope_flags
from .build import Runtime, build_model, local_bytes, max_over_ranks, model_config, optimizer_bytes, setup_runtime
from .ckpt import check_rope, has_scaler, load_checkpoint, model_fingerprint, resolve_resume, save_checkpoint
from .config import (TrainConfig, global_batch, model_folder, open_data, open_eval_data, parse_args, validate,
                     world_size_of)
from .evaluate import describe, eval_due, eval_key, evaluate
from .flops import attention_shape, peak_flops, step_flops
from .log import TrainLog, plot_losses, summary
from .step import (LossScaleError, check_loss_scale, lr_at, make_scaler, maybe_crash, optimizer_step,
                   peak_memory_mib, static_step, sync)


@dataclass
class TrainResult:
    """What rank 0 returns: one record per step (restored ones included), the last checkpoint.
    ``packed``: documents were packed with their boundaries kept (always, for every softmax method).
    ``evals``: one record per evaluation (``--eval-data``; restored ones included)."""

    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
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
    except LossScaleError as exc:  # fp16 overflowing at every step: what to try, no traceback
        print(f"seqpar train: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


def run(cfg: TrainConfig) -> TrainResult | None:
    validate(cfg, world_size_of(cfg))
    if cfg.resume is not None:  # a checkpoint of another RoPE: refused before the ranks read the model
        check_rope(cfg, model_config(cfg, model_folder(cfg)))
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
        plot_losses(result.history, cfg.plot, result.evals)
    return result


# ----------------------------------------------------------------------------- one rank


@dataclass
class _Run:
    """Everything one rank's training loop holds."""

    cfg: TrainConfig
    rt: Runtime
    data: object  # PackedSequences (bytes) or PackedTokenSequences (--model's tokenizer)
    model: torch.nn.Module
    folder: object  # the --model ModelFolder, or None
    params: list
    optimizer: torch.optim.Optimizer
    batch: int
    settings: dict
    fingerprint: dict
    result: TrainResult
    log: TrainLog
    runner: object = None  # the AdaptiveRunner of --adaptive
    evalset: object = None  # the EvalSet of --eval-data (None: no evaluation)
    scaler: object = None  # --dtype float16's loss scaler (None otherwise)
    step_scale: float | None = None  # the scale of the running step's loss (fp16)
    skipped: bool = False  # whether the running step's update was skipped (fp16: inf/NaN gradients)
    num_params: int = 0
    shape: tuple = ()
    peak: float | None = None


def _adaptive_runner(cfg: TrainConfig, rt: Runtime, folder):
    if not cfg.adaptive:
        return None
    from .adaptive import AdaptiveRunner
    from .config import adaptive_models

    cluster, cost = adaptive_models(cfg, rt.world, model_config(cfg, folder))
    return AdaptiveRunner(rt.world, rt.rank, cost_model=cost, cluster=cluster)


def _resume(cfg: TrainConfig, run: "_Run") -> None:
    resume_from = resolve_resume(cfg.resume, cfg.save)
    meta = (load_checkpoint(resume_from, run.model, run.optimizer, run.fingerprint, scaler=run.scaler)
            if resume_from is not None else None)
    if meta is not None:
        run.result.start_step, run.result.history = meta["step"], list(meta.get("history", []))
        same_set = meta.get("eval_set") == eval_key(cfg, run.evalset)
        run.result.evals = list(meta.get("evals", [])) if same_set else []
    run.log = TrainLog(cfg, run.rt.rank == 0, run.result.start_step, resume_from is not None)
    if meta is not None:
        changed = [k for k, v in run.settings.items() if meta.get("settings", {}).get(k) != v and k != "data_root"]
        saved = meta.get("run", {})
        run.log.info(f"resumed from {resume_from} at step {run.result.start_step} (saved by {saved.get('world')} "
                     f"rank(s) with {saved.get('context_parallel')}-way context parallelism)")
        if changed:
            run.log.info(f"warning: {', '.join(changed)} differ from the saved run: the data order is not the one "
                         "the interrupted run would have seen")
        if meta.get("evals") and not same_set:
            run.log.info("the saved run's evaluations used another evaluation set (or none now): not restored")
        if run.scaler is not None and has_scaler(resume_from):  # torch's convention: the saved scale goes on
            init = cfg.loss_scale_init
            run.log.info(f"loss scale {run.scaler.get_scale():g} restored from the checkpoint"
                         + (f" (--loss-scale-init {init:g} applies to a fresh start only)" if init is not None else ""))


def _start(cfg: TrainConfig) -> _Run:
    """Data, model (sharded, filled), optimizer, resumed state and log of this rank."""
    rt = setup_runtime(cfg)
    folder = model_folder(cfg)
    data = open_data(cfg, folder)
    runner = _adaptive_runner(cfg, rt, folder)
    model = build_model(cfg, rt, folder, before_shard=runner.register if runner is not None else None)
    if runner is not None:
        runner.model, runner.loss_chunk = model, cfg.loss_chunk
    else:
        rt = dataclasses.replace(rt, cp_group=model.seqpar_cp_group)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    batch = global_batch(cfg, rt.world)
    fingerprint = getattr(data, "fingerprint", None) or data.files.fingerprint
    settings = {"data_root": data.files.root, "data_glob": cfg.glob, "data_fingerprint": fingerprint,
                "seq_len": cfg.seq_len, "batch_size": batch, "seed": cfg.seed}
    run = _Run(cfg, rt, data, model, folder, params, optimizer, batch, settings, model_fingerprint(model),
               TrainResult(), None, runner, num_params=sum(p.numel() for p in params),
               shape=attention_shape(model.config), peak=peak_flops(rt.device, cfg.dtype),
               scaler=make_scaler(cfg, rt), evalset=open_eval_data(cfg, folder))
    _resume(cfg, run)
    param_bytes = int(max_over_ranks(local_bytes(params), rt, "parameter bytes all-reduce"))  # bytes: an int
    mode = "adaptive" if cfg.adaptive else f"cp={cfg.context_parallel} ({cfg.cp_method}) x dp={rt.dp}"
    source = f"model {cfg.model}" if cfg.model else "random weights"
    shards = "one process, unsharded" if rt.mesh is None else (
        f"FSDP2 over {rt.world} rank(s)" if cfg.replicas == 1
        else f"HSDP: {cfg.replicas} replicas, each sharded over {rt.world // cfg.replicas} rank(s)")
    run.log.info(f"seqpar train: {rt.world} rank(s) on {rt.device.type}, {mode}, {shards}; "
                 f"{run.num_params:,} parameters ({source}; {param_bytes / 2**20:,.1f} MiB on the largest rank); "
                 f"{batch} x {cfg.seq_len} tokens per step; data {data.files.root} ({len(data.lengths)} documents, "
                 f"{data.per_epoch} sequences per epoch, its last {data.unused} tokens unused)")
    if run.evalset is not None:
        run.log.info(describe(cfg, run.evalset))
    rope = rope_flags.summary(model.config)
    if rope_flags.given(cfg):
        run.log.info(f"RoPE set by {', '.join(rope_flags.given(cfg))}: {rope['rope_parameters']}, "
                     f"max_position_embeddings {rope['max_position_embeddings']}")
    run.log.event({"event": "start", "config": cfg.to_dict(), "world": rt.world, "packed": True, "rope": rope,
                   "start_step": run.result.start_step, "params": run.num_params, "param_bytes_local": param_bytes})
    return run


def _step(run: _Run, step: int, autocast):
    """Forward and backward of one step: ``(loss, sum of squared document lengths, plan or None)``."""
    cfg, rt = run.cfg, run.rt
    if run.runner is None:
        loss, squares = static_step(cfg, rt, run.data, run.model, run.batch, step, autocast, run.scaler)
        return loss, squares, None
    lengths = [cfg.seq_len] * run.batch
    plan = run.runner.plan(lengths)
    first = (step - 1) * run.batch
    loss, squares = run.runner.step(plan, lengths, lambda i: run.data.sequence(first + i), rt, autocast=autocast,
                                    scaler=run.scaler)
    maybe_crash(cfg, rt.rank, step)
    return loss, squares, plan


def _record(run: _Run, step: int, loss: float, squares: float, plan, lr: float, grad_norm: float | None,
            dt: float, cpu_s: float) -> dict:
    """The step's record (peak memory the max over ranks, CPU seconds summed: on a shared machine wall
    time measures the neighbours too)."""
    cfg, rt = run.cfg, run.rt
    mem = torch.tensor([peak_memory_mib(rt.device)], device=rt.device)
    cpu = torch.tensor([cpu_s], dtype=torch.float64, device=rt.device)
    if rt.world > 1:
        with peer_errors(name="step record all-reduce"):
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)
    tokens = run.batch * cfg.seq_len
    flops = step_flops(run.num_params, tokens, squares, run.shape)
    rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
           "step_time_s": dt, "tokens_per_s": tokens / dt, "peak_mem_mib": float(mem[0]),
           "cpu_s": float(cpu[0]), "world": rt.world, "model_flops": flops,
           "mfu": flops / (dt * rt.world * run.peak) if run.peak else None,
           "context_parallel": None if cfg.adaptive else cfg.context_parallel}
    if run.scaler is not None:  # fp16: the scale this step's loss was multiplied by, and whether it was skipped
        rec["loss_scale"], rec["skipped"] = run.step_scale, run.skipped
    if plan is not None:
        rec["groups"] = [[g.start, g.size, g.method, len(g.seqs)] for g in plan.groups]
    return rec


def _maybe_save(run: _Run, step: int) -> None:
    cfg = run.cfg
    if cfg.save and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
        meta = {"step": step, "model": run.fingerprint, "settings": run.settings, "history": run.result.history,
                "evals": run.result.evals, "eval_set": eval_key(cfg, run.evalset),
                "run": {"world": run.rt.world, "context_parallel": cfg.context_parallel,
                        "cp_method": cfg.cp_method, "adaptive": cfg.adaptive, "lr": cfg.lr,
                        "steps": cfg.steps, "dtype": cfg.dtype, "model": cfg.model,
                        "rope": rope_flags.summary(run.model.config)}}
        path = save_checkpoint(cfg.save, step, run.model, run.optimizer, meta, scaler=run.scaler)
        run.result.checkpoint = str(path)
        run.log.info(f"saved {path}")


def _train_step(run: _Run, step: int, autocast) -> dict:
    cfg = run.cfg
    sync(run.rt.device)
    t0, c0 = time.perf_counter(), time.process_time()
    run.step_scale = run.scaler.get_scale() if run.scaler is not None else None
    loss, squares, plan = _step(run, step, autocast)
    # a step skipped for inf/NaN gradients (fp16) still consumes its step number, learning rate and
    # data (torch's GradScaler convention): the schedule and the data order stay functions of the
    # step alone, so a resumed run replays the same ones; only the update is left out
    lr = lr_at(cfg, step)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    grad_norm, run.skipped = optimizer_step(run.optimizer, run.params,
                                            cfg.grad_clip if cfg.grad_clip > 0 else math.inf, run.scaler)
    run.optimizer.zero_grad(set_to_none=True)
    sync(run.rt.device)
    return _record(run, step, loss, squares, plan, lr, grad_norm, time.perf_counter() - t0, time.process_time() - c0)


def _finish(run: _Run) -> None:
    """End record (optimizer bytes), and ``--export-hf`` gathered from the shards (collective)."""
    cfg = run.cfg
    optim = int(max_over_ranks(optimizer_bytes(run.optimizer), run.rt, "optimizer bytes all-reduce"))
    if cfg.export_hf:
        from .model_io import export_hf

        config = run.folder.config if run.folder is not None else model_config(cfg, None)
        export_hf(run.model, cfg.export_hf, config=config,
                  tokenizer=run.folder.tokenizer if run.folder is not None else None)
        run.log.info(f"exported {cfg.export_hf}")
    extra = {"optim_bytes_local": optim, "export_hf": cfg.export_hf}
    if run.evalset is not None and run.result.evals:
        extra["final_eval_loss"] = run.result.evals[-1]["eval_loss"]
    if run.scaler is not None:  # fp16: this run's skipped steps and the scale its next step would use
        extra["skipped_steps"] = sum(bool(r.get("skipped")) for r in run.result.history
                                     if r["step"] > run.result.start_step)
        extra["loss_scale"] = run.scaler.get_scale()
    summary(run.log, run.result, extra)


def _rank_main(cfg: TrainConfig) -> TrainResult | None:
    run = _start(cfg)
    single = run.rt.mesh is None  # one process: no FSDP2 mixed precision, so autocast
    autocast = (torch.autocast(run.rt.device.type, dtype=getattr(torch, cfg.dtype))
                if cfg.dtype != "float32" and single else contextlib.nullcontext())
    try:
        for step in range(run.result.start_step + 1, cfg.steps + 1):
            rec = _train_step(run, step, autocast)
            run.result.history.append(rec)
            run.log.step(rec)
            check_loss_scale(cfg, run.scaler, step, run.result.history)  # after the step's record is written
            if eval_due(cfg, step):  # before the save: a checkpoint holds the evaluations up to its step
                done = evaluate(cfg, run.rt, run.model, run.evalset, step, autocast, run.runner, run.batch)
                run.result.evals.append(done)
                run.log.evaluation(done)
            _maybe_save(run, step)
        _finish(run)
    finally:
        run.log.close()
    return run.result if run.rt.rank == 0 else None


__all__ = ["TrainResult", "main", "run", "train"]
