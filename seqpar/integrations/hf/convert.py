"""Hugging Face transformers: turn a decoder model into a context-parallel one with one call
(:func:`apply_context_parallel`; the inputs and the loss are in :mod:`.inputs`).

Each rank holds the whole model and a shard of the sequence; attention is the only layer that
needs the other ranks' tokens, so it is the only layer that changes. The change goes through
transformers' public ``AttentionInterface`` (no patched private functions, no guessed signatures):

    model = apply_context_parallel(model, group=cp_group, method="zigzag_ring")
    batch = shard_inputs(input_ids, group=cp_group, method="zigzag_ring")        # this rank's shard
    logits = model(**batch.model_kwargs()).logits                                 # [B, T_local, V]
    loss = context_parallel_loss(logits, batch.labels, group=cp_group)            # global mean
    loss.backward()                   # then all_reduce(SUM) the parameter gradients over cp_group

Shapes: ``T_global`` tokens are split over the N ranks of the group, ``T_local = T_global / N``
(plus the library's padding for packed documents). Everything token-indexed (input ids, labels,
position ids) must be sharded with :func:`shard_inputs`, so rotary embeddings see global positions
and no label is lost at a shard edge (labels are shifted before sharding).

Per-layer attention options come from each layer's own call: ``sliding_window`` (Mistral, Qwen2
with ``use_sliding_window``, Gemma-2/3 and gpt-oss, whose local layers alternate with global ones)
becomes ``seqpar.attention(window=...)`` (transformers' window of W keys including the query's own,
flash-attn's ``window_size=(W-1, 0)``), and ``s_aux`` (gpt-oss's per-head sink logits) becomes
``sinks=`` (cast to float32; its gradient flows back to the parameter). Attention-logit softcapping
(Gemma-2's ``attn_logit_softcapping``) changes every score inside the kernel and is refused.
"""

from __future__ import annotations

import hashlib
import inspect

import torch

from ...comm import group_info
from ...methods import method as declared
from ...softmax import attention
from . import cache_hooks, rope

__all__ = ["apply_context_parallel"]

# seqpar.attention keywords this integration sets itself; the others may be passed as options.
_BOUND = {"group", "method", "causal", "softmax_scale", "cu_seqlens", "window", "sinks"}  # window, sinks: per layer
_PROBE_NAME = "seqpar_probe"
_UNVERIFIED_NAME = "seqpar_unverified"


def _attention_options() -> tuple[str, ...]:
    params = inspect.signature(attention).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in _BOUND)


def _interface():
    try:
        from transformers import AttentionInterface
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("seqpar.integrations.hf needs transformers with AttentionInterface: "
                          "pip install 'seqpar[hf]' (transformers>=5)") from exc
    return AttentionInterface


# ----------------------------------------------------------------------------- attention function


def _make_attention(group, method: str, options: dict):
    """The function registered with AttentionInterface, bound to one model's group and options."""

    def seqpar_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         is_causal=None, **kwargs):
        """transformers calls this with q ``(B, Hq, T_local, D)``, k ``(B, Hkv, T_local, D)``, v
        ``(B, Hkv, T_local, D_v)`` (KV heads not repeated, and not repeated here either; ``D_v != D``
        in MLA models such as DeepSeek-V3); returns ``((B, T_local, Hq, D_v), None)``.
        """
        name = type(module).__name__
        if attention_mask is not None:
            raise ValueError(
                f"attention_mask: {name} received a mask, but context-parallel attention takes none; "
                "pass packed documents with cu_seqlens (see shard_inputs) instead of padding masks")
        if dropout:
            raise ValueError(f"dropout: {name} asks for attention dropout {dropout}, which seqpar does not "
                             "implement; set the config's attention_dropout to 0")
        refused = _refused(name, kwargs)
        if refused:
            raise ValueError(refused)
        cache = kwargs.get("seqpar_cache")  # a ShardedCache: generate() (set by the hooks of cache_hooks.py)
        if cache is not None:
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            out = cache.attend(module.layer_idx, q, k.to(q.dtype), v.to(q.dtype), scale=scaling, name=name,
                               causal=bool(module.is_causal if is_causal is None else is_causal), **_layer_options(kwargs))
            return out, None
        if query.shape[2] != key.shape[2]:
            raise ValueError(f"{name}: {query.shape[2]} queries against {key.shape[2]} keys: a KV cache is "
                             "not supported under context parallelism; call the model with use_cache=False")
        causal = module.is_causal if is_causal is None else is_causal
        cu_seqlens = kwargs.get("cu_seqlens")
        if cu_seqlens is None and kwargs.get("cu_seq_lens_q") is not None:
            raise ValueError("cu_seq_lens_q: transformers' local flash-attention boundaries are not used under "
                             "context parallelism; pass the global boundaries as cu_seqlens (see shard_inputs)")
        dtype = query.dtype
        if torch.is_autocast_enabled(query.device.type):
            dtype = torch.get_autocast_dtype(query.device.type)
        # [B, H, T, D] -> seqpar's [B, T, H, D]; rotary embeddings may have promoted q, k but not v
        q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))
        out = attention(q, k, v, group=group, method=method, causal=bool(causal), softmax_scale=scaling,
                        cu_seqlens=cu_seqlens, **_layer_options(kwargs), **options)
        return out, None

    return seqpar_attention


def _layer_options(kwargs: dict) -> dict:
    """``seqpar.attention`` options of one layer's call: its window and its sinks (float32 ``[Hq]``)."""
    extra = {}
    if kwargs.get("sliding_window") is not None:
        extra["window"] = int(kwargs["sliding_window"])
    if kwargs.get("s_aux") is not None:
        extra["sinks"] = kwargs["s_aux"].float()
    return extra


def _refused(name: str, kwargs: dict) -> str | None:
    """Why one layer's attention call cannot run context-parallel (None when it can)."""
    softcap = kwargs.get("softcap")
    if softcap is not None:
        return (f"softcap: {name} applies attention-logit softcapping ({softcap}, the config's "
                "attn_logit_softcapping), which seqpar's attention kernels do not implement (it changes every "
                "score before the softmax); set config.attn_logit_softcapping = None to train this model "
                "context-parallel (Gemma-3 has none), or keep its attention local")
    return None


def _unsupported(model, attention_modules) -> str | None:
    """Why a model's attention cannot run context-parallel, from its config and modules (None when it
    can): features that read the sequence's global layout where seqpar's attention sees a shard."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    chunked = [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind == "chunked_attention"]
    if chunked:
        return (f"model: layers {chunked} of {type(model).__name__} use chunked attention (attention_chunk_size="
                f"{getattr(config, 'attention_chunk_size', None)}: a token sees only its own chunk), which seqpar's "
                "attention does not implement; build the config with attention_chunk_size=None (every layer full "
                "causal attention), or keep the model's attention local")
    for name, module in attention_modules:
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            return (f"model: {name} scales its queries by their position (attn_temperature_tuning on a layer "
                    "without RoPE), computed from the positions of the tokens it holds, which under context "
                    "parallelism are a shard's, not the sequence's; build the config with "
                    "attn_temperature_tuning=False, or keep the model's attention local")
    return None


def _probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     is_causal=None, **kwargs):
    """Records which modules dispatch through the interface (and receive forward kwargs), with the
    per-layer kwargs :func:`_refused` looks at."""
    seen = kwargs.get("seqpar_probe")
    if seen is not None:
        seen[id(module)] = {key: kwargs.get(key) for key in ("softcap", "sliding_window")}
    # the right shape (v's head dim: MLA models' differs from q's); the values do not matter here
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


# ----------------------------------------------------------------------------- model conversion


def _decoder_layers(model):
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            return name, mod
    raise ValueError(f"model: found no decoder layers (an nn.ModuleList named 'layers') in "
                     f"{type(model).__name__}; apply_context_parallel supports decoder models such as Llama and Qwen2")


def _attention_of(layer_name: str, layer) -> tuple[str, torch.nn.Module]:
    for attr in ("self_attn", "attn", "attention", "self_attention"):
        mod = getattr(layer, attr, None)
        if isinstance(mod, torch.nn.Module):
            return f"{layer_name}.{attr}", mod
    for child_name, mod in layer.named_children():
        if "attention" in type(mod).__name__.lower():
            return f"{layer_name}.{child_name}", mod
    raise ValueError(f"model: decoder layer {layer_name} ({type(layer).__name__}) has no attention submodule "
                     "(looked for self_attn, attn, attention and *Attention* children)")


def _set_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers: the config attribute is what the attention layers read
        model.config._attn_implementation = name
    if getattr(model.config, "_attn_implementation", None) != name:
        raise ValueError(
            f"model: {type(model).__name__} does not let transformers set its attention implementation "
            f"(it stays {model.config._attn_implementation!r}): its attention does not go through "
            "transformers' AttentionInterface, so it cannot run context-parallel attention")


def _check_dispatch(model, attention_modules, defer_on_meta: bool = False) -> bool:
    """Run a 2-token forward with a recording implementation: every decoder layer's attention must
    call the interface and receive the forward's kwargs (that is how cu_seqlens reaches it).
    Returns False (checked nothing) when ``defer_on_meta`` and the forward cannot run on the meta device."""
    _interface().register(_PROBE_NAME, _probe_attention)
    _set_implementation(model, _PROBE_NAME)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    seen: dict[int, dict] = {}
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False, seqpar_probe=seen)
    except Exception as exc:
        if device.type == "meta" and defer_on_meta:
            return False  # an op without a meta kernel (gpt-oss' grouped-matmul experts): check once filled
        raise ValueError(f"model: a 2-token test forward of {type(model).__name__} failed ({type(exc).__name__}: "
                         f"{exc}); apply_context_parallel needs a decoder model that takes input_ids") from exc
    missing = [f"{path} ({type(mod).__name__})" for path, mod in attention_modules if id(mod) not in seen]
    if missing:
        raise ValueError(
            f"model: the attention of {', '.join(missing)} does not go through transformers' AttentionInterface "
            "(or does not pass the forward's kwargs on to it), so it would silently attend only to this rank's "
            "tokens; use a transformers attention class there, or call seqpar.attention in that module")
    refused = [_refused(f"{path} ({type(mod).__name__})", seen[id(mod)]) for path, mod in attention_modules]
    refused = [why for why in refused if why]
    if refused:
        raise ValueError(f"{refused[0]} ({len(refused)} of {len(attention_modules)} attention layers alike)")
    return True


def _unverified_attention(module, *args, **kwargs):
    raise ValueError(
        f"model: {type(module).__name__}'s context-parallel attention is not verified yet: the model was converted "
        "on the meta device, where its 2-token test forward cannot run; after filling its weights call "
        "seqpar.integrations.hf.verify_context_parallel(model) on every rank (seqpar train does)")


def verify_context_parallel(model) -> None:
    """Finish :func:`apply_context_parallel` on a model converted on the meta device whose test forward
    could not run there (an op without a meta kernel, such as gpt-oss' grouped-matmul experts): run the
    2-token dispatch check now that the weights are filled (sharded or not), then select seqpar's
    attention. Until then the model's attention raises instead of attending locally. Collective under
    FSDP2 (every rank calls it at the same point); a no-op for a model already checked."""
    pending = getattr(model, "seqpar_unverified", None)
    if pending is None:
        return
    name, attention_modules = pending
    try:
        _check_dispatch(model, attention_modules)
    except Exception:
        _set_implementation(model, _UNVERIFIED_NAME)
        raise
    _set_implementation(model, name)
    del model.seqpar_unverified


def apply_context_parallel(model, *, group=None, method: str = "zigzag_ring", **options):
    """Make every attention layer of a transformers decoder model run :func:`seqpar.attention`.

    Args:
        model: a transformers ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``, ``Qwen2ForCausalLM``),
            identical on every rank of ``group``.
        group: ProcessGroup or 1-D DeviceMesh of the context-parallel ranks (None = the default group;
            a single device when torch.distributed is not initialised). ``method="usp"`` also takes a
            2-D mesh, a (ulysses, ring) pair or ``make_usp_groups(...)``; a plain group's subgroups are
            built here, once (collective over the job; the group must then be the whole world).
        method: a softmax method of ``seqpar.METHODS``; shard the inputs with the same method.
        **options: passed on to every ``seqpar.attention`` call (``backend``, ``stats``,
            ``grad_comm_dtype``).
    Returns:
        ``model`` itself. Its attention is registered with transformers' ``AttentionInterface``
        under a name derived from ``group``, ``method`` and ``options`` (the same call registers the
        same name again, so repeated calls add nothing), bound to them (a closure: nothing global of
        seqpar holds the group), and selected with ``model.set_attn_implementation``.

    The model then expects this rank's shard from :func:`shard_inputs`: q ``[B, T_local, Hq, D]``,
    K,V with Hkv heads (GQA stays unexpanded), causal masking in global token order
    (``module.is_causal``), ``softmax_scale`` = the module's ``scaling``, and packed documents when
    ``cu_seqlens`` (global) is passed to the forward; each layer's own ``sliding_window`` and
    ``s_aux`` (sinks) as ``window=`` and ``sinks=``. Raises ``ValueError`` when a decoder layer's
    attention does not dispatch through the interface (naming the module), when a layer applies
    attention-logit softcapping (Gemma-2; naming the module and ``attn_logit_softcapping``), for
    chunked attention or position-scaled queries (Llama-4's ``attention_chunk_size``,
    ``attn_temperature_tuning``: they read the sequence's layout where a rank holds a shard), for an
    unknown method or option, and for a group of the wrong type. On the meta device, a model whose
    test forward cannot run there (gpt-oss' grouped-matmul experts) is checked later: call
    :func:`verify_context_parallel` once its weights are filled (its attention raises until then).
    A RoPE whose frequencies depend on the sequence length ("dynamic", "longrope") is updated from
    the whole input's largest position before each forward (:mod:`.rope`), as one process would.
    """
    if not hasattr(model, "config") or not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    declared(method, kind="softmax")
    if method == "usp":  # the Ulysses and ring subgroups, built once here, not in every attention call
        group = _usp_groups(group, options.get("ulysses_degree"))
    else:
        group_info(group)  # validates the type now, not inside the first forward
    allowed = _attention_options()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"options: unknown {', '.join(unknown)}; apply_context_parallel passes on "
                         f"{', '.join(allowed)} and sets {', '.join(sorted(_BOUND))} itself")
    layers_name, layers = _decoder_layers(model)
    attention_modules = [_attention_of(f"{layers_name}.{i}", layer) for i, layer in enumerate(layers)]
    why = _unsupported(model, attention_modules)
    if why:
        raise ValueError(why)
    previous = getattr(model.config, "_attn_implementation", None)
    name = _registration_name(group, method, options)
    try:
        checked = _check_dispatch(model, attention_modules, defer_on_meta=True)
        _interface().register(name, _make_attention(group, method, dict(options)))
        if not checked:  # on meta: verify_context_parallel(model) once the weights are filled
            _interface().register(_UNVERIFIED_NAME, _unverified_attention)
            model.seqpar_unverified = (name, attention_modules)
        _set_implementation(model, name if checked else _UNVERIFIED_NAME)
        cache_hooks.install(model, layers_name, group, method, options)  # generate() on a ShardedCache
        base_name = layers_name.rpartition(".")[0]
        rope.install(model, model.get_submodule(base_name) if base_name else model, group)  # "dynamic", "longrope"
    except Exception:
        if previous is not None and getattr(model.config, "_attn_implementation", None) != previous:
            _set_implementation(model, previous)
        raise
    return model


def _usp_groups(group, ulysses_degree):
    """USP's groups of ``group``: a 2-D mesh, a pair or a ``USPGroups`` as given; a plain group or a
    1-D mesh through ``make_usp_groups`` (collective over the job when it creates subgroups)."""
    from ...comm.groups import _is_device_mesh
    from ...comm.usp_groups import make_usp_groups

    if _is_device_mesh(group) and group.ndim == 1:
        group = group.get_group()
    return make_usp_groups(group, ulysses_degree)


def _registration_name(group, method: str, options: dict) -> str:
    """The ``AttentionInterface`` name of one (group, method, options): equal arguments give the same
    name, so applying the same context parallelism again (every model of a run, every layer type)
    overwrites one registration instead of adding one per call."""
    infos = [group.ulysses, group.ring] if method == "usp" else [group_info(group)]
    plain = (str, int, float, bool, type(None))
    opts = sorted((k, v if isinstance(v, plain) else f"object {id(v)}") for k, v in options.items())
    key = repr((method, [(i.global_ranks, id(i.group)) for i in infos], opts))
    return f"seqpar_cp_{method}_{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}"
