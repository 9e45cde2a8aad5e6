"""The replay (seqpar.bench.replay) on hand-checked tiny traces: one message, link sharing and full
duplex, overlap of compute and communication, a send waiting for its result, collectives, host
work, the GPU overlap slowdown; bad input; machine profiles and kernel model; exports."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from seqpar.bench.machine import KERNELS, Machine, load_machine, machine, save_machine
from seqpar.bench.replay import replay
from seqpar.bench.trace_export import chrome_trace, write_chrome_trace, write_timeline_png
from seqpar.tracing import FORMAT, VERSION, block_flops

BW, LAT = 1e9, 1e-5
CPU = Machine("test", ranks_per_node=8, intra_bw=BW, inter_bw=BW / 4, intra_lat=LAT, inter_lat=2 * LAT, host=False)


class _T:
    """Builds one rank's trace by hand (times in ms of CPU)."""

    def __init__(self, rank: int, n: int, meta=None):
        self.rank, self.n, self.events, self.meta = rank, n, [], meta or {}

    def _add(self, type_, **f):
        self.events.append({"id": len(self.events), "type": type_, "phase": "fwd", "t": 0, "w": 0, **f})
        return len(self.events) - 1

    def compute(self, ms, deps=()):
        return self._add("compute", name="block_fwd", flops=0.0, shape=[], mask=None, cpu=int(ms * 1e6), wall=0,
                         deps=list(deps))

    def send(self, dst, nbytes, tag=0, deps=()):
        return self._add("send", src=self.rank, dst=dst, bytes=nbytes, chan="c", tag=tag, deps=list(deps))

    def recv(self, src, nbytes, tag=0):
        return self._add("recv", src=src, dst=self.rank, bytes=nbytes, chan="c", tag=tag)

    def wait(self, *ids):
        return self._add("wait", ids=list(ids))

    def coll(self, kind, members, nbytes, splits=None, async_op=False):
        f = {"splits": splits} if splits else {}
        return self._add("coll", kind=kind, members=list(members), bytes=nbytes, chan="g", **{"async": async_op},
                         deps=[], **f)

    def dict(self):
        return {"format": FORMAT, "version": VERSION, "rank": self.rank, "world_size": self.n, "meta": self.meta,
                "events": self.events}


def _ranks(n, **kw):
    return [_T(r, n, **kw) for r in range(n)]


def test_one_message_takes_latency_plus_bytes_over_bandwidth():
    a, b = _ranks(2)
    b.wait(b.recv(0, 10**6))
    a.wait(a.send(1, 10**6))
    res = replay([a.dict(), b.dict()], CPU)
    assert res.step_s == pytest.approx(LAT + 1e-3)
    assert res.ranks[1].exposed_comm_s == pytest.approx(LAT + 1e-3)
    assert res.messages == [(0, 1, 0.0, pytest.approx(LAT + 1e-3), 10**6, "c")]


def test_transfers_share_a_port_and_links_are_full_duplex():
    r0, r1, r2 = _ranks(3)
    r0.wait(r0.send(1, 10**6), r0.send(2, 10**6))  # two transfers out of rank 0: half the port each
    r1.wait(r1.recv(0, 10**6))
    r2.wait(r2.recv(0, 10**6))
    assert replay([r.dict() for r in (r0, r1, r2)], CPU).step_s == pytest.approx(2e-3 + LAT)
    a, b = _ranks(2)
    a.wait(a.send(1, 10**6), a.recv(1, 10**6))  # both directions at once: full bandwidth each
    b.wait(b.send(0, 10**6), b.recv(0, 10**6))
    assert replay([a.dict(), b.dict()], CPU).step_s == pytest.approx(1e-3 + LAT)


def test_nodes_use_the_network_port():
    m = replace(CPU, ranks_per_node=1)
    a, b = _ranks(2)
    a.wait(a.send(1, 10**6))
    b.wait(b.recv(0, 10**6))
    assert replay([a.dict(), b.dict()], m).step_s == pytest.approx(4e-3 + 2 * LAT)


@pytest.mark.parametrize("compute_ms", (3.0, 0.5))
def test_communication_hides_under_compute(compute_ms):
    a, b = _ranks(2)
    s = a.send(1, 10**6)
    a.compute(compute_ms)
    a.wait(s)
    r = b.recv(0, 10**6)
    b.compute(compute_ms)
    b.wait(r)
    res = replay([a.dict(), b.dict()], CPU)
    transfer = 1e-3 + LAT
    assert res.step_s == pytest.approx(max(compute_ms * 1e-3, transfer))
    assert res.ranks[1].exposed_comm_s == pytest.approx(max(0.0, transfer - compute_ms * 1e-3))
    assert res.ranks[1].compute_s == pytest.approx(compute_ms * 1e-3)


def test_a_send_leaves_when_the_result_it_carries_is_computed():
    """All-Scan's forwarded block: posted first, it needs the block it forwards."""
    a, b, c = _ranks(3)
    a.compute(2.0)
    a.wait(a.send(1, 10**6))
    got = b.recv(0, 10**6)
    fwd = b.send(2, 10**6, deps=[got])  # posted at once, leaves when the block arrived
    b.compute(0.1)
    b.wait(got, fwd)
    c.wait(c.recv(1, 10**6))
    res = replay([x.dict() for x in (a, b, c)], CPU)
    assert res.ranks[2].end_s == pytest.approx(2e-3 + 2 * (1e-3 + LAT))


def test_collectives_follow_their_algorithm():
    n, chunk = 4, 10**6
    ranks = _ranks(n)
    for r in ranks:
        r.compute(1.0 * r.rank)  # the last to arrive starts it
        r.coll("all_gather", range(n), chunk)
    res = replay([r.dict() for r in ranks], CPU)
    assert res.step_s == pytest.approx(3e-3 + (n - 1) * (LAT + chunk / BW))
    assert res.ranks[0].exposed_comm_s == pytest.approx(res.step_s)
    ranks = _ranks(n)
    for r in ranks:  # pairwise all-to-all: N-1 rounds, each as long as its largest message
        r.coll("all_to_all", range(n), 4 * chunk, splits=[chunk * (1 + (r.rank == 0))] * n)
    res = replay([r.dict() for r in ranks], CPU)
    assert res.step_s == pytest.approx((n - 1) * (LAT + 2 * chunk / BW))
    # a machine that timed its collectives runs each kind on the link fitted for it, the others on its links
    timed = replace(CPU, collectives={"all_to_all": (BW / 3, 7 * LAT)})
    assert replay([r.dict() for r in ranks], timed).step_s == pytest.approx((n - 1) * (7 * LAT + 6 * chunk / BW))
    ranks = _ranks(n)
    for r in ranks:
        r.coll("all_gather", range(n), chunk)
    assert replay([r.dict() for r in ranks], timed).step_s == pytest.approx((n - 1) * (LAT + chunk / BW))


def test_asynchronous_collective_overlaps_compute():
    ranks = _ranks(2)
    for r in ranks:
        c = r.coll("all_gather", range(2), 10**6, async_op=True)
        r.compute(5.0)
        r.wait(c)
    assert replay([r.dict() for r in ranks], CPU).step_s == pytest.approx(5e-3)


def test_host_time_between_events_counts_inside_calls_only():
    a, b = _ranks(2)
    for r in (a, b):
        r.events.append({"id": 0, "type": "begin", "phase": "fwd", "t": 0, "w": 0, "name": "attention fwd"})
        r.compute(1.0)
        r.events[-1]["t"] = 2_000_000  # 2 ms of host work before the kernel
        r.events.append({"id": 2, "type": "end", "phase": "fwd", "t": 3_500_000, "w": 0, "name": "attention fwd"})
    traces = [a.dict(), b.dict()]
    assert replay(traces, replace(CPU, host=True)).step_s == pytest.approx(3.5e-3)  # 2 + 1 + 0.5 ms
    assert replay(traces, CPU).step_s == pytest.approx(1e-3)
    assert replay(traces, replace(CPU, host=True)).ranks[0].host_s == pytest.approx(2.5e-3)


def _sender_computes(ms: float) -> list[dict]:
    """Rank 0 posts 1 MB to rank 1, computes ``ms``, waits; rank 1 only receives."""
    a, b = _ranks(2)
    s = a.send(1, 10**6)
    a.compute(ms)
    a.wait(s)
    b.wait(b.recv(0, 10**6))
    return [a.dict(), b.dict()]


def test_gpu_compute_slows_while_its_rank_transfers():
    res = replay(_sender_computes(4.0), replace(CPU, overlap_slowdown=0.25))
    # the kernel's first 1 ms overlaps the 1 ms transfer at 1/1.25 speed: 0.8 ms of work done, 3.2 ms left
    assert res.ranks[0].end_s == pytest.approx(1e-3 + 3.2e-3)


def test_cpu_transfer_shares_the_core_of_a_computing_rank():
    m = replace(CPU, transfer_cpu=0.5)
    res = replay(_sender_computes(4.0), m)
    # rank 0 computes with one end of a transfer on its core: both run 1 + 0.5 x 1 = 1.5x slower, so the
    # 1 ms message takes 1.5 ms, during which 1 ms of the kernel's 4 ms is done; 3 ms follow at full speed
    assert res.messages[0][3] == pytest.approx(1.5e-3 + LAT)
    assert res.ranks[0].end_s == pytest.approx(4.5e-3)
    a, b = _ranks(2)
    for me, r in ((0, a), (1, b)):  # a ring step of two ranks: both send, receive and compute at once
        s, v = r.send(1 - me, 10**6), r.recv(1 - me, 10**6)
        r.compute(4.0)
        r.wait(s, v)
    res = replay([a.dict(), b.dict()], m)
    # two ends on each core (a send and a receive): 2x slower; the messages take 2 ms and 1 ms of work is done
    assert [x[3] for x in res.messages] == pytest.approx([2e-3 + LAT] * 2)
    assert res.step_s == pytest.approx(5e-3)
    assert replay([a.dict(), b.dict()], CPU).step_s == pytest.approx(4e-3)  # no transfer CPU: fully hidden
    c, d = _ranks(2)  # nobody computes: the transfer flows at the link's speed
    c.wait(c.send(1, 10**6))
    d.wait(d.recv(0, 10**6))
    assert replay([c.dict(), d.dict()], m).step_s == pytest.approx(1e-3 + LAT)


def test_cpu_transfer_speeds_up_when_the_compute_ends_or_starts_later():
    m = replace(CPU, transfer_cpu=0.5)
    # the 0.5 ms kernel runs 1.5x slower (0.75 ms) and so does the message meanwhile (0.5 of its 1 ms
    # done), whose other half then flows at full speed: it ends at 1.25 ms
    res = replay(_sender_computes(0.5), m)
    assert res.messages[0][3] == pytest.approx(1.25e-3 + LAT)
    assert res.ranks[0].end_s == pytest.approx(1.25e-3 + LAT)
    a, b = _ranks(2)  # a message in flight when its receiver starts computing
    big, small = a.send(1, 10**6), a.send(1, 1000, tag=1)
    a.wait(big, small)
    rb, rs = b.recv(0, 10**6), b.recv(0, 1000, tag=1)
    b.wait(rs)
    b.compute(4.0)
    b.wait(rb)
    res = replay([a.dict(), b.dict()], m)
    # both share the ports at BW / 2 until the small one's last byte (2 us), the big one then flows at
    # BW until rank 1 has the small one (+ LAT) and starts its kernel, then at BW / 1.5
    t_small = 2 * 1000 / BW
    left = 10**6 - 1000 - LAT * BW
    done = {x[4]: x[3] for x in res.messages}
    assert done[10**6] == pytest.approx(t_small + LAT + left * 1.5 / BW + LAT)
    assert res.ranks[1].end_s == pytest.approx(t_small + LAT + 4e-3 + (left * 1.5 / BW) * (1 - 1 / 1.5))


def test_cpu_asynchronous_collective_shares_the_core():
    m = replace(CPU, transfer_cpu=0.5, collectives={"all_gather": (BW, 0.0)})
    ranks = _ranks(2)
    for r in ranks:
        g = r.coll("all_gather", range(2), 10**6, async_op=True)  # 1 ms at BW, one step of two members
        r.compute(4.0)
        r.wait(g)
    res = replay([x.dict() for x in ranks], m)
    # one transfer end per rank for the collective's 1 ms: the kernel does 1/1.5 ms of work then
    assert res.step_s == pytest.approx(1e-3 + 4e-3 - 1e-3 / 1.5)
    a, b = _ranks(2)  # the collective starts while a message of a computing rank flows: it slows too
    s, g = a.send(1, 2 * 10**6), a.coll("all_gather", range(2), 10**6, async_op=True)
    a.compute(4.0)
    a.wait(s, g)
    r = b.recv(0, 2 * 10**6)
    b.compute(1.0)
    b.wait(b.coll("all_gather", range(2), 10**6, async_op=True))
    b.wait(r)
    res = replay([a.dict(), b.dict()], m)
    # 0-1.5 ms: both compute with one end each, 1.5x slower: 1 MB flows, rank 1's kernel ends. 1.5-2.5:
    # the all-gather; rank 0 computes with two ends (2x), rank 1 waits: 0.5 MB. Then 1.5x again: the
    # last 0.5 MB takes 0.75 ms. Rank 0's kernel: 1 + 0.5 + 0.5 ms of work by 3.25 ms, 2 ms after
    assert res.messages[0][3] == pytest.approx(3.25e-3 + LAT)
    assert res.ranks[0].end_s == pytest.approx(5.25e-3)


def test_inconsistent_traces_raise_naming_the_problem():
    a, b = _ranks(2, meta={"method": "ring"})
    a.wait(a.send(1, 100))
    with pytest.raises(ValueError, match="rank 0 sends 1 message.*rank 1 receives 0"):
        replay([a.dict(), b.dict()], CPU)
    b.wait(b.recv(0, 99))
    with pytest.raises(ValueError, match="sent with 100 bytes and received with 99"):
        replay([a.dict(), b.dict()], CPU)
    c, d = _ranks(2, meta={"method": "ring"})
    with pytest.raises(ValueError, match="trace of rank 0: method='ring', but the replay expects method='zigzag_ring'"):
        replay([c.dict(), d.dict()], CPU, expect={"method": "zigzag_ring"})
    with pytest.raises(ValueError, match="recorded on 2 ranks, 3 traces given"):
        replay([c.dict(), d.dict(), d.dict()], CPU)
    c.wait(5)
    with pytest.raises(ValueError, match="depends on 5, not an earlier event"):
        replay([c.dict(), d.dict()], CPU)
    e = _T(0, 2)
    e.coll("all_gather", range(2), 8)
    with pytest.raises(ValueError, match="all_gather on ranks \\[0, 1\\] is called"):
        replay([e.dict(), _T(1, 2).dict()], CPU)
    bad = e.dict()
    bad["version"] = VERSION + 1
    with pytest.raises(ValueError, match="trace of rank 0: trace version"):
        replay([bad, _T(1, 2).dict()], CPU)


def test_profiles_and_the_kernel_model(tmp_path):
    h100, a100 = machine("h100-nvlink-ib"), machine("a100-nvlink-ib")
    assert h100.kernels is KERNELS["h100-fa3"] and not h100.host and h100.intra_bw > a100.intra_bw
    assert machine("h800-nvlink-ib").intra_bw == 160e9
    k = KERNELS["h100-fa2"]
    # at 8K, head dim 128: the published FlashAttention-2 rates (FA3 paper, Fig. 5)
    assert k.rate("fwd", "none", 8192, 128) == pytest.approx(370e12)
    assert k.rate("fwd", "causal", 8192, 128) == pytest.approx(333e12)
    assert k.rate("fwd", "none", 6000, 128) == pytest.approx(k.rate("fwd", "none", 6000, 128))
    assert k.rate("fwd", "none", 256, 128) == pytest.approx(309e12 / 2)  # below the table: per-pair cost of 512
    ev = {"name": "block_fwd", "flops": block_flops(1, 8192, 8192, 32, 128, "causal"),
          "shape": [1, 8192, 8192, 32, 8, 128], "mask": "causal"}
    merge = 8192 * 32 * (128 * 18 + 12)  # bf16 block output cast to fp32 and lerped into the accumulator
    assert k.seconds(ev) == pytest.approx(ev["flops"] / 333e12 + merge / (0.85 * 3.35e12) + 5e-6)
    assert KERNELS["a100-fa2"].seconds(ev) > k.seconds(ev) > KERNELS["h100-fa3"].seconds(ev)
    for bad in ("tpu", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match="neither a known profile"):
            machine(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    with pytest.raises(ValueError, match="broken.json.*not a readable JSON"):
        machine(str(broken))
    broken.write_text(json.dumps({"format": "seqpar-machine", "name": "x"}))
    with pytest.raises(ValueError, match="broken.json.*missing or bad field"):
        machine(str(broken))
    saved = tmp_path / "m.json"
    save_machine(CPU, saved)
    assert load_machine(saved) == CPU
    timed = replace(CPU, collectives={"all_gather": (BW / 2, LAT), "reduce": (BW, 0.0)}, transfer_cpu=0.3)
    save_machine(timed, saved)
    assert load_machine(saved) == timed
    assert machine(str(saved), kernels="h100-fa3").transfer_cpu == 0.0  # a GPU's kernels: no gloo threads
    save_machine(replace(timed, transfer_cpu=-0.1), saved)
    with pytest.raises(ValueError, match="m.json.*transfer_cpu=-0.1 < 0"):
        load_machine(saved)
    with pytest.raises(ValueError, match="kernels='tpu'"):
        machine("pcie", kernels="tpu")


def test_exports(tmp_path):
    res = replay(_sender_computes(0.5), CPU)
    data = chrome_trace(res)
    kinds = {(e["pid"], e.get("cat")) for e in data["traceEvents"] if e["ph"] == "X"}
    assert {(0, "compute"), (1, "wait"), (0, "message")} <= kinds
    write_chrome_trace(res, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["otherData"]["step_s"] == res.step_s
    write_timeline_png(res, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_floor_of_repeats_takes_each_segments_least_disturbed_time():
    from seqpar.bench.replay_validate import floor_traces

    def one(host_ms, compute_ms):  # begin, host work, a kernel, host work, end: one rank
        r = _T(0, 1)
        r.events.append({"id": 0, "type": "begin", "phase": "fwd", "t": 0, "w": 0, "name": "attention fwd"})
        r.compute(compute_ms)
        r.events[-1]["t"] = int(host_ms[0] * 1e6)
        end = r.events[-1]["t"] + r.events[-1]["cpu"] + int(host_ms[1] * 1e6)
        r.events.append({"id": 2, "type": "end", "phase": "fwd", "t": end, "w": 0, "name": "attention fwd"})
        return [r.dict()]

    # the kernel was disturbed in the first repeat, the host work in the second: floor = 1 + 2 + 0.5 ms
    floor = floor_traces([one((1.0, 0.5), 3.0), one((4.0, 0.9), 2.0)])
    assert replay(floor, replace(CPU, host=True)).step_s == pytest.approx(3.5e-3)
    other = one((1.0, 0.5), 2.0)
    other[0]["events"].insert(1, dict(other[0]["events"][1], type="wait", ids=[]))
    assert floor_traces([one((1.0, 0.5), 3.0), other]) is None  # different events: no floor


def test_kernel_classes_take_one_median_time_over_ranks_and_repeats():
    from seqpar.bench.replay_validate import kernel_class_traces

    def repeat(ms_a, ms_b):  # two ranks, one kernel each (the same class), no messages
        a, b = _ranks(2)
        a.compute(ms_a)
        b.compute(ms_b)
        return [a.dict(), b.dict()]

    # rank 1 was disturbed in two of three repeats: the class's median over all six (1.1 ms), on both ranks
    classed = kernel_class_traces([repeat(1.0, 3.0), repeat(1.0, 1.0), repeat(1.2, 2.0)])
    assert [t["events"][0]["cpu"] for t in classed] == [1_100_000, 1_100_000]
    assert replay(classed, CPU).step_s == pytest.approx(1.1e-3)
