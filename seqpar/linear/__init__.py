"""Sequence-parallel gated linear attention: ZeCO's All-Scan, with LASP-2 and LASP-1 baselines.

See ``README.md`` beside this file, and ALGORITHMS.md §6.
"""

from .api import linear_attention
from .geometry import LinearShard, build_shard
from .plans import LINEAR_METHODS, PLANS, ScanPlan
from .reference import reference_linear_attention

__all__ = ["LINEAR_METHODS", "PLANS", "LinearShard", "ScanPlan", "build_shard", "linear_attention",
           "reference_linear_attention", "bench_linear"]


def __getattr__(name):  # the benchmark pulls in timing helpers only when asked for
    if name == "bench_linear":
        from .bench import bench_linear

        return bench_linear
    raise AttributeError(name)
