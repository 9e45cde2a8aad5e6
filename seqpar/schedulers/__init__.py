"""Heterogeneity-adaptive scheduling (seqpar/schedulers/README.md): per batch, which ranks form which
sequence-parallel groups, which method each group runs, and which sequences it processes.

Planning needs numpy (and scipy for the MILP; without it the greedy planner is used). Nothing here
imports torch or touches process groups: a :class:`Plan` is plain data for an executor. The executor
(:mod:`.execute`: ``GroupCache``, ``RankWork``, ``rank_work``, ``execute_plan``, ``train_step``) needs
torch and is imported on first use of those names.

    cluster = ClusterSpec.h100(world_size=64)
    plan = plan_batch(seq_lens, cluster)            # MILP (HiGHS) seeded and checked by greedy
    mine = local_batch(plan, rank, seq_lens)        # sequences this rank's group packs
    (group,) = plan.groups_for_rank(rank)           # its ranks and method
"""

from .ahead import PlanAhead
from .cluster import ClusterSpec
from .cost import (
    KNOWN_METHODS,
    LINEAR_METHODS,
    SOFTMAX_METHODS,
    CostModel,
    GroupCoeffs,
    MethodCost,
)
from .data import fit_to_cluster, sample_lengths, stdlib_lengths
from .greedy import best_static_plan, greedy_plan, static_plan
from .plan import GroupPlan, Plan, local_batch
from .planner import plan_batch

__all__ = [
    "ClusterSpec", "CostModel", "GroupCache", "GroupCoeffs", "GroupPlan", "KNOWN_METHODS", "LINEAR_METHODS",
    "MethodCost", "Plan", "PlanAhead", "RankWork", "SOFTMAX_METHODS", "best_static_plan", "execute_plan",
    "fit_to_cluster", "greedy_plan", "local_batch", "plan_batch", "rank_work", "sample_lengths", "static_plan",
    "stdlib_lengths", "train_step",
]

_EXECUTE = ("GroupCache", "RankWork", "execute_plan", "rank_work", "train_step")


def __getattr__(name):  # the executor imports torch: load it only when asked for
    if name in _EXECUTE:
        from . import execute

        return getattr(execute, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
