"""Collectives with byte accounting: all-gather, reduce-scatter, all-to-all, all-reduce.

Names say what they cost. Bytes counted are what *this rank sends* under the usual ring/pairwise
algorithms: an all-gather or reduce-scatter of a local chunk of ``n`` bytes sends ``(N-1)·n``; an
all-to-all sends everything except the part that stays local.

A collective that fails because a member crashed, hung up or timed out raises
:class:`~seqpar.comm.PeerError` naming the group's other members (a collective cannot tell which
one failed) instead of the backend's bare error.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..tracing import Trace
from .groups import GroupInfo, group_info
from .p2p import PeerError, peer_error
from .stats import CommStats, nbytes


@contextlib.contextmanager
def _named_failure(info: GroupInfo, name: str, peers=None):
    """Turn a backend error of the operation ``name`` into a PeerError naming ``peers`` (global
    ranks; default: the group's other members, as a collective cannot tell which one failed)."""
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as exc:  # gloo and NCCL report a dead or silent member as RuntimeError
        me = info.global_ranks[info.rank]
        who = [r for r in info.global_ranks if r != me] if peers is None else peers
        raise peer_error(exc, info, who, name) from exc


@contextlib.contextmanager
def peer_errors(group=None, name: str = "collective"):
    """Around a ``torch.distributed`` collective called directly (a barrier, an all-reduce of counts,
    ``broadcast_object_list``): a member that crashed, or stayed silent past the group's timeout,
    raises a :class:`~seqpar.comm.PeerError` naming the group's other members instead of the
    backend's bare error. ``group``: a ProcessGroup, None (the world) or a GroupInfo."""
    info = group if isinstance(group, GroupInfo) else group_info(group)
    with _named_failure(info, name):
        yield


def _all_gather_flat(out, flat, group):
    # all_gather_single is the newer name; all_gather_into_tensor is deprecated from torch 2.13 on
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, flat, group=group)


def all_gather_stack(info: GroupInfo, x: torch.Tensor, *, stats: CommStats | None = None,
                     name: str = "all_gather", trace: Trace | None = None) -> torch.Tensor:
    """Gather ``x`` from every member: returns ``[N, *x.shape]`` (member order of the group)."""
    x = x.contiguous()
    if info.single:
        return x.unsqueeze(0)
    record(trace, info, "all_gather", nbytes(x), name)
    flat = x.reshape(-1)
    out = torch.empty((info.size * flat.numel(),), dtype=x.dtype, device=x.device)
    with _named_failure(info, name):
        _all_gather_flat(out, flat, info.group)
    out = out.view(info.size, *x.shape)
    if stats is not None:
        _add_ring(info, stats, name, nbytes(x))
    return out


def reduce_scatter_stack(info: GroupInfo, x: torch.Tensor, *, stats: CommStats | None = None,
                         name: str = "reduce_scatter", trace: Trace | None = None) -> torch.Tensor:
    """Sum ``x`` (``[N, *chunk]``) over members and return this member's chunk ``x[rank]`` summed."""
    if info.single:
        return x[0]
    record(trace, info, "reduce_scatter", nbytes(x[0]), name)
    x = x.contiguous()
    out = torch.empty(x[0].numel(), dtype=x.dtype, device=x.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # newer name first
    with _named_failure(info, name):
        fn(out, x.reshape(-1), group=info.group)
    out = out.view(x.shape[1:])
    if stats is not None:
        _add_ring(info, stats, name, nbytes(out))
    return out


def record(trace: Trace | None, info: GroupInfo, kind: str, chunk: int, name: str, *, splits=None,
           async_op: bool = False) -> int | None:
    """Record a collective of this member's ``chunk`` bytes in ``trace`` (None: nothing); its id."""
    if trace is None:
        return None
    return trace.collective(kind, info.global_ranks[info.rank], info.global_ranks, chunk, splits=splits, chan=name,
                            async_op=async_op)


def _add_ring(info: GroupInfo, stats: CommStats, name: str, n: int) -> None:
    """Count a collective that moves ``n`` bytes per member chunk as the ring algorithm routes it
    (gloo's and NCCL's all-gather and reduce-scatter): N-1 chunks, all to the next member, so
    busiest-link figures see the (N-1)·n bytes on that link."""
    stats.add(name, (info.size - 1) * n, peer=info.peer(1))


def all_to_all(info: GroupInfo, x: torch.Tensor, *, input_splits: list[int] | None = None,
               output_splits: list[int] | None = None, stats: CommStats | None = None,
               name: str = "all_to_all", trace: Trace | None = None) -> torch.Tensor:
    """All-to-all along dim 0 with optional uneven splits (``all_to_all_single``)."""
    x = x.contiguous()
    if info.single:
        return x
    if trace is not None:
        row = nbytes(x[:1]) if x.shape[0] else 0
        sizes = input_splits or [x.shape[0] // info.size] * info.size
        record(trace, info, "all_to_all", nbytes(x), name, splits=[s * row for s in sizes])
    if output_splits is None:
        out = torch.empty_like(x)
    else:
        out = torch.empty((sum(output_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    with _named_failure(info, name):
        dist.all_to_all_single(out, x, output_splits, input_splits, group=info.group)
    if stats is not None:  # per peer, so busiest-link figures see it; the one exchange is one step
        row = nbytes(x[:1]) if x.shape[0] else 0
        splits = input_splits or [x.shape[0] // info.size] * info.size
        per_peer = {info.global_ranks[m]: splits[m] * row for m in range(info.size) if m != info.rank}
        for peer, n in per_peer.items():
            stats.add(name, n, peer=peer)
        if hasattr(stats, "note_step"):
            stats.note_step(per_peer)
    return out


def all_reduce_(info: GroupInfo, x: torch.Tensor, *, op=None, stats: CommStats | None = None,
                name: str = "all_reduce", trace: Trace | None = None) -> torch.Tensor:
    """In-place all-reduce (sum by default)."""
    if info.single:
        return x
    record(trace, info, "all_reduce", nbytes(x), name)
    with _named_failure(info, name):
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=info.group)
    if stats is not None:
        stats.add(name, 2 * (info.size - 1) * nbytes(x) // info.size)
    return x
