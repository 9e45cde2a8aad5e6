"""seqpar: exact sequence-parallel attention for long sequences.

Public API:
    METHODS, attention, shard, unshard, SequenceParallelAttention, CommStats,
    LINEAR_METHODS, linear_attention, checkpoint, TokenRingGroups, packed_layout, PeerError
"""

from .attention import METHODS, SequenceParallelAttention, attention
from .attention.checkpoint import checkpoint
from .attention.packed import packed_layout
from .attention.token_ring import TokenRingGroups
from .comm import CommStats, PeerError
from .layout import shard, unshard
from .linear import LINEAR_METHODS, linear_attention

__version__ = "0.1.0"
__all__ = ["LINEAR_METHODS", "METHODS", "CommStats", "SequenceParallelAttention", "attention", "linear_attention", "shard", "unshard",
           "__version__", "checkpoint", "TokenRingGroups",
           "packed_layout", "PeerError"]
