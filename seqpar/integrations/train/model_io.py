"""Real models in and out of ``seqpar train``: a transformers folder read straight into FSDP2 shards,
and a sharded model written back as a transformers folder.

The flow for a model larger than one rank's memory::

    folder = load_folder(path)                       # config, tokenizer, weight files; validated
    model = build_meta_model(folder.config)          # no memory: parameters on the meta device
    model = parallelize(model, mesh, ...)            # FSDP2 fully_shard: DTensor parameters, still meta
    load_sharded_weights(model, folder)              # to_empty + each rank reads only its own rows
    ...train...
    export_hf(model, out_dir, config=folder.config, tokenizer=folder.tokenizer)

Global vs local shapes: a parameter of global shape ``[R, ...]`` sharded by FSDP2 over ``W`` ranks
is a DTensor with ``Shard(0)``; rank ``r`` holds rows ``[r*ceil(R/W), min((r+1)*ceil(R/W), R))``
(torch.chunk semantics; the last ranks may hold fewer or none). ``load_sharded_weights`` reads
exactly those rows from the safetensors files (``safe_open(...).get_slice``), so a rank reads
about ``1/W`` of the checkpoint; unsharded (plain tensor) parameters are read whole.

Weights are read from safetensors only. A pickled ``pytorch_model.bin`` can run arbitrary code when
loaded, so it is refused unless the caller passes ``trust_pickle=True`` (``seqpar train
--trust-pickle``); even then it is read with ``torch.load(weights_only=True)``, whole, on each rank.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelFolder:
    """A validated transformers model folder.

    ``config``: the ``PretrainedConfig``; ``tokenizer``: a transformers tokenizer or None when the
    folder has none; ``weights``: tensor name -> file (absolute path) that holds it; ``pickled``:
    True when the weights are a ``pytorch_model.bin`` (loaded only with ``trust_pickle=True``).
    """

    path: str
    config: Any
    tokenizer: Any
    weights: dict[str, str]
    pickled: bool = False


def load_folder(path: str | os.PathLike, *, trust_pickle: bool = False,
                argument: str = "--model") -> ModelFolder:
    """Read and validate a local transformers folder (no network, no remote code).

    Raises ValueError naming ``argument`` when: the folder is missing, ``config.json`` is missing or
    unreadable, there are no weights (``model.safetensors`` or ``model.safetensors.index.json`` with
    all its shard files), only a pickled ``pytorch_model.bin`` is present and ``trust_pickle`` is
    False (fix: convert to safetensors, or opt in with ``--trust-pickle``), the tokenizer cannot be
    loaded, or the tokenizer's vocabulary (``len(tokenizer)``) is larger than the embedding
    (``config.vocab_size``): token ids past the embedding would index out of range.
    """
    from transformers import AutoConfig

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{argument}: {str(path)!r} is not a folder; pass a local transformers model "
                         f"folder (config.json, model.safetensors, tokenizer files)")
    if not (root / "config.json").is_file():
        raise ValueError(f"{argument}: {root} has no config.json; pass the folder written by "
                         f"save_pretrained (or use --model-config for random weights)")
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises several types for a bad or foreign config
        raise ValueError(f"{argument}: cannot read {root / 'config.json'}: {exc}") from None
    weights, pickled = _weight_files(root, trust_pickle, argument)
    tokenizer = _load_tokenizer(root, argument)
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if tokenizer is not None and vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"{argument}: the tokenizer in {root} has {len(tokenizer)} tokens but the model's "
                         f"embedding has {vocab} rows (config.vocab_size); ids past {vocab - 1} cannot be "
                         f"embedded: resize the embedding (model.resize_token_embeddings) and save again, "
                         f"or use the model's own tokenizer")
    return ModelFolder(str(root.resolve()), config, tokenizer, weights, pickled)


def _weight_files(root: Path, trust_pickle: bool, argument: str) -> tuple[dict[str, str], bool]:
    """Tensor name -> file, from the safetensors index, the single file, or (opt-in) a pickle."""
    if (root / _INDEX).is_file():
        with open(root / _INDEX) as f:
            weight_map = json.load(f).get("weight_map", {})
        missing = sorted({v for v in weight_map.values() if not (root / v).is_file()})
        if not weight_map or missing:
            raise ValueError(f"{argument}: {root / _INDEX} names shard files that are not there "
                             f"({', '.join(missing[:3]) or 'an empty weight_map'}); copy the whole folder")
        return {k: str(root / v) for k, v in weight_map.items()}, False
    if (root / _SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(root / _SINGLE), framework="pt") as f:
            return {k: str(root / _SINGLE) for k in f.keys()}, False
    pickles = [p for p in _PICKLES if (root / p).is_file()]
    if not pickles:
        raise ValueError(f"{argument}: {root} has no weights (model.safetensors or {_INDEX}); pass a "
                         f"folder written by save_pretrained, or use --model-config for random weights")
    if not trust_pickle:
        raise ValueError(f"{argument}: {root} holds only a pickled checkpoint ({pickles[0]}), which can run "
                         f"arbitrary code when loaded; convert it to safetensors (load it once in "
                         f"transformers and save_pretrained) or pass --trust-pickle if you trust its source")
    if pickles[0].endswith(".json"):
        with open(root / pickles[0]) as f:
            return {k: str(root / v) for k, v in json.load(f)["weight_map"].items()}, True
    state = torch.load(str(root / pickles[0]), map_location="cpu", weights_only=True, mmap=True)
    return {k: str(root / pickles[0]) for k in state}, True


def _load_tokenizer(root: Path, argument: str):
    if not any((root / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # tokenizer classes raise many types for unreadable files
        raise ValueError(f"{argument}: cannot load the tokenizer in {root}: {exc}") from None


def build_meta_model(config, *, dtype: torch.dtype = torch.float32):
    """``AutoModelForCausalLM.from_config(config)`` with every parameter and buffer on the meta
    device (no memory, no initialisation cost). Parameters are ``dtype`` (fp32 master weights by
    default, whatever dtype the checkpoint was saved in). Tied embeddings stay tied (one
    ``Parameter`` object under both names). Fill it with :func:`load_sharded_weights`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


class _Reader:
    """Opens each weight file once (lazily) and reads tensors or row ranges of them."""

    def __init__(self, folder: ModelFolder):
        self.folder, self._open, self._pickles = folder, {}, {}

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape()) if not self.folder.pickled else list(self._pickle(name).shape)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if self.folder.pickled:
            return self._pickle(name)[index]
        return self._slice(name)[index]

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.folder.weights[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt", device="cpu")
        return self._open[file].get_slice(name)

    def _pickle(self, name: str) -> torch.Tensor:
        file = self.folder.weights[name]
        if file not in self._pickles:
            self._pickles = {file: torch.load(file, map_location="cpu", weights_only=True, mmap=True)}
        return self._pickles[file][name]


def _aliases(model) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct parameter and persistent buffer once, with every name it has (tied weights)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), ([], p))[0].append(name)
    persistent = set(model.state_dict(keep_vars=True).keys())
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            groups.setdefault(id(b), ([], b))[0].append(name)
    return list(groups.values())


def local_index(tensor: torch.Tensor) -> tuple[tuple[slice, ...], torch.Tensor]:
    """The slice of the global tensor this rank holds, and the local tensor to write into.

    For FSDP2's DTensors (``Shard`` and ``Replicate`` placements): each ``Shard(d)`` mesh dim cuts dim
    ``d`` the way ``torch.chunk`` does (pieces of ``ceil(n / size)``, the last ones shorter or empty),
    at this rank's index in that mesh dim's group. The index comes from the group
    (``dist.get_rank(group)``) rather than from the mesh's cached coordinate.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape), tensor
    mesh = tensor.device_mesh
    start, stop = [0] * tensor.dim(), list(tensor.shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"model: a parameter placed as {placement} (only Shard and Replicate, as FSDP2 places "
                             "them, can be filled from a checkpoint here)")
        d, size = placement.dim, mesh.size(mesh_dim)
        index = dist.get_rank(mesh.get_group(mesh_dim))
        piece = -(-(stop[d] - start[d]) // size)
        lo = min(start[d] + index * piece, stop[d])
        start[d], stop[d] = lo, min(lo + piece, stop[d])
    local = tensor.to_local()
    shape = tuple(b - a for a, b in zip(start, stop))
    if tuple(local.shape) != shape:
        raise RuntimeError(f"local shard shape {tuple(local.shape)} != expected {shape}")
    return tuple(slice(a, b) for a, b in zip(start, stop)), local


def materialize(model, device=None, argument: str = "--model") -> None:
    """Give a meta model (plain or FSDP2-sharded) real, uninitialised storage: ``to_empty`` on
    ``device`` (default: the DTensor mesh's device type, else CPU), plain tied weights tied again,
    and non-persistent buffers (RoPE ``inv_freq``) recomputed with the model's own initialiser; a
    float buffer that stays unset raises ValueError naming ``argument`` instead of holding garbage.
    Parameters and persistent buffers are left to the caller (:func:`load_sharded_weights`, or a
    random initialisation)."""
    if device is None:
        device = next((t.device_mesh.device_type for t in model.parameters() if hasattr(t, "device_mesh")),
                      "cpu")
    tied = [names for names, t in _aliases(model) if len(names) > 1 and isinstance(t, torch.nn.Parameter)]
    model.to_empty(device=device)
    for names in tied:  # to_empty gives each name of a plain tied weight its own tensor: tie again
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            if model.get_parameter(name) is not first:
                setattr(model.get_submodule(owner), attr, first)
    persistent = set(model.state_dict(keep_vars=True).keys())
    owners = {}
    for name, buf in model.named_buffers(remove_duplicate=False):
        if name not in persistent:
            mod_name = name.rsplit(".", 1)[0] if "." in name else ""
            owners[mod_name] = model.get_submodule(mod_name)
            if buf.is_floating_point():
                buf.fill_(float("nan"))
    with torch.no_grad():
        for mod in owners.values():
            model._init_weights(mod)
    for mod in model.modules():  # a forward on meta (the dispatch check) cached longrope's long factors there:
        for name, value in list(vars(mod).items()):  # None makes transformers compute them again on first use
            if name.endswith("long_inv_freq") and isinstance(value, torch.Tensor) and value.is_meta:
                setattr(mod, name, None)
    for name, buf in model.named_buffers():
        if name not in persistent and buf.is_floating_point() and torch.isnan(buf).any():
            raise ValueError(f"{argument}: cannot recompute buffer {name!r} of {type(model).__name__} after "
                             f"meta-device construction; this model type cannot be loaded this way")


@torch.no_grad()
def load_sharded_weights(model, folder: ModelFolder | str | os.PathLike, *, device=None,
                         argument: str = "--model") -> list[str]:
    """Fill ``model``'s parameters and persistent buffers from ``folder``'s checkpoint, in place.

    ``model``: built by :func:`build_meta_model` (meta device), optionally after FSDP2
    ``fully_shard`` (DTensor parameters), or already materialised. A meta model is first moved with
    ``to_empty`` to ``device`` (default: the DTensor mesh's device type, else CPU) and its
    non-persistent buffers (RoPE ``inv_freq``) are recomputed, not loaded. Each rank reads only the
    rows of each tensor it holds (see module doc) and casts them to the parameter's dtype.
    Tied weights (one Parameter under several names, e.g. ``lm_head.weight`` and
    ``model.embed_tokens.weight``) are read once from whichever name the file has. No
    communication: every rank must see the same folder. Returns the file's tensor names that the
    model did not use (old ``rotary_emb.inv_freq`` entries, for example).

    Raises ValueError naming ``argument`` when a tensor is missing from the files or has another
    global shape than the model's (the config does not match the weights).
    """
    if not isinstance(folder, ModelFolder):
        folder = load_folder(folder, argument=argument)
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        materialize(model, device, argument)
    reader, used = _Reader(folder), set()
    for names, tensor in _aliases(model):
        found = next((n for n in names if n in folder.weights), None)
        if found is None:
            raise ValueError(f"{argument}: the weights in {folder.path} have no tensor {names[0]!r} "
                             f"that {type(model).__name__} needs; the folder's config and weights do not "
                             f"match (checkpoints in an older layout: load and save_pretrained them once)")
        shape = reader.shape(found)
        if shape != list(tensor.shape):
            raise ValueError(f"{argument}: {found} has shape {shape} in {folder.path} but the model built "
                             f"from its config.json expects {list(tensor.shape)}")
        index, local = local_index(tensor)
        if local.numel():
            local.copy_(reader.read(found, index))
        used.add(found)
    return sorted(set(folder.weights) - used)


def _check_export_dir(out_dir: Path, argument: str) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{argument}: {out_dir} exists and is not an empty folder; choose a new path "
                         f"(the export never overwrites)")
    if not out_dir.parent.is_dir():
        raise ValueError(f"{argument}: the parent folder {out_dir.parent} does not exist; create it first")


def _export_plan(model, dtype, max_shard_size):
    """Names to save (tied weights once, under their first name), and the file split."""
    from huggingface_hub import split_torch_state_dict_into_shards

    entries = {}
    for names, tensor in _aliases(model):
        entries[names[0]] = (tensor, dtype or tensor.dtype)
    meta = {n: torch.empty(t.shape, dtype=d, device="meta") for n, (t, d) in entries.items()}
    return entries, split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)


def export_hf(model, out_dir: str | os.PathLike, *, config, tokenizer=None, dtype: torch.dtype | None = None,
              max_shard_size: int | str = "5GB", argument: str = "--export-hf") -> None:
    """Write ``model`` (FSDP2-sharded or plain) as a transformers folder at ``out_dir``: safetensors
    (one file, or shards of at most ``max_shard_size`` with ``model.safetensors.index.json``),
    ``config.json`` (``config``, with ``dtype`` updated) and the tokenizer when given.

    Collective: every rank of the model's mesh must call it, in the same order as its other
    collectives. Tensors are gathered one file at a time (``DTensor.full_tensor()``), so rank 0 holds
    at most one file's worth of tensors. Rank 0 writes into a temporary folder beside ``out_dir`` and
    renames it into place, so ``out_dir`` is either absent or complete. Names and shapes are the
    original model's; tied weights are saved once (``lm_head.weight`` left out, as transformers does).
    ``dtype``: the saved dtype (default: each parameter's own, fp32 master weights stay fp32).

    Raises ValueError naming ``argument`` on every rank, before any communication, when ``out_dir``
    exists and is not an empty folder or its parent folder is missing. A failure while writing on
    rank 0 is raised on every rank (as RuntimeError there) and leaves no partial folder.
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    _check_export_dir(out_dir, argument)
    distributed = dist.is_available() and dist.is_initialized()
    writer = not distributed or dist.get_rank() == 0
    entries, plan = _export_plan(model, dtype, max_shard_size)
    tmp, error = None, None
    if writer:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=str(out_dir.parent)))
    for filename, names in plan.filename_to_tensors.items():
        tensors = {}
        for name in names:
            tensor, save_dtype = entries[name]
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if writer:
                tensors[name] = full.detach().to(device="cpu", dtype=save_dtype).contiguous()
        if writer and error is None:
            try:
                save_file(tensors, str(tmp / filename), metadata={"format": "pt"})
            except Exception as exc:  # disk full, permissions: reported on every rank below
                error = f"{type(exc).__name__}: {exc}"
    if writer and error is None:
        error = _finish_export(tmp, out_dir, plan, config, tokenizer, dtype, model)
    if writer and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"{argument}: writing {out_dir} failed: {error}")


def _finish_export(tmp: Path, out_dir: Path, plan, config, tokenizer, dtype, model) -> str | None:
    """Index, config, tokenizer, generation config, then the atomic rename. An error string or None."""
    import copy

    try:
        if plan.is_sharded:
            index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
            (tmp / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config = copy.deepcopy(config)
        config.dtype = dtype or next(iter(model.parameters())).dtype
        config.save_pretrained(str(tmp))
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, out_dir)  # atomic; replaces an empty folder on POSIX
        return None
    except Exception as exc:  # reported on every rank by the caller
        return f"{type(exc).__name__}: {exc}"
