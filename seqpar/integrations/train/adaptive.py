"""``seqpar train --adaptive``: the adaptive scheduler plans every step's sequences, each rank runs its
group's share of the plan on the FSDP2-sharded model.

Rank 0 plans the step's batch with :func:`seqpar.schedulers.plan_batch` (groups of aligned
power-of-two rank blocks, a method per group, sequences per group) and broadcasts the plan, so every
rank follows the same one. The process groups come from one
:class:`~seqpar.schedulers.execute.GroupCache` built at start (``new_group`` is collective over the
world), and :func:`~seqpar.schedulers.execute.rank_work` gives each rank its group, method and
sequences; a group's sequences, each a ``[seq_len]`` stream of packed documents, are concatenated
into one packed stream whose boundaries are the documents' (``shard_inputs(cu_seqlens=...)``).

The parameters are sharded over all W ranks (FSDP2, mesh ``(dp=W, cp=1)``), so every forward and
backward gathers and reduces over the whole world: every rank must run the same number of passes
per step. Each rank runs exactly one: its group's stream, or, when the plan leaves its group without
sequences, a two-token pass on its own with weight 0 (its gradients are zeros, its collectives
match the others'). The attention of every (group, method) this rank may meet is registered once,
on the meta model before sharding (registering runs a test forward, which on a sharded model would
be a collective that other ranks do not enter); a step only switches ``set_attn_implementation``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ...comm.collectives import peer_errors
from ...methods import ADAPTIVE_METHODS
from ..hf import apply_context_parallel, shard_inputs
from .step import backward, sum_over_ranks, token_loss


class AdaptiveRunner:
    """Plans a step's sequences and runs this rank's share of the plan.

    Args:
        world, rank: this process's world size and rank (torch.distributed must be initialised).
        time_limit: seconds ``plan_batch`` may spend per step.
        cost_model: the scheduler's :class:`~seqpar.schedulers.CostModel` (default: its GPU default).
        cluster: the :class:`~seqpar.schedulers.ClusterSpec` planned for (default: ``world`` ranks on one
            node with the GPU defaults); ``--calibration`` passes the measured one.

    Construction is collective (it builds the :class:`GroupCache`): every rank constructs it at the
    same point. Then :meth:`register` on the meta model, before ``parallelize``.
    """

    def __init__(self, world: int, rank: int, time_limit: float = 0.1, cost_model=None, cluster=None):
        from seqpar.schedulers import ClusterSpec, GroupCache

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("--adaptive: needs a process group (run with --nproc N >= 2 or under torchrun)")
        self.world, self.rank, self.time_limit = world, rank, time_limit
        self.cost_model = cost_model
        self.cluster = cluster if cluster is not None else ClusterSpec(world_size=world, ranks_per_node=world)
        if self.cluster.world_size != world:
            raise ValueError(f"cluster: plans for {self.cluster.world_size} ranks but the world has {world}")
        self.methods = [m for m in ADAPTIVE_METHODS if cost_model is None or m in cost_model.method_names]
        self.groups = GroupCache()  # every aligned block, built once; collective over the world
        self.implementations: dict[tuple[int, int, str], str] = {}
        self.model = None
        self.loss_chunk = None  # tokens per loss chunk (--loss-chunk; None = the default)

    def register(self, model) -> None:
        """One attention implementation per (block containing this rank, method), on the meta model."""
        size = 1
        while size <= self.world:
            start = self.rank // size * size
            group = self.groups.get(start, size)
            for method in self.methods:
                apply_context_parallel(model, group=group, method=method)
                self.implementations[(start, size, method)] = model.config._attn_implementation
            size *= 2
        self.model = model

    def plan(self, seq_lens: list[int]):
        """The same plan on every rank (rank 0 solves, then broadcasts)."""
        from seqpar.schedulers import plan_batch

        box = [plan_batch(seq_lens, self.cluster, self.cost_model, methods=self.methods,
                          time_limit=self.time_limit) if self.rank == 0 else None]
        with peer_errors(name="plan broadcast"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _inputs(self, work, sequence, device):
        """This rank's shard of its group's packed stream, or of a 2-token stream on its own (empty group)."""
        if work.empty:
            self.model.set_attn_implementation(self.implementations[(self.rank, 1, self.methods[0])])
            tokens = torch.zeros((1, 2), dtype=torch.long, device=device)
            return shard_inputs(tokens, cu_seqlens=[0, 2], group=self.groups.get(self.rank, 1),
                                method=self.methods[0]), [0, 2]
        g = work.group_plan
        self.model.set_attn_implementation(self.implementations[(g.start, g.size, work.method)])
        items = [sequence(i) for i in work.seqs]
        tokens = torch.cat([t for t, _ in items])[None].to(device)  # one packed stream of their documents
        cu, offset = [0], 0
        for t, doc_cu in items:
            cu.extend(offset + c for c in doc_cu[1:])
            offset += t.numel()
        return shard_inputs(tokens, cu_seqlens=cu, group=work.group, method=work.method), cu

    def step(self, plan, seq_lens: list[int], sequence: Callable[[int], tuple[torch.Tensor, list[int]]],
             rt, *, autocast, scaler=None) -> tuple[float, float]:
        """Forward and backward of one batch under ``plan`` (one pass on every rank); returns the
        global loss and the sum of squared document lengths. ``sequence(i)`` gives batch entry ``i``
        as ``(tokens [seq_len] int64, document cu_seqlens)``. FSDP2 sums the gradients of the global
        mean loss into the shards; with ``scaler`` (fp16) the loss is scaled before the backward."""
        from seqpar.schedulers.execute import rank_work

        from .flops import squared_lengths

        work = rank_work(plan, seq_lens, self.rank, self.groups)
        shard, cu = self._inputs(work, sequence, rt.device)
        valid = 0.0 if work.empty else float(shard.num_valid)
        count = max(sum_over_ranks([valid], rt, "label count all-reduce")[0], 1.0)
        token_loss_sum = token_loss(self.model, shard, autocast, self.loss_chunk)
        weight = 0.0 if work.empty else 1.0 / count  # the empty group's pass only keeps FSDP2 in step
        backward(token_loss_sum * weight, scaler)
        local = 0.0 if work.empty else float(token_loss_sum.detach())
        squares = 0.0 if work.empty else squared_lengths(cu) / work.group_plan.size
        total, squares = sum_over_ranks([local, squares], rt, "loss all-reduce")
        return total / count, squares

    def forward_sums(self, plan, seq_lens: list[int], sequence: Callable[[int], tuple[torch.Tensor, list[int]]],
                     rt, *, autocast) -> tuple[float, float]:
        """Forward only (the caller holds ``torch.no_grad()``): this rank's summed token loss and
        number of valid labels of a batch under ``plan`` (0, 0 on a rank whose group has no sequence;
        it still runs its pass). Local: the caller sums over the world."""
        from seqpar.schedulers.execute import rank_work

        work = rank_work(plan, seq_lens, self.rank, self.groups)
        shard, _ = self._inputs(work, sequence, rt.device)
        loss = token_loss(self.model, shard, autocast, self.loss_chunk)
        if work.empty:
            return 0.0, 0.0
        return float(loss.double()), float(shard.num_valid)
