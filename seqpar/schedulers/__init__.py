"""Heterogeneity-adaptive scheduling (ALGORITHMS.md §7): per batch, which ranks form which
sequence-parallel groups, which method each group runs, and which sequences it processes.

Planning needs numpy (and scipy for the MILP; without it the greedy planner is used). Nothing here
imports torch or touches process groups: a :class:`Plan` is plain data for an executor.

    cluster = ClusterSpec.h100(world_size=64)
    plan = plan_batch(seq_lens, cluster)            # MILP (HiGHS) seeded and checked by greedy
    mine = local_batch(plan, rank, seq_lens)        # sequences this rank's group packs
    (group,) = plan.groups_for_rank(rank)           # its ranks and method
"""

from .ahead import PlanAhead
from .cluster import ClusterSpec
from .cost import KNOWN_METHODS, LINEAR_METHODS, SOFTMAX_METHODS, CostModel, GroupCoeffs, MethodCost
from .data import fit_to_cluster, sample_lengths, stdlib_lengths
from .greedy import best_static_plan, greedy_plan, static_plan
from .plan import GroupPlan, Plan, local_batch
from .planner import plan_batch

__all__ = [
    "ClusterSpec", "CostModel", "GroupCoeffs", "GroupPlan", "KNOWN_METHODS", "LINEAR_METHODS", "MethodCost",
    "Plan", "PlanAhead", "SOFTMAX_METHODS", "best_static_plan", "fit_to_cluster", "greedy_plan", "local_batch",
    "plan_batch", "sample_lengths", "static_plan", "stdlib_lengths",
]
