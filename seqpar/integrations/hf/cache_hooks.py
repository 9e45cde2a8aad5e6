"""The forward hooks that let ``generate()`` run a converted model on a :class:`~.cache.ShardedCache`.

:func:`install` puts them on a model in :func:`~.convert.apply_context_parallel`; they do nothing
unless the forward receives a ``ShardedCache`` (as ``cache`` or ``past_key_values``).

Before the decoder model's forward (``model.model`` of a ``*ForCausalLM``) on a ShardedCache:
check the call (a padding mask only on the left, no gradients, the cache's group is the model's,
every rank the same tokens), then for a prefill (more than one new token) replace ``input_ids`` / ``inputs_embeds``
``[B, T_new]`` and ``position_ids`` by this rank's rows, padded at the end to the layout's multiple:
the method's layout on an empty cache, zigzag over a cached prefix or for left-padded rows
(:mod:`.cache`'s docstring: the pads are never attended to); a decode step (one new token)
runs on every rank alike. The attention layers find the cache in the forward's kwargs
(``seqpar_cache``). After it: gather the hidden rows the LM head needs (the last ``logits_to_keep``
new tokens; every new token when 0) onto every rank with one all-reduce of this rank's rows, and let
the cache finish the step. Under a sharded prefill, ``last_hidden_state`` therefore holds the last
``logits_to_keep`` rows only (what a ``*ForCausalLM`` slices anyway), and ``hidden_states`` (when
requested) every new row.
"""

from __future__ import annotations

import inspect

import torch

from ...comm import all_reduce_
from ...layouts import Zigzag, placement
from .cache import ShardedCache, Step

__all__ = ["install"]

_HANDLES = "_seqpar_cache_hooks"


def install(model, layers_name: str, group, method: str, options: dict) -> None:
    """Put the hooks on ``model`` (replacing those of an earlier conversion)."""
    for handle in getattr(model, _HANDLES, ()):
        handle.remove()
    base_name = layers_name.rpartition(".")[0]
    base = model.get_submodule(base_name) if base_name else model
    binding = (group, method, dict(options))
    handles = [base.register_forward_pre_hook(_pre_hook(binding, base), with_kwargs=True),
               base.register_forward_hook(_post_hook, with_kwargs=True)]
    if base is not model and "logits_to_keep" in inspect.signature(model.forward).parameters:
        handles.append(model.register_forward_pre_hook(_keep_hook, with_kwargs=True))
    object.__setattr__(model, _HANDLES, handles)


def _cache_of(kwargs: dict):
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def _keep_hook(module, args, kwargs):
    """On the ``*ForCausalLM``: pass ``logits_to_keep`` down to the decoder model's hook, and refuse
    ``generate(use_cache=False)``: its forwards (no cache, ``use_cache=False``, ``logits_to_keep=1``,
    no gradients) would feed every rank the whole sequence as if it were a shard (wrong results)."""
    cache, keep = _cache_of(kwargs), kwargs.get("logits_to_keep", 0)
    keep = keep if isinstance(keep, int) else 0
    if isinstance(cache, ShardedCache):
        kwargs["seqpar_keep"] = keep
    elif cache is None and not args and kwargs.get("use_cache") is False and keep == 1 and not torch.is_grad_enabled():
        raise ValueError(
            "use_cache=False: generate() on a context-parallel model needs its K,V in a ShardedCache; pass "
            "cache=ShardedCache(group=...) (the group given to apply_context_parallel) and leave use_cache on")
    return args, kwargs


def _pre_hook(binding, base):
    signature = inspect.signature(base.forward)

    def hook(module, args, kwargs):
        keep = kwargs.pop("seqpar_keep", 0)
        cache = _cache_of(kwargs)
        if cache is None and args:
            bound = signature.bind_partial(*args, **kwargs)
            cache = _cache_of(bound.arguments)
        if cache is None:
            return args, kwargs
        if not isinstance(cache, ShardedCache):
            raise ValueError(
                f"past_key_values: a context-parallel model keeps its K,V in a ShardedCache, got {type(cache).__name__}; "
                "pass cache=ShardedCache(group=...) to generate() (the group given to apply_context_parallel); a "
                "forward on the shards of shard_inputs (training) takes use_cache=False")
        if args:  # everything by name from here on
            kwargs = dict(signature.bind_partial(*args, **kwargs).arguments)
            kwargs.update(kwargs.pop("kwargs", {}))
            args = ()
        _prepare(cache, binding, kwargs, keep)
        return args, kwargs

    return hook


_LEFT = ("pad on the left (tokenizer.padding_side = 'left'), each row with at least one real token, and pass "
         "the 2-D mask [B, past + new] of 0/1 that the tokenizer and generate() build")


def _padding(cache: ShardedCache, mask, x: torch.Tensor) -> list[int] | None:
    """Each batch row's leading pad columns from the 2-D ``attention_mask`` ``[B, past + new]``
    (None: no padding). Left padding only (zeros a prefix of each row, at least one 1 per row),
    given in the first call on the cache; later calls repeat the same leading zeros."""
    past = cache.length
    if mask is None:
        if cache.pads is not None and any(cache.pads) and past > 0:
            raise ValueError(f"attention_mask: this ShardedCache holds left-padded rows (pads {cache.pads}); pass the "
                             "attention_mask of the whole sequence (the first call's mask followed by ones), as "
                             "generate() does")
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        what = f"a {mask.dim()}-D mask" if isinstance(mask, torch.Tensor) else f"a {type(mask).__name__}"
        raise ValueError(f"attention_mask: {what} cannot be applied by context-parallel generation; {_LEFT}")
    if tuple(mask.shape) != (x.shape[0], past + x.shape[1]):
        raise ValueError(f"attention_mask: shape {tuple(mask.shape)}, expected [B, past + new] = "
                         f"{[x.shape[0], past + x.shape[1]]} (the mask of the whole sequence, cached tokens included)")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"attention_mask: values other than 0 and 1; {_LEFT}")
    real = mask == 1
    pads = (real.cumsum(1) == 0).sum(1)  # leading zeros per row
    empty = torch.nonzero(pads == mask.shape[1]).flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask: rows {empty} are all zeros (no real token; with generate(prefill_chunk_size"
                         f"=...), make the chunks longer than the padding); {_LEFT}")
    holes = torch.nonzero(real.sum(1) != mask.shape[1] - pads).flatten().tolist()
    if holes:
        raise ValueError(f"attention_mask: rows {holes} have zeros after their first real token (right padding or "
                         f"gaps), which context-parallel generation cannot apply; {_LEFT}")
    pads = pads.tolist()
    if past > 0 and pads != (cache.pads or [0] * len(pads)):
        raise ValueError(f"attention_mask: leading zeros {pads} per row, but this ShardedCache was filled with "
                         f"{cache.pads or [0] * len(pads)}; padding goes in the first call on a cache, and later calls "
                         "pass the mask of the whole sequence (the earlier mask followed by ones)")
    return pads if any(pads) else None


def _check_call(cache: ShardedCache, kwargs: dict, x: torch.Tensor) -> list[int] | None:
    """Local checks (no communication): the same verdict on every rank given the same call.
    Returns the rows' leading pad columns (None: no padding)."""
    if torch.is_grad_enabled():
        raise ValueError("ShardedCache is for inference: call generate() (it disables gradients) or run the forward "
                         "under torch.no_grad() / torch.inference_mode()")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions: context-parallel attention computes no attention weights; "
                         "pass output_attentions=False")
    if x.dim() < 2 or x.shape[1] == 0:
        raise ValueError(f"input_ids: expected [B, T] with T >= 1 new tokens, got shape {tuple(x.shape)}")
    return _padding(cache, kwargs.get("attention_mask"), x)


def _agree_shape(cache: ShardedCache, x: torch.Tensor) -> None:
    """One all-reduce of a fixed size (max of the shape and of its negation), before a prefill's token
    check: ranks that pass inputs of different shapes would all-reduce tensors of different sizes there,
    which gloo aborts on and NCCL may hang on; here each raises a ValueError instead."""
    dims = [float(x.dim()), float(x.is_floating_point())] + [float(d) for d in x.shape[:4]]
    head = torch.tensor(dims + [-1.0] * (6 - len(dims)), dtype=torch.float64, device=x.device)
    both = torch.cat([head, -head])
    all_reduce_(cache.info, both, op=torch.distributed.ReduceOp.MAX, stats=cache.stats, name="check_shape")
    if not torch.equal(both[:6], -both[6:]):
        raise ValueError(f"input_ids: the ranks passed inputs of different shapes to a context-parallel forward "
                         f"(this rank: {'inputs_embeds' if x.is_floating_point() else 'input_ids'} "
                         f"{tuple(x.shape)}); every rank passes the whole batch, the same on each")


def _agree(cache: ShardedCache, x: torch.Tensor, pads: list[int] | None) -> None:
    """One all-reduce (max of x and of -x): every rank must pass the same tokens (and padding). The
    pad counts go in on every rank (zeros when unpadded): one size whatever each rank's mask. A
    prefill (more than one token, or an empty cache) first agrees on the shape (:func:`_agree_shape`);
    a decode step's shape follows from the prefill's."""
    if x.shape[1] > 1 or cache.length == 0:
        _agree_shape(cache, x)
    flat = x.detach().reshape(-1).to(torch.float64)
    counts = pads if pads is not None else [0] * x.shape[0]
    flat = torch.cat([flat, torch.tensor(counts, dtype=torch.float64, device=flat.device)])
    both = torch.cat([flat, -flat])
    all_reduce_(cache.info, both, op=torch.distributed.ReduceOp.MAX, stats=cache.stats, name="check_tokens")
    if not torch.equal(both[:flat.numel()], -both[flat.numel():]):
        raise ValueError(
            "input_ids: the ranks passed different tokens (or attention_mask padding) to a context-parallel forward "
            "(with sampling: seed every rank the same, e.g. torch.manual_seed(seed) before generate(), so every "
            "rank draws the same tokens)")


def _prepare(cache: ShardedCache, binding, kwargs: dict, keep: int) -> None:
    group, method, options = binding
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    x = ids if ids is not None else embeds
    if x is None:
        raise ValueError("input_ids: a forward on a ShardedCache needs input_ids or inputs_embeds")
    cache.discard_unfinished()
    pads = _check_call(cache, kwargs, x)
    cache.bind(group, method, options)
    if cache.check_tokens and not cache.info.single and x.shape[1] > 0:
        cache.stats.phase = "prefill" if x.shape[1] > 1 else "decode"
        _agree(cache, x, pads)
    past, new = cache.length, x.shape[1]
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(past, past + new, device=x.device)[None]
    kwargs["attention_mask"] = None
    kwargs["seqpar_cache"] = cache
    if new == 1:
        cache.step = Step(past=past, new=new, sharded=False, positions=[past], keep=keep, pads=pads)
        kwargs["position_ids"] = position_ids
        return
    n, rank = cache.info.size, cache.info.rank
    if past == 0 and pads is None:
        place = placement(method, group, ulysses_degree=options.get("ulysses_degree"),
                          ring_method_name=options.get("ring_method"))
        multiple = place.layout.multiple(n)
        t_pad = -(-new // multiple) * multiple
        local = place.shard(torch.arange(t_pad)[None], dim=1)[0].tolist()
        members = None
    else:
        layout = Zigzag()
        t_pad = -(-new // layout.multiple(n)) * layout.multiple(n)
        members = [layout.positions(t_pad, n, m) for m in range(n)]
        local = members[rank]
        members = [[past + i for i in m] for m in members]
    index = torch.tensor(local, dtype=torch.int64, device=x.device)
    real = index.clamp(max=new - 1)
    if ids is not None:
        kwargs["input_ids"] = ids.index_select(1, real)
    else:
        kwargs["inputs_embeds"] = embeds.index_select(1, real)
    pos = position_ids.index_select(-1, real)
    kwargs["position_ids"] = torch.where(index < new, pos, pos + (index - real))  # padding rows: past the end
    cache.step = Step(past=past, new=new, sharded=True, positions=[past + i for i in local],
                      member_positions=members, keep=keep, pads=pads)


def _gather_rows(cache: ShardedCache, step: Step, x: torch.Tensor, first: int) -> torch.Tensor:
    """Rows ``first .. new - 1`` (new-token order) of the sharded ``x`` ``[B, T_local, ...]`` on every
    rank: each rank writes its rows into zeros, one all-reduce sums them (exact: one non-zero term)."""
    out = x.new_zeros((x.shape[0], step.new - first, *x.shape[2:]))
    rows = [(i, p - step.past - first) for i, p in enumerate(step.positions) if first <= p - step.past < step.new]
    if rows:
        src = torch.tensor([r[0] for r in rows], device=x.device)
        dst = torch.tensor([r[1] for r in rows], device=x.device)
        out.index_copy_(1, dst, x.index_select(1, src))
    cache.stats.phase = "prefill"
    return all_reduce_(cache.info, out, stats=cache.stats, name="prefill_hidden_rows")


def _post_hook(module, args, kwargs, output):
    cache = kwargs.get("seqpar_cache")
    if not isinstance(cache, ShardedCache) or cache.step is None:
        return output
    step = cache.step
    try:
        if step.sharded:
            first = max(0, step.new - step.keep) if step.keep > 0 else 0
            output.last_hidden_state = _gather_rows(cache, step, output.last_hidden_state, first)
            if getattr(output, "hidden_states", None) is not None:
                output.hidden_states = tuple(_gather_rows(cache, step, h, 0) for h in output.hidden_states)
    finally:
        cache.finish()
    return output
