"""The model of ``seqpar train`` on each rank: the device mesh, the model built on the meta device,
:func:`seqpar.integrations.parallelize` (context-parallel attention, checkpointing, compile, FSDP2
over all ``dp x cp`` ranks), then its shards filled from ``--model DIR`` or a seeded random init.

Shapes: a parameter of global shape ``[R, ...]`` is a DTensor sharded on dim 0 over the W ranks
(``ceil(R / W)`` rows per rank, the last ranks fewer); with one process (no torch.distributed) it is
a plain tensor. The random init is a pure function of ``(--seed, parameter name, shape)``, generated
whole and sliced to this rank's rows, so every world size and cp degree trains the same weights.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...comm.collectives import peer_errors
from .config import TrainConfig, run_model_config
from .model_io import local_index


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs: the world, its rank, the data-parallel degree and index, the DeviceMesh
    ``(dp, cp)`` (None in one process), its context-parallel group (``mesh["cp"]``, USP's groups for
    ``--cp-method usp``; None with --adaptive, whose groups change per step) and its device."""

    world: int
    rank: int
    dp: int
    dp_rank: int
    mesh: object
    cp_group: object
    device: torch.device


def setup_runtime(cfg: TrainConfig) -> Runtime:
    """The mesh of this run (collective: every rank calls it once, at start): ``(dp, cp)``, or with
    ``--replicas R`` ``(dp_replicate=R, dp_shard=dp/R, cp)`` (HSDP). ``--adaptive`` shards over all
    ranks as ``(dp=W, cp=1)``; its attention groups come from each step's plan."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cpu")
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):  # "nccl" or "cpu:gloo,cuda:nccl"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    cp = 1 if cfg.adaptive else cfg.context_parallel
    dp, dp_rank, mesh = world // cp, 0, None
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh

        if cfg.replicas > 1:  # HSDP: replicated across dp_replicate, sharded over dp_shard x cp
            shard = dp // cfg.replicas
            mesh = init_device_mesh(device.type, (cfg.replicas, shard, cp),
                                    mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
            dp_rank = mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard")
        else:
            mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
            dp_rank = mesh.get_local_rank("dp")
    return Runtime(world, rank, dp, dp_rank, mesh, None, device)


def model_config(cfg: TrainConfig, folder):
    """The config the run builds: ``--model``'s or ``--model-config``'s, with the RoPE flags applied."""
    return folder.config if folder is not None else run_model_config(cfg)


def build_model(cfg: TrainConfig, rt: Runtime, folder, before_shard=None):
    """The parallelized model with its shards filled; ``before_shard(model)`` runs on the meta model
    before :func:`parallelize` (``--adaptive`` registers its attention implementations there)."""
    from ..parallelize import parallelize
    from .model_io import build_meta_model

    model = build_meta_model(model_config(cfg, folder))
    if before_shard is not None:
        before_shard(model)
    dtype = None if cfg.dtype == "float32" or rt.mesh is None else cfg.dtype  # one process: autocast
    model = parallelize(model, rt.mesh, cp_method=cfg.cp_method, checkpointing=cfg.checkpointing,
                        compile=cfg.compile, dtype=dtype)
    if folder is not None:
        from .model_io import load_sharded_weights

        load_sharded_weights(model, folder, device=rt.device)
    else:
        from .model_io import materialize

        materialize(model, rt.device, "--model-config")
        random_init(model, cfg.seed)
    from ..hf.convert import verify_context_parallel

    verify_context_parallel(model)  # the dispatch check a meta-device forward could not run (gpt-oss)
    return model.train()


def _full_init(name: str, module, shape, std: float, seed: int) -> torch.Tensor:
    """The whole initial value of one parameter (CPU, fp32), from ``(seed, name)`` only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) >= 2:
        full = torch.randn(shape, generator=gen) * std
        padding = getattr(module, "padding_idx", None)
        if isinstance(module, torch.nn.Embedding) and padding is not None:
            full[padding] = 0
        return full
    return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)


@torch.no_grad()
def random_init(model, seed: int) -> None:
    """Matrices ~ N(0, initializer_range) (the padding row of an embedding zero), 1-D weights (norms) 1,
    biases and other vectors 0; each parameter drawn whole from ``(seed, its first name)`` and this
    rank's rows copied in (tied weights once)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    std = getattr(config, "initializer_range", None) or 0.02
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        full = _full_init(name, owner, tuple(p.shape), std, seed).to(p.dtype)
        index, local = local_index(p)  # this rank's rows of the whole value (FSDP2's uneven last shard too)
        local.copy_(full[index])


def local_bytes(tensors) -> int:
    """Bytes this rank stores of ``tensors`` (a DTensor counts its local shard; each tensor once)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def optimizer_bytes(optimizer) -> int:
    return local_bytes(v for state in optimizer.state.values() for v in state.values())


def max_over_ranks(value: float, rt: Runtime, name: str) -> float:
    if rt.world == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=rt.device)
    with peer_errors(name=name):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


__all__ = ["Runtime", "build_model", "local_bytes", "max_over_ranks", "model_config", "optimizer_bytes",
           "random_init", "setup_runtime"]
