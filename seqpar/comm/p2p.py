"""Point-to-point exchanges on a ring, posted early and waited on late.

The ring loop posts the transfer of the next step *before* computing the current block and waits
only when the data is needed, so communication overlaps compute. On gloo (CPU) the transfers run on
gloo's own threads; on NCCL they run on NCCL's internal stream, and ``wait()`` makes the current
stream wait for them (no host synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .groups import GroupInfo
from .stats import CommStats, nbytes


@dataclass
class Pending:
    """Transfers in flight; ``wait()`` returns the received tensors (in the order they were posted)."""

    works: list
    received: list

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        return self.received


def exchange(
    info: GroupInfo,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    *,
    stats: CommStats | None = None,
    name: str = "p2p",
) -> Pending:
    """Post sends ``(tensor, group_offset)`` and receives ``(buffer, group_offset)`` as one batch.

    Offsets are relative to this rank on the group's ring (+1 = next, -1 = previous, any other value
    for direct links). Sending to oneself is not allowed (gloo refuses it); the caller skips it.
    An entry may carry a third element, a message tag (default 0): messages between two ranks are
    matched per tag, so streams with different tags never pair up with each other.
    """
    if info.single or (not sends and not recvs):
        return Pending([], [entry[0] for entry in recvs])
    ops = []
    for t, off, *tag in sends:
        peer = info.peer(off)
        if not t.is_contiguous():
            raise ValueError("exchange: tensors must be contiguous (internal error)")
        ops.append(dist.P2POp(dist.isend, t, peer, info.group, tag[0] if tag else 0))
        if stats is not None:
            stats.add(name, nbytes(t), peer=peer)
    for buf, off, *tag in recvs:
        ops.append(dist.P2POp(dist.irecv, buf, info.peer(off), info.group, tag[0] if tag else 0))
    works = dist.batch_isend_irecv(ops)
    return Pending(list(works), [entry[0] for entry in recvs])


def ring_shift(
    info: GroupInfo,
    tensor: torch.Tensor,
    *,
    stats: CommStats | None = None,
    name: str = "ring_p2p",
    offset: int = 1,
) -> Pending:
    """Send ``tensor`` to the member ``offset`` ahead and receive one like it from ``offset`` behind."""
    buf = torch.empty_like(tensor)
    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    return exchange(info, [(t, offset)], [(buf, -offset)], stats=stats, name=name)
