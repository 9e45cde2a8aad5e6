"""Discrete-event replay of one step's per-rank traces (:mod:`seqpar.tracing`) on a machine model.

Every rank runs its trace in its own order: a compute takes the traced CPU time or the GPU kernel
model's time (:mod:`.machine`), the CPU time between events inside an attention call is host work
(traced CPU machines only), a ``wait`` blocks until its messages or asynchronous collectives are
done, a blocking collective until every member arrived and the collective finished. A message
starts once its send is posted, its receive is posted and the results it carries are computed
(a send's ``deps``), and then flows through the sender's out-port and the receiver's in-port (the
node fabric inside a node, the NICs across): ports are full duplex, concurrent transfers share a
port fairly (each gets ``bandwidth / transfers on the port``, the smaller of its two ports), a
message ends ``latency`` after its last byte. Collectives run their algorithm on the links of
their members: ring all-gather / reduce-scatter (``N-1`` steps of one chunk over the slowest hop),
ring all-reduce (twice that, chunks of ``1/N``), pipelined chain broadcast / reduce, pairwise
all-to-all (``N-1`` rounds, each as long as its slowest pair); they do not share ports with
point-to-point messages (no seqpar schedule runs both at once). With a GPU kernel model, a
compute that overlaps a transfer of its rank runs ``overlap_slowdown`` slower (:mod:`.machine`).

:func:`replay` returns a :class:`ReplayResult`: per rank the timeline, its end, compute, host and
exposed (blocked) communication time; the step is the last rank's end.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from seqpar.tracing import Trace

from .machine import Machine
from .trace_check import check_traces, match_messages


@dataclass
class RankResult:
    rank: int
    end_s: float = 0.0
    compute_s: float = 0.0
    host_s: float = 0.0
    exposed_comm_s: float = 0.0  # blocked in waits and collectives (transfers or slower peers)
    timeline: list = field(default_factory=list)  # (start, end, kind, name): compute|host|wait|coll


@dataclass
class ReplayResult:
    step_s: float
    ranks: list[RankResult]
    messages: list = field(default_factory=list)  # (src, dst, start, end, bytes, chan)
    machine: dict = field(default_factory=dict)

    @property
    def exposed_comm_s(self) -> float:
        """Exposed communication of the rank that ends last (what the step waits for)."""
        return max(self.ranks, key=lambda r: r.end_s).exposed_comm_s

    def efficiency(self, ideal_s: float) -> float:
        return ideal_s / self.step_s if self.step_s > 0 else float("nan")


class _Msg:
    __slots__ = ("src", "dst", "nbytes", "chan", "send_id", "recv_id", "posted", "unready", "start", "done",
                 "left", "rate", "t", "version", "ports")

    def __init__(self, src, dst, nbytes, chan, send_id, recv_id):
        self.src, self.dst, self.nbytes, self.chan = src, dst, nbytes, chan
        self.send_id, self.recv_id = send_id, recv_id
        self.posted, self.unready, self.start, self.done = 0, 0, None, None
        self.left, self.rate, self.t, self.version, self.ports = float(nbytes), 0.0, 0.0, 0, ()


class _Sim:
    """The event loop; see the module docstring. Time in seconds."""

    def __init__(self, traces: list[Trace], m: Machine):
        self.m, self.traces = m, traces
        self.n = len(traces)
        self.heap: list = []
        self.seq = 0
        self.res = [RankResult(r) for r in range(self.n)]
        self.pc = [0] * self.n
        self.gap_done = [False] * self.n
        self.done: list[dict] = [dict() for _ in range(self.n)]  # rank -> {event id: time}
        self.waiters: list[dict] = [defaultdict(list) for _ in range(self.n)]  # id -> [callbacks]
        self.blocked: list = [None] * self.n  # (since, missing ids) while blocked
        raw, self.by_send, self.by_recv = match_messages(traces)
        self.msgs = [_Msg(*x) for x in raw]
        self.colls = _match_collectives(traces)
        self.port_flows: dict = defaultdict(set)
        self.active = [0] * self.n  # transfers in flight per rank (overlap slowdown)
        self.comp: list = [None] * self.n  # running compute: [left seconds at full speed, t, version, ev]
        self.messages_out: list = []
        self.gaps = [_host_gaps(t.events) if m.host else None for t in traces]

    # ----------------------------------------------------------------------------- loop
    def push(self, t: float, kind: str, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def run(self) -> ReplayResult:
        for r in range(self.n):
            self.push(0.0, "resume", r)
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            getattr(self, "_on_" + kind)(t, *payload)
        stuck = [r for r in range(self.n) if self.pc[r] < len(self.traces[r].events)]
        if stuck:
            r = stuck[0]
            raise ValueError(f"traces: the replay deadlocks: rank {r} never gets past event "
                             f"{self.traces[r].events[self.pc[r]]} (a message or collective without its partner)")
        return ReplayResult(max(x.end_s for x in self.res), self.res, self.messages_out, self.m.to_dict())

    def _on_resume(self, t: float, r: int) -> None:
        self.advance(r, t)

    def finish(self, r: int, eid: int, t: float) -> None:
        """Event ``eid`` of rank ``r`` is complete at ``t``: release what waited for it."""
        self.done[r][eid] = t
        for cb in self.waiters[r].pop(eid, ()):
            cb(t)

    def when_done(self, r: int, eid: int, cb) -> None:
        if eid in self.done[r]:
            cb(self.done[r][eid])
        else:
            self.waiters[r][eid].append(cb)

    # ----------------------------------------------------------------------------- ranks
    def advance(self, r: int, t: float) -> None:
        evs = self.traces[r].events
        while self.pc[r] < len(evs):
            ev = evs[self.pc[r]]
            gap = self.gaps[r][self.pc[r]] if self.gaps[r] is not None else 0.0
            if gap > 0 and not self.gap_done[r]:
                self.gap_done[r] = True
                self.res[r].host_s += gap
                self.res[r].timeline.append((t, t + gap, "host", ""))
                self.push(t + gap, "resume", r)
                return
            kind = ev["type"]
            if kind == "compute":
                self.start_compute(r, ev, t)
                return
            if kind == "wait" and not self.try_wait(r, ev, t):
                return
            if kind == "coll" and not self.arrive(r, ev, t):
                return
            if kind in ("send", "recv"):
                self.post(r, ev, t)
            self.pc[r] += 1
            self.gap_done[r] = False
        self.res[r].end_s = t

    def start_compute(self, r: int, ev: dict, t: float) -> None:
        dur = self.m.compute_seconds(ev)
        self.comp[r] = [dur, t, 0, ev, t]
        self._schedule_compute(r, t)

    def _speed(self, r: int) -> float:
        return 1.0 / (1.0 + self.m.overlap_slowdown) if self.active[r] and self.m.overlap_slowdown else 1.0

    def _schedule_compute(self, r: int, t: float) -> None:
        c = self.comp[r]
        c[2] += 1
        self.push(t + c[0] / self._speed(r), "computed", r, c[2])

    def _rate_change(self, r: int, t: float, before: float) -> None:
        c = self.comp[r]
        if c is None or self._speed(r) == before:
            return
        c[0] -= (t - c[1]) * before
        c[1] = t
        self._schedule_compute(r, t)

    def _on_computed(self, t: float, r: int, version: int) -> None:
        c = self.comp[r]
        if c is None or c[2] != version:
            return
        ev, start = c[3], c[4]
        self.comp[r] = None
        self.res[r].compute_s += t - start
        self.res[r].timeline.append((start, t, "compute", ev["name"]))
        self.finish(r, ev["id"], t)
        self.pc[r] += 1
        self.gap_done[r] = False
        self.advance(r, t)

    def block(self, r: int, t: float, ids, kind: str, name: str) -> bool:
        missing = [i for i in ids if i not in self.done[r]]
        if not missing:
            return True
        state = {"left": len(missing), "since": t}

        def release(tt: float, r=r, state=state):
            state["left"] -= 1
            if state["left"] == 0:
                self.res[r].exposed_comm_s += tt - state["since"]
                self.res[r].timeline.append((state["since"], tt, kind, name))
                self.pc[r] += 1
                self.gap_done[r] = False
                self.push(tt, "resume", r)

        for i in missing:
            self.when_done(r, i, release)
        return False

    def try_wait(self, r: int, ev: dict, t: float) -> bool:
        return self.block(r, t, ev["ids"], "wait", "")

    # ----------------------------------------------------------------------------- messages
    def post(self, r: int, ev: dict, t: float) -> None:
        msg = self.msgs[self.by_send[(r, ev["id"])] if ev["type"] == "send" else self.by_recv[(r, ev["id"])]]
        msg.posted += 1
        if ev["type"] == "send":
            deps = [d for d in ev.get("deps", ()) if d not in self.done[r]]
            msg.unready = len(deps)
            for d in deps:
                self.when_done(r, d, lambda tt, msg=msg: self._ready(msg, tt))
        self.try_start(msg, t)

    def _ready(self, msg: _Msg, t: float) -> None:
        msg.unready -= 1
        self.try_start(msg, t)

    def try_start(self, msg: _Msg, t: float) -> None:
        if msg.posted < 2 or msg.unready or msg.start is not None:
            return
        msg.start, msg.t = t, t
        kind = "fab" if self.m.same_node(msg.src, msg.dst) else "nic"
        msg.ports = ((msg.src, kind, "out"), (msg.dst, kind, "in"))
        for r in (msg.src, msg.dst):
            before = self._speed(r)
            self.active[r] += 1
            self._rate_change(r, t, before)
        for p in msg.ports:
            self.port_flows[p].add(msg)
        self._rerate(msg.ports, t)

    def _capacity(self, port) -> float:
        return self.m.intra_bw if port[1] == "fab" else self.m.inter_bw

    def _rerate(self, ports, t: float) -> None:
        flows = set()
        for p in ports:
            flows |= self.port_flows[p]
        for f in flows:
            rate = min(self._capacity(p) / len(self.port_flows[p]) for p in f.ports)
            if rate == f.rate:
                continue
            f.left -= (t - f.t) * f.rate
            f.t, f.rate = t, rate
            f.version += 1
            self.push(t + max(f.left, 0.0) / f.rate, "flowed", f, f.version)

    def _on_flowed(self, t: float, msg: _Msg, version: int) -> None:
        if msg.version != version:
            return
        for p in msg.ports:
            self.port_flows[p].discard(msg)
        for r in (msg.src, msg.dst):
            before = self._speed(r)
            self.active[r] -= 1
            self._rate_change(r, t, before)
        self._rerate(msg.ports, t)
        _, lat = self.m.link(msg.src, msg.dst)
        msg.done = t + lat
        self.messages_out.append((msg.src, msg.dst, msg.start, msg.done, msg.nbytes, msg.chan))
        self.push(msg.done, "delivered", msg)

    def _on_delivered(self, t: float, msg: _Msg) -> None:
        self.finish(msg.src, msg.send_id, t)
        self.finish(msg.dst, msg.recv_id, t)

    # ----------------------------------------------------------------------------- collectives
    def arrive(self, r: int, ev: dict, t: float) -> bool:
        inst = self.colls[(r, ev["id"])]
        inst["arrived"][r] = (t, ev)
        if len(inst["arrived"]) == len(inst["members"]):
            self._start_collective(inst, t)
        if ev.get("async"):
            return True
        return self.block(r, t, [ev["id"]], "coll", ev["kind"])

    def _start_collective(self, inst: dict, t: float) -> None:
        dur = collective_seconds(inst, self.m)
        async_ = any(ev.get("async") for _, ev in inst["arrived"].values())
        for r in inst["arrived"]:
            if async_:
                before = self._speed(r)
                self.active[r] += 1
                self._rate_change(r, t, before)
        self.push(t + dur, "collected", inst, async_)

    def _on_collected(self, t: float, inst: dict, async_: bool) -> None:
        for r, (_, ev) in inst["arrived"].items():
            if async_:
                before = self._speed(r)
                self.active[r] -= 1
                self._rate_change(r, t, before)
            self.finish(r, ev["id"], t)


def _host_gaps(events: list[dict]) -> list[float]:
    """Seconds of traced host CPU time before each event, inside begin/end regions only."""
    gaps, inside, last = [], False, None
    for ev in events:
        gap = 0.0
        if inside and last is not None:
            gap = max(0.0, (ev["t"] - last) * 1e-9)
        if ev["type"] == "begin":
            inside, gap = True, 0.0
        elif ev["type"] == "end":
            inside = False
        gaps.append(gap)
        last = ev["t"] + ev.get("cpu", 0) if ev["type"] == "compute" else ev["t"]
    return gaps


def _match_collectives(traces: list[Trace]) -> dict:
    """(rank, event id) -> the collective instance it is part of (k-th call on the same members)."""
    count: dict = defaultdict(int)
    instances: dict = {}
    out = {}
    for r, tr in enumerate(traces):
        for ev in tr.events:
            if ev["type"] != "coll":
                continue
            key = (tuple(ev["members"]), ev["kind"])
            k = count[(r, key)]
            count[(r, key)] += 1
            inst = instances.setdefault((key, k), {"members": key[0], "kind": ev["kind"], "arrived": {}})
            out[(r, ev["id"])] = inst
    return out


def collective_seconds(inst: dict, m: Machine) -> float:
    """Duration of a collective by its algorithm on ``m``'s links (module docstring)."""
    members, kind = inst["members"], inst["kind"]
    p = len(members)
    if p <= 1:
        return 0.0
    evs = {r: ev for r, (_, ev) in inst["arrived"].items()}
    chunk = max(ev["bytes"] for ev in evs.values())
    hops = [m.link(members[i], members[(i + 1) % p]) for i in range(p)]
    bw, lat = min(b for b, _ in hops), max(lat for _, lat in hops)
    if kind in ("all_gather", "reduce_scatter"):
        return (p - 1) * (lat + chunk / bw)
    if kind == "all_reduce":
        return 2 * (p - 1) * (lat + chunk / p / bw)
    if kind in ("broadcast", "reduce"):
        return (p - 1) * lat + chunk / bw
    if kind == "all_to_all":
        total = 0.0
        for i in range(1, p):
            worst = 0.0
            for j, src in enumerate(members):
                dst = members[(j + i) % p]
                splits = evs[src].get("splits") or [evs[src]["bytes"] // p] * p
                b, lt = m.link(src, dst)
                worst = max(worst, lt + splits[(j + i) % p] / b)
            total += worst
        return total
    raise ValueError(f"traces: unknown collective kind {kind!r}")


def replay(traces, m: Machine, *, expect: dict | None = None) -> ReplayResult:
    """Replay one step of the traces of all ranks (``traces[r]`` of global rank r: :class:`Trace`
    objects or their dicts) on machine ``m``. ``expect`` (e.g. ``{"method": ..., "world_size": ...}``)
    must match every trace's meta: ValueError naming the rank and key otherwise, as for traces that
    are inconsistent (a send without its receive, a collective some members lack, cyclic deps)."""
    traces = [t if isinstance(t, Trace) else Trace.from_dict(t, source=f"trace of rank {i}")
              for i, t in enumerate(traces)]
    check_traces(traces, expect=expect)
    return _Sim(traces, m).run()


__all__ = ["RankResult", "ReplayResult", "collective_seconds", "replay"]
