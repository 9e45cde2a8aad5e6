"""The one executor of every softmax method, and the one autograd.Function of the family.

``ring``, ``zigzag_ring``, ``striped_ring``, ``allgather_kv``, ``token_ring`` and ``lightseq``
are all :class:`~seqpar.softmax.plans.Schedule` s run by :func:`execute`. Per step it

1. posts the step's moves as one batch per (channel, payload): operands for later steps
   (prefetch) and results of the previous step going to their owner or along the ring;
2. computes the step's blocks: results for this rank's rows go straight into its accumulators
   (running out/lse merged in fp32, or dq / dK,dV summed in fp32), results for other members'
   rows are kept until a move sends them;
3. waits for the step's transfers, folds the results that arrived into the accumulators and keeps
   the operands that arrived for the next steps (and drops those no later step uses).

The forward and the backward run the same schedule: forward operands are q and K,V and results
are (out, lse); backward operands are the query bundle (q, dout, lse, delta) and K,V, and results
are dq and dK,dV (dK,dV moves are skipped in forward). Everything that touches a tensor is here;
the schedules are plain host-side data.

Running output and lse stay in fp32 for the whole loop and are cast once at the end, so the error
does not grow with the ring size. Results travel as follows: a forward partial out in the input
dtype (each partial a schedule sends is one block's output, which the kernel returns in that dtype:
no extra rounding) with its lse in fp32; dq, dK, dV in ``grad_comm_dtype`` (default fp32, exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import (
    CommStats,
    GroupInfo,
    all_gather_stack,
    exchange,
    nbytes,
    reduce_scatter_stack,
)
from ..kernels import block_backward, block_forward, block_forward_into, merge_, new_accumulator
from ..kernels.varlen import varlen_backward, varlen_forward
from ..tracing import Trace, begin, end
from .checkpoint import active_tape
from .foreign import bundle_stats, with_lse_grad
from .lse import incoming, returned
from .messages import indexed_moves, last_use, message_tag
from .plans import FOLD, OPERANDS, WIRES, Move, RingPlan, Schedule, Task, Wire
from .sinks import apply_sinks, sinks_grad
from .tracebook import RunBook, block_span


@dataclass(frozen=True)
class RingConfig:
    """Everything the executor needs besides tensors; frozen, built once per call.

    ``plan``: a :class:`~seqpar.softmax.plans.RingPlan` or any ``Schedule``. ``channels``:
    communication channels, process groups with the same members as ``info`` (channel ``i`` of a
    schedule uses ``channels[i]``, the last one for higher indices); None: ``info`` for all.
    """

    info: GroupInfo
    plan: RingPlan | Schedule
    scale: float
    backend: str | None = None
    grad_comm_dtype: torch.dtype | None = None  # None: dq, dK, dV travel in fp32 (exact)
    stats: CommStats | None = None
    channels: tuple[GroupInfo, ...] | None = None
    trace: Trace | None = None  # records kernels, messages and their dependencies (seqpar.tracing)
    return_lse: bool = False  # returns (out, lse); backward may get its gradient (:mod:`.lse`, :mod:`.foreign`)

    def channel(self, i: int) -> GroupInfo:
        if not self.channels:
            return self.info
        return self.channels[min(i, len(self.channels) - 1)]


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _own(r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``r`` in ``dtype`` as a tensor of the executor's own, to be added into in place."""
    t = r.to(dtype)
    return t if t is not r or r._base is None else r.clone()


def _narrow(x: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    return x if (start, stop) == (0, x.shape[dim]) else x.narrow(dim, start, stop - start)


class _Held:
    """Rows ``[row0, row0 + n)`` (owner's local order) of one member's operand, as named tensors
    (``q`` | ``k``, ``v`` | backward: ``dout``, ``lse``, ``delta``, ``out``) and as sent (``wire``)."""

    def __init__(self, row0: int, parts: dict, wire: tuple | None = None):
        self.row0, self.parts, self.wire = row0, parts, wire
        first = parts["q"] if "q" in parts else parts["k"]
        self.n = first.shape[1]

    def local(self, rows: slice) -> slice:
        lo, hi = rows.start - self.row0, rows.stop - self.row0
        if lo < 0 or hi > self.n:
            raise RuntimeError(f"schedule error: rows {rows} used, but only {self.row0}..{self.row0 + self.n} held")
        return slice(lo, hi)


class _Run:
    """One pass (forward or backward) of a schedule on this rank."""

    def __init__(self, cfg: RingConfig, sched: Schedule, q, k, v, dout=None, out=None, lse=None, dlse=None):
        self.cfg, self.sched, self.bwd = cfg, sched, dout is not None
        self.check = cfg.return_lse or dlse is not None  # a bundle's delta may include a dlse
        self.acc = _acc_dtype(q)
        self.gwire = cfg.grad_comm_dtype or self.acc
        self.shape_q, self.shape_kv = tuple(q.shape), tuple(k.shape)
        self.dv = v.shape[3]  # D_v: the head dim of v, out, dout and dv (may differ from q's, MLA)
        self.dtype, self.device = q.dtype, q.device
        parts = {"q": q}
        if self.bwd:
            parts.update(dout=dout, out=out, lse=lse)
            if dlse is not None:  # delta' = delta - dlse, for the own rows and as sent
                with_lse_grad(parts, dlse, self.acc)
        # (what, owner) -> the row ranges held of that operand (one, or several disjoint ones)
        self.held = {("q", 0): [_Held(0, parts)], ("kv", 0): [_Held(0, {"k": k, "v": v})]}
        self.incoming: dict = {}  # operands that arrived in the current step, held from the next
        self.partials: dict = {}  # (what, owner) -> [(rows, result tensors)] for other members' rows
        # this rank's accumulators; None until a result arrives (see _fold: no zero fill to add onto)
        self.mine: dict = {"out": None, "dkv": None} if self.bwd else {"out": self._zeros("out")}
        self.book = RunBook() if cfg.trace is not None else None

    # ---------------------------------------------------------------- payload geometry (plans.WIRES)
    def _wires(self, what: str) -> tuple[Wire, ...]:
        return WIRES[(what, self.bwd)]

    def _parts(self, what: str) -> list[tuple[str, Wire]]:
        """The named parts of a payload in wire order, each with the wire that carries it."""
        return [(name, w) for w in self._wires(what) for name in w.parts]

    def _dtype(self, w: Wire) -> torch.dtype:
        return {"input": self.dtype, "acc": self.acc, "grad": self.gwire}[w.dtype]

    def _part_shape(self, w: Wire, n: int | None = None) -> tuple:
        """A part's shape for ``n`` rows (default: the whole local shard)."""
        b, t, hq, d = self.shape_q
        heads = hq if w.heads == "q" else self.shape_kv[2]
        n = t if n is None else n
        return (b, heads, n) if w.stat else (b, n, heads, self.dv if w.dim == "v" else d)

    @staticmethod
    def _sl(w: Wire, rows: slice) -> tuple:
        """Index of rows ``rows`` of one part (row statistics hold the rows in their last dim)."""
        return (slice(None), slice(None), rows) if w.stat else (slice(None), rows)

    # ---------------------------------------------------------------- results
    def _zeros(self, what: str) -> tuple:
        """A fresh accumulator for a whole local shard: (out, lse), (dq,) or (dk, dv)."""
        if FOLD[(what, self.bwd)] == "merge":
            return new_accumulator(self.shape_q[:3] + (self.dv,), self.device, dtype=self.acc)
        return tuple(torch.zeros(self._part_shape(w), dtype=self.acc, device=self.device) for _, w in self._parts(what))

    def _fold(self, acc: tuple | None, what: str, rows: slice, res: tuple) -> tuple:
        """``acc`` with the result ``res`` of rows ``rows`` folded in. ``acc`` None (nothing yet): a
        result that covers every row becomes the accumulator (cast, or taken as it is: kernel
        outputs and received buffers are fresh tensors), as ring-flash-attention starts its sums;
        otherwise a zero accumulator is made first."""
        parts = self._parts(what)
        if acc is None and all(tuple(r.shape) == self._part_shape(w) for (_, w), r in zip(parts, res)):
            return tuple(_own(r, self.acc) for r in res)
        acc = self._zeros(what) if acc is None else acc
        if FOLD[(what, self.bwd)] == "merge":
            merge_(acc[0][:, rows], acc[1][:, :, rows], res[0], res[1])
        else:
            for (_, w), a, r in zip(parts, acc, res):
                a[self._sl(w, rows)].add_(r)
        return acc

    def own(self, what: str) -> tuple:
        """This rank's accumulator of ``what``, made (zeros) if no result has arrived."""
        if self.mine[what] is None:
            self.mine[what] = self._zeros(what)
        return self.mine[what]

    def add(self, what: str, owner: int, rows: slice, res: tuple) -> None:
        if owner == 0:
            self.mine[what] = self._fold(self.mine[what], what, rows, res)
        else:
            self.partials.setdefault((what, owner), []).append((rows, res))

    def _rows(self, acc: tuple, what: str, rows: slice) -> tuple:
        return tuple(a[self._sl(w, rows)] for (_, w), a in zip(self._parts(what), acc))

    def take(self, what: str, owner: int, rows: slice) -> tuple:
        """Hand over the results for ``owner``'s rows ``rows``, as they travel."""
        if owner == 0:  # the ring carries this rank's own dK,dV accumulator: send it, start afresh
            res = self._rows(self.own(what), what, rows)
            self.mine[what] = None
        else:
            kept = self.partials.pop((what, owner), [])
            inside = [rows.start <= r.start and r.stop <= rows.stop for r, _ in kept]
            # the widest first: a part that covers every row becomes the sum (no zero fill, see _fold)
            parts = sorted((p for p, keep in zip(kept, inside) if keep), key=lambda p: p[0].start - p[0].stop)
            if len(parts) < len(kept):  # results of other row ranges leave in their own moves
                self.partials[(what, owner)] = [p for p, keep in zip(kept, inside) if not keep]
            if len(parts) == 1 and parts[0][0] == rows:  # one block's result: send it as computed
                res = parts[0][1]
            else:
                acc = None
                for r, p in parts:
                    acc = self._fold(acc, what, r, p)
                res = self._rows(acc if acc is not None else self._zeros(what), what, rows)
        return self._pack(what, dict(zip((name for name, _ in self._parts(what)), res)))

    def _pack(self, what: str, parts: dict) -> tuple:
        """The wire tensors of a payload from its named parts, one per part (cast and made
        contiguous only where they are not already: own K,V and fp32 results go as they are)."""
        return tuple(parts[name].to(self._dtype(w)).contiguous() for name, w in self._parts(what))

    # ---------------------------------------------------------------- operands
    def piece(self, what: str, owner: int, rows: slice) -> _Held:
        """The held range of ``owner``'s operand that contains ``rows``."""
        for h in self.held.get((what, owner), ()):
            if h.row0 <= rows.start and rows.stop <= h.row0 + h.n:
                return h
        raise RuntimeError(f"schedule error: {what} rows {rows} of member +{owner} used, but not held")

    def wire(self, what: str, owner: int, rows: slice) -> tuple:
        """The tensors that carry ``owner``'s operand rows ``rows`` (views when nothing is cut)."""
        h = self.piece(what, owner, rows)
        if h.wire is None:  # own data, packed once
            if "delta" in (name for name, _ in self._parts(what)):
                self._delta(h)
            h.wire = self._pack(what, h.parts)
        lo = h.local(rows)
        return tuple(_narrow(t, w.row_dim, lo.start, lo.stop).contiguous() for t, w in zip(h.wire, self._wires(what)))

    def _delta(self, h: _Held) -> torch.Tensor:
        p = h.parts
        if p.get("delta") is None:
            p["delta"] = (p["dout"].to(self.acc) * p["out"].to(self.acc)).sum(-1).transpose(1, 2).contiguous()
        return p["delta"]

    def buffers(self, m: Move) -> tuple:
        n = m.rows.stop - m.rows.start
        return tuple(torch.empty(self._part_shape(w, n), dtype=self._dtype(w), device=self.device)
                     for w in self._wires(m.what))

    def arrived(self, m: Move, bufs: tuple, ids=()) -> None:
        if self.book is not None:
            self.book.arrived(m.what, m.owner, ids)
        parts = {name: buf for (name, _), buf in zip(self._parts(m.what), bufs)}
        if m.what in OPERANDS:
            self.incoming.setdefault((m.what, m.owner), []).append(_Held(m.rows.start, parts, bufs))
        else:
            self.add(m.what, m.owner, m.rows, tuple(parts[name] for name, _ in self._parts(m.what)))

    # ---------------------------------------------------------------- steps
    def post(self, moves: tuple[Move, ...]) -> list:
        """Post a step's moves, one batch per (channel, payload); returns what to wait for."""
        batches: dict = {}
        per_peer: dict = {}
        for m, index in indexed_moves(moves):
            if (m.what, self.bwd) not in WIRES:  # dK,dV moves are for the backward pass only
                continue
            sends, recvs, arrivals = batches.setdefault((m.channel, m.what), ([], [], []))
            if m.send:
                tensors = self.wire(m.what, m.owner, m.rows) if m.what in OPERANDS else \
                    self.take(m.what, m.owner, m.rows)
                sends += [(t, m.peer, message_tag(m.what, i, index)) for i, t in enumerate(tensors)]
                per_peer[m.peer] = per_peer.get(m.peer, 0) + nbytes(*tensors)
                if self.book is not None:
                    self.book.sending((m.channel, m.what), m.what, m.owner, len(tensors))
            else:
                bufs = self.buffers(m)
                recvs += [(t, m.peer, message_tag(m.what, i, index)) for i, t in enumerate(bufs)]
                arrivals.append((m, bufs))
        stats = self.cfg.stats
        if stats is not None and per_peer:
            stats.note_step({self.cfg.info.peer(p): n for p, n in per_peer.items()})
        posted = []
        for (ch, what), (sends, recvs, arrivals) in batches.items():
            pending = exchange(self.cfg.channel(ch), sends, recvs, stats=stats, name=f"{self.sched.name}_{what}",
                               trace=self.cfg.trace, deps=self.book and self.book.posted((ch, what)))
            posted.append((pending, arrivals))
        return posted

    def settle(self) -> None:
        """Operands that arrived in this step replace what was held of the same owner's payload."""
        self.held.update(self.incoming)
        self.incoming = {}
        if self.book is not None:
            self.book.settle()

    def compute(self, task: Task) -> None:
        cfg = self.cfg
        for b in task.blocks:
            qh, kvh = self.piece("q", task.q, b.q), self.piece("kv", task.kv, b.kv)
            k, v, qp = kvh.parts["k"], kvh.parts["v"], qh.parts
            qr, kr = qh.local(b.q), kvh.local(b.kv)
            with block_span(cfg.trace, self.book, task, b, qp["q"][:, qr], k[:, kr], self.bwd):
                self._block(task, b, qp, qr, k[:, kr], v[:, kr])

    def _block(self, task: Task, b, qp: dict, qr: slice, k, v) -> None:
        cfg = self.cfg
        if b.segments is not None:
            self._compute_packed(task, b, qp, qr, k, v)
        elif not self.bwd and task.q == 0:  # own rows: merged into the running accumulator in place
            block_forward_into(*self._rows(self.mine["out"], "out", b.q), qp["q"][:, qr], k, v, scale=cfg.scale,
                               mask=b.mask, backend=cfg.backend)
        elif not self.bwd:
            o, lse = block_forward(qp["q"][:, qr], k, v, scale=cfg.scale, mask=b.mask, backend=cfg.backend)
            self.add("out", task.q, b.q, (o, lse))
        else:
            out, delta = bundle_stats(task, qp, qr, self.check)
            gq, gk, gv = block_backward(qp["dout"][:, qr], qp["q"][:, qr], k, v, out, qp["lse"][:, :, qr],
                                        scale=cfg.scale, mask=b.mask, backend=cfg.backend, delta=delta)
            self.add("out", task.q, b.q, (gq,))
            self.add("dkv", task.kv, b.kv, (gk, gv))

    def _compute_packed(self, task: Task, b, qp: dict, qr: slice, k, v) -> None:
        """A packed block: the varlen kernels accumulate in place into this rank's fp32
        accumulators (own rows / own K,V) or into fresh fp32 partials for other members."""
        cfg, segs = self.cfg, b.segments
        if not self.bwd:
            acc = self._rows(self.mine["out"], "out", b.q) if task.q == 0 else \
                new_accumulator(qp["q"][:, qr].shape[:3] + (self.dv,), self.device, dtype=self.acc)
            varlen_forward(qp["q"][:, qr], k, v, segs, scale=cfg.scale, backend=cfg.backend, acc=acc)
            if task.q != 0:
                self.add("out", task.q, b.q, acc)  # cast to the input dtype when sent
            return
        out, delta = bundle_stats(task, qp, qr, self.check)
        gq = self.own("out")[0][:, b.q] if task.q == 0 else \
            torch.zeros(qp["q"][:, qr].shape, dtype=self.acc, device=self.device)
        if task.kv == 0:
            gk, gv = self.own("dkv")[0][:, b.kv], self.own("dkv")[1][:, b.kv]
        else:
            gk, gv = (torch.zeros(x.shape, dtype=self.acc, device=self.device) for x in (k, v))
        varlen_backward(qp["dout"][:, qr], qp["q"][:, qr], k, v, out, qp["lse"][:, :, qr], segs,
                        scale=cfg.scale, backend=cfg.backend, delta=delta, grad_acc=(gq, gk, gv))
        if task.q != 0:
            self.add("out", task.q, b.q, (gq,))
        if task.kv != 0:
            self.add("dkv", task.kv, b.kv, (gk, gv))


def execute(cfg: RingConfig, q, k, v, dout=None, out=None, lse=None, dlse=None) -> tuple:
    """Run this rank's schedule. Forward (``dout`` None): returns ``(out, lse)`` of the local rows,
    fp32 accumulators. Backward: returns fp32 ``(dq, dk, dv)`` of the local shard (``dlse``: a
    gradient on the lse, or None)."""
    info = cfg.info
    sched = cfg.plan.schedule(q.shape[1])
    run = _Run(cfg, sched, q, k, v, dout, out, lse, dlse)
    gathered = sched.transport == "allgather" and not info.single
    if gathered:  # K and V gathered as they are (no stacked copy; their head dims may differ)
        k_all, ids = all_gather_stack(info, k, stats=cfg.stats, name="allgather_kv", trace=cfg.trace), []
        if cfg.trace is not None:
            ids.append(cfg.trace.last_id)
        v_all = all_gather_stack(info, v, stats=cfg.stats, name="allgather_kv", trace=cfg.trace)
        if cfg.stats is not None:  # a ring all-gather passes one shard to the next rank per step
            cfg.stats.note_step({info.peer(1): nbytes(k, v)})
        for j in range(info.size):
            if j != info.rank:
                run.held[("kv", (j - info.rank) % info.size)] = [_Held(0, {"k": k_all[j], "v": v_all[j]})]
                if run.book is not None:
                    run.book.gathered(("kv", (j - info.rank) % info.size), *ids, cfg.trace.last_id)
    last = last_use(sched)
    for i, step in enumerate(sched.steps):
        posted = run.post(step.moves)
        for task in step.tasks:
            run.compute(task)
        for pending, arrivals in posted:
            pending.wait()
            got = iter(pending.recv_ids)
            for m, bufs in arrivals:
                run.arrived(m, bufs, [i for i, _ in zip(got, bufs)])
        run.settle()
        for key in [key for key in run.held if key[1] != 0 and last.get(key, -1) <= i]:
            del run.held[key]
    if not run.bwd:
        return run.mine["out"]
    if gathered:  # every member's dK,dV partials, summed onto their owners
        full = tuple(torch.zeros((info.size, *x.shape), dtype=run.acc, device=q.device) for x in (k, v))
        for j in range(info.size):
            off = (j - info.rank) % info.size
            parts = run.partials.pop(("dkv", off), []) + ([(slice(None), run.own("dkv"))] if off == 0 else [])
            for r, p in parts:
                run._fold((full[0][j], full[1][j]), "dkv", r, p)
        dk, dv = (reduce_scatter_stack(info, x, stats=cfg.stats, name="reduce_scatter_dkv", trace=cfg.trace)
                  for x in full)
        return run.own("out")[0], dk, dv
    return run.own("out")[0], *run.own("dkv")


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: RingConfig):
    """Local Q ``[B, T, Hq, D]`` against every rank's K,V ``[B, T, Hkv, D]`` as ``cfg.plan`` says.
    Returns ``(out, lse)``: out ``[B, T, Hq, D]`` fp32 (float64 for float64 input), lse ``[B, Hq, T]``."""
    return execute(cfg, q, k, v)


def ring_backward(dout, q, k, v, out, lse, cfg: RingConfig, dlse=None):
    """Gradients for the local q, k, v given the merged ``out``/``lse`` of the local rows, and
    ``dlse [B, Hq, T]`` (or None), the gradient on that lse (:mod:`.lse`). Returns fp32 (float64 for
    float64 input) ``dq [B, T, Hq, D]``, ``dk``, ``dv [B, T, Hkv, D]``."""
    return execute(cfg, q, k, v, dout, out, lse, dlse)


class RingAttention(torch.autograd.Function):
    """Saves what backward needs and restores it; the work is in ring_forward / ring_backward.

    ``sinks`` (``[Hq]`` or None, :mod:`.sinks`) are applied to the merged ``(out, lse)`` after the
    whole schedule; backward runs the schedule on the adjusted ``(out', lse')`` and returns ``ds``
    from this rank's rows (its share: the sum over the group is the gradient).

    Inside :func:`seqpar.checkpoint`, the first forward records ``(out, lse)`` and the
    recomputation before backward replays them: the attention forward and its communication run
    once per step.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg: RingConfig):
        tape = active_tape()
        if tape is not None and tape.replaying:
            out, lse = tape.replay(q, v)
            out = out.detach()
        else:
            if cfg.stats is not None:
                cfg.stats.phase = "fwd"
            out, lse = ring_forward(q, k, v, cfg)
            if sinks is not None:
                out, lse = apply_sinks(out, lse, sinks)
            out = out.to(q.dtype)
            if tape is not None:
                tape.record(out.detach(), lse)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cfg = cfg
        return returned(ctx, out, lse, cfg.return_lse)

    @staticmethod
    def backward(ctx, dout, *dlse):  # dlse: the returned lse's gradient (return_lse=True), or None
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cfg = ctx.cfg
        if cfg.stats is not None:
            cfg.stats.phase = "bwd"
        dout, dlse = incoming(dout, dlse, out.shape, out)
        begin(cfg.trace, "attention bwd")
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, cfg, dlse)
        end(cfg.trace, "attention bwd")
        if cfg.stats is not None:
            cfg.stats.phase = "fwd"
        ds = sinks_grad(dout, out, lse, sinks, dlse) if ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), ds, None
