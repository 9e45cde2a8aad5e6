"""Point-to-point exchanges on a ring, posted early and waited on late.

The ring loop posts the transfer of the next step *before* computing the current block and waits
only when the data is needed, so communication overlaps compute. On gloo (CPU) the transfers run on
gloo's own threads; on NCCL they run on NCCL's internal stream, and ``wait()`` makes the current
stream wait for them (no host synchronisation).

A transfer that fails because a peer died, closed its connection or did not answer within the
process group's timeout raises :class:`PeerError` naming the peer rank(s), never a bare backend
error: on gloo a crashed peer is reported at once ("connection closed"), a silent one after the
group's ``timeout``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..tracing import Trace
from .groups import GroupInfo
from .stats import CommStats, nbytes


class PeerError(RuntimeError):
    """A send, receive or collective failed because a peer crashed, hung up or timed out.

    ``peers``: the global ranks the failed operation talked to (the suspects); ``op``: what failed
    (e.g. ``"ring_p2p recv"``); ``timeout``: the process group's timeout, when known.
    """

    def __init__(self, message: str, *, peers: tuple[int, ...] = (), op: str = "",
                 timeout: datetime.timedelta | None = None) -> None:
        super().__init__(message)
        self.peers, self.op, self.timeout = tuple(peers), op, timeout


def group_timeout(group) -> datetime.timedelta | None:
    """The timeout of ``group``'s backend (for messages only; None when torch does not say)."""
    if group is None:
        return None
    for device in ("cpu", "cuda"):
        try:  # not a public attribute: any failure just leaves the timeout out of the message
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:
            continue
    return None


def peer_error(exc: BaseException, info: GroupInfo, peers, op: str) -> PeerError:
    """Wrap the backend's error ``exc`` of operation ``op`` with ``peers`` (global ranks) into a
    :class:`PeerError` that names them and says what to do."""
    peers = tuple(sorted(set(peers)))
    timeout = group_timeout(info.group)
    me = info.global_ranks[info.rank] if info.global_ranks else info.rank
    who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {list(peers)}"
    limit = f"the group's timeout of {timeout}" if timeout is not None else "the group's timeout"
    return PeerError(
        f"{op} on rank {me} with {who} failed: {type(exc).__name__}: {str(exc).strip()[:400]}\n"
        f"{who.capitalize()} has probably crashed, raised an error or stopped communicating (a silent "
        f"peer is given up on after {limit}). Check the log of {who} for its first error. To fail "
        f"faster (or wait longer) on a silent peer, pass timeout=datetime.timedelta(seconds=...) to "
        f"torch.distributed.init_process_group / new_group.",
        peers=peers, op=op, timeout=timeout)


@dataclass
class Pending:
    """Transfers in flight; ``wait()`` returns the received tensors (in the order they were posted).

    ``peers[i]`` lists the ``(global_rank, "send" | "recv")`` transfers behind ``works[i]`` (one, or
    a whole batch when the backend coalesces it); a failed wait raises :class:`PeerError` naming them.
    """

    works: list
    received: list
    peers: list = field(default_factory=list)
    info: GroupInfo | None = None
    name: str = "p2p"
    trace: Trace | None = None
    recv_ids: list = field(default_factory=list)  # trace ids of the receives, in posting order
    ids: list = field(default_factory=list)  # trace ids of every transfer (what wait() waits for)

    def wait(self) -> list[torch.Tensor]:
        works, peers, self.works = self.works, self.peers, []
        if self.trace is not None:
            self.trace.wait(self.ids)
        for i, w in enumerate(works):
            try:
                w.wait()
            except RuntimeError as exc:  # gloo and NCCL report a dead or silent peer as RuntimeError
                raise _transfer_error(exc, self.info, peers[i] if i < len(peers) else [], self.name) from exc
        return self.received


def _transfer_error(exc, info, transfers, name) -> PeerError:
    roles = "/".join(sorted({role for _, role in transfers})) or "transfer"
    return peer_error(exc, info, [p for p, _ in transfers], f"{name} {roles}")


def _post(info: GroupInfo, ops: list, transfers: list, name: str) -> tuple[list, list]:
    """Post ``ops``: one by one for CPU tensors (gloo, which does not coalesce: exactly what
    ``batch_isend_irecv`` does there, but a failure is pinned on its own peer), as one batch
    otherwise (NCCL groups the batch; its works then stand for all of ``transfers``)."""
    try:
        if all(op.tensor.device.type == "cpu" for op in ops):
            works = []
            for op, transfer in zip(ops, transfers):
                try:
                    works.append(op.op(op.tensor, op.peer, op.group, op.tag))
                except RuntimeError as exc:
                    raise _transfer_error(exc, info, [transfer], name) from exc
            return works, [[t] for t in transfers]
        works = list(dist.batch_isend_irecv(ops))
    except RuntimeError as exc:
        if isinstance(exc, PeerError):
            raise
        raise _transfer_error(exc, info, transfers, name) from exc
    per = [[t] for t in transfers] if len(works) == len(transfers) else [list(transfers)] * len(works)
    return works, per


def exchange(
    info: GroupInfo,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    *,
    stats: CommStats | None = None,
    name: str = "p2p",
    trace: Trace | None = None,
    deps: list | None = None,
) -> Pending:
    """Post sends ``(tensor, group_offset)`` and receives ``(buffer, group_offset)`` as one batch.

    Offsets are relative to this rank on the group's ring (+1 = next, -1 = previous, any other value
    for direct links). Sending to oneself is not allowed (gloo refuses it); the caller skips it.
    An entry may carry a third element, a message tag (default 0): messages between two ranks are
    matched per tag, so streams with different tags never pair up with each other.
    Raises :class:`PeerError` (here or in ``wait()``) when a peer crashed or timed out.
    ``trace``: record every transfer there (stream ``name``), the sends with ``deps[i]`` (the ids
    of the events whose results send ``i`` carries).
    """
    if info.single or (not sends and not recvs):
        return Pending([], [entry[0] for entry in recvs])
    ops, transfers = [], []
    ids = _record(trace, info, sends, recvs, name, deps) if trace is not None else ([], [])
    for t, off, *tag in sends:
        peer = info.peer(off)
        if not t.is_contiguous():
            raise ValueError("exchange: tensors must be contiguous (internal error)")
        ops.append(dist.P2POp(dist.isend, t, peer, info.group, tag[0] if tag else 0))
        transfers.append((peer, "send"))
        if stats is not None:
            stats.add(name, nbytes(t), peer=peer)
    for buf, off, *tag in recvs:
        ops.append(dist.P2POp(dist.irecv, buf, info.peer(off), info.group, tag[0] if tag else 0))
        transfers.append((info.peer(off), "recv"))
    works, per = _post(info, ops, transfers, name)
    return Pending(works, [entry[0] for entry in recvs], per, info, name, trace, ids[1], ids[0] + ids[1])


def _record(trace: Trace, info: GroupInfo, sends, recvs, name: str, deps) -> tuple[list, list]:
    """Trace ids of the sends and of the receives of one :func:`exchange`."""
    me = info.global_ranks[info.rank]
    sent = [trace.send(me, info.peer(off), nbytes(t), chan=name, tag=tag[0] if tag else 0,
                       deps=deps[i] if deps else ()) for i, (t, off, *tag) in enumerate(sends)]
    got = [trace.recv(info.peer(off), me, nbytes(t), chan=name, tag=tag[0] if tag else 0) for t, off, *tag in recvs]
    return sent, got


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
