"""Communication primitives. Each takes the group explicitly and an optional ``CommStats``."""

from .collectives import all_gather_stack, all_reduce_, all_to_all, reduce_scatter_stack
from .groups import GroupInfo, group_info, resolve_group
from .p2p import Pending, PeerError, exchange, ring_shift
from .stats import CommStats, nbytes

__all__ = [
    "CommStats", "GroupInfo", "Pending", "PeerError", "all_gather_stack", "all_reduce_", "all_to_all", "exchange",
    "group_info", "nbytes", "reduce_scatter_stack", "resolve_group", "ring_shift",
]
