"""Rotary embeddings whose frequencies depend on the sequence length, under context parallelism.

transformers' ``"dynamic"`` RoPE (NTK scaling grown with the sequence) and ``"longrope"`` (Phi-3's
short and long factors) choose their frequencies in each forward from ``max(position_ids) + 1``
(``transformers.modeling_rope_utils.dynamic_rope_update``). A rank of a context-parallel group
holds only its shard of the positions, so each rank would pick its own frequencies: the keys of one
sequence rotated differently on different ranks, and logits 25-70% off with no error. :func:`install`
makes the choice global: before the decoder model's forward, a hook works out the largest position
of the whole input and runs transformers' own update with it; the rotary module's forward then
computes cos / sin of the local positions without updating again. The result is what one process
computes on the whole input; for packed documents (``cu_seqlens``) that is transformers' packed forward
(position ids restarting per document), whose frequencies come from the longest document of the input,
not from each document's own length.

The largest position: on a :class:`~.cache.ShardedCache` (``generate()``) every rank holds the whole
input, so it is read off it (``position_ids``, else ``past + new - 1`` as transformers numbers them);
otherwise the input is this rank's shard from :func:`~.inputs.shard_inputs` (padding rows at position
0) and one all-reduce (max, one int64) over the context-parallel group gives it. Models whose RoPE
does not depend on the length (default, linear, llama3, yarn, ...) get nothing.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from ...comm import group_info
from ...comm.usp_groups import USPGroups
from .cache import ShardedCache

__all__ = ["install", "length_dependent_layers", "length_dependent_types"]

_HANDLES = "_seqpar_rope_hooks"


def _depends_on_length(rope_type: str) -> bool:
    # the two branches of transformers' dynamic_rope_update
    return "dynamic" in rope_type or rope_type == "longrope"


def length_dependent_layers(rotary) -> list[str | None]:
    """The layer types (None: the module has one RoPE) whose RoPE ``rotary`` updates from the length."""
    kinds = getattr(rotary, "rope_type", None)
    if isinstance(kinds, str):
        return [None] if _depends_on_length(kinds) else []
    if isinstance(kinds, dict):
        return [name for name, kind in kinds.items() if isinstance(kind, str) and _depends_on_length(kind)]
    return []


def length_dependent_types(config) -> list[str]:
    """The RoPE types of a transformers ``config`` (every layer type's) that depend on the sequence length."""
    params = getattr(config, "rope_parameters", None) or {}
    per_type = [p for p in params.values() if isinstance(p, dict)] or [params]
    return sorted({p["rope_type"] for p in per_type
                   if isinstance(p.get("rope_type"), str) and _depends_on_length(p["rope_type"])})


def install(model, base: torch.nn.Module, group) -> None:
    """On ``base`` (the decoder model that calls its rotary modules): take every length-dependent
    rotary child's update out of its forward and run it from the whole input's largest position,
    before everything else of the forward (replacing the hooks of an earlier conversion)."""
    for handle in getattr(model, _HANDLES, ()):
        handle.remove()
    handles = []
    rotaries = [(name, m) for name, m in base.named_children() if length_dependent_layers(m)]
    for name, rotary in rotaries:
        decorated = type(rotary).forward
        undecorated = getattr(decorated, "__wrapped__", None)
        if undecorated is None:
            raise ValueError(f"model: {type(model).__name__}.{name} uses a RoPE that depends on the sequence length "
                             f"({rotary.rope_type}) without transformers' dynamic_rope_update around its forward, so "
                             "its frequencies cannot be made the same on every rank; use a RoPE type that does not "
                             "depend on the length (e.g. 'yarn' or 'default')")
        rotary.forward = types.MethodType(undecorated, rotary)  # this instance only: no update inside
        hook = _update_hook(rotary, decorated, length_dependent_layers(rotary), group)
        handles.append(base.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
    object.__setattr__(model, _HANDLES, handles)


def _update_hook(rotary, decorated, layer_types, group):
    def hook(module, args, kwargs):
        x = kwargs.get("inputs_embeds")
        ids = kwargs.get("input_ids", args[0] if args else None)
        device = (ids if ids is not None else x).device
        top = _largest_position(kwargs, ids if ids is not None else x, group)
        probe = torch.full((1, 1), top, dtype=torch.int64, device=device)
        dtype = x.dtype if x is not None else torch.get_default_dtype()
        one = torch.zeros((1, 1, 1), dtype=dtype, device=device)
        with torch.no_grad():
            for layer_type in layer_types:  # transformers' own update, run with the global length
                decorated(rotary, one, probe, **({} if layer_type is None else {"layer_type": layer_type}))
        return None

    return hook


def _largest_position(kwargs: dict, x: torch.Tensor, group) -> int:
    cache = kwargs.get("cache")
    cache = kwargs.get("past_key_values") if cache is None else cache
    positions = kwargs.get("position_ids")
    if isinstance(cache, ShardedCache):  # generate(): every rank holds the whole input
        if positions is not None and positions.numel():
            return int(positions.max())
        return cache.get_seq_length() + x.shape[1] - 1
    local = torch.tensor([int(positions.max()) if positions is not None and positions.numel() else
                          x.shape[1] - 1], dtype=torch.int64, device=x.device)
    infos = [group.ulysses, group.ring] if isinstance(group, USPGroups) else [group_info(group)]
    for info in infos:
        if not info.single:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=info.group)
    return int(local)
