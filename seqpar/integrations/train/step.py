"""One training step of ``seqpar train``: the loss of this rank's tokens and its backward (FSDP2 sums the
gradients over the world), gradient clipping on the global norm of the sharded gradients, the
optimizer step (with ``--dtype float16``: dynamic loss scaling, torch's ``GradScaler`` in one
process, ``ShardedGradScaler`` over FSDP2's sharded gradients), the learning-rate schedule and fault
injection. Shared by the fixed-mesh trainer (:mod:`.trainer`) and the adaptive one (:mod:`.adaptive`)."""

from __future__ import annotations

import math
import os
import resource
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...comm.collectives import peer_errors
from ..hf import IGNORE_INDEX, shard_inputs
from .config import TrainConfig, initial_loss_scale


def token_loss(model, shard, autocast, chunk_size: int | None = None) -> torch.Tensor:
    """Summed (fp32) next-token cross entropy of one sharded batch on this rank, in the graph.

    ``chunk_size``: tokens per chunk of the chunked loss (:func:`seqpar.integrations.loss.causal_lm_loss`:
    never all local tokens' full-vocabulary logits at once; None = its default, 256 MiB of fp32
    logits per chunk); 0 = the model's full logits and one cross entropy."""
    kwargs = shard.model_kwargs()
    if chunk_size == 0:
        with autocast:
            logits = model(**kwargs).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shard.labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    from ..loss import causal_lm_loss

    input_ids = kwargs.pop("input_ids")
    with autocast:
        return causal_lm_loss(model, input_ids, shard.labels, chunk_size=chunk_size, ignore_index=IGNORE_INDEX,
                              **kwargs)


def backward(loss: torch.Tensor, scaler=None) -> None:
    """``loss.backward()``, the loss first multiplied by the scaler's current scale when there is one
    (fp16: the gradients are then ``scale`` times the true ones until :func:`optimizer_step` unscales)."""
    (loss if scaler is None else scaler.scale(loss)).backward()


def forward_backward(model, shards, count: float, autocast, chunk_size: int | None = None,
                     scaler=None) -> torch.Tensor:
    """Backward of this rank's token losses / the global count (each microbatch's loss scaled by
    ``scaler``, fp16); returns their (detached, unscaled) sum.

    FSDP2 sums each backward's gradients over all ranks (its divide factor is 1), so the gradients
    after the step are those of the global mean loss (times the loss scale)."""
    loss_sum = None
    for b in shards:
        token_loss_sum = token_loss(model, b, autocast, chunk_size)
        backward(token_loss_sum / count, scaler)
        part = token_loss_sum.detach().double()
        loss_sum = part if loss_sum is None else loss_sum + part
    return loss_sum


def clip_gradients(params, max_norm: float) -> float:
    """The global L2 norm of the (sharded) gradients, before clipping; scales them to ``max_norm``
    when larger (``inf``: no clipping). Collective over the ranks holding shards."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):  # a partial sum of squares per rank until gathered
        norm = norm.full_tensor()
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


class LossScaleError(RuntimeError):
    """``--dtype float16``: the loss scale fell below ``--loss-scale-min`` (raised on every rank)."""


def check_loss_scale(cfg: TrainConfig, scaler, step: int, history: list[dict]) -> None:
    """Raise :class:`LossScaleError` when the scale after ``step``'s update is below ``--loss-scale-min``
    (default 1, or --loss-scale-init when lower). The scale is the same on every rank (the inf/NaN
    finding is all-reduced), so every rank raises at the same step; ``history``: the step records so
    far (this step's last)."""
    floor = min(1.0, initial_loss_scale(cfg)) if cfg.loss_scale_min is None else cfg.loss_scale_min
    if scaler is None or scaler.get_scale() >= floor:
        return
    run = 0
    for rec in reversed(history):
        if not rec.get("skipped"):
            break
        run += 1
    raise LossScaleError(
        f"--dtype float16: the loss scale fell to {scaler.get_scale():g} after step {step}, below --loss-scale-min "
        f"{floor:g}: the loss or the gradients overflow float16 at every step ({run} step(s) in a row skipped, no "
        "update made). Try a lower --lr (or more --warmup), check the data for bad documents, or train with "
        "--dtype bfloat16, whose range needs no loss scaling")


def make_scaler(cfg: TrainConfig, rt):
    """The dynamic loss scaler of ``--dtype float16`` (None for bfloat16 / float32, whose exponent
    range needs none): ``torch.amp.GradScaler`` in one process, FSDP2's ``ShardedGradScaler`` over the
    world otherwise (its unscale finds inf/NaN in each rank's shards of the DTensor gradients and
    all-reduces the finding, so every rank skips the same steps)."""
    if cfg.dtype != "float16":
        return None
    init = initial_loss_scale(cfg)
    # the scaler multiplies by its fp32 scale but reports the Python number until its first scale():
    # rounded here, the first step's record says the factor used (1000.1 -> 1000.0999755859375)
    init = float(torch.tensor(init, dtype=torch.float32))
    interval = 2000 if cfg.loss_scale_growth_interval is None else cfg.loss_scale_growth_interval
    if rt.mesh is None:
        return torch.amp.GradScaler(rt.device.type, init_scale=init, growth_interval=interval)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(rt.device.type, init_scale=init, growth_interval=interval,
                             process_group=dist.group.WORLD)


def optimizer_step(optimizer, params, max_norm: float, scaler=None) -> tuple[float | None, bool]:
    """Clip the gradients to ``max_norm`` (``inf``: no clipping) and step; returns ``(grad_norm,
    skipped)``, the norm of the true (unscaled) gradients before clipping. Collective.

    With a ``scaler`` (fp16): unscale first, then clip and step, which the scaler skips when any
    rank's gradients hold inf/NaN (``skipped``; the norm is then None: not a number to report), and
    update the scale (halved after a skipped step, doubled after ``growth_interval`` clean ones).
    A skipped step is still a step (torch's convention): the caller's step counter, the
    learning-rate schedule and the data order advance; only the parameters and the optimizer state
    (AdamW's moments and its own step count) stay as they were."""
    if scaler is None:
        norm = clip_gradients(params, max_norm)
        optimizer.step()
        return norm, False
    scale = scaler.get_scale()
    with warnings.catch_warnings():
        # torch's DTensor handler of the inf check wraps the scaler's found_inf (shape [1]) as a replicated
        # DTensor and warns about its shape, on every rank and run; the finding is still right (the max over
        # the mesh's shard dims, then the scaler's all-reduce over the world)
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)
        scaler.unscale_(optimizer)  # the inf/NaN finding is all-reduced here: every rank agrees
    norm = clip_gradients(params, max_norm)
    scaler.step(optimizer)
    scaler.update()
    # the scale falls only after an inf/NaN step (backoff 0.5) and never falls otherwise (growth 2)
    skipped = scaler.get_scale() < scale
    return (None if skipped else norm), skipped


def sum_over_ranks(values: list[float], rt, name: str) -> list[float]:
    """``values`` summed over the world (float64; one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    if rt.world > 1:
        with peer_errors(name=name):
            dist.all_reduce(t)
    return t.tolist()


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to --lr, then cosine down to 10% at the last step (a function of the step only)."""
    warmup = cfg.warmup if cfg.warmup is not None else min(10, cfg.steps // 10)
    if step <= warmup:
        return cfg.lr * step / max(warmup, 1)
    progress = (step - warmup) / max(cfg.steps - warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on CPU): a step's clock starts and stops on an idle GPU, or it
    would time the kernel launches and the previous step's queued work instead of this step's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def maybe_crash(cfg: TrainConfig, rank: int, step: int) -> None:
    """--crash-at-step: fault injection on rank 0, mid-step (after the backward, before the optimizer)."""
    if cfg.crash_at_step == step and rank == 0:
        if dist.is_initialized():
            os._exit(17)  # die like a killed process
        raise RuntimeError(f"--crash-at-step: injected crash at step {step}")


def static_step(cfg: TrainConfig, rt, data, model, batch: int, step: int, autocast,
                scaler=None) -> tuple[float, float]:
    """One step at the fixed ``(dp, cp)`` mesh: this rank's data-parallel slice of the step's ``batch``
    sequences (``batch / dp`` forward and backward passes, the same number on every rank, as FSDP2's
    collectives require), sharded over its cp group. Returns the global loss and the sum of the
    step's squared document lengths (for the attention FLOPs)."""
    from .flops import squared_lengths

    per_dp = batch // rt.dp
    first = (step - 1) * batch + rt.dp_rank * per_dp
    shards, squares = [], 0.0
    for s in range(first, first + per_dp):
        tokens, cu = data.sequence(s)
        squares += squared_lengths(cu)
        shards.append(shard_inputs(tokens[None].to(rt.device), cu_seqlens=cu,
                                   group=rt.cp_group, method=cfg.cp_method))
    # the global number of labels normalises every rank's share (each label is on exactly one rank)
    count = max(sum_over_ranks([float(sum(b.num_valid for b in shards))], rt, "label count all-reduce")[0], 1.0)
    loss_sum = forward_backward(model, shards, count, autocast, cfg.loss_chunk, scaler)
    maybe_crash(cfg, rt.rank, step)
    cp = rt.world // rt.dp  # the cp ranks of a group hold the same sequences
    total, squares = sum_over_ranks([float(loss_sum), squares / cp], rt, "loss all-reduce")
    return total / count, squares


__all__ = ["LossScaleError", "backward", "check_loss_scale", "clip_gradients", "forward_backward", "lr_at",
           "make_scaler", "maybe_crash", "optimizer_step", "peak_memory_mib", "static_step", "sum_over_ranks", "sync",
           "token_loss"]
