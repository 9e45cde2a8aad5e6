"""``seqpar train --adaptive``: the adaptive scheduler plans every step's sequences, the trainer runs
the plan through :mod:`seqpar.schedulers.execute`.

Rank 0 plans the step's batch with :func:`seqpar.schedulers.plan_batch` (groups of aligned
power-of-two rank blocks, a method per group, sequences per group) and broadcasts the plan, so every
rank follows the same one. Everything after that is the scheduler's executor:

* the process groups come from one :class:`~seqpar.schedulers.execute.GroupCache` the runner owns
  for the whole run (built once at start: ``new_group`` is collective over the world);
* :func:`~seqpar.schedulers.execute.train_step` gives each rank its
  :class:`~seqpar.schedulers.execute.RankWork` (group, method, sequences), normalises the loss by
  the global label count and sums the gradients over the world, so a step equals the same batch on
  one rank whatever the plan.

The runner only adds what is specific to a transformers model: one registered attention per
(group, method) it meets (switched with ``set_attn_implementation``), and the group's sequences,
each a ``[seq_len]`` stream of packed documents, concatenated into one packed stream whose document
boundaries are the documents' (``shard_inputs(cu_seqlens=...)``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ...comm.collectives import peer_errors
from ...methods import ADAPTIVE_METHODS
from ..hf import apply_context_parallel, shard_inputs
from .step import token_loss


class AdaptiveRunner:
    """Plans a step's sequences and runs this rank's share of the plan on ``model``.

    Args:
        model: a transformers causal LM (the same weights on every rank).
        world, rank: this process's world size and rank (torch.distributed must be initialised).
        time_limit: seconds ``plan_batch`` may spend per step.
        cost_model: the scheduler's :class:`~seqpar.schedulers.CostModel` (default: its GPU default).
        cluster: the :class:`~seqpar.schedulers.ClusterSpec` planned for (default: ``world`` ranks on one
            node with the GPU defaults); ``--calibration`` passes the measured one.

    Construction is collective (it builds the :class:`GroupCache`): every rank constructs it at the
    same point.
    """

    def __init__(self, model, world: int, rank: int, time_limit: float = 0.1, cost_model=None, cluster=None):
        from seqpar.schedulers import ClusterSpec, GroupCache

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("--adaptive: needs a process group (run with --nproc N >= 2 or under torchrun)")
        self.model, self.world, self.rank, self.time_limit = model, world, rank, time_limit
        self.cost_model = cost_model
        self.cluster = cluster if cluster is not None else ClusterSpec(world_size=world, ranks_per_node=world)
        if self.cluster.world_size != world:
            raise ValueError(f"cluster: plans for {self.cluster.world_size} ranks but the world has {world}")
        self.methods = [m for m in ADAPTIVE_METHODS if cost_model is None or m in cost_model.method_names]
        self.groups = GroupCache()  # every aligned block, built once; collective over the world
        self.implementations: dict[tuple[int, int, str], str] = {}

    def plan(self, seq_lens: list[int]):
        """The same plan on every rank (rank 0 solves, then broadcasts)."""
        from seqpar.schedulers import plan_batch

        box = [plan_batch(seq_lens, self.cluster, self.cost_model, methods=self.methods,
                          time_limit=self.time_limit) if self.rank == 0 else None]
        with peer_errors(name="plan broadcast"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def use(self, work) -> None:
        """Switch the model's attention to ``work``'s group and method (registered once per pair)."""
        g = work.group_plan
        key = (g.start, g.size, work.method)
        if key not in self.implementations:
            apply_context_parallel(self.model, group=work.group, method=work.method)
            self.implementations[key] = self.model.config._attn_implementation
        else:
            self.model.set_attn_implementation(self.implementations[key])

    def step(self, plan, seq_lens: list[int], sequence: Callable[[int], tuple[torch.Tensor, list[int]]],
             params, *, device: torch.device, autocast) -> float:
        """Forward and backward of one batch under ``plan``; returns the global loss (every rank).

        ``sequence(i)`` gives batch entry ``i`` as ``(tokens [seq_len] int64, document cu_seqlens)``.
        Gradients of ``params`` are summed over the world on return (``.grad`` None or zero on entry).
        """
        from seqpar.schedulers.execute import train_step

        def loss_fn(work):
            self.use(work)
            items = [sequence(i) for i in work.seqs]
            tokens = torch.cat([t for t, _ in items])[None].to(device)  # one packed stream of their documents
            cu, offset = [0], 0
            for t, doc_cu in items:
                cu.extend(offset + c for c in doc_cu[1:])
                offset += t.numel()
            shards = [shard_inputs(tokens, cu_seqlens=cu, group=work.group, method=work.method)]
            loss_sum, count = None, 0
            for b in shards:
                ce = token_loss(self.model, b, autocast)
                loss_sum = ce if loss_sum is None else loss_sum + ce
                count += b.num_valid
            return loss_sum, count

        return train_step(plan, seq_lens, self.rank, self.groups, loss_fn, params)
