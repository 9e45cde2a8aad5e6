"""Resumable checkpoints of a :class:`~seqpar.integrations.hf_trainer.ContextParallelTrainer`, written
atomically, with the FSDP2-sharded model and optimizer state in torch.distributed.checkpoint (DCP).

A checkpoint is the plain Trainer's folder ``OUTPUT/checkpoint-N`` (the full model that
``from_pretrained`` loads, the scheduler, every rank's RNG state, ``trainer_state.json``; under DDP the
optimizer's ``optimizer.pt``), plus under FSDP2 ``fsdp2_state/``: the DCP files of the model's and the
optimizer's shards (every rank writes its own: DTensors with their global offsets; a shared file
system). It is written to ``OUTPUT/.tmp-checkpoint-N`` and renamed to ``checkpoint-N`` only once every
rank has finished and the files are synced: a run that dies while saving leaves its last complete
checkpoint the newest ``checkpoint-*`` (what ``transformers.trainer_utils.get_last_checkpoint`` and
``resume_from_checkpoint=True`` take), and the half-written folder, which no ``checkpoint-*`` pattern
matches, is cleared by the next save of that step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..files import fsync_path, replace_dir

__all__ = ["SHARDED_STATE", "check_unsharded", "commit", "load_sharded", "save_sharded", "staging_dir"]

#: the DCP folder inside a checkpoint written under FSDP2
SHARDED_STATE = "fsdp2_state"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def staging_dir(final: Path, writer: bool) -> Path:
    """The empty folder where checkpoint ``final`` is written first (collective: every rank calls it;
    ``writer``: this rank creates folders and renames, one per shared file system)."""
    staging = final.parent / f".tmp-{final.name}"
    if writer:
        # saves run one at a time: any staging folder still here was left by a run that died while
        # saving (this step or another), and only this one will ever be renamed into place
        for stale in final.parent.glob(".tmp-checkpoint-*"):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    return staging


def commit(staging: Path, final: Path, writer: bool) -> None:
    """Rename the finished ``staging`` folder to ``final`` once every rank has written its files
    (collective). The files and the parent folder are synced first and after, so the rename is what
    makes the checkpoint appear; an existing ``final`` (the same step saved again) is replaced."""
    _barrier()
    if writer:
        for root, _, files in os.walk(staging):
            for name in files:
                fsync_path(Path(root, name))
        replace_dir(staging, final)
    _barrier()


def _torch_optimizer(optimizer):
    """accelerate's ``AcceleratedOptimizer`` holds the torch optimizer as ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def save_sharded(folder: str | Path, model, optimizer) -> None:
    """The FSDP2 model's and optimizer's shards into ``folder/fsdp2_state`` (collective, every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, _torch_optimizer(optimizer))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(Path(folder, SHARDED_STATE)))


def check_unsharded(folder: str | Path) -> None:
    """``ValueError`` (every rank, before any communication; a shared file system) when checkpoint
    ``folder`` holds its optimizer state only as FSDP2 shards: a run without FSDP2 would load its model
    and silently start a new optimizer and learning-rate schedule (the Trainer skips both when
    ``optimizer.pt`` is missing)."""
    if Path(folder, SHARDED_STATE).is_dir() and not Path(folder, "optimizer.pt").is_file():
        raise ValueError(f"resume_from_checkpoint: {folder} was saved under FSDP2: its optimizer state is in "
                         f"{SHARDED_STATE}/ (FSDP2 shards), which a run without fsdp cannot load; resume with "
                         "fsdp=True, fsdp_config={'version': 2} as it was saved, or load its model with "
                         "from_pretrained and start a new run")


def load_sharded(folder: str | Path, model, optimizer=None) -> None:
    """Load the model's shards (``optimizer=None``) or the optimizer's from ``folder/fsdp2_state``
    in place (collective). ``ValueError`` on every rank if the folder has none (the same file system)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    path = Path(folder, SHARDED_STATE)
    if not path.is_dir():
        raise ValueError(f"resume_from_checkpoint: {folder} has no {SHARDED_STATE}/ (the FSDP2 model and optimizer "
                         "shards): it was not saved by ContextParallelTrainer under FSDP2 with save_only_model=False; "
                         "resume from such a checkpoint, or load its model with from_pretrained and start a new run")
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        return
    optimizer = _torch_optimizer(optimizer)
    state = {"optim": get_optimizer_state_dict(model, optimizer)}  # a fresh optimizer gets its state made here
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, optimizer, state["optim"])
