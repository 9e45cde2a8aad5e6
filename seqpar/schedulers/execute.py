"""Running a :class:`~seqpar.schedulers.plan.Plan`: process groups, packed batches, a training step.

The planner's output is plain data; this module turns it into work on one rank
(seqpar/schedulers/README.md):

* :class:`GroupCache` builds, once, every aligned power-of-two process group a plan may use.
  ``dist.new_group`` is collective over the *world*, so every rank creates every candidate group in
  the same order (sizes ascending, then start rank), including the groups it is not a member of.
  The caller owns the cache (there is no module-level cache): make one after
  ``init_process_group`` and keep it for the whole run.
* :func:`rank_work` gives a rank its :class:`RankWork`: its group of the plan, the process group, the
  method, and its group's sequences (:func:`~seqpar.schedulers.plan.local_batch`, longest first) as
  one packed batch with global ``cu_seqlens`` and a prebuilt ``seqpar.packed_layout``.
  ``RankWork.pack`` / ``shard`` / ``attention`` / ``unshard`` are the packed-input calls of
  ``seqpar`` bound to that group and method.
* :func:`execute_plan` runs a caller's ``run_group_batch(work)`` on that work.
* :func:`train_step` is one training step of a plan: the loss is the sum of per-token losses over
  the whole batch divided by the global token count, and every parameter gradient is all-reduced
  (summed) over all ranks, so the step equals the same batch on one rank whatever the plan.

    groups = GroupCache()                                   # collective; once per run
    plan = plan_batch(seq_lens, ClusterSpec(world_size=dist.get_world_size(), ranks_per_node=...))
    loss = train_step(plan, seq_lens, dist.get_rank(), groups, loss_fn, model.parameters())

Every rank must call these with the same plan and ``seq_lens`` (e.g. rank 0 plans and broadcasts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import peer_errors
from ..comm.groups import collective_device
from ..layouts import packed_layout, shard, unshard
from ..softmax import attention
from .plan import GroupPlan, Plan, local_batch

__all__ = ["GroupCache", "RankWork", "execute_plan", "rank_work", "train_step"]


def _aligned_sizes(world_size: int) -> tuple[int, ...]:
    sizes, s = [], 1
    while s <= world_size:
        sizes.append(s)
        s *= 2
    return tuple(sizes)


class GroupCache:
    """Every aligned power-of-two process group ``[start, start + size)`` of the world, built once.

    Args:
        sizes: group sizes to build (powers of two up to the world size); default all of them, i.e.
            ``world/1 + world/2 + ... + 1`` groups (7 on 4 ranks, 511 on 256). Pass
            ``plan.group_sizes()``-style subsets to build fewer; every rank must pass the same.
        backend: ``dist.new_group`` backend (default: the world's).

    Construction is collective over the default group: every rank must construct it, with the same
    arguments, at the same point. Groups of one rank are real single-rank groups (``group=None``
    would mean the whole world to ``seqpar.attention``). Lookups (:meth:`get`, :meth:`for_plan`) are
    local. The groups live as long as the default process group (or until the caller destroys them).
    """

    def __init__(self, *, sizes: Iterable[int] | None = None, backend: str | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("GroupCache: torch.distributed is not initialised; call init_process_group first")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        allowed = _aligned_sizes(self.world_size)
        if sizes is None:
            chosen = allowed
        else:
            chosen = tuple(sorted({int(s) for s in sizes}))
            bad = [s for s in chosen if s not in allowed]
            if bad or not chosen:
                raise ValueError(f"sizes: expected powers of two in {list(allowed)}, got {sorted(set(sizes))!r}")
        self.sizes = chosen
        self._groups: dict[tuple[int, int], Any] = {}
        for size in chosen:  # the same order on every rank: new_group is collective over the world
            for start in range(0, self.world_size - size + 1, size):
                pg = dist.new_group(list(range(start, start + size)), backend=backend)
                if start <= self.rank < start + size:
                    self._groups[(start, size)] = pg

    def get(self, start: int, size: int):
        """The process group of ranks ``[start, start + size)``; this rank must be a member."""
        key = (int(start), int(size))
        if key not in self._groups:
            if size not in self.sizes:
                raise ValueError(f"GroupCache: no groups of size {size} were built (sizes={list(self.sizes)})")
            raise ValueError(f"GroupCache: rank {self.rank} is not in the group of ranks [{start}, {start + size}) "
                             "or that block is not aligned")
        return self._groups[key]

    def for_plan(self, plan: Plan, rank: int | None = None) -> tuple[GroupPlan, Any]:
        """``(group plan, process group)`` of ``rank`` (default: this rank) in ``plan``."""
        rank = self.rank if rank is None else rank
        if plan.world_size != self.world_size:
            raise ValueError(f"plan: world_size {plan.world_size} differs from the process world of "
                             f"{self.world_size} ranks")
        if rank != self.rank:
            raise ValueError(f"rank={rank} is not this process's rank {self.rank}")
        mine = plan.groups_for_rank(rank)
        if len(mine) != 1:
            raise ValueError(f"plan: rank {rank} is in {len(mine)} groups; a plan's groups must partition the ranks")
        g = mine[0]
        return g, self.get(g.start, g.size)

    def __len__(self) -> int:
        return len(self._groups)

    def __repr__(self) -> str:
        return f"GroupCache(world_size={self.world_size}, rank={self.rank}, sizes={list(self.sizes)})"


@dataclass(frozen=True)
class RankWork:
    """What one rank runs for a plan: its group, method and packed sequences.

    Attributes:
        rank: global rank.
        group_plan: this rank's :class:`GroupPlan`.
        group: its process group (from the :class:`GroupCache`).
        method: the group's method.
        seqs: batch indices the group packs, longest first (the same on every rank of the group).
        lens: their lengths.
        cu_seqlens: int32 global document offsets of the packed stream ``[len(seqs) + 1]``.
        layout: ``seqpar.packed_layout`` of that stream for ``method`` on ``group`` (None when the
            group has no sequences); pass it as ``cu_seqlens=`` to every layer.
    """

    rank: int
    group_plan: GroupPlan
    group: Any
    method: str
    seqs: tuple[int, ...]
    lens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    layout: Any = None
    _mask: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def group_rank(self) -> int:
        """This rank's index inside its group."""
        return self.rank - self.group_plan.start

    @property
    def empty(self) -> bool:
        """True when the group has no sequences this step."""
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        """Real tokens of the group's packed stream."""
        return sum(self.lens)

    def pack(self, per_sequence: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Concatenate ``per_sequence[i]`` for ``i in seqs`` along ``dim`` and add a batch dim of 1.

        ``per_sequence`` is indexed by batch index (the whole batch, or a mapping from index); each
        tensor has the sequence's tokens along ``dim``. Returns ``[1, T_group, ...]``.
        """
        parts = [per_sequence[i] for i in self.seqs]
        for i, n, p in zip(self.seqs, self.lens, parts):
            if p.shape[dim] != n:
                raise ValueError(f"per_sequence[{i}] has {p.shape[dim]} tokens along dim {dim}, but the plan's "
                                 f"seq_lens say {n}")
        return torch.cat(parts, dim=dim).unsqueeze(0)

    def shard(self, packed: torch.Tensor, dim: int = 1, pad_value=0) -> torch.Tensor:
        """This rank's padded local stream of a packed global tensor (``seqpar.shard``, packed).

        Padding rows hold ``pad_value`` (e.g. ``-100`` for labels an ignoring loss skips).
        """
        out = shard(packed, group=self.group, method=self.method, dim=dim, cu_seqlens=self.layout)
        if pad_value != 0:
            mask = self.real_mask(packed.device)
            shape = [1] * out.dim()
            shape[0], shape[dim % out.dim()] = mask.shape[0], mask.shape[1]
            out = out.masked_fill(~mask.reshape(shape), pad_value)
        return out

    def real_mask(self, device=None) -> torch.Tensor:
        """bool ``[1, T_local]``: True on this rank's real tokens, False on padding rows."""
        key = str(torch.device(device or "cpu"))
        if key not in self._mask:
            ones = torch.ones(1, self.num_tokens, 1, device=device)
            local = shard(ones, group=self.group, method=self.method, dim=1, cu_seqlens=self.layout)
            self._mask[key] = local[..., 0] > 0
        return self._mask[key]

    def unshard(self, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The group's packed global tensor from every member's local stream (collective over the group)."""
        return unshard(local, group=self.group, method=self.method, dim=dim, cu_seqlens=self.layout)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                  **kwargs) -> torch.Tensor:
        """``seqpar.attention`` over the group with its method and packed layout (documents never
        attend across a boundary; ``causal`` is per document)."""
        return attention(q, k, v, group=self.group, method=self.method, causal=causal,
                         cu_seqlens=self.layout, **kwargs)


def rank_work(plan: Plan, seq_lens: Sequence[int], rank: int, groups: GroupCache) -> RankWork:
    """This rank's :class:`RankWork` for ``plan`` on batch ``seq_lens`` (local: no communication)."""
    g, pg = groups.for_plan(plan, rank)
    seqs = tuple(local_batch(plan, rank, seq_lens))
    lens = tuple(int(seq_lens[i]) for i in seqs)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32)
    layout = packed_layout(cu, method=g.method, group=pg) if seqs else None
    return RankWork(rank=rank, group_plan=g, group=pg, method=g.method, seqs=seqs, lens=lens, cu_seqlens=cu,
                    layout=layout)


def execute_plan(plan: Plan, seq_lens: Sequence[int], rank: int, groups: GroupCache,
                 run_group_batch: Callable[[RankWork], Any], *, skip_empty: bool = True) -> Any:
    """Run ``run_group_batch(work)`` with this rank's :class:`RankWork` and return its result.

    Every rank of a group gets the same sequences, cu_seqlens and method, so collectives inside
    ``run_group_batch`` (``work.attention``, ``work.unshard``) run over the group only. A group with
    no sequences returns None without calling it (``skip_empty=False`` calls it with
    ``work.empty`` True).
    """
    work = rank_work(plan, seq_lens, rank, groups)
    if work.empty and skip_empty:
        return None
    return run_group_batch(work)


_GRAD_BUCKET = 1 << 26  # elements per gradient all-reduce (256 MB of fp32): bounds the flat copy


def _reduce_grads(params: list[torch.Tensor], group=None, bucket: int = _GRAD_BUCKET) -> None:
    """Sum every parameter's ``.grad`` over ``group`` in flat all-reduces of at most ``bucket``
    elements per dtype and device (None grads count as 0); a parameter larger than ``bucket`` goes
    alone."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for plist in by_dtype.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for p in plist + [None]:
            if p is not None and (not chunk or size + p.numel() <= bucket):
                chunk.append(p)
                size += p.numel()
                continue
            flat = torch.cat([q.grad.reshape(-1) for q in chunk])
            with peer_errors(group, "gradient all-reduce"):
                dist.all_reduce(flat, group=group)
            offset = 0
            for q in chunk:
                n = q.grad.numel()
                q.grad.copy_(flat[offset:offset + n].view_as(q.grad))
                offset += n
            chunk, size = ([p], p.numel()) if p is not None else ([], 0)


def train_step(plan: Plan, seq_lens: Sequence[int], rank: int, groups: GroupCache,
               loss_fn: Callable[[RankWork], tuple[torch.Tensor, int]], params: Iterable[torch.Tensor],
               *, world_group=None) -> float:
    """Forward and backward of one batch under ``plan``; returns the global loss (same on every rank).

    ``loss_fn(work)`` runs the model on this rank's shard of its group's packed batch and returns
    ``(loss_sum, num_tokens)``: the *sum* of per-token losses over this rank's real tokens (padding
    rows and ignored labels excluded; it must stay connected to the graph even when the rank holds
    no real token, e.g. ``(ce * mask).sum()``, because attention's backward is collective over the
    group) and how many tokens that sum counts. It is not called on ranks whose group has no
    sequences.

    The loss is ``Σ loss_sum / Σ num_tokens`` over all ranks (one all-reduce of the two numbers);
    each rank back-propagates its ``loss_sum / Σ num_tokens``, then every parameter's gradient is
    summed over ``world_group`` (default: the world). Parameters' ``.grad`` must be None or zero
    on entry (they are all-reduced whole); None grads become zeros. Parameters must be the same
    list, in the same order, on every rank.
    """
    params = [p for p in params if p.requires_grad]
    work = rank_work(plan, seq_lens, rank, groups)
    # the two numbers travel on the world group's device (CUDA under NCCL), whatever the parameters'
    # device or whether there are any (seqpar calibrate passes none)
    device, dtype = collective_device(world_group), torch.float64
    if work.empty:
        loss_sum, count = None, 0
        stats = torch.zeros(2, dtype=dtype, device=device)
    else:
        loss_sum, count = loss_fn(work)
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
            raise ValueError("loss_fn: expected (scalar loss tensor, token count)")
        stats = torch.stack([loss_sum.detach().to(device, dtype), torch.tensor(float(count), dtype=dtype,
                                                                                device=device)])
    with peer_errors(world_group, "loss all-reduce"):
        dist.all_reduce(stats, group=world_group)
    total_loss, total_tokens = float(stats[0]), float(stats[1])
    if total_tokens <= 0:
        raise ValueError("train_step: the batch has no loss tokens (every num_tokens was 0)")
    if loss_sum is not None:
        (loss_sum / total_tokens).backward()
    _reduce_grads(params, group=world_group)
    return total_loss / total_tokens
