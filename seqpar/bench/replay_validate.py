"""The replay against real runs on this machine (benchmarks/results/replay_validation.md).

:func:`calibrate_link` fits the 2-rank point-to-point link of this machine with a ping-pong (both
ranks send and receive at once, as a ring step does): ``t = latency + bytes / bandwidth``.
:func:`calibrate_collectives` times each collective kind on the same 2 ranks and fits the link it
runs on (gloo's collectives copy through buffers of their own and are slower than the messages).
:func:`run_case` runs one method on N local gloo ranks (one torch thread each, the bench's inputs
and call), timing every repeat's wall-clock step (the slowest rank's forward+backward) and
recording every repeat's trace. :func:`validate` replays each repeat's traces with their CPU
times on that link (:data:`CPU`-style machine: host work kept) and compares with the measured
step; on N ranks sharing fewer cores it reports the replayed efficiency against the replayed
one-rank run, which thread CPU times make independent of how the cores were shared.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from seqpar.comm import TokenRingGroups
from seqpar.comm.pool import LocalRanks
from seqpar.tracing import Trace, trace

from .core import _TWO_WAY, BenchCase, _call, _inputs
from .local_cores import MachineLock, check_own_cores, one_core, own_core
from .machine import Machine
from .replay import replay

PINGPONG_BYTES = (1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24)


def _pingpong_on_rank(sizes, repeats: int, cpu: bool = False, stat=statistics.median) -> list:
    """Median (``stat``) seconds of one exchange of each size between ranks 0 and 1 (both directions
    at once); with ``cpu``, (seconds, CPU seconds of this process's other threads during the exchange)
    instead: the main thread only waits, the threads that move the bytes (gloo's) run."""
    torch.set_num_threads(1)
    peer = 1 - dist.get_rank()
    out = []
    for size in sizes:
        send, recv = torch.zeros(size // 4), torch.empty(size // 4)
        times, others = [], []
        for _ in range(repeats + 1):
            dist.barrier()
            t0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
            works = [dist.isend(send, peer), dist.irecv(recv, peer)]
            for w in works:
                w.wait()
            times.append(time.perf_counter() - t0)
            others.append((time.process_time() - p0) - (time.thread_time() - c0))
        med = stat(times[1:])
        out.append((med, stat(others[1:])) if cpu else med)
    return out


LATENCY_REPEATS = 40  # exchanges of the smallest size whose mean is the link's latency


def calibrate_link(ranks: LocalRanks, sizes=PINGPONG_BYTES, repeats: int = 7,
                   latency_repeats: int = LATENCY_REPEATS) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of this machine's 2-rank link: the bandwidth by least squares
    on the ping-pong's medians; the latency from the mean of ``latency_repeats`` exchanges of the
    smallest size (0: the fit's intercept). The mean, not the median: a thread that waits for a
    message on this VM wakes at once or, about one time in three, at the next 4 ms timer tick (a
    32-byte exchange after a barrier: 0.1-0.3 ms in 8 of 12 tries, 2.8-4.2 ms in 4), and a replay
    of a whole step needs the expected wait; the median hides the tail."""
    per_rank = ranks.run(_pingpong_on_rank, 2, sizes, repeats, timeout=600)
    t = np.maximum(per_rank[0], per_rank[1])
    slope, lat = np.polyfit(np.asarray(sizes, float), t, 1)
    bw = 1.0 / max(slope, 1e-15)
    if latency_repeats:
        least = min(sizes)
        small = ranks.run(_pingpong_on_rank, 2, [least], latency_repeats, False, statistics.mean, timeout=600)
        lat = max(small[0][0], small[1][0]) - least / bw
    return bw, max(float(lat), 0.0)


# Sizes of the transfer-CPU calibration: the messages of the validation's ring steps (8.4 MB) and
# around them, long enough (2-9 ms here) that the threads' start-up is a small part.
TRANSFER_CPU_BYTES = (1 << 22, 1 << 23, 1 << 24)


def calibrate_transfer_cpu(ranks: LocalRanks, sizes=TRANSFER_CPU_BYTES, repeats: int = 7) -> float:
    """Cores a message takes at each of its ends while it flows on this machine (``Machine.transfer_cpu``):
    in the ping-pong each process sends one message and receives one (two ends), so the CPU time of
    its other threads over the exchange's wall time, halved; the median over sizes and both ranks.
    Measured here (gloo over loopback TCP, 2 cores): 0.2-0.45 per end, so a rank that computes while
    its ring step's two messages flow shares its core with about 0.7 of another."""
    per_rank = ranks.run(_pingpong_on_rank, 2, sizes, repeats, True, timeout=600)
    shares = [other / wall / 2 for rows in per_rank for wall, other in rows if wall > 0]
    return max(0.0, float(statistics.median(shares)))


# Chunk sizes (bytes per member, as the traces record them) of the collective calibration: from a
# linear-attention state to a K,V chunk of the validation's shape (2048 tokens x 8 heads x 64 x 4
# bytes x 2 = 8.4 MB at N = 2).
COLLECTIVE_BYTES = (1 << 16, 1 << 20, 1 << 22, 1 << 23, 12 << 20)
# At two members every algorithm of the replay (seqpar.bench.replay.collective_seconds) is
# ``latencies x lat + chunk / bw``: one step of the ring all-gather / reduce-scatter, one round of
# the all-to-all, the chain broadcast / reduce; the ring all-reduce twice its half chunk.
_LATENCIES = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "broadcast": 1, "reduce": 1, "all_reduce": 2}


def _collectives_on_rank(sizes, repeats: int) -> dict[str, list[float]]:
    """Median seconds of each collective kind between ranks 0 and 1 for each chunk size."""
    torch.set_num_threads(1)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out: dict[str, list[float]] = {k: [] for k in _LATENCIES}
    for size in sizes:
        one, two = torch.zeros(size // 4), torch.zeros(2 * (size // 4))
        res = torch.empty(2 * (size // 4))
        calls = {"all_gather": lambda: gather(res, one), "reduce_scatter": lambda: scatter(one, two),
                 "all_to_all": lambda: dist.all_to_all_single(res, two), "broadcast": lambda: dist.broadcast(one, 0),
                 "reduce": lambda: dist.reduce(one, 0), "all_reduce": lambda: dist.all_reduce(one)}
        for kind, call in calls.items():
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            out[kind].append(statistics.median(times[1:]))
    return out


def calibrate_collectives(ranks: LocalRanks, sizes=COLLECTIVE_BYTES, repeats: int = 5) -> dict:
    """``{kind: (bandwidth, latency)}`` of each collective kind on 2 ranks of this machine: its time
    (the slower rank's median) fitted to the replay's formula for two members (:data:`_LATENCIES`)
    by least squares on the relative error, so that every size, small or large, is fitted to the
    same fraction (unweighted, the largest chunk alone set the line: one calibration gave the
    reduce-scatter 0.17 GB/s and no latency, another 0.52 GB/s and 517 us); :attr:`Machine.collectives`
    then replays each kind as measured."""
    per_rank = ranks.run(_collectives_on_rank, 2, sizes, repeats, timeout=600)
    fitted = {}
    for kind, lats in _LATENCIES.items():
        t = np.maximum(per_rank[0][kind], per_rank[1][kind])
        slope, fixed = np.polyfit(np.asarray(sizes, float), t, 1, w=1.0 / t)
        fitted[kind] = (1.0 / max(slope, 1e-15), max(float(fixed), 0.0) / lats)
    return fitted


def calibrate_machine(ranks: LocalRanks) -> Machine:
    """This machine's :func:`cpu_machine` with everything calibrated on ``ranks``: the ping-pong link
    (:func:`calibrate_link`), each collective (:func:`calibrate_collectives`) and the transfers'
    CPU (:func:`calibrate_transfer_cpu`). Run it once, on the idle machine."""
    bw, lat = calibrate_link(ranks)
    return cpu_machine(bw, lat, collectives=calibrate_collectives(ranks), transfer_cpu=calibrate_transfer_cpu(ranks))


def cpu_machine(bandwidth: float, latency: float, name: str = "this machine",
                collectives: dict | None = None, transfer_cpu: float = 0.0) -> Machine:
    """Traced CPU times and host work, every rank its own port (one node); ``collectives`` from
    :func:`calibrate_collectives` (else every collective runs on the ping-pong link); ``transfer_cpu``
    from :func:`calibrate_transfer_cpu` (else transfers take no CPU from the ranks)."""
    desc = "local gloo ranks, link from a ping-pong" + (", collectives timed" if collectives else "")
    desc += f", transfers take {transfer_cpu:.2f} core per end" if transfer_cpu else ""
    return Machine(name, desc, ranks_per_node=1 << 20, intra_bw=bandwidth, inter_bw=bandwidth, intra_lat=latency,
                   inter_lat=latency, kernels=None, host=True, transfer_cpu=transfer_cpu,
                   collectives=dict(collectives or {}))


def _case_on_rank(case: BenchCase, repeats: int, warmup: int, exclusive: MachineLock | None = None,
                  paired: bool = False, pin: bool = False) -> list[tuple[float, dict, dict | None]]:
    """Every repeat's (this rank's fwd+bwd wall seconds, trace, one-rank trace or None) of ``case``
    (the bench's call); with ``exclusive``, the ranks compute one at a time (:class:`seqpar.Trace`),
    all on one core (:func:`one_core`); with ``pin``, each rank's compute thread on a core of its own
    (:func:`own_core`). With ``paired``, rank 0 runs the same method on one rank (the whole
    sequence, a group of its own) after every N-rank step, while the other ranks wait: the one-rank
    reference of each repeat is measured seconds after that repeat, in the same processes."""
    if exclusive is not None:
        place = one_core()
    elif pin:
        place = own_core(dist.get_rank() if dist.is_initialized() else 0, case.world_size)
    else:
        place = contextlib.nullcontext()
    with place:
        return _repeats_on_rank(case, repeats, warmup, exclusive, paired)


def _repeats_on_rank(case: BenchCase, repeats: int, warmup: int, exclusive, paired: bool) -> list:
    from seqpar.layouts import shard

    torch.set_num_threads(case.threads)
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    full = _inputs(case, torch.device("cpu"))
    local = [shard(t, method=case.method, group=group) for t in full]
    comm = TokenRingGroups(group) if group is not None and case.method in _TWO_WAY else None
    one = None
    if paired:  # every rank takes part in creating a group, rank 0 alone is in it
        one = (replace(case, world_size=1), dist.new_group([0]) if group is not None else None)
    out = []
    for i in range(warmup + repeats):
        rec = _trace(case, rank, case.world_size, exclusive)
        with trace(rec):
            _, fwd_ms, bwd_ms = _call(case, local, group, comm=comm)
        rec1 = None
        if one is not None:
            if group is not None:
                dist.barrier(group)  # the N-rank step is over on every rank
            if rank == 0:
                rec1 = _trace(case, 0, 1, exclusive)
                with trace(rec1):
                    _call(one[0], full, one[1])
                rec1 = rec1.to_dict()
        if i >= warmup:
            out.append(((fwd_ms + bwd_ms) * 1e-3, rec.to_dict(), rec1))
    if comm is not None:
        comm.destroy()
    return out


def _trace(case: BenchCase, rank: int, world_size: int, exclusive) -> Trace:
    return Trace(rank=rank, world_size=world_size, exclusive=exclusive,
                 meta={"method": case.method, "world_size": world_size, "cpus": sorted(os.sched_getaffinity(0))})


def run_case(ranks: LocalRanks, case: BenchCase, repeats: int = 3, warmup: int = 1,
             exclusive: MachineLock | None = None, paired: bool = False,
             pin: bool = False) -> tuple[list, list, list]:
    """(measured steps: the slowest rank per repeat, traces: per repeat the list of every rank's,
    one-rank traces: per repeat a list of one trace with ``paired``, else []); ``exclusive`` and
    ``pin`` as for :func:`_case_on_rank` (not both)."""
    if exclusive is not None and pin:
        raise ValueError("pin: the ranks of an exclusive run share one core (one_core); pass pin=False")
    if pin:
        check_own_cores(case.world_size)
    per_rank = ranks.run(_case_on_rank, case.world_size, case, repeats, warmup, exclusive, paired, pin,
                         timeout=3600)
    steps = [max(per_rank[r][i][0] for r in range(case.world_size)) for i in range(repeats)]
    traces = [[per_rank[r][i][1] for r in range(case.world_size)] for i in range(repeats)]
    one = [[per_rank[0][i][2]] for i in range(repeats)] if paired else []
    return steps, traces, one


def floor_traces(repeats: list[list[dict]], pick=min) -> list[dict] | None:
    """One trace per rank whose every compute time and host gap is ``pick`` (default the minimum)
    over the repeats (the repeats of one case record the same events in the same order): the least
    disturbed estimate of each segment on shared cores, where another rank's work can only slow a
    segment down (cache, frequency), never speed it up. None when the repeats' events differ."""
    out = []
    for rank_traces in zip(*repeats):
        events = [t["events"] for t in rank_traces]
        if any(len(e) != len(events[0]) or any(a["type"] != b["type"] for a, b in zip(e, events[0])) for e in events):
            return None
        floor, clock = [], 0
        for i, ev in enumerate(events[0]):
            if i:
                clock += max(0, pick([e[i]["t"] - _end(e[i - 1]) for e in events]))
            ev = dict(ev, t=clock)
            if ev["type"] == "compute":
                ev["cpu"] = pick([e[i]["cpu"] for e in events])
                clock += ev["cpu"]
            floor.append(ev)
        out.append(dict(rank_traces[0], events=floor))
    return out


def _end(ev: dict) -> int:
    return ev["t"] + ev.get("cpu", 0) if ev["type"] == "compute" else ev["t"]


def kernel_class_traces(repeats: list[list[dict]]) -> list[dict] | None:
    """The median repeat (:func:`floor_traces` with the median), then every compute event's time
    replaced by the median over every rank and repeat of the events of its class (name, shape,
    mask): one time per kernel class, as a GPU kernel model has, so that noise on one rank's
    segment no longer shows up as imbalance between ranks. None when the repeats' events differ."""
    med = floor_traces(repeats, pick=statistics.median)
    if med is None:
        return None
    times: dict = {}
    for ranks in repeats:
        for tr in ranks:
            for ev in tr["events"]:
                if ev["type"] == "compute":
                    times.setdefault(_kernel_class(ev), []).append(ev["cpu"])
    out = []
    for tr in med:
        events, shift = [], 0
        for ev in tr["events"]:
            ev = dict(ev, t=ev["t"] + shift)
            if ev["type"] == "compute":
                cpu = statistics.median(times[_kernel_class(ev)])
                shift += cpu - ev["cpu"]
                ev["cpu"] = cpu
            events.append(ev)
        out.append(dict(tr, events=events))
    return out


def _kernel_class(ev: dict) -> tuple:
    return ev["name"], tuple(ev.get("shape") or ()), str(ev.get("mask"))


def validate(methods, world_size: int, shape: dict, *, m: Machine, ranks: LocalRanks, repeats: int = 3,
             warmup: int = 1, ideal: bool = False, exclusive: MachineLock | None = None,
             rounds: int = 1, pin: bool = False) -> list[dict]:
    """One row per method: measured and replayed step (medians over repeats), their error,
    ``off_cpu`` (the compute segments' time off the CPU, :func:`off_cpu_share`),
    ``efficiency_own`` (the ranks' mean traced busy time over the replayed step: the schedule's
    imbalance, exposed communication and waiting, measured against the same run's own work), and
    with ``ideal`` the replayed efficiency against a replayed one-rank run (its step / N / the step),
    also for the :func:`floor_traces` of the repeats (``efficiency_floor``) and for their
    :func:`kernel_class_traces` (``efficiency_class``). The one-rank run of each repeat follows the
    N-rank step in the same processes (:func:`run_case` ``paired``), so a machine that drifts in
    speed slows both alike.

    With ``exclusive`` (a :class:`MachineLock`) the ranks compute one at a time, all on one core
    (:func:`one_core`), so each traced kernel time is that kernel's alone on that core however many
    ranks share the cores; the measured wall clock then says nothing about the method and the row
    has no ``error``. With ``pin`` each rank computes on a core of its own (:func:`own_core`).
    ``rounds`` > 1 takes the repeats in that many rounds over ``methods`` (:func:`round_robin`)."""
    rows = []
    for meth, (measured, traces, one) in round_robin(ranks, methods, world_size, shape, repeats, warmup,
                                                     exclusive, ideal, rounds, pin).items():
        results = [replay(tr, m, expect={"method": meth, "world_size": world_size}) for tr in traces]
        replayed = [r.step_s for r in results]
        # the same run's traced work, perfectly divided: mean busy (compute + host) time over the step
        own = [statistics.mean(x.compute_s + x.host_s for x in r.ranks) / r.step_s for r in results]
        row = {"method": meth, "world_size": world_size, **shape, "measured_s": statistics.median(measured),
               "replayed_s": statistics.median(replayed), "measured_all": measured, "replayed_all": replayed,
               "efficiency_own": statistics.median(own), "exclusive": exclusive is not None}
        if exclusive is None:
            row["error"] = row["replayed_s"] / row["measured_s"] - 1
            row["off_cpu"] = off_cpu_share(traces, measured)
        if ideal:
            row.update(_against_one_rank(traces, one, row["replayed_s"], m))
        rows.append(row)
    return rows


def round_robin(ranks: LocalRanks, methods, world_size: int, shape: dict, repeats: int, warmup: int,
                exclusive, paired: bool, rounds: int = 1, pin: bool = False) -> dict:
    """method -> :func:`run_case`'s (measured, traces, one-rank traces), its ``repeats`` taken
    ``repeats // rounds`` at a time, method after method, round after round: each method's repeats
    spread over the whole call instead of one stretch of it, so that the least disturbed time of a
    segment (:func:`floor_traces`) is the least over the same minutes for every method and is not
    decided by the machine's state in one stretch (bench_b_spread.md: this VM's kernels of different
    sizes slow down unequally from one minute to the next). Only the first round starts with
    ``warmup`` untimed steps: a later round's first repeat (fresh inputs and groups) may be slower,
    which the floor ignores but the medians of :func:`validate` (``measured_s``, ``replayed_s``,
    ``efficiency``, ``efficiency_own``, ``efficiency_class``) include."""
    if rounds < 1 or repeats % rounds:
        raise ValueError(f"rounds: must divide repeats ({repeats}) and be >= 1, got {rounds}; "
                         f"pass a repeat count that is a multiple of the rounds")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods: {list(methods)} names a method twice; name each once")
    out = {meth: ([], [], []) for meth in methods}
    for r in range(rounds):
        for meth in methods:
            got = run_case(ranks, BenchCase(meth, world_size=world_size, **shape), repeats // rounds,
                           warmup if r == 0 else 0, exclusive, paired=paired, pin=pin)
            for acc, new in zip(out[meth], got):
                acc.extend(new)
    return out


def off_cpu_share(traces: list[list[dict]], measured: list[float]) -> float:
    """Median over the repeats of the most time any rank's compute segments spent off its CPU (their
    wall time minus their thread CPU time, which the replay computes with) over the measured step:
    the part of a measured step that a replay with traced CPU times cannot see (a rank taken off its
    core by other threads, or runnable and waiting for one; :func:`own_core`)."""
    shares = []
    for ranks, step in zip(traces, measured):
        off = max(sum(ev["wall"] - ev["cpu"] for ev in tr["events"] if ev["type"] == "compute") for tr in ranks)
        shares.append(off * 1e-9 / step)
    return statistics.median(shares)


def _against_one_rank(traces, one, replayed_s, m) -> dict:
    """The efficiencies of :func:`validate` against the replayed one-rank run of the same method."""
    n = len(traces[0])
    t1 = statistics.median(replay(tr, m).step_s for tr in one)
    out = {"replayed_one_s": t1, "efficiency": t1 / n / replayed_s}
    for key, build in (("efficiency_floor", floor_traces), ("efficiency_class", kernel_class_traces)):
        many, single = build(traces), build(one)
        if many is not None and single is not None:
            out[key] = replay(single, m).step_s / n / replay(many, m).step_s
    return out


def tracing_overhead(ranks: LocalRanks, case: BenchCase, repeats: int = 5) -> dict:
    """Steps with and without tracing, interleaved repeat by repeat (medians): wall clock (the
    slowest rank) and this thread's CPU time (the busiest rank; insensitive to other jobs)."""
    per_rank = ranks.run(_overhead_on_rank, case.world_size, case, repeats, timeout=3600)
    out = {}
    for k, name in enumerate(("wall", "cpu")):
        on = statistics.median(max(r[i][2 * k] for r in per_rank) for i in range(repeats))
        off = statistics.median(max(r[i][2 * k + 1] for r in per_rank) for i in range(repeats))
        out.update({f"traced_{name}_s": on, f"untraced_{name}_s": off, f"overhead_{name}": on / off - 1})
    out["overhead"] = out["overhead_wall"]
    return out


def _overhead_on_rank(case: BenchCase, repeats: int) -> list[tuple[float, float, float, float]]:
    from seqpar.layouts import shard

    torch.set_num_threads(case.threads)
    group = dist.group.WORLD
    local = [shard(t, method=case.method, group=group) for t in _inputs(case, torch.device("cpu"))]
    _call(case, local, group)
    out = []
    for _ in range(repeats):
        c0 = time.thread_time()
        with trace(Trace()):
            _, f1, b1 = _call(case, local, group)
        c1 = time.thread_time()
        _, f0, b0 = _call(case, local, group)
        c2 = time.thread_time()
        out.append(((f1 + b1) * 1e-3, (f0 + b0) * 1e-3, c1 - c0, c2 - c1))
    return out


__all__ = ["LATENCY_REPEATS", "calibrate_link", "calibrate_machine", "calibrate_transfer_cpu", "cpu_machine", "floor_traces",
           "kernel_class_traces", "off_cpu_share", "round_robin", "run_case", "tracing_overhead", "validate"]
