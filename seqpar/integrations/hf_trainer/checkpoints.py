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

Another world size: ``context_parallel.json`` records the saving run's layout (world, cp, dp, batch per
group, gradient accumulation). A resume may change the world, ``context_parallel_size`` and the number
of data-parallel groups, under DDP (the optimizer state in ``optimizer.pt`` is whole) and FSDP2 (DCP
reshards the model's and the optimizer's shards), as long as each micro-batch holds as many sequences
(``dp x per_device_train_batch_size``) with the same ``gradient_accumulation_steps``: the Trainer finds
its data position by skipping ``global_step x gradient_accumulation_steps`` micro-batches of its own
size, so only then does the resumed run train on the examples the saved run would have taken next
(:func:`check_layout` refuses the rest, unless ``ignore_data_skip`` starts the data again at an epoch's
beginning; under ``group_by_length`` the batch per group must stay too). The RNG
states are restored for the process indices the checkpoint has; ranks beyond them keep the seed's
state, so a model with dropout draws other masks than an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..files import fsync_path, replace_dir

__all__ = ["LAYOUT", "SHARDED_STATE", "check_layout", "check_unsharded", "commit", "load_sharded", "save_layout",
           "save_sharded", "staging_dir"]

#: the DCP folder inside a checkpoint written under FSDP2
SHARDED_STATE = "fsdp2_state"
#: the saving run's world, context-parallel size, data-parallel groups, batch per group and accumulation
LAYOUT = "context_parallel.json"


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


def save_layout(folder: str | Path, *, world: int, cp: int, batch: int, accumulation: int, fsdp: bool) -> None:
    """Write the run's layout into checkpoint ``folder`` (one rank): ``batch`` sequences per data-parallel
    group in each of ``accumulation`` micro-batches of an optimizer step."""
    layout = {"world_size": world, "context_parallel_size": cp, "data_parallel_size": world // cp,
              "per_device_train_batch_size": batch, "gradient_accumulation_steps": accumulation, "fsdp": fsdp}
    Path(folder, LAYOUT).write_text(json.dumps(layout, indent=1) + "\n")


def check_layout(folder: str | Path, *, world: int, cp: int, batch: int, accumulation: int,
                 grouped: bool = False, auto_batch: bool = False) -> None:
    """``ValueError`` naming ``resume_from_checkpoint`` (every rank, before any communication; a shared
    file system) when checkpoint ``folder`` was saved with another number of sequences per micro-batch
    (``dp x batch``) or another ``gradient_accumulation_steps``: the resumed run would skip another number
    of examples than were trained and take other batches per step. ``grouped``
    (``train_sampling_strategy='group_by_length'``): also another ``batch``, which orders the examples
    (transformers' LengthGroupedSampler sorts megabatches of ``batch x accumulation`` sequences). A
    checkpoint without the layout file (the plain Trainer's) is left to transformers' own rules.
    ``auto_batch`` (``auto_find_batch_size``): the batch compared is the one transformers restores from
    the checkpoint's trainer_state.json right after this check (what the saving run had found), if any."""
    path = Path(folder, LAYOUT)
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    state = Path(folder, "trainer_state.json")
    if auto_batch and state.is_file():
        batch = json.loads(state.read_text()).get("train_batch_size") or batch
    was = saved["data_parallel_size"] * saved["per_device_train_batch_size"]
    dp = world // cp
    if was == dp * batch and saved["gradient_accumulation_steps"] == accumulation:
        if grouped and batch != saved["per_device_train_batch_size"]:
            raise ValueError(f"resume_from_checkpoint: {folder} was saved at per_device_train_batch_size "
                             f"{saved['per_device_train_batch_size']}, this run takes {batch}: with "
                             "train_sampling_strategy='group_by_length' the order of the examples depends on it "
                             "(transformers' LengthGroupedSampler sorts megabatches of per_device_train_batch_size x "
                             "gradient_accumulation_steps), so the resumed run would train on other examples; keep "
                             f"per_device_train_batch_size {saved['per_device_train_batch_size']} and "
                             f"{saved['data_parallel_size']} data-parallel group(s) (the world and "
                             "context_parallel_size may change with them), or set ignore_data_skip=True")
        return
    fix = (f"per_device_train_batch_size {was // dp} at this run's {dp} data-parallel group(s)" if was % dp == 0 else
           f"a world / context_parallel_size that divides {was}")
    raise ValueError(f"resume_from_checkpoint: {folder} was saved by {saved['world_size']} process(es) at "
                     f"context_parallel_size {saved['context_parallel_size']}: {saved['data_parallel_size']} "
                     f"data-parallel group(s) x per_device_train_batch_size {saved['per_device_train_batch_size']} = "
                     f"{was} sequences per micro-batch, gradient_accumulation_steps "
                     f"{saved['gradient_accumulation_steps']}; this run takes {dp} x {batch} = {dp * batch}, "
                     f"gradient_accumulation_steps {accumulation}. The Trainer finds its place in the data by "
                     f"skipping the micro-batches already trained, counted in its own size, so it would train on "
                     f"other examples; keep {was} sequences per micro-batch ({fix}) and gradient_accumulation_steps "
                     f"{saved['gradient_accumulation_steps']} (the world and context_parallel_size may change), set "
                     "ignore_data_skip=True to start the data again at the beginning of an epoch, or start a new run "
                     "from the checkpoint's model (from_pretrained)")
