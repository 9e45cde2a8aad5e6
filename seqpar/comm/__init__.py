"""Communication primitives and process-group plumbing. Each primitive takes the group explicitly and an
optional ``CommStats``. Also here: agreement across ranks (:mod:`.agreement`), USP's groups
(:mod:`.usp_groups`), duplicated communicators (:mod:`.channels`), how this process was launched
(:mod:`.launch`) and local CPU ranks for the commands (:mod:`.pool`)."""

from .channels import TokenRingGroups
from .collectives import all_gather_stack, all_reduce_, all_to_all, reduce_scatter_stack
from .groups import GroupInfo, group_info, resolve_group
from .p2p import PeerError, Pending, exchange, ring_shift
from .stats import CommStats, nbytes

__all__ = [
    "CommStats", "GroupInfo", "Pending", "PeerError", "TokenRingGroups", "all_gather_stack", "all_reduce_",
    "all_to_all", "exchange", "group_info", "nbytes", "reduce_scatter_stack", "resolve_group", "ring_shift",
]
