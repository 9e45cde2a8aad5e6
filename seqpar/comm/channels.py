"""Duplicate communicators of a group, one per traffic direction (TokenRing, LightSeq).

On NCCL every communicator is one stream: two traffic directions on one communicator serialise.
:class:`TokenRingGroups` gives a group two duplicates with the same members in the same order.
"""

from __future__ import annotations

import torch.distributed as dist

from .groups import GroupInfo, group_info

#: channel of the queries (and backward bundles) and channel of the partial results
Q_CHANNEL, OUT_CHANNEL = 0, 1


class TokenRingGroups:
    """A sequence-parallel group plus one duplicate communicator per traffic direction.

    Create it collectively (every member of ``group`` calls it, in the same order as its other
    group creations; for the whole world that is every process) and pass it as
    ``group=`` to :func:`seqpar.attention` (any method accepts it; ``token_ring`` then sends
    queries on ``channels[0]`` and partial results on ``channels[1]``), and to ``seqpar.shard`` /
    ``unshard`` as ``group=groups.group``. The caller owns the groups: keep the object for the
    whole training run and call :meth:`destroy` at the end. With a plain group instead, token_ring
    runs both directions on that group (tagged streams: correct, but on NCCL one stream).

    Attributes: ``group`` (the original), ``info`` (its :class:`~seqpar.comm.GroupInfo`),
    ``channels`` (two ``GroupInfo`` with the same members and order).
    """

    def __init__(self, group=None):
        self.group = group
        self.info = group_info(group)
        self._owned = []
        if self.info.single:
            self.channels: tuple[GroupInfo, ...] = (self.info, self.info)
            return
        ranks = list(self.info.global_ranks)
        # A subgroup is duplicated by its members alone (local synchronisation). The whole world
        # uses torch's counter-named groups instead: hashed names depend on how many groups exist,
        # so after groups were destroyed a new one could reuse a dead group's rendezvous keys.
        local = self.info.size != dist.get_world_size()
        chans = []
        for _ in (Q_CHANNEL, OUT_CHANNEL):
            pg = dist.new_group(ranks, use_local_synchronization=local)
            self._owned.append(pg)
            chans.append(GroupInfo(pg, dist.get_rank(pg), len(ranks), tuple(dist.get_process_group_ranks(pg))))
        if any(c.global_ranks != self.info.global_ranks or c.rank != self.info.rank for c in chans):
            raise RuntimeError("TokenRingGroups: a duplicated group orders its members differently (internal error)")
        self.channels = tuple(chans)

    def destroy(self) -> None:
        """Destroy the duplicated communicators (collective over the members)."""
        for pg in self._owned:
            dist.destroy_process_group(pg)
        self._owned = []
        self.channels = (self.info, self.info)

    def __repr__(self) -> str:
        return f"TokenRingGroups(size={self.info.size}, ranks={list(self.info.global_ranks)})"


__all__ = ["OUT_CHANNEL", "Q_CHANNEL", "TokenRingGroups"]
