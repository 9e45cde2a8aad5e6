"""seqpar: exact sequence-parallel attention for long sequences.

Public API:
    METHODS, attention, shard, unshard, SequenceParallelAttention, CommStats
"""

from .attention import METHODS, SequenceParallelAttention, attention
from .comm import CommStats
from .layout import shard, unshard

__version__ = "0.1.0"
__all__ = ["METHODS", "CommStats", "SequenceParallelAttention", "attention", "shard", "unshard", "__version__"]
