"""Checkpoints of ``seqpar train``: torch.distributed.checkpoint (DCP), atomic, resumable at any
context-parallel degree.

Layout: ``SAVE_DIR/step_00000003/`` holds the DCP files of the model and optimizer state,
``meta.json`` (step, model config, parameter shapes, data and run settings, loss history) and,
written last, an empty ``COMPLETE`` marker. A checkpoint is first written to
``SAVE_DIR/.tmp-step_00000003/`` and renamed when complete, so a crash leaves no directory that
looks finished; :func:`latest_checkpoint` and :func:`load_checkpoint` ignore or refuse anything
without the marker.

Parameters and optimizer state are FSDP2 shards (DTensors, dim 0 over all ranks); DCP stores each
tensor's shards with their global offsets (``get_state_dict`` / ``set_state_dict`` of
``torch.distributed.checkpoint.state_dict``), so a run at any world size and CP degree, sharded or
in one process, loads it and reshards it to its own layout. An fp16 run's loss scaler (its scale and
growth tracker, the same on every rank) is saved beside them as two replicated tensors (``scaler.*``)
and restored on resume; a checkpoint without them (bf16 / fp32 runs) leaves a new scaler at its
initial scale, and a run without a scaler ignores them.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ...comm.collectives import peer_errors
from ..files import replace_dir

COMPLETE = "COMPLETE"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# config entries set by --rope-theta, --rope-scaling and --max-position-embeddings
_ROPE_KEYS = {"rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
              "original_max_position_embeddings"}
# config entries that do not change the architecture or the math
_CONFIG_IGNORE = {"_attn_implementation", "_attn_implementation_internal", "attn_implementation", "architectures",
                  "transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions",
                  "output_hidden_states", "return_dict", "_name_or_path", "name_or_path", "_commit_hash"}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        with peer_errors(name="checkpoint barrier"):
            dist.barrier()


def _rank0() -> bool:
    return not _distributed() or dist.get_rank() == 0


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE).is_file() and (Path(path) / META).is_file()


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def resolve_resume(resume: str | None, save: str | None) -> Path | None:
    """Which checkpoint ``--resume`` means.

    ``""`` (the flag alone): the latest complete checkpoint under ``--save``, None if there is none
    yet (a fresh start, so the same command can be rerun after a crash). A path: that checkpoint,
    or the latest complete one inside it; ValueError if there is none.
    """
    if resume is None:
        return None
    if resume == "":
        if not save:
            raise ValueError("--resume: without a path it resumes from the latest checkpoint under --save; pass --save")
        return latest_checkpoint(save)
    path = Path(resume)
    if _STEP_DIR.match(path.name) and path.is_dir():
        if not is_complete(path):
            raise ValueError(f"--resume: {path} is not a complete checkpoint (no {COMPLETE} marker: the run that "
                             f"wrote it stopped while saving); resume from an earlier one")
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ValueError(f"--resume: no complete checkpoint (step_*/ with a {COMPLETE} marker) in {path}")
    return found


def config_entries(config) -> dict:
    """A model config's architecture entries as meta.json holds them (:func:`model_fingerprint`)."""
    entries = {k: v for k, v in sorted(config.to_dict().items()) if k not in _CONFIG_IGNORE}
    # a non-finite config value as its JSON name ("Infinity"), so meta.json stays strict JSON
    return json.loads(json.dumps(entries, default=str), parse_constant=str)


def model_fingerprint(model) -> dict:
    """What must match for a checkpoint to load: the config (architecture entries) and the shapes."""
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    return {"config": config_entries(model.config), "shapes": shapes}


def _config_diffs(old: dict, new: dict, keys=None) -> list[str]:
    """The entries (of ``keys``, default all) where two :func:`config_entries` differ, as messages."""
    return [f"{key}: checkpoint {old.get(key)!r}, this run {new.get(key)!r}"
            for key in sorted(set(old) | set(new)) if (keys is None or key in keys) and old.get(key) != new.get(key)]


def check_same_model(meta: dict, current: dict, path: Path) -> None:
    """ValueError listing the differences when the checkpoint was saved from another model."""
    saved = meta.get("model", {})
    diffs = _config_diffs(saved.get("config", {}), current["config"])
    old_shapes, new_shapes = saved.get("shapes", {}), current["shapes"]
    if not diffs and old_shapes != new_shapes:
        names = sorted(set(old_shapes) ^ set(new_shapes)) or [n for n in new_shapes if old_shapes[n] != new_shapes[n]]
        diffs.append(f"parameters differ: {', '.join(names[:5])}")
    rope = [d for d in diffs if d.split(":")[0] in _ROPE_KEYS]
    if rope and len(rope) == len(diffs):  # only the RoPE differs: name the flags that set it
        raise rope_mismatch(path, rope)
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise ValueError(f"--resume: {path} was saved from a different model ({shown}); resume with the same "
                         f"--model-config, or start a new run with another --save folder")


def check_rope(cfg, config) -> None:
    """Before any rank starts or reads the model: ValueError naming the RoPE flags when ``--resume``'s
    checkpoint was saved from a model config whose RoPE entries differ from ``config``'s (the run's,
    flags applied): :func:`check_same_model`'s comparison, on those entries, before the build. The
    ranks compare the rest after it."""
    path = resolve_resume(cfg.resume, cfg.save)
    if path is None or not (path / META).is_file():
        return
    saved = json.loads((path / META).read_text()).get("model", {}).get("config")
    diffs = _config_diffs(saved, config_entries(config), _ROPE_KEYS) if saved is not None else []
    if diffs:
        raise rope_mismatch(path, diffs)


def rope_mismatch(path: Path, diffs: list[str]) -> ValueError:
    """The refusal of a resume whose model differs in the RoPE flags' entries only (``diffs``)."""
    return ValueError(f"--resume: {path} was trained with another RoPE ({'; '.join(diffs)}); resume with the "
                      "--rope-theta / --rope-scaling / --max-position-embeddings values it was saved with (the "
                      "checkpoint's, above), or start a new run with another --save folder")


def _state(model, optimizer, scaler=None):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh and optimizer.state:
        # get_state_dict creates an empty optimizer's state with one zero-gradient step at lr 0
        # (moments 0, step count 1). An fp16 run whose steps so far were all skipped has no state
        # when it saves; left at 1, its next real step would use AdamW's second-step bias
        # correction. Back to 0, the state behaves as none: the next step is AdamW's first.
        for per_param in optimizer.state.values():
            if torch.is_tensor(per_param.get("step")):
                per_param["step"].zero_()
            elif "step" in per_param:
                per_param["step"] = 0
        model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if scaler is not None:  # float64 holds the fp32 scale exactly
        state["scaler"] = {"scale": torch.tensor(scaler.get_scale(), dtype=torch.float64),
                           "growth_tracker": torch.tensor(scaler.state_dict()["_growth_tracker"], dtype=torch.int64)}
    return state


def has_scaler(path: Path) -> bool:
    """Whether the checkpoint at ``path`` holds a loss scaler's state (saved by an fp16 run)."""
    import torch.distributed.checkpoint as dcp

    return "scaler.scale" in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def save_checkpoint(root: str | Path, step: int, model, optimizer, meta: dict, scaler=None) -> Path:
    """Collective over the default group (every rank calls it). Returns the final directory.
    ``scaler``: fp16's ``GradScaler`` / ``ShardedGradScaler``, whose state is saved too (after its
    ``update``)."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    text = meta_text(meta)  # on every rank, before any collective: a value JSON cannot hold fails here
    final, tmp = step_dir(root, step), root / f".tmp-step_{step:08d}"
    if _rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():  # single process: DCP warns that it assumes so, which is the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.save(_state(model, optimizer, scaler), checkpoint_id=str(tmp), no_dist=not _distributed())
    _barrier()
    if _rank0():
        with open(tmp / META, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / COMPLETE, "w") as f:  # last: its presence means everything above is on disk
            f.write(f"step {step}\n")
            f.flush()
            os.fsync(f.fileno())
        replace_dir(tmp, final)  # (the same step saved again, e.g. a rerun: replaced)
    _barrier()
    return final


def meta_text(meta: dict) -> str:
    """``meta`` as strict JSON. The step and evaluation records' non-finite losses and norms are written
    as their text ("nan", "inf", "-inf"), not null as in the ``--json`` log: a record's None (an fp16
    step skipped before its norm was taken) must read back as None, and a NaN loss as NaN. A start
    record's non-finite config value is its text (:func:`.log.strict_record`); any other raises."""
    from .log import NULLABLE, strict_record

    def record(r: dict) -> dict:
        return strict_record({k: str(v) if k in NULLABLE and isinstance(v, float) and not math.isfinite(v) else v
                              for k, v in r.items()})

    records = {key: [record(r) for r in meta[key]] for key in ("history", "evals") if key in meta}
    return json.dumps({**meta, **records}, indent=1, allow_nan=False)


def read_meta(path: str | Path) -> dict:
    """A checkpoint's meta; the records' non-finite losses and norms ("nan", "inf") read back as floats."""
    from .log import NULLABLE

    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"--resume: {path} is not a complete checkpoint (no {COMPLETE} marker)")
    with open(path / META) as f:
        meta = json.load(f)
    text = ("nan", "inf", "-inf")
    for key in ("history", "evals"):
        if key in meta:
            meta[key] = [{k: float(v) if k in NULLABLE and v in text else v for k, v in r.items()} for r in meta[key]]
    return meta


def load_checkpoint(path: str | Path, model, optimizer, fingerprint: dict, scaler=None) -> dict:
    """Check the model matches, then load model and optimizer state in place; returns the meta.
    ``scaler``: restored to the saved scale and growth tracker when the checkpoint holds them (its
    growth factor, backoff and interval stay this run's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    meta = read_meta(path)
    check_same_model(meta, fingerprint, path)
    state = _state(model, optimizer, scaler if scaler is not None and has_scaler(path) else None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if "scaler" in state:
        scaler.load_state_dict({**scaler.state_dict(), "scale": float(state["scaler"]["scale"]),
                                "_growth_tracker": int(state["scaler"]["growth_tracker"])})
    return meta

