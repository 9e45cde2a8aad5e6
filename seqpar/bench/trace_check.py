"""Consistency of a set of per-rank traces (one step of every rank of a run), before a replay.

A complete and consistent set has: one trace per rank, ranks 0..N-1, the same ``meta`` everywhere
(method, world size, shape: what the replay is asked to replay); every send matched by exactly one
receive (same source, destination, stream and tag, k-th with k-th, the same size) and back; every
collective present on all its members with one size per kind; dependencies and waits naming
earlier events only (so they cannot form a cycle); ``begin`` / ``end`` balanced.
"""

from __future__ import annotations

from collections import defaultdict

from seqpar.tracing import Trace

_WAITABLE = ("send", "recv", "coll")


def _check_one(r: int, tr: Trace, expect: dict | None) -> None:
    where = f"trace of rank {r}"
    if tr.rank is not None and tr.rank != r:
        raise ValueError(f"{where}: it says rank {tr.rank}; pass the traces ordered by rank (0..N-1)")
    for key, want in (expect or {}).items():
        got = tr.meta.get(key)
        if got != want:
            raise ValueError(f"{where}: {key}={got!r}, but the replay expects {key}={want!r} (a trace of "
                             f"another run; record it again with the expected {key})")
    depth = 0
    for i, ev in enumerate(tr.events):
        if ev.get("id") != i:
            raise ValueError(f"{where}: event {i} has id {ev.get('id')!r} (events must be numbered in order)")
        for d in list(ev.get("deps", ())) + list(ev.get("ids", ())):
            if not isinstance(d, int) or not 0 <= d < i:
                raise ValueError(f"{where}: event {i} ({ev['type']}) depends on {d!r}, not an earlier event: "
                                 f"dependencies must point backwards (no cycles)")
            if ev["type"] == "wait" and tr.events[d]["type"] not in _WAITABLE:
                raise ValueError(f"{where}: event {i} waits for event {d}, a {tr.events[d]['type']}")
        if ev["type"] == "begin":
            depth += 1
        elif ev["type"] == "end":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{where}: event {i} ends a region that never began")
        if ev["type"] == "coll" and r not in ev["members"]:
            raise ValueError(f"{where}: event {i} is a collective of {ev['members']} without this rank")


def match_messages(traces: list[Trace]) -> tuple[list, dict, dict]:
    """Pair every send with its receive: ``(messages, by_send, by_recv)`` with messages
    ``(src, dst, bytes, chan, send id, recv id)`` and ``(rank, event id) -> index``. ValueError
    naming the stream when a send has no receive (or back) or their sizes differ."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, tr in enumerate(traces):
        for ev in tr.events:
            if ev["type"] == "send":
                sends[(ev["src"], ev["dst"], ev["chan"], ev["tag"])].append(ev)
            elif ev["type"] == "recv":
                recvs[(ev["src"], ev["dst"], ev["chan"], ev["tag"])].append(ev)
    messages, by_send, by_recv = [], {}, {}
    for key in sorted(set(sends) | set(recvs), key=str):
        s, v = sends.get(key, []), recvs.get(key, [])
        src, dst, chan, tag = key
        if len(s) != len(v):
            raise ValueError(f"traces: rank {src} sends {len(s)} message(s) to rank {dst} on stream {chan!r} tag "
                             f"{tag}, rank {dst} receives {len(v)}: every send needs its receive")
        for a, b in zip(s, v):
            if a["bytes"] != b["bytes"]:
                raise ValueError(f"traces: a message {src} -> {dst} on {chan!r} tag {tag} is sent with {a['bytes']} "
                                 f"bytes and received with {b['bytes']}")
            by_send[(src, a["id"])] = by_recv[(dst, b["id"])] = len(messages)
            messages.append((src, dst, a["bytes"], chan, a["id"], b["id"]))
    return messages, by_send, by_recv


def check_collectives(traces: list[Trace]) -> None:
    calls = defaultdict(list)
    for r, tr in enumerate(traces):
        for ev in tr.events:
            if ev["type"] == "coll":
                calls[(tuple(ev["members"]), ev["kind"])].append(r)
    for (members, kind), ranks in calls.items():
        count = {m: ranks.count(m) for m in members}
        if len(set(count.values())) != 1:
            raise ValueError(f"traces: {kind} on ranks {list(members)} is called {count} times by those ranks: "
                             f"every member must call it as often")


def check_traces(traces: list[Trace], *, expect: dict | None = None) -> None:
    """Raise ValueError naming the rank and the problem unless ``traces`` are complete and consistent."""
    if not traces:
        raise ValueError("traces: none given")
    n = len(traces)
    for r, tr in enumerate(traces):
        if tr.world_size is not None and tr.world_size != n:
            raise ValueError(f"trace of rank {r}: recorded on {tr.world_size} ranks, {n} traces given")
        _check_one(r, tr, expect)
    for r, tr in enumerate(traces):
        for ev in tr.events:
            for peer in (ev.get("src"), ev.get("dst"), *ev.get("members", ())):
                if peer is not None and not 0 <= peer < n:
                    raise ValueError(f"trace of rank {r}: event {ev['id']} names rank {peer}, outside 0..{n - 1}")
    match_messages(traces)
    check_collectives(traces)


__all__ = ["check_collectives", "check_traces", "match_messages"]
