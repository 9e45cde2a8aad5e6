"""Sequence-parallel gated linear attention: ZeCO's All-Scan, with LASP-2 and LASP-1 baselines.

See ``README.md`` beside this file, and docs/methods.md. The benchmark is :mod:`seqpar.bench.linear`.
"""

from ..methods import LINEAR_METHODS
from .api import linear_attention
from .geometry import LinearShard, build_shard
from .plans import PLANS, ScanPlan
from .reference import reference_linear_attention

__all__ = ["LINEAR_METHODS", "PLANS", "LinearShard", "ScanPlan", "build_shard", "linear_attention",
           "reference_linear_attention"]
