"""Per-rank traces built from the methods' schedules alone: what :mod:`seqpar.tracing` records from
a real run, without running it (no tensors, no processes), for any N.

A real run of N ranks at the requested shape is out of reach on one machine for large N (and for
GPU shapes at any N), but what a rank computes and sends is fixed by its schedule: the ring
family's :class:`~seqpar.softmax.plans.Schedule` (posted per step in batches, the same
:class:`~seqpar.softmax.tracebook.RunBook` for the dependencies), Ulysses' head splits and
all-to-alls, USP's two axes, the linear methods' scan plans. :func:`rank_events` yields, lazily,
the events the executor, the Ulysses runner and the linear ops record, in their order, with the
same peers, streams, tags, bytes, FLOPs and dependencies; only the CPU times are zero (replay
them with a GPU kernel model). ``tests/test_schedule_trace.py`` checks, event by event, that they
equal the traces of real runs on 2, 3 and 4 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqpar.comm.fingerprint import QUICK_TAG, STATE_WORDS, agreement_offsets
from seqpar.kernels.linear_chunk import CHUNK
from seqpar.linear.plans import resolve_plan
from seqpar.methods import method as declared
from seqpar.methods import ring_method
from seqpar.softmax.messages import indexed_moves, message_tag
from seqpar.softmax.plans import PAYLOADS, WIRES
from seqpar.softmax.registry import dense_plan
from seqpar.softmax.tracebook import RunBook, block_event
from seqpar.softmax.ulysses import gqa_segments, split_heads
from seqpar.tracing import FORMAT, VERSION, Trace, block_flops, linear_part_flops


@dataclass(frozen=True)
class Shape:
    """The global problem: ``[batch, seq_len, heads, head_dim]`` with ``kv_heads`` K,V heads; element
    sizes in bytes of the inputs, of fp32 accumulators and of the gradients on the wire."""

    seq_len: int
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    causal: bool = True
    esize: int = 2
    acc: int = 4
    grad: int = 4


class _Emit:
    """Numbers events as the recorder does (times zero)."""

    def __init__(self) -> None:
        self.next, self.phase = 0, "fwd"

    def __call__(self, type_: str, **fields) -> dict:
        ev = {"id": self.next, "type": type_, "phase": self.phase, "t": 0, "w": 0, **fields}
        self.next += 1
        if type_ == "compute":
            ev["cpu"] = ev["wall"] = 0
            ev["shape"], ev["deps"] = list(ev["shape"]), sorted(set(ev["deps"]))
        return ev


def _wire_bytes(w, rows: int, s: Shape, heads: tuple[int, int]) -> int:
    per = (1 if w.stat else s.head_dim) * (heads[0] if w.heads == "q" else heads[1])
    size = {"input": s.esize, "acc": s.acc, "grad": s.grad}[w.dtype]
    return len(w.parts) * s.batch * rows * per * size


def ring_pass(em: _Emit, sched, me: int, ranks: list[int], t_local: int, s: Shape, heads: tuple[int, int],
              bwd: bool):
    """The events of one pass of the executor (seqpar.softmax.executor.execute) on this rank."""
    n, idx, book = len(ranks), ranks.index(me), RunBook()
    b, d = s.batch, s.head_dim
    sizes_of: dict = {}  # (what, rows) -> bytes of each wire tensor
    if sched.transport == "allgather" and n > 1:
        ids = []
        for _ in ("k", "v"):  # K and V gathered apart (executor.execute)
            ev = em("coll", kind="all_gather", members=ranks, bytes=b * t_local * heads[1] * d * s.esize,
                    chan="allgather_kv", deps=[], **{"async": False})
            ids.append(ev["id"])
            yield ev
        for j in range(n):
            if j != idx:
                book.gathered(("kv", (j - idx) % n), *ids)
    tags = {w: [4 * PAYLOADS.index(w) + i for i in range(len(WIRES[(w, bwd)]))] for w in PAYLOADS
            if (w, bwd) in WIRES}
    chans = {w: f"{sched.name}_{w}" for w in tags}
    for step in sched.steps:
        batches: dict = {}
        for m, index in indexed_moves(step.moves):
            what = m.what
            if what not in tags:  # dK,dV moves are for the backward pass only
                continue
            rows = m.rows.stop - m.rows.start
            sends, recvs, arrivals = batches.setdefault((m.channel, what), ([], [], []))
            sizes = sizes_of.get((what, rows))
            if sizes is None:
                sizes = sizes_of[(what, rows)] = [_wire_bytes(w, rows, s, heads) for w in WIRES[(what, bwd)]]
            if m.send:
                sends += [(m.peer, size, message_tag(what, i, index)) for i, size in enumerate(sizes)]
                book.sending((m.channel, what), what, m.owner, len(sizes))
            else:
                recvs += [(m.peer, size, message_tag(what, i, index)) for i, size in enumerate(sizes)]
                arrivals.append((m, len(sizes)))
        posted = []
        for (ch, what), (sends, recvs, arrivals) in batches.items():
            deps, chan, sent, got = book.posted((ch, what)), chans[what], [], []
            if n > 1:
                for k, (off, size, tag) in enumerate(sends):
                    dk = deps[k]
                    ev = em("send", src=me, dst=ranks[(idx + off) % n], bytes=size, chan=chan, tag=tag,
                            deps=sorted(set(dk)) if len(dk) > 1 else list(dk))
                    sent.append(ev["id"])
                    yield ev
                for off, size, tag in recvs:
                    ev = em("recv", src=ranks[(idx + off) % n], dst=me, bytes=size, chan=chan, tag=tag)
                    got.append(ev["id"])
                    yield ev
            posted.append((sent, got, arrivals))
        for task in step.tasks:
            for blk in task.blocks:  # schedules use explicit row ranges (plans.row_range)
                q_shape = (b, blk.q.stop - blk.q.start, heads[0], d)
                k_shape = (b, blk.kv.stop - blk.kv.start, heads[1], d)
                ev = em("compute", **block_event(task, blk, q_shape, k_shape, bwd, book))
                book.computed(ev["id"], task.q, task.kv, bwd)
                yield ev
        for sent, got, arrivals in posted:
            if sent or got:
                yield em("wait", ids=sent + got)
            pos = 0
            for m, k in arrivals:
                book.arrived(m.what, m.owner, got[pos:pos + k])
                pos += k
        book.settle()
    if bwd and sched.transport == "allgather" and n > 1:
        for _ in ("dk", "dv"):
            yield em("coll", kind="reduce_scatter", members=ranks, bytes=b * t_local * heads[1] * d * s.acc,
                     chan="reduce_scatter_dkv", deps=[], **{"async": False})


def _a2a(em: _Emit, me: int, ranks: list[int], per_member: list[int], esize: int, chan: str) -> dict:
    return em("coll", kind="all_to_all", members=ranks, bytes=sum(per_member) * esize, chan=chan, deps=[],
              splits=[x * esize for x in per_member], **{"async": False})


def ulysses_pass(em: _Emit, me: int, ulysses: list[int], c: int, s: Shape, bwd: bool, ring=None):
    """Ulysses' all-to-alls around the local attention (or, in USP, ``ring``: (sched, ring ranks))."""
    u, idx, b, d = len(ulysses), ulysses.index(me), s.batch, s.head_dim
    qs, kvs = split_heads(s.heads, s.kv_heads, u)
    qkv = [b * c * d * (qs.count(m) + 2 * kvs.count(m)) for m in range(u)]
    mine = b * c * d * qs.count(idx)
    segs = gqa_segments(qs, kvs, s.heads // s.kv_heads, idx)
    mask = "causal" if s.causal else "none"
    if u > 1:
        yield _a2a(em, me, ulysses, [b * c * d * qs.count(m) for m in range(u)] if bwd else qkv, s.esize,
                   "ulysses_dout" if bwd else "ulysses_qkv")
    for seg in segs:
        hq, hkv = seg.q.stop - seg.q.start, seg.kv.stop - seg.kv.start
        if ring is not None:  # USP: the ring axis's schedule on these heads
            yield from ring_pass(em, ring[0], me, ring[1], u * c, s, (hq, hkv), bwd)
        else:
            yield em("compute", name="block_bwd" if bwd else "block_fwd",
                     flops=block_flops(b, u * c, u * c, hq, d, mask, bwd), shape=(b, u * c, u * c, hq, hkv, d),
                     mask=mask, deps=[em.next - 1])
    if u > 1:
        back = [b * c * d * (qs.count(idx) + 2 * kvs.count(idx))] * u if bwd else [mine] * u
        yield _a2a(em, me, ulysses, back, s.esize, "ulysses_dqkv" if bwd else "ulysses_out")


def _chain(em: _Emit, me: int, n: int, idx: int, blocks, rows: int, size: int, reverse: bool, first=None):
    head, tail = idx == (n - 1 if reverse else 0), idx == (0 if reverse else n - 1)
    step = -1 if reverse else 1
    ids = []
    for i, (a, b) in enumerate(blocks):
        got = None if head else em("recv", src=me - step, dst=me, bytes=rows * (b - a) * size, chan="allscan", tag=i)
        deps = [got["id"]] if got else ([first] if first is not None else [])
        sent = None if tail else em("send", src=me, dst=me + step, bytes=rows * (b - a) * size, chan="allscan",
                                    tag=i, deps=deps)
        for e in (got, sent):
            if e is not None:
                ids.append(e["id"])
                yield e
    return ids + ([first] if first is not None else [])


def linear_pass(em: _Emit, method: str, me: int, n: int, c: int, s: Shape, bwd: bool):
    """The events of seqpar.linear.ops' forward or backward on rank ``me`` (a contiguous dense shard)."""
    plan, (b, h, kd) = resolve_plan(method), (s.batch, s.heads, s.head_dim)

    def kernel(name, part, scale=1.0):
        return em("compute", name=name, flops=linear_part_flops(b, c, h, kd, kd, part, bwd, CHUNK) * scale,
                  shape=(b, c, h, kd), mask=None, deps=[])

    cuts = torch.linspace(0, kd, min(max(1, plan.n_blocks), kd) + 1).round().long().tolist()
    blocks = list(zip(cuts[:-1], cuts[1:]))

    def exchange():  # the ids the finish waits for (a state is R·H·K·V fp32 elements, R = batch)
        if n == 1:
            return []
        if plan.exchange == "allgather":  # forward: [S_loc | Gamma_end], V + 1 columns
            ev = em("coll", kind="all_gather", members=list(range(n)), bytes=b * h * kd * (kd + (not bwd)) * s.acc,
                    chan="all_gather_states", deps=[], **{"async": True})
            yield ev
            return [ev["id"]]
        return (yield from _chain(em, me, n, me, blocks, b * h * kd, s.acc, reverse=bwd))

    yield kernel("linear_dstates" if bwd else "linear_states", "states", 1.5 if bwd else 1.0)
    pending = (yield from exchange()) if plan.overlap else []
    yield kernel("linear_bwd_intra" if bwd else "linear_intra", "intra")
    if not plan.overlap:
        pending = yield from exchange()
    if pending:
        yield em("wait", ids=sorted(pending))
    if not bwd and me > 0:
        yield kernel("linear_states", "states")
    if bwd and me < n - 1:
        yield kernel("linear_dstates", "states")
    yield kernel("linear_bwd_finish" if bwd else "linear_output", "output")


def agreement_pass(em: _Emit, me: int, n: int):
    """The rank agreement at the start of a call's forward (seqpar.comm.fingerprint.reduce_state on
    the CPU channel): per round of ``agreement_offsets(n)``, this rank's state of ``STATE_WORDS``
    int64 to the member that far ahead, one from the member that far behind, and their wait. One
    flat group of ranks 0..n-1, as these traces assume throughout; a group without a CPU backend
    records one ``all_reduce`` instead, and usp given a mesh or a pair of groups reduces once per
    axis."""
    size = 8 * STATE_WORDS
    for step in agreement_offsets(n):
        sent = em("send", src=me, dst=(me + step) % n, bytes=size, chan="check_ranks", tag=QUICK_TAG, deps=[])
        got = em("recv", src=(me - step) % n, dst=me, bytes=size, chan="check_ranks", tag=QUICK_TAG)
        yield from (sent, got, em("wait", ids=[sent["id"], got["id"]]))


def rank_events(method: str, n: int, rank: int, s: Shape, *, forward_only: bool = False,
                ulysses_degree: int | None = None, agreement: bool = False):
    """Yield rank ``rank``'s events of one step (forward, then backward) of ``method`` on ``n`` ranks.
    ``agreement``: the forward starts with the rank agreement's messages, as on a group with a CPU
    backend (the default ``check_ranks``); off for GPU replays, where they run on the host ahead of
    the device (docs/reliability.md)."""
    em, spec = _Emit(), declared(method)
    c = s.seq_len // n
    for bwd in (False,) if forward_only else (False, True):
        em.phase = "bwd" if bwd else "fwd"
        region = ("linear " if spec.family == "linear" else "attention ") + em.phase
        yield em("begin", name=region)
        if agreement and not bwd:
            yield from agreement_pass(em, rank, n)
        if spec.family == "linear":
            yield from linear_pass(em, method, rank, n, c, s, bwd)
        elif spec.family == "ulysses":
            yield from ulysses_pass(em, rank, list(range(n)), c, s, bwd)
        elif spec.family == "usp":
            u = ulysses_degree or n
            j, ring_spec = rank // u, ring_method(None)
            sched = dense_plan(ring_spec, j, n // u, u * c, s.causal).schedule(u * c)
            ring_ranks = [jj * u + rank % u for jj in range(n // u)]
            yield from ulysses_pass(em, rank, [j * u + x for x in range(u)], c, s, bwd, ring=(sched, ring_ranks))
        else:
            sched = dense_plan(spec, rank, n, c, s.causal).schedule(c)
            yield from ring_pass(em, sched, rank, list(range(n)), c, s, (s.heads, s.kv_heads), bwd)
        yield em("end", name=region)


def schedule_traces(method: str, n: int, s: Shape, *, forward_only: bool = False,
                    ulysses_degree: int | None = None, meta: dict | None = None,
                    agreement: bool = False) -> list[Trace]:
    """Every rank's trace, materialised (small N; the replay streams :func:`rank_events` for large N)."""
    out = []
    for r in range(n):
        tr = Trace.from_dict({"format": FORMAT, "version": VERSION, "rank": r, "world_size": n,
                              "meta": dict(meta or {}), "events": []})
        tr.events = list(rank_events(method, n, r, s, forward_only=forward_only, ulysses_degree=ulysses_degree,
                                     agreement=agreement))
        out.append(tr)
    return out


__all__ = ["Shape", "rank_events", "schedule_traces"]
