"""``seqpar simulate``: the real schedules of every method, traced and replayed on a machine model.

For each method and N, every rank's trace of one step is built from the method's schedule
(:mod:`.schedule_trace`: the same events a real run records, equal to them event by event on
2-4 ranks in the tests; no run of N ranks at GPU shapes fits on one machine) or read from a
directory of recorded traces (``--traces DIR``, written by ``seqpar bench --trace DIR``), then
replayed (:mod:`.replay`) on a profile (:mod:`.machine`: ``h100-nvlink-ib``, ``h800-nvlink-ib``,
``a100-nvlink-ib``, ``pcie``, or a ``seqpar calibrate`` / machine file).

Rows: ``step_time_s`` (the last rank's end), ``ideal_s`` = the same method on one rank / N (as
``seqpar bench``), ``efficiency`` = ideal / step, ``efficiency_local`` = N x one rank's kernel time on
its own ``T/N`` tokens / step (ring-flash-attention's "theoretic flash_attn" definition: flash_attn
alone, without seqpar's accumulators),
``exposed_comm_s`` (the last rank's time blocked on communication), ``compute_s``, ``bytes_sent``
(the busiest rank), ``source`` (``schedule`` | ``recorded``), ``error`` (why a method cannot run at
this N; numbers NaN).
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from seqpar.methods import method as declared

from .machine import Machine
from .replay import ReplayResult, replay
from .schedule_trace import Shape, rank_events, schedule_traces

# 8 .. 256 by default: a replay of 512 or 1024 ranks handles millions of events (minutes each; pass them)
DEFAULT_WORLD_SIZES = tuple(1 << k for k in range(3, 9))


@contextmanager
def _no_gc():
    """The replay of 1024 ranks allocates millions of short-lived events: the cyclic collector would
    rescan them all the time (measured 1.45x slower at 256 ranks); nothing it builds is cyclic."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def ulysses_degree(n: int, heads: int, ranks_per_node: int) -> int:
    """USP's Ulysses degree on a machine: ``min(N, ranks per node)``, halved until it divides Hq."""
    u = min(n, ranks_per_node)
    while heads % u:
        u //= 2
    return u


def check_tiling(method: str, n: int, s: Shape) -> None:
    """ValueError naming the option when the method's layout cannot tile ``seq_len`` over ``n`` ranks."""
    spec = declared(method)
    multiple = n * spec.layout_multiple
    if s.seq_len % multiple:
        raise ValueError(f"--world-sizes: N={n} cannot tile --seq-len {s.seq_len} for {method} (its layout needs a "
                         f"multiple of {multiple} tokens); choose a length divisible by {multiple}")
    if spec.family == "linear" and s.kv_heads != s.heads:
        raise ValueError(f"--kv-heads: {method} is linear attention, which needs kv heads = heads ({s.heads})")


def _cannot_run(method: str, n: int, s: Shape, m: Machine) -> str:
    """Why ``method`` cannot run on ``n`` ranks (empty when it can)."""
    family = declared(method).family
    if family == "ulysses" and s.heads % n:
        return f"ulysses needs heads={s.heads} divisible by N={n}; use usp"
    if family == "usp":
        u = ulysses_degree(n, s.heads, m.ranks_per_node)
        if (s.seq_len // n * u) % 2:
            return f"usp's zigzag ring axis needs an even super-shard (U*T/N = {s.seq_len // n * u})"
    return ""


def step(method: str, n: int, s: Shape, m: Machine, *, forward_only: bool = False, traces=None) -> ReplayResult:
    """Replay one step of ``method`` on ``n`` ranks (schedule traces unless ``traces`` are given)."""
    u = ulysses_degree(n, s.heads, m.ranks_per_node) if declared(method).family == "usp" else None
    if traces is None:
        traces = [rank_events(method, n, r, s, forward_only=forward_only, ulysses_degree=u) for r in range(n)]
    with _no_gc():
        return replay(traces, m)


def simulate(methods, world_sizes, s: Shape, m: Machine, *, forward_only: bool = False,
             traces_dir: str | None = None, on_result=None, progress=None) -> list[dict]:
    """One row per (method, N) (module docstring). ``on_result(method, n, result)`` sees each replay;
    ``progress(method, n, seconds)`` is told how long each took."""
    for meth in methods:
        declared(meth)
        for n in world_sizes:
            check_tiling(meth, n, s)
    rows = []
    for meth in methods:
        one = step(meth, 1, s, m, forward_only=forward_only).step_s
        for n in world_sizes:
            row = {"method": meth, "world_size": n, "seq_len": s.seq_len, "batch": s.batch, "heads": s.heads,
                   "kv_heads": s.kv_heads, "head_dim": s.head_dim, "causal": s.causal, "forward_only": forward_only,
                   "profile": m.name, "source": "recorded" if traces_dir else "schedule"}
            why = _cannot_run(meth, n, s, m)
            if why:
                rows.append({**row, **dict.fromkeys(("step_time_s", "ideal_s", "efficiency", "efficiency_local",
                                                     "exposed_comm_s", "compute_s", "bytes_sent"), math.nan),
                             "error": why})
                continue
            recorded = load_trace_dir(traces_dir, meth, n, s.seq_len) if traces_dir else None
            t0 = time.perf_counter()
            res = step(meth, n, s, m, forward_only=forward_only, traces=recorded)
            if progress is not None:
                progress(meth, n, time.perf_counter() - t0)
            # ring-flash-attention's ideal assumes quadratic work (N x T/N tokens = T²/N): softmax only
            local = math.nan if declared(meth).family == "linear" else step(
                meth, 1, Shape(**{**s.__dict__, "seq_len": s.seq_len // n}), _kernel_only(m),
                forward_only=forward_only).step_s
            last = max(res.ranks, key=lambda r: r.end_s)
            rows.append({**row, "step_time_s": res.step_s, "ideal_s": one / n, "efficiency": one / n / res.step_s,
                         "efficiency_local": n * local / res.step_s, "exposed_comm_s": last.exposed_comm_s,
                         "compute_s": last.compute_s, "bytes_sent": _busiest(meth, n, s, m, forward_only, recorded),
                         "error": ""})
            if on_result is not None:
                on_result(meth, n, res)
    return rows


def _kernel_only(m: Machine) -> Machine:
    """``m`` with the attention kernel alone on one rank (no accumulator epilogue): the baseline of
    ``efficiency_local``, flash_attn on each GPU's own tokens."""
    return m if m.kernels is None else replace(m, kernels=replace(m.kernels, merge="none"))


def _busiest(method, n, s, m: Machine, forward_only, recorded) -> float:
    """Bytes the busiest rank sends in one step (messages, and its chunk of every collective)."""
    if n > 64 and recorded is None:
        return math.nan  # not worth a second pass over a million events
    u = ulysses_degree(n, s.heads, m.ranks_per_node) if declared(method).family == "usp" else None
    traces = recorded or schedule_traces(method, n, s, forward_only=forward_only, ulysses_degree=u)
    return float(max(sum(e["bytes"] for e in t.events if e["type"] in ("send", "coll")) for t in traces))


def load_trace_dir(path: str, method: str, n: int, seq_len: int) -> list:
    """The traces ``seqpar bench --trace DIR`` wrote for (method, n, seq_len), ordered by rank;
    ValueError naming the directory and the missing file."""
    from seqpar.tracing import Trace

    from .core import BenchCase, trace_file

    case = BenchCase(method=method, seq_len=seq_len, world_size=n)
    out = []
    for r in range(n):
        f = Path(path) / trace_file(case, r)
        if not f.exists():
            raise ValueError(f"--traces {path!r}: {f.name} is missing; record it with 'seqpar bench --methods {method} "
                             f"--seq-lens {seq_len} --nproc {n} --trace {path}'")
        out.append(Trace.load(f))
    for r, t in enumerate(out):
        for key, want in (("method", method), ("world_size", n), ("seq_len", seq_len)):
            if t.meta.get(key) != want:
                raise ValueError(f"--traces {path!r}: rank {r}'s trace has {key}={t.meta.get(key)!r}, "
                                 f"expected {want!r}")
    return out


__all__ = ["DEFAULT_WORLD_SIZES", "check_tiling", "load_trace_dir", "simulate", "step", "ulysses_degree"]
