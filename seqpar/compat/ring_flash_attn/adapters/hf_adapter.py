"""ring-flash-attention's HF adapter: a transformers model whose attention implementation is
``"flash_attention_2"`` runs seqpar over contiguous pieces of a packed stream (how axolotl uses it).

Usage, unchanged from the original (each rank feeds its contiguous piece of the packed
``input_ids`` / ``position_ids``, position ids restarting at every document)::

    substitute_hf_flash_attn(process_group, heads_k_stride=1)   # once
    for batch in loader:
        update_ring_flash_attn_params(cu_seqlens, process_group)  # global offsets, every batch
        model(input_ids=local_ids, position_ids=local_position_ids, use_cache=False)

:func:`substitute_hf_flash_attn` replaces ``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]`` with a
function that calls ``seqpar.attention(..., method="ring", cu_seqlens=<stream layout>)``
(:mod:`seqpar.layouts.stream`), so it works on CPU too and needs no flash-attn build. The model's
sliding window (``sliding_window``) is honoured; attention dropout, logit softcapping, attention
sinks and padding masks raise ``ValueError``.

It lives at the original's module path, ``ring_flash_attn.adapters.hf_adapter`` (axolotl calls
``ring_flash_attn.adapters.hf_adapter.substitute_hf_flash_attn(process_group=..., heads_k_stride=...)``
and reads ``DATA_PARAMS``); the three functions are also re-exported by the package.

This module holds the peer's global state, as the original does (the substituted group, the
current batch's layout, the on/off switch, and ``DATA_PARAMS``: this rank's
:func:`llama3_flash_attn_prepare_cu_seqlens` result for the current batch, under the original's
keys, for code that calls ``llama3_flash_attn_varlen_func`` with them): it is the only place in
seqpar that does.
"""

from __future__ import annotations

import torch

from seqpar.comm import group_info
from seqpar.layouts import check_cu_seqlens
from seqpar.softmax import attention

from .._core import checked, option_fields
from ..llama3 import cached_stream_layout, llama3_flash_attn_prepare_cu_seqlens

_NAME = "flash_attention_2"
# The peer's forced global state: set by the three public functions below, read by the attention.
_STATE: dict = {"group": None, "heads_k_stride": None, "layout": None, "enabled": True, "previous": None}
# The original's public dict of this rank's llama3 arguments for the current batch (keys: cu_seqlens_q,
# cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice), refreshed by update_ring_flash_attn_params.
DATA_PARAMS: dict = {}


def substitute_hf_flash_attn(process_group, heads_k_stride: int):
    """Make transformers' ``"flash_attention_2"`` attention run seqpar over ``process_group``.

    ``heads_k_stride``: the original all-gathers K,V this many heads at a time; seqpar fetches only
    the K,V rows each rank needs, so it is only checked (a positive int dividing every layer's K,V
    heads)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int) or heads_k_stride < 1:
        raise ValueError(f"heads_k_stride={heads_k_stride!r}: expected a positive int")
    group_info(process_group)  # a bad group fails here, not in the first forward
    current = ALL_ATTENTION_FUNCTIONS.get(_NAME)
    if current is not ring_flash_attention_forward:  # what use_ring_attn(False) goes back to
        _STATE["previous"] = current
    ALL_ATTENTION_FUNCTIONS[_NAME] = ring_flash_attention_forward
    _STATE.update(group=process_group, heads_k_stride=heads_k_stride)


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group):
    """The global offsets of the packed stream of the next forward (every rank passes the same).

    The stream of ``cu_seqlens[-1]`` tokens is cut into N contiguous pieces, rank r feeding tokens
    ``[r·T/N, (r+1)·T/N)``; ValueError when N does not divide it. Also refreshes
    :data:`DATA_PARAMS` with this rank's causal :func:`llama3_flash_attn_prepare_cu_seqlens` result,
    as the original does. Local: no communication."""
    info = group_info(process_group)
    layout = cached_stream_layout(check_cu_seqlens(cu_seqlens, None), info.size)
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice")
    DATA_PARAMS.update(zip(names, llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, info.rank, info.size)))
    _STATE["layout"] = layout


def use_ring_attn(flag: bool):
    """Switch the substituted attention on (True) or back to the one it replaced (False)."""
    if not isinstance(flag, bool):
        raise ValueError(f"flag: expected True or False, got {flag!r}")
    _STATE["enabled"] = flag


def _refuse(name: str, attention_mask, dropout, softcap, kwargs) -> None:
    if dropout:
        raise ValueError(f"dropout: {name} asks for attention dropout {dropout}, which seqpar does not implement; "
                         "set the config's attention_dropout to 0")
    if softcap is not None:
        raise ValueError(f"softcap: {name} applies attention-logit softcapping ({softcap}), which seqpar does not "
                         "implement; set config.attn_logit_softcapping = None")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"s_aux: {name} has attention sinks; use seqpar.integrations.hf.apply_context_parallel, "
                         "which supports them, instead of this drop-in")
    if attention_mask is not None and not bool((attention_mask != 0).all()):
        raise ValueError(f"attention_mask: {name} received a padding mask; pack the documents into one stream "
                         "with restarting position_ids and pass its cu_seqlens to update_ring_flash_attn_params")


def ring_flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                 sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """The function put in ``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]``: q ``(1, Hq, T_local, D)``,
    k, v ``(1, Hkv, T_local, D)`` (K,V heads not repeated) -> ``((1, T_local, Hq, D), None)``."""
    if not _STATE["enabled"]:
        if _STATE["previous"] is None:
            raise ValueError("use_ring_attn(False): there is no previous flash_attention_2 function to go back to")
        return _STATE["previous"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, **kwargs)
    name = type(module).__name__
    layout, group = _STATE["layout"], _STATE["group"]

    def local():
        _refuse(name, attention_mask, dropout, softcap, kwargs)
        if layout is None:
            raise ValueError("cu_seqlens: call update_ring_flash_attn_params(cu_seqlens, process_group) with the "
                             "batch's global offsets before the forward")
        if query.shape[0] != 1:
            raise ValueError(f"query has batch size {query.shape[0]}: ring attention takes one packed stream per "
                             "rank (batch size 1); pack the batch's documents into one sequence")
        if key.shape[1] % _STATE["heads_k_stride"]:
            raise ValueError(f"heads_k_stride={_STATE['heads_k_stride']} does not divide {name}'s {key.shape[1]} "
                             "K,V heads; pass a divisor to substitute_hf_flash_attn")

    checked(group, f"ring_flash_attn HF adapter ({name})",
            option_fields(query, dropout=dropout, softcap=softcap, sliding_window=sliding_window), local, like=query)
    causal = module.is_causal if is_causal is None else is_causal
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))  # [1, T_local, H, D]
    out = attention(q, k, v, group=group, method="ring", causal=bool(causal), softmax_scale=scaling,
                      cu_seqlens=layout, window=None if sliding_window is None else int(sliding_window))
    return out, None


__all__ = ["DATA_PARAMS", "ring_flash_attention_forward", "substitute_hf_flash_attn", "update_ring_flash_attn_params",
           "use_ring_attn"]
