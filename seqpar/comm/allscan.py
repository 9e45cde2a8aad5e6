"""Scans of affine state maps along the ranks of a group (ZeCO's All-Scan and its baselines).

Rank ``p`` of the group holds a map ``S -> diag(decay_p) S + local_p`` on states of shape
``[R, H, K, V]`` (``decay_p``: ``[R, H, K]``). A *forward* scan gives every rank the state coming in
from the ranks before it, ``in_0 = first``, ``in_p = out_{p-1}``, ``out_p = decay_p * in_p + local_p``;
a *reverse* scan runs the same recurrence from the last rank to the first (the backward pass).

Primitives (names say what they cost; every one takes the group explicitly and records the bytes this
rank sends in a :class:`~seqpar.comm.stats.CommStats` when one is given):

- :class:`ChainScan` (``"allscan"``): point-to-point chain. Every rank except the last sends exactly one
  state (``R*H*K*V`` elements), whatever the group size. The state is cut into ``n_blocks`` row blocks
  along K; because the decay is diagonal, block ``b`` of ``out_p`` needs only block ``b`` of ``in_p``,
  so a block is forwarded as soon as it arrives and the chain costs about one state transfer plus
  ``N - 1`` block latencies. A helper thread does the receive-combine-send work, so the calling
  thread computes meanwhile (gloo runs the transfers on its own threads; on CUDA the helper's
  kernels go to a side stream, untested on a GPU so far).
- :func:`allgather_start` (``"all_gather"``): every rank's tensor to every rank, posted asynchronously
  (sends ``(N-1)`` copies of the local tensor); :func:`fold_forward` / :func:`fold_reverse` finish the
  scan locally (LASP-2).
- :func:`broadcast_from` (``"broadcast"``) and :func:`reduce_to` (``"reduce"``), for the final state and
  its gradient.

A transfer that fails because a peer crashed, hung up or timed out raises
:class:`~seqpar.comm.PeerError` naming it (the chain's neighbour; the other members for a
collective), like the ring's P2P exchange.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

from ..tracing import Trace
from .collectives import _add_ring, _named_failure, record
from .groups import GroupInfo
from .stats import CommStats, nbytes

__all__ = ["ChainScan", "Gathered", "allgather_start", "fold_forward", "fold_reverse", "broadcast_from",
           "reduce_to"]


class ChainScan:
    """One All-Scan pass along the group, pipelined by row blocks of K.

    Arguments (this rank's view): ``local`` ``[R, H, K, V]``, ``decay`` ``[R, H, K]`` (broadcastable),
    ``first`` the incoming state of the head rank (rank 0 forward, rank N-1 reverse; ``None`` = zeros,
    ignored on other ranks), ``first_work`` an async work to wait on before ``first`` is read.

    :meth:`start` posts every receive at once and starts the helper thread; :meth:`wait` joins it and
    returns ``(incoming, outgoing)``, both ``[R, H, K, V]``: the state received (or ``first``) and
    ``decay * incoming + local`` (what was sent; on the tail rank it is the scan's last value).
    """

    def __init__(self, info: GroupInfo, local: torch.Tensor, decay: torch.Tensor, first=None, *,
                 n_blocks: int = 1, reverse: bool = False, stats: CommStats | None = None,
                 name: str = "allscan", first_work=None, trace: Trace | None = None, first_id=None) -> None:
        self.info, self.local, self.decay = info, local, decay.expand(local.shape[:-1])
        self.first, self.first_work = first, first_work
        self.stats, self.name = stats, name
        k = local.shape[2]
        cuts = torch.linspace(0, k, min(max(1, n_blocks), k) + 1).round().long().tolist()
        self.blocks = [(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
        step = -1 if reverse else 1
        n, r = info.size, info.rank
        self.head = r == (n - 1 if reverse else 0)
        self.tail = r == (0 if reverse else n - 1)
        self.prev = None if self.head else info.peer(-step)
        self.next = None if self.tail else info.peer(step)
        self._recv: list = []
        self._bufs: list = []
        self._inc: list = [None] * len(self.blocks)
        self._out: list = [None] * len(self.blocks)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stream = None
        self.trace, self.first_id, self._ids = trace, first_id, []

    def _record(self) -> None:
        """The chain in the trace: every receive posted now, each block's send once that block arrived
        (the helper thread forwards it; the head's once ``first`` is there)."""
        me, rows = self.info.global_ranks[self.info.rank], self.local[:, :, :1].numel()
        size = self.local.element_size()
        for i, (a, b) in enumerate(self.blocks):
            got = None if self.head else self.trace.recv(self.prev, me, rows * (b - a) * size, chan=self.name, tag=i)
            deps = [got] if got is not None else ([self.first_id] if self.first_id is not None else [])
            sent = None if self.tail else self.trace.send(me, self.next, rows * (b - a) * size, chan=self.name,
                                                          tag=i, deps=deps)
            self._ids += [x for x in (got, sent) if x is not None]

    def start(self) -> ChainScan:
        if self.trace is not None and not self.info.single:
            self._record()
        if self.local.is_cuda:  # the helper's small kernels must not queue behind the compute stream
            self._stream = torch.cuda.Stream(device=self.local.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.local.device))
        if not self.head:  # post every receive before any compute
            with _named_failure(self.info, f"{self.name} receive", [self.prev]):
                for i, (a, b) in enumerate(self.blocks):
                    buf = self.local.new_empty(*self.local.shape[:2], b - a, self.local.shape[3])
                    self._bufs.append(buf)
                    self._recv.append(dist.irecv(buf, src=self.prev, group=self.info.group, tag=i))
        if self.info.single:
            self._run()
        else:
            self._thread = threading.Thread(target=self._run, name="seqpar-allscan", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        sends = []
        side = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), side:
                if self.head and self.first_work is not None:
                    self.first_work.wait()
                for i, (a, b) in enumerate(self.blocks):
                    if self.head:
                        inc = (self.local.new_zeros(*self.local.shape[:2], b - a, self.local.shape[3])
                               if self.first is None else self.first[:, :, a:b].to(self.local.dtype))
                    else:
                        with _named_failure(self.info, f"{self.name} receive", [self.prev]):
                            self._recv[i].wait()
                        inc = self._bufs[i]
                    out = torch.addcmul(self.local[:, :, a:b], self.decay[:, :, a:b, None], inc).contiguous()
                    self._inc[i], self._out[i] = inc, out
                    if not self.tail:
                        with _named_failure(self.info, f"{self.name} send", [self.next]):
                            sends.append(dist.isend(out, dst=self.next, group=self.info.group, tag=i))
                        if self.stats is not None:
                            self.stats.add(self.name, nbytes(out), peer=self.next)
                with _named_failure(self.info, f"{self.name} send", [self.next]):
                    for w in sends:
                        w.wait()
        except BaseException as exc:  # re-raised in the calling thread by wait()
            self._error = exc

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.trace is not None:
            self.trace.wait(self._ids + ([self.first_id] if self.first_id is not None else []))
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if self._stream is not None:
            main = torch.cuda.current_stream(self.local.device)
            main.wait_stream(self._stream)
            for t in self._inc + self._out:
                t.record_stream(main)
        return torch.cat(self._inc, dim=2), torch.cat(self._out, dim=2)


class Gathered:
    """An all-gather in flight; :meth:`wait` returns ``[N, *x.shape]`` in group order."""

    def __init__(self, out: torch.Tensor, work, info: GroupInfo | None = None, name: str = "all_gather",
                 trace: Trace | None = None, trace_id: int | None = None) -> None:
        self.out, self.work, self.info, self.name = out, work, info, name
        self.trace, self.trace_id = trace, trace_id

    def wait(self) -> torch.Tensor:
        if self.trace is not None and self.trace_id is not None:
            self.trace.wait([self.trace_id])
        if self.work is not None:
            with _named_failure(self.info, self.name):
                self.work.wait()
            self.work = None
        return self.out


def allgather_start(info: GroupInfo, x: torch.Tensor, *, stats: CommStats | None = None,
                    name: str = "all_gather", trace: Trace | None = None) -> Gathered:
    """Post an asynchronous all-gather of ``x``; this rank sends ``N - 1`` copies of it (counted as the
    ring algorithm of gloo and NCCL routes them: all to the next member, like
    :func:`~seqpar.comm.collectives.all_gather_stack`)."""
    x = x.contiguous()
    out = x.new_empty(info.size, *x.shape)
    if info.single:
        out[0] = x
        return Gathered(out, None)
    flat = out.view(info.size * x.shape[0], *x.shape[1:]) if x.dim() else out
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    trace_id = record(trace, info, "all_gather", nbytes(x), name, async_op=True)
    with _named_failure(info, name):
        work = gather(flat, x, group=info.group, async_op=True)
    if stats is not None:
        _add_ring(info, stats, name, nbytes(x))
    return Gathered(out, work, info, name, trace, trace_id)


def fold_forward(locals_: torch.Tensor, decays: torch.Tensor, first: torch.Tensor | None, upto: int):
    """``in_upto`` of the forward scan from gathered ``locals_ [N, R, H, K, V]``, ``decays [N, R, H, K]``."""
    s = torch.zeros_like(locals_[0]) if first is None else first.to(locals_.dtype)
    for j in range(upto):
        s = torch.addcmul(locals_[j], decays[j][..., None], s)
    return s


def fold_reverse(locals_: torch.Tensor, decays: torch.Tensor, last: torch.Tensor | None, downto: int):
    """``in_downto`` of the reverse scan (from rank N-1 down to ``downto + 1``)."""
    s = torch.zeros_like(locals_[0]) if last is None else last.to(locals_.dtype)
    for j in range(locals_.shape[0] - 1, downto, -1):
        s = torch.addcmul(locals_[j], decays[j][..., None], s)
    return s


def broadcast_from(info: GroupInfo, x: torch.Tensor | None, src: int, like: torch.Tensor, *,
                   stats: CommStats | None = None, name: str = "broadcast", trace: Trace | None = None) -> torch.Tensor:
    """Member ``src``'s ``x`` on every member (others pass ``x=None`` and a ``like`` template). The
    source counts ``N - 1`` copies (what a flat broadcast sends)."""
    if info.single:
        return x
    buf = x.contiguous() if info.rank == src else torch.empty_like(like)
    record(trace, info, "broadcast", nbytes(buf), name)
    with _named_failure(info, name):
        dist.broadcast(buf, src=info.global_ranks[src], group=info.group)
    if stats is not None and info.rank == src:
        for i, peer in enumerate(info.global_ranks):
            if i != src:
                stats.add(name, nbytes(buf), peer=peer)
    return buf


def reduce_to(info: GroupInfo, x: torch.Tensor, dst: int, *, stats: CommStats | None = None,
              name: str = "reduce", async_op: bool = False, trace: Trace | None = None):
    """Sum ``x`` over the group onto member ``dst`` (in place there). Every other member sends one
    copy. ``x`` itself is left alone (the sum goes into a copy). Returns ``(sum, work, trace id)``;
    ``work`` is None when synchronous or single, the id None without ``trace``; the sum is only
    meaningful on ``dst``."""
    x = x.detach().clone(memory_format=torch.contiguous_format)
    if info.single:
        return x, None, None
    trace_id = record(trace, info, "reduce", nbytes(x), name, async_op=async_op)
    with _named_failure(info, name):
        work = dist.reduce(x, dst=info.global_ranks[dst], group=info.group, async_op=async_op)
    if stats is not None and info.rank != dst:
        stats.add(name, nbytes(x), peer=info.global_ranks[dst])
    return x, (work if async_op else None), trace_id
