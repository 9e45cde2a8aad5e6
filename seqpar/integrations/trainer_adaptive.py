"""``seqpar train --adaptive``: the adaptive scheduler plans every step's sequences, the trainer runs
the plan.

Rank 0 plans the step's batch with :func:`seqpar.schedulers.plan_batch` (groups of aligned
power-of-two rank blocks, a method per group, sequences per group) and broadcasts the plan, so every
rank follows the same one. The process groups of every aligned block are created once at start
(``new_group`` is collective); the model gets one registered attention per (group, method) it meets
and switches between them with ``set_attn_implementation``. Gradients and the loss are reduced over
the whole world, so a step equals the same batch on one rank whatever the plan.
"""

from __future__ import annotations

import torch.distributed as dist

from .hf import apply_context_parallel

RING_FAMILY = ("zigzag_ring", "striped_ring", "ring", "allgather_kv")  # 1-D groups, any head counts


class AdaptiveRunner:
    """Plans a step's sequences and selects this rank's group and method on the model."""

    def __init__(self, model, world: int, rank: int, time_limit: float = 0.1):
        import seqpar
        from seqpar.schedulers import SOFTMAX_METHODS, ClusterSpec

        self.model, self.world, self.rank, self.time_limit = model, world, rank, time_limit
        self.cluster = ClusterSpec(world_size=world, ranks_per_node=world)
        self.methods = [m for m in RING_FAMILY if m in SOFTMAX_METHODS and m in seqpar.METHODS]
        self.groups = {}  # (start, size) -> ProcessGroup of the blocks this rank is in
        size = 1  # single-rank groups too: group=None would mean the whole world
        while size <= world:
            for start in range(0, world, size):
                group = dist.new_group(list(range(start, start + size)))  # every rank, same order
                if start <= rank < start + size:
                    self.groups[(start, size)] = group
            size *= 2
        self.implementations: dict[tuple[int, int, str], str] = {}

    def plan(self, seq_lens: list[int]):
        """The same plan on every rank (rank 0 solves, then broadcasts)."""
        from seqpar.schedulers import plan_batch

        box = [plan_batch(seq_lens, self.cluster, methods=self.methods, time_limit=self.time_limit)
               if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def my_sequences(self, plan, seq_lens: list[int]) -> tuple[object, str, list[int]]:
        """This rank's (group, method, batch indices); the model is switched to that group and method."""
        from seqpar.schedulers import local_batch

        groups = plan.groups_for_rank(self.rank)
        if not groups:
            return None, "", []
        g = groups[0]
        group = self.groups[(g.start, g.size)]
        key = (g.start, g.size, g.method)
        if key not in self.implementations:
            apply_context_parallel(self.model, group=group, method=g.method)
            self.implementations[key] = self.model.config._attn_implementation
        else:
            self.model.set_attn_implementation(self.implementations[key])
        return group, g.method, local_batch(plan, self.rank, seq_lens)
