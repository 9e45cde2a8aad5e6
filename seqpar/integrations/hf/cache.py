"""``ShardedCache``: a transformers ``Cache`` whose K,V are split over the ranks of a context-parallel
group, for ``generate()`` on a model converted by :func:`~seqpar.integrations.hf.apply_context_parallel`.

    model = apply_context_parallel(model, group=g, method="zigzag_ring")
    out = model.generate(input_ids, cache=ShardedCache(group=g), max_new_tokens=64)
    # older transformers: past_key_values=ShardedCache(group=g); a plain forward: model(ids, cache=c)
    # under torch.no_grad(), with logits_to_keep=1 to gather only the last hidden row

Every rank passes the whole prompt ``[B, T]`` and gets the whole sequence back. Inside:

- **Prefill** (more than one new token): the model runs on this rank's shard of the new tokens only
  (the hooks of :mod:`.cache_hooks` shard ``input_ids`` and ``position_ids``, padding to the layout
  inside, and gather the hidden rows the LM head needs). An empty cache runs the converted
  attention's own method (``seqpar.attention``, any softmax method, windows and sinks), unless the
  rows are left-padded (below). Over a cached prefix (a second turn, a second ``generate`` call)
  the new tokens are laid out zigzag and attend to the cached shards and to each other by K,V
  passing or query passing (:func:`~.cache_ops.choose_prefill`, Meta's rule; ``prefill=`` forces
  one).
- **Decode** (one new token, the same on every rank): each rank attends it to its own slots and the
  partials are combined exactly in fp32 by an all-gather of ``(out, lse)`` or the tree all-reduce
  (:func:`~.cache_ops.choose_combine`; ``decode_combine=`` forces one). The new token's K,V are
  stored on one rank: position ``p`` on member ``p mod N`` (round robin).
- Each rank stores ``[B, S_local, Hkv, D]`` K and V per layer (GQA heads as the model makes them)
  and the global position of each slot; sliding-window layers keep the last ``W - 1`` positions.
  Sinks are applied once, after the combine. ``get_seq_length()`` and the mask sizes are global.

Inference only: a forward with gradients enabled raises (``generate`` disables them). ``stats`` (a
``CommStats``) receives the bytes this rank sends, phase ``"prefill"`` or ``"decode"``.

**Left padding** (prompts of different lengths in one batch, ``tokenizer.padding_side = "left"``):
the 2-D ``attention_mask`` of the first call on the cache may start rows with zeros; later calls
pass the mask of the whole sequence (HF does), with the same leading zeros (:mod:`.cache_hooks`
checks it and refuses any other mask). Design: the cache keeps one slot per column of the batch,
pads included, tagged with the column (the slot positions are shared by the batch rows, as the
layout of one ``[B, S_local, Hkv, D]`` tensor requires), and records each row's pad count
``pads[b]``. Since pads are a prefix of the row and the slots of a rank are in increasing column
order, a row's pad slots are a prefix of every rank's slots: every attention of that row starts at
its first real column (``floors`` of :func:`~.cache_ops.local_partial`), so no query ever sees a
pad, and what the pads' K,V hold does not matter. Dropping the pads instead (rows as packed
documents) would give each row its own slot positions on each rank, which one batched tensor per
layer cannot hold. A padded first call therefore runs as a prefill over an empty cache (zigzag
layout, K,V or query passing with the floors) rather than the method's own schedule, whose masks
know token order only. Positions (RoPE) are the ``position_ids`` transformers derives from the
mask (``cumsum - 1``); the cache uses them as given.
"""

from __future__ import annotations

import dataclasses

import torch

from ...comm import CommStats, group_info
from ...comm.usp_groups import USPGroups
from ...softmax import attention
from ...softmax.sinks import apply_sinks
from . import cache_ops

__all__ = ["ShardedCache"]

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("seqpar.integrations.hf.ShardedCache needs transformers>=5: pip install 'seqpar[hf]'") from exc

PREFILL_MODES = ("auto", "pass_kv", "pass_q")
COMBINE_MODES = ("auto", "allgather", "tree")


@dataclasses.dataclass
class Step:
    """One forward of the model on a :class:`ShardedCache` (built by :mod:`.cache_hooks`).

    ``past`` cached tokens before it, ``new`` real new tokens (global), ``sharded`` when the new
    tokens are split over the ranks (prefill) rather than the same on every rank (decode);
    ``positions`` the global position of each local row (``>= past + new`` on padding rows);
    ``member_positions`` every member's (prefill over a prefix, for query passing)."""

    past: int
    new: int
    sharded: bool
    positions: list[int]
    member_positions: list[list[int]] | None = None
    keep: int = 0
    pads: list[int] | None = None  # per batch row: leading pad columns (None: no padding)
    prefill: str | None = None
    combine: str | None = None


class ShardLayer(CacheLayerMixin):
    """One decoder layer's slots on this rank: ``keys``, ``values`` ``[B, S_local, Hkv, D]`` and
    ``positions`` ``[S_local]`` (host int64, increasing)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window
        self.positions = torch.empty(0, dtype=torch.int64)
        self.length = 0
        self.kept_from = 0  # positions below this were dropped by the window

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.keys = key_states[:, :0].contiguous()
        self.values = value_states[:, :0].contiguous()
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise ValueError("ShardLayer.update: a ShardedCache layer is written by the context-parallel attention "
                         "(apply_context_parallel), not by a model's own attention")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> None:
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        if positions:
            self.keys = torch.cat([self.keys, k], dim=1)
            self.values = torch.cat([self.values, v], dim=1)
            self.positions = torch.cat([self.positions, torch.tensor(positions, dtype=torch.int64)])

    def _keep(self, mask: torch.Tensor) -> None:
        if self.is_initialized and not bool(mask.all()):
            idx = torch.nonzero(mask).flatten()
            dev = idx.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(1, dev), self.values.index_select(1, dev)
            self.positions = self.positions[idx]

    def finish(self, length: int) -> None:
        """The forward that brought the cache to ``length`` tokens is done: drop what the window no
        longer needs (the next query is at ``length``; it sees positions above ``length - W``)."""
        self.length = length
        if self.window is not None:
            self.kept_from = max(self.kept_from, length - self.window + 1)
            self._keep(self.positions >= self.kept_from)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop: pass a negative count of tokens to remove (got {tokens_to_remove}), as for "
                             "transformers' DynamicCache")
        length = max(0, self.length + tokens_to_remove)
        if self.window is not None and length - self.window + 1 < self.kept_from:
            raise ValueError(f"crop: this sliding-window layer (window {self.window}) no longer holds the positions "
                             f"from {length - self.window + 1} on that a cache of {length} tokens needs; crop less, "
                             "or crop before the window moves past them")
        self._keep(self.positions < length)
        self.length = length

    def select_batch(self, index: torch.Tensor) -> None:
        if self.is_initialized:
            index = index.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_batch(torch.as_tensor(indices).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def reset(self) -> None:
        self.__init__(self.window)

    def kv_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def _same_group(info, group) -> bool:
    """Whether the model's ``group`` (for usp: its ``USPGroups``) is the cache's group ``info``."""
    if isinstance(group, USPGroups):
        if group.flat is not None:
            return group.flat.global_ranks == info.global_ranks and group.flat.group is info.group
        mine = set(info.global_ranks)
        axes = [a for a in (group.ulysses, group.ring) if a is not None]
        return group.ulysses_degree * group.ring_degree == info.size and all(set(a.global_ranks) <= mine for a in axes)
    other = group_info(group)
    return other.global_ranks == info.global_ranks and other.group is info.group


def _choice(name: str, value, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(map(repr, allowed))}")
    return value


class ShardedCache(Cache):
    """A transformers ``Cache`` whose K,V lie sharded over ``group`` (module docstring).

    Args:
        group: the ProcessGroup / 1-D DeviceMesh the model was converted with (None = default group).
        prefill: ``"auto"`` (Meta's rule, :func:`~.cache_ops.choose_prefill`), ``"pass_kv"`` or
            ``"pass_q"``: how new tokens over a cached prefix reach the cached shards. An attribute:
            set it between calls to override one call.
        decode_combine: ``"auto"`` (by size, :func:`~.cache_ops.choose_combine`), ``"allgather"`` or
            ``"tree"``: how decode partials are combined.
        stats: a ``CommStats`` that receives the bytes this rank sends (phases ``"prefill"`` and
            ``"decode"``); default a new one (``cache.stats``).
        check_tokens: check with one small all-reduce per forward that every rank passes the same
            tokens (sampling with different seeds per rank would otherwise diverge silently), after
            one more of a fixed size on a prefill that every rank passes the same shape.
        kernel_flops, link_bandwidth, link_latency: flop/s of the block kernel, bytes/s and seconds
            per message of one link, for the two rules (defaults: an H100's bf16 attention, ~400
            TFLOP/s, 50 GB/s RDMA, 10 us).
    Attributes: ``history`` (one dict per forward: phase, past, new, the prefill and combine used),
    :meth:`kv_bytes`, :meth:`comm_summary`.
    """

    def __init__(self, group=None, *, prefill: str = "auto", decode_combine: str = "auto",
                 stats: CommStats | None = None, check_tokens: bool = True, kernel_flops: float = 4e14,
                 link_bandwidth: float = 5e10, link_latency: float = 1e-5):
        self.prefill = _choice("prefill", prefill, PREFILL_MODES)
        self.decode_combine = _choice("decode_combine", decode_combine, COMBINE_MODES)
        if stats is not None and not isinstance(stats, CommStats):
            raise ValueError(f"stats: expected a seqpar.comm.CommStats, got {type(stats).__name__}")
        super().__init__(layers=[])
        self.group = group
        self.info = group_info(group)
        self.stats = stats if stats is not None else CommStats()
        self.check_tokens = bool(check_tokens)
        self.kernel_flops, self.link_bandwidth, self.link_latency = kernel_flops, link_bandwidth, link_latency
        self.length = 0
        self.step: Step | None = None
        self.method: str | None = None
        self.options: dict = {}
        self.model_group = group
        self.history: list[dict] = []
        self.pads: list[int] | None = None  # per batch row: the leading pad columns of the first call

    # ------------------------------------------------------------------ transformers' Cache API

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.step is None:
            raise ValueError(
                "model: a ShardedCache was passed to a model whose attention is not context-parallel; convert it "
                "first with seqpar.integrations.hf.apply_context_parallel(model, group=..., method=...) on every rank")
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)
        self.length = max(0, self.length + tokens_to_remove)
        if self.pads is not None:
            self.pads = [min(p, self.length) for p in self.pads]

    def reset(self) -> None:
        super().reset()
        self.length = 0
        self.pads = None

    def reorder_cache(self, beam_idx) -> None:
        super().reorder_cache(beam_idx)
        self._select_pads(torch.as_tensor(beam_idx).flatten())

    def batch_select_indices(self, indices) -> None:
        super().batch_select_indices(indices)
        self._select_pads(torch.as_tensor(indices).flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.pads is not None:
            self.pads = [p for p in self.pads for _ in range(repeats)]

    def _select_pads(self, index: torch.Tensor) -> None:
        if self.pads is not None:
            self.pads = [self.pads[i] for i in index.tolist()]

    # ------------------------------------------------------------------ seqpar

    def bind(self, group, method: str, options: dict) -> None:
        """The model about to run uses ``group`` / ``method``: the group must be this cache's."""
        if not _same_group(self.info, group):
            raise ValueError(
                f"past_key_values: this ShardedCache belongs to the group of ranks {list(self.info.global_ranks)}, but "
                "the model runs context-parallel over another group; make one ShardedCache per group: "
                "ShardedCache(group=<the group given to apply_context_parallel>)")
        self.method, self.options, self.model_group = method, dict(options), group

    def kv_bytes(self) -> int:
        """Bytes of K and V this rank holds (every layer; the positions' index not included)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def comm_summary(self) -> dict:
        """Bytes this rank sent: per prefill forward and per decoded token (means over the history)."""
        prefills = sum(1 for h in self.history if h["phase"] == "prefill")
        decoded = sum(h["new"] for h in self.history if h["phase"] == "decode")
        return {"prefill_bytes": self.stats.total("prefill"), "prefills": prefills,
                "prefill_bytes_per_call": self.stats.total("prefill") / max(1, prefills),
                "decode_bytes": self.stats.total("decode"), "decoded_tokens": decoded,
                "decode_bytes_per_token": self.stats.total("decode") / max(1, decoded)}

    def _layer(self, idx: int, window: int | None) -> ShardLayer:
        while len(self.layers) <= idx:
            self.layers.append(ShardLayer())
        layer = self.layers[idx]
        if not layer.is_initialized:
            layer.window = window
        elif layer.window != window:
            raise ValueError(f"layer {idx}: its sliding window changed from {layer.window} to {window} on the same cache")
        return layer

    def discard_unfinished(self) -> None:
        """Drop the slots of a forward that raised part-way (its post-hook never ran: ``step`` still
        set), so the cache is as after its last finished forward."""
        if self.step is not None:
            for layer in self.layers:
                layer._keep(layer.positions < self.length)
            self.step = None

    def finish(self) -> None:
        """Called after the model's forward: the new tokens are in; windows drop what they no longer need."""
        step, self.step = self.step, None
        if step is None:
            return
        self.length = step.past + step.new
        if step.past == 0:
            self.pads = step.pads
        for layer in self.layers:
            layer.finish(self.length)
        fresh = step.sharded and step.past == 0 and not step.pads
        self.history.append({"phase": "prefill" if step.sharded else "decode", "past": step.past, "new": step.new,
                             "prefill": ("method" if fresh else step.prefill) if step.sharded else None,
                             "combine": step.combine})

    def attend(self, layer_idx: int, q, k, v, *, scale: float | None, causal: bool, window: int | None = None,
               sinks=None, name: str = "attention") -> torch.Tensor:
        """This rank's attention output ``[B, T_local, Hq, D]`` (q's dtype) for the local rows ``q``
        ``[B, T_local, Hq, D]`` with their new ``k``, ``v`` ``[B, T_local, Hkv, D]``; stores them."""
        step = self.step
        if step is None:
            raise ValueError(f"{name}: ShardedCache.attend outside a model forward prepared by apply_context_parallel")
        if not causal:
            raise ValueError(f"{name}: ShardedCache serves causal (decoder) attention; this layer is not causal")
        layer = self._layer(layer_idx, window)
        scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
        if step.sharded and step.past == 0 and not step.pads:
            return self._fresh_prefill(layer, step, q, k, v, scale, window, sinks)
        limit = step.past + step.new
        if step.sharded:
            mine = [i for i, p in enumerate(step.positions) if p < limit]
        else:
            mine = [i for i, p in enumerate(step.positions) if p % self.info.size == self.info.rank]
        self._store(layer, k, v, mine, step.positions)
        out, lse = self._spread(step, layer, q, k, scale, window)
        if sinks is not None:
            out, lse = apply_sinks(out, lse, sinks)
        return out.to(q.dtype)

    def _store(self, layer: ShardLayer, k, v, rows: list[int], positions: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.int64, device=k.device)
        layer.append(k.index_select(1, idx), v.index_select(1, idx), [positions[i] for i in rows])

    def _fresh_prefill(self, layer, step, q, k, v, scale, window, sinks):
        local = CommStats()
        opts = {key: val for key, val in self.options.items() if key != "stats"}
        out = attention(q, k, v, group=self.model_group, method=self.method, causal=True, softmax_scale=scale,
                        window=window, sinks=sinks, stats=local, **opts)
        self.stats.phase = "prefill"
        self.stats.add("prefill_attention", local.total())
        self._store(layer, k, v, [i for i, p in enumerate(step.positions) if p < step.past + step.new], step.positions)
        return out

    def _spread(self, step: Step, layer: ShardLayer, q, k, scale, window):
        """fp32 ``(out, lse)`` of the local rows over every rank's slots."""
        backend = self.options.get("backend")
        n = self.info.size
        common = dict(scale=scale, window=window, backend=backend, stats=self.stats, floors=step.pads)
        if step.sharded:
            if step.prefill is None:
                step.prefill = self.prefill if self.prefill != "auto" else cache_ops.choose_prefill(
                    step.new, step.past, q.shape[2], k.shape[2], n, flops=self.kernel_flops,
                    bandwidth=self.link_bandwidth, itemsize=k.element_size())
            self.stats.phase = "prefill"
            if step.prefill == "pass_q":
                runs = [cache_ops.query_runs(p) for p in step.member_positions]
                return cache_ops.pass_q(self.info, q, runs, layer.keys, layer.values, layer.positions, **common)
            return cache_ops.pass_kv(self.info, q, cache_ops.query_runs(step.positions), layer.keys, layer.values,
                                     layer.positions, **common)
        out, lse = cache_ops.local_partial(q, [(0, step.new, step.past)], layer.keys, layer.values, layer.positions,
                                           scale=scale, window=window, backend=backend, floors=step.pads)
        if step.combine is None and n == 1:
            step.combine = "none"  # one rank: nothing to combine
        elif step.combine is None:
            rows = out.shape[0] * out.shape[1] * out.shape[2]
            step.combine = self.decode_combine if self.decode_combine != "auto" else cache_ops.choose_combine(
                n, rows * (out.shape[3] + 1) * 4, rows * 4, latency=self.link_latency, bandwidth=self.link_bandwidth)
        self.stats.phase = "decode"
        return cache_ops.combine_replicated(self.info, out, lse, step.combine, stats=self.stats)
