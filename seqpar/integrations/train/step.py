"""One training step of ``seqpar train``: the loss of this rank's tokens, its backward, the gradient sum
over the world, the learning-rate schedule and fault injection. Shared by the fixed-mesh trainer
(:mod:`.trainer`) and the adaptive one (:mod:`.adaptive`)."""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...comm.collectives import peer_errors
from ..hf import IGNORE_INDEX, shard_inputs
from .config import TrainConfig

_GRAD_BUCKET = 1 << 26  # elements per gradient all-reduce (256 MB of fp32)


def token_loss(model, shard, autocast) -> torch.Tensor:
    """Summed (fp32) next-token cross entropy of one sharded batch on this rank, in the graph."""
    with autocast:
        logits = model(**shard.model_kwargs()).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shard.labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def forward_backward(model, shards, count: float, autocast) -> torch.Tensor:
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


def all_reduce_grads(params: list[torch.nn.Parameter], extra: torch.Tensor) -> torch.Tensor:
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
        with peer_errors(name="gradient all-reduce"):
            dist.all_reduce(flat)
        offset = 0
        for q in bucket:
            q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
            offset += q.numel()
        if p is None:
            return flat[offset:]
        bucket, size = [p], p.numel()
    return extra


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
    """--crash-at-step: fault injection on rank 0, mid-step (before the gradient all-reduce)."""
    if cfg.crash_at_step == step and rank == 0:
        if dist.is_initialized():
            os._exit(17)  # die like a killed process
        raise RuntimeError(f"--crash-at-step: injected crash at step {step}")


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs: the world, its rank, the data-parallel degree and index, its context-parallel
    group (None with --adaptive, whose groups change per step) and its device."""

    world: int
    rank: int
    dp: int
    dp_rank: int
    cp_group: object
    device: torch.device


def static_step(cfg: TrainConfig, rt: Runtime, data, model, params, batch: int, step: int, autocast) -> float:
    """One step at the fixed ``(dp, cp)`` mesh: this rank's data-parallel slice of the step's ``batch``
    sequences, sharded over its cp group; returns the global loss (gradients summed over the world)."""
    per_dp = batch // rt.dp
    first = (step - 1) * batch + rt.dp_rank * per_dp
    shards = []
    for s in range(first, first + per_dp):
        tokens, cu = data.sequence(s)
        shards.append(shard_inputs(tokens[None].to(rt.device), cu_seqlens=cu,
                                   group=rt.cp_group, method=cfg.cp_method))
    count = torch.tensor([float(sum(b.num_valid for b in shards))], dtype=torch.float64, device=rt.device)
    if rt.world > 1:
        with peer_errors(name="label count all-reduce"):
            dist.all_reduce(count)  # the global number of labels normalises every rank's share
    loss_sum = forward_backward(model, shards, float(count.clamp(min=1)), autocast)
    maybe_crash(cfg, rt.rank, step)
    return float(all_reduce_grads(params, loss_sum.float().reshape(1))[0]) / float(count.clamp(min=1))


__all__ = ["Runtime", "all_reduce_grads", "forward_backward", "lr_at", "maybe_crash", "peak_memory_mib", "static_step",
           "sync", "token_loss"]
