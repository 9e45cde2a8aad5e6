"""seqpar: exact sequence-parallel attention for long sequences.

Public API:
    METHODS, attention, shard, unshard, SequenceParallelAttention, CommStats,
    LINEAR_METHODS, linear_attention, checkpoint, TokenRingGroups, packed_layout, PeerError,
    Trace, trace (per-rank traces of a run: seqpar.tracing; replayed by seqpar.bench.replay)

The map of the package (what each folder owns and may import) is docs/architecture.md.
"""

from ._version import __version__
from .comm import CommStats, PeerError, TokenRingGroups
from .comm.usp_groups import USPGroups, make_usp_groups
from .layouts import packed_layout, shard, unshard
from .linear import linear_attention
from .methods import LINEAR_METHODS, METHODS
from .softmax import SequenceParallelAttention, attention
from .softmax.checkpoint import checkpoint
from .tracing import Trace, trace

__all__ = ["LINEAR_METHODS", "METHODS", "CommStats", "SequenceParallelAttention", "attention", "linear_attention",
           "shard", "unshard", "__version__", "checkpoint", "TokenRingGroups", "packed_layout", "PeerError",
           "Trace", "trace", "USPGroups", "make_usp_groups"]
