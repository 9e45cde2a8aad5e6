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
all-to-all (``N-1`` rounds, each as long as its slowest pair), on the link the machine measured
for that kind where it has one (:attr:`.machine.Machine.collectives`); they do not share ports
with point-to-point messages (no seqpar schedule runs both at once). With a GPU kernel model, a
compute that overlaps a transfer of its rank runs ``overlap_slowdown`` slower (:mod:`.machine`). On a
CPU machine a transfer takes ``transfer_cpu`` of a core at each of its ends (the threads that copy it:
gloo's over TCP); while a rank computes, its compute and the transfers of its ``k`` ends (messages and
asynchronous collectives) share its core: the compute runs ``1 + transfer_cpu * k`` times slower, and
so does every message of that rank (at the slower of its two ends).

:func:`replay` returns a :class:`ReplayResult`: per rank the timeline, its end, compute, host and
exposed (blocked) communication time; the step is the last rank's end.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field

from seqpar.tracing import Trace

from .machine import Machine
from .trace_check import check_traces


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
                 "left", "rate", "t", "version", "ports", "sim")

    def __init__(self, src, dst, nbytes, chan, sim):
        self.src, self.dst, self.nbytes, self.chan, self.sim = src, dst, nbytes, chan, sim
        self.send_id = self.recv_id = None
        self.posted, self.unready, self.start, self.done = 0, 0, None, None
        self.left, self.rate, self.t, self.version, self.ports = float(nbytes), 0.0, 0.0, 0, ()

    def ready(self, t: float) -> None:
        """One of the results this message carries is computed."""
        self.unready -= 1
        self.sim.try_start(self, t)


class _Sim:
    """The event loop; see the module docstring. Time in seconds. ``sources[r]`` yields rank r's
    events in order (a list, or a generator: schedule traces of 1024 ranks are never held whole);
    messages and collectives are matched as they are posted (k-th send with k-th receive)."""

    def __init__(self, sources, m: Machine, detail: bool = True, host_gaps=None):
        self.m, self.n, self.detail = m, len(sources), detail
        self.src = [iter(x) for x in sources]
        self.cur = [next(it, None) for it in self.src]
        self.reached = [0] * self.n  # ids below this were reached by the rank
        self.heap: list = []
        self.seq = 0
        self.res = [RankResult(r) for r in range(self.n)]
        self.gap_done = [False] * self.n
        self.pending: list = [set() for _ in range(self.n)]  # reached, not complete
        self.waiters: list[dict] = [defaultdict(list) for _ in range(self.n)]
        self.sends: dict = defaultdict(deque)  # (src, dst, chan, tag) -> posted sends not yet received
        self.recvs: dict = defaultdict(deque)
        self.by_event: dict = {}  # (rank, id) -> _Msg
        self.colls: dict = {}
        self.coll_count: dict = defaultdict(int)
        self.port_flows: dict = defaultdict(set)
        self.active = [0] * self.n  # transfers in flight per rank (overlap slowdown)
        self.comp: list = [None] * self.n  # running compute: [left seconds at full speed, t, version, ev, start]
        self.messages_out: list = []
        self.gaps = host_gaps if m.host else None

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
        stuck = [r for r in range(self.n) if self.cur[r] is not None]
        if stuck:
            r = stuck[0]
            raise ValueError(f"traces: the replay deadlocks: rank {r} never gets past event {self.cur[r]} "
                             f"(a message or collective without its partner)")
        left = [k for q in (self.sends, self.recvs) for k, v in q.items() if v]
        if left:
            src, dst, chan, tag = left[0]
            raise ValueError(f"traces: a message {src} -> {dst} on stream {chan!r} tag {tag} has no partner: "
                             f"every send needs its receive")
        return ReplayResult(max(x.end_s for x in self.res), self.res, self.messages_out, self.m.to_dict())

    def _on_resume(self, t: float, r: int) -> None:
        self.advance(r, t)

    def finish(self, r: int, eid: int, t: float) -> None:
        """Event ``eid`` of rank ``r`` is complete at ``t``: release what waited for it."""
        self.pending[r].discard(eid)
        for cb in self.waiters[r].pop(eid, ()):
            cb(t)

    def is_done(self, r: int, eid: int) -> bool:
        return eid < self.reached[r] and eid not in self.pending[r]

    def when_done(self, r: int, eid: int, cb) -> None:
        self.waiters[r][eid].append(cb)

    def next_event(self, r: int) -> None:
        self.cur[r] = next(self.src[r], None)
        self.gap_done[r] = False

    def note(self, r: int, interval: tuple) -> None:
        if self.detail:
            self.res[r].timeline.append(interval)

    # ----------------------------------------------------------------------------- ranks
    def advance(self, r: int, t: float) -> None:
        while self.cur[r] is not None:
            ev = self.cur[r]
            gap = self.gaps[r][ev["id"]] if self.gaps is not None else 0.0
            if gap > 0 and not self.gap_done[r]:
                self.gap_done[r] = True
                self.res[r].host_s += gap
                self.note(r, (t, t + gap, "host", ""))
                self.push(t + gap, "resume", r)
                return
            kind = ev["type"]
            self.reached[r] = ev["id"] + 1
            if kind == "compute":
                self.pending[r].add(ev["id"])
                self.start_compute(r, ev, t)
                return
            if kind == "wait" and not self.block(r, t, ev["ids"], "wait", ""):
                return
            if kind == "coll" and not self.arrive(r, ev, t):
                return
            if kind in ("send", "recv"):
                self.post(r, ev, t)
            self.next_event(r)
        self.res[r].end_s = t

    def start_compute(self, r: int, ev: dict, t: float) -> None:
        dur = self.m.compute_seconds(ev)
        self.comp[r] = [dur, t, 0, ev, t]
        self._schedule_compute(r, t)
        self._core_changed(r, t)

    def _speed(self, r: int) -> float:
        """Rate of rank r's compute: 1 alone, slower while transfers of r are in flight."""
        if not self.active[r]:
            return 1.0
        return 1.0 / ((1.0 + self.m.overlap_slowdown) * (1.0 + self.m.transfer_cpu * self.active[r]))

    def _shared(self, r: int) -> float:
        """How many times slower rank r's transfers flow: its core is shared while it computes."""
        return 1.0 + self.m.transfer_cpu * self.active[r] if self.comp[r] is not None else 1.0

    def _schedule_compute(self, r: int, t: float) -> None:
        c = self.comp[r]
        c[2] = self.seq + 1  # unique: a stale completion of an earlier compute never matches a later one
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
        self._core_changed(r, t)
        self.res[r].compute_s += t - start
        self.note(r, (start, t, "compute", ev["name"]))
        self.finish(r, ev["id"], t)
        self.next_event(r)
        self.advance(r, t)

    def block(self, r: int, t: float, ids, kind: str, name: str) -> bool:
        missing = [i for i in ids if not self.is_done(r, i)]
        if not missing:
            return True
        state = [len(missing)]

        def release(tt: float, r=r, state=state, since=t):
            state[0] -= 1
            if state[0] == 0:
                self.res[r].exposed_comm_s += tt - since
                self.note(r, (since, tt, kind, name))
                self.next_event(r)
                self.advance(r, tt)  # now: nothing earlier is left in the queue

        for i in missing:
            self.when_done(r, i, release)
        return False

    # ----------------------------------------------------------------------------- messages
    def post(self, r: int, ev: dict, t: float) -> None:
        key = (ev["src"], ev["dst"], ev["chan"], ev["tag"])
        mine, theirs = (self.sends, self.recvs) if ev["type"] == "send" else (self.recvs, self.sends)
        if theirs[key]:
            msg = theirs[key].popleft()
            if msg.nbytes != ev["bytes"]:
                raise ValueError(f"traces: a message {key[0]} -> {key[1]} on {key[2]!r} tag {key[3]} is posted with "
                                 f"{msg.nbytes} and {ev['bytes']} bytes by its two ends")
        else:
            msg = _Msg(ev["src"], ev["dst"], ev["bytes"], ev["chan"], self)
            mine[key].append(msg)
        self.pending[r].add(ev["id"])
        msg.posted += 1
        if ev["type"] == "send":
            msg.send_id = ev["id"]
            pending, reached = self.pending[r], self.reached[r]
            deps = [d for d in ev["deps"] if d >= reached or d in pending]
            if deps:
                msg.unready = len(deps)
                ready = msg.ready
                for d in deps:
                    self.waiters[r][d].append(ready)
        else:
            msg.recv_id = ev["id"]
        self.try_start(msg, t)


    def try_start(self, msg: _Msg, t: float) -> None:
        if msg.posted < 2 or msg.unready or msg.start is not None:
            return
        msg.start, msg.t = t, t
        kind = "fab" if self.m.same_node(msg.src, msg.dst) else "nic"
        msg.ports = ((msg.src, kind, "out"), (msg.dst, kind, "in"))
        for r in (msg.src, msg.dst):
            self._transfers(r, t, 1)
        for p in msg.ports:
            self.port_flows[p].add(msg)
        self._rerate(msg.ports, t)
        for r in (msg.src, msg.dst):
            self._core_changed(r, t)

    def _transfers(self, r: int, t: float, delta: int) -> None:
        """A transfer of rank r starts (+1) or ends (-1): r's compute changes speed."""
        before = self._speed(r)
        self.active[r] += delta
        self._rate_change(r, t, before)

    def _capacity(self, port) -> float:
        return self.m.intra_bw if port[1] == "fab" else self.m.inter_bw

    def _rerate(self, ports, t: float) -> None:
        pf = self.port_flows
        a, b = pf[ports[0]], pf[ports[1]]
        self._rerate_flows(a | b if len(a) + len(b) > 1 else (a or b), t)

    def _core_changed(self, r: int, t: float) -> None:
        """Rank r started or ended a compute, or a transfer of r started or ended: with
        ``transfer_cpu``, the messages of r change speed."""
        if self.m.transfer_cpu and self.active[r]:
            pf = self.port_flows
            self._rerate_flows({f for k in ("fab", "nic") for d in ("out", "in") for f in pf.get((r, k, d), ())}, t)

    def _rerate_flows(self, flows, t: float) -> None:
        pf = self.port_flows
        for f in flows:
            p, q = f.ports
            rate = min(self._capacity(p) / len(pf[p]), self._capacity(q) / len(pf[q]))
            if self.m.transfer_cpu:
                rate /= max(self._shared(f.src), self._shared(f.dst))
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
            self._transfers(r, t, -1)
        self._rerate(msg.ports, t)
        for r in (msg.src, msg.dst):
            self._core_changed(r, t)
        _, lat = self.m.link(msg.src, msg.dst)
        msg.done = t + lat
        if self.detail:
            self.messages_out.append((msg.src, msg.dst, msg.start, msg.done, msg.nbytes, msg.chan))
        self.push(msg.done, "delivered", msg)

    def _on_delivered(self, t: float, msg: _Msg) -> None:
        self.finish(msg.src, msg.send_id, t)
        self.finish(msg.dst, msg.recv_id, t)

    # ----------------------------------------------------------------------------- collectives
    def arrive(self, r: int, ev: dict, t: float) -> bool:
        key = (tuple(ev["members"]), ev["kind"])
        k = self.coll_count[(r, key)]
        self.coll_count[(r, key)] += 1
        inst = self.colls.setdefault((key, k), {"members": key[0], "kind": ev["kind"], "arrived": {}})
        inst["arrived"][r] = (t, ev)
        self.pending[r].add(ev["id"])
        if len(inst["arrived"]) == len(inst["members"]):
            del self.colls[(key, k)]
            self._start_collective(inst, t)
        if ev.get("async"):
            return True
        return self.block(r, t, [ev["id"]], "coll", ev["kind"])

    def _start_collective(self, inst: dict, t: float) -> None:
        dur = collective_seconds(inst, self.m)
        async_ = any(ev.get("async") for _, ev in inst["arrived"].values())
        for r in inst["arrived"]:
            if async_:
                self._transfers(r, t, 1)
                self._core_changed(r, t)
        self.push(t + dur, "collected", inst, async_)

    def _on_collected(self, t: float, inst: dict, async_: bool) -> None:
        for r, (_, ev) in inst["arrived"].items():
            if async_:
                self._transfers(r, t, -1)
                self._core_changed(r, t)
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


def collective_seconds(inst: dict, m: Machine) -> float:
    """Duration of a collective by its algorithm on ``m``'s links (module docstring)."""
    members, kind = inst["members"], inst["kind"]
    p = len(members)
    if p <= 1:
        return 0.0
    evs = {r: ev for r, (_, ev) in inst["arrived"].items()}
    chunk = max(ev["bytes"] for ev in evs.values())
    hops = [m.link(members[i], members[(i + 1) % p]) for i in range(p)]
    bw, lat = m.collectives.get(kind) or (min(b for b, _ in hops), max(lat for _, lat in hops))
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
                b, lt = m.collectives.get(kind) or m.link(src, dst)
                worst = max(worst, lt + splits[(j + i) % p] / b)
            total += worst
        return total
    raise ValueError(f"traces: unknown collective kind {kind!r}")


def replay(traces, m: Machine, *, expect: dict | None = None, detail: bool | None = None) -> ReplayResult:
    """Replay one step of the traces of all ranks (``traces[r]`` of global rank r: :class:`Trace`
    objects or their dicts, checked first by :func:`.trace_check.check_traces`, or event iterators
    such as :func:`.schedule_trace.rank_events`) on machine ``m``. ``expect`` (e.g.
    ``{"method": ..., "world_size": ...}``) must match every trace's meta: ValueError naming the rank
    and key otherwise, as for traces that are inconsistent (a send without its receive, a collective
    some members lack, cyclic deps). ``detail``: keep timelines and messages for the exports
    (default: up to 64 ranks)."""
    if all(isinstance(t, (Trace, dict)) for t in traces):
        traces = [t if isinstance(t, Trace) else Trace.from_dict(t, source=f"trace of rank {i}")
                  for i, t in enumerate(traces)]
        check_traces(traces, expect=expect)
        gaps = [_host_gaps(t.events) for t in traces]
        traces = [t.events for t in traces]
    else:
        gaps = None
        if m.host:
            raise ValueError("traces: event streams carry no CPU times; replay them with a GPU kernel model")
    return _Sim(traces, m, len(traces) <= 64 if detail is None else detail, gaps).run()


__all__ = ["RankResult", "ReplayResult", "collective_seconds", "replay"]
