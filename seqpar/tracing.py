"""Per-rank traces of real runs: what a rank computed and sent, in its own order (torch-free).

A :class:`Trace` is a recorder the caller owns, like :class:`seqpar.CommStats`: pass it as
``trace=`` to :func:`seqpar.attention` / :func:`seqpar.linear_attention`, or make it current for a
block of code with :func:`trace` (a context variable set only inside the ``with`` block's dynamic
extent, as :func:`seqpar.checkpoint`'s tape: nothing global, nothing left behind), so a model that
calls attention deep inside (HF transformers) is traced without plumbing. Every rank records its
own trace; :meth:`Trace.save` writes it as JSON and :mod:`seqpar.bench.replay` replays the traces
of all ranks on a machine model.

Events, in the rank's order (``id`` = index; every event has ``phase`` ``"fwd"``/``"bwd"``, ``t``:
this thread's CPU time when it started, ``w``: wall time, both ns since the trace began; the file's
``wall_origin_ns`` is when it began on ``time.perf_counter_ns``'s clock, which on Linux is one
clock for every process of a machine, so local ranks' events can be put on one time line):

- ``compute``: one kernel or block call: ``name``, ``flops`` (the bench's formulas below),
  ``shape``, ``mask``, ``cpu`` (its duration as this thread's CPU time, ``time.thread_time_ns``:
  ranks sharing a core do not inflate each other), ``wall``, ``deps`` (ids of the messages or
  collectives whose data it reads);
- ``send`` / ``recv``: one message: ``src``, ``dst`` (global ranks), ``bytes``, ``chan`` (the
  stream's name), ``tag``; a send lists in ``deps`` the computes (or receives) whose results it
  carries and may be posted before they exist (All-Scan's helper thread forwards a block once it
  arrived);
- ``wait``: the rank blocks until the messages / asynchronous collectives ``ids`` completed;
- ``coll``: a collective: ``kind`` (``all_gather``, ``reduce_scatter``, ``all_to_all``,
  ``all_reduce``, ``broadcast``, ``reduce``), ``members`` (global ranks, group order), ``bytes``
  (this member's chunk; ``splits``: bytes to each member for all-to-all), ``async`` (then a later
  ``wait`` names it; else the rank blocks in it);
- ``begin`` / ``end``: the borders of one attention call's forward or backward; the CPU time
  between two events inside them is host work (Python, packing, merges) the replay keeps.

With no trace (``trace=None`` and no :func:`trace` block) nothing is recorded: every hook is one
``is None`` test.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
from pathlib import Path

FORMAT = "seqpar-trace"
VERSION = 1

# The recorder of the innermost ``with seqpar.trace(...)`` block being run in this context.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("seqpar_trace", default=None)
_NULL = contextlib.nullcontext()


def attention_flops(batch: int, seq_len: int, heads: int, head_dim: int, causal: bool) -> tuple[float, float]:
    """FLOPs of softmax attention over a whole ``[B, T, Hq, D]`` problem, ``(forward, backward)``.

    Forward: two matmuls (``Q K^T`` and ``P V``) of ``T x T x D`` per head at 2 FLOPs per
    multiply-add, ``4 * B * T^2 * Hq * D``, halved when causal (only the lower triangle is needed).
    Backward: 2.5 x forward (five matmuls: recomputed ``Q K^T``, ``dV``, ``dP``, ``dQ``, ``dK``).
    GQA does not change the count (K,V heads are shared, the products are per query head).
    """
    fwd = 4.0 * batch * seq_len * seq_len * heads * head_dim * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


def block_flops(batch: int, rows: int, cols: int, heads: int, head_dim: int, mask: str,
                backward: bool = False, pairs: int | None = None) -> float:
    """FLOPs of one ``rows x cols`` block by the same formula (a masked block counts half; a packed
    block counts its ``pairs`` visible (query, key) pairs)."""
    area = pairs if pairs is not None else rows * cols * (0.5 if mask != "none" else 1.0)
    fwd = 4.0 * batch * area * heads * head_dim
    return 2.5 * fwd if backward else fwd


def linear_flops(batch: int, seq_len: int, heads: int, key_dim: int, value_dim: int,
                 chunk: int = 64) -> tuple[float, float]:
    """FLOPs of chunked (gated) linear attention, ``(forward, backward)``.

    Per token and head, with chunk length ``C`` (the whole ``C x C`` score block is computed):
    intra-chunk scores ``q k^T`` over ``C`` keys (``2·C·K``) and ``A V`` (``2·C·V``), inter-chunk
    ``q S`` (``2·K·V``) and the state update ``k^T v`` (``2·K·V``), so forward
    ``= B·T·H·(2·C·(K + V) + 4·K·V)``. Backward: 2 x forward (each product has two gradient
    products). Decay terms (element-wise) are not counted.
    """
    fwd = float(batch) * seq_len * heads * (2.0 * chunk * (key_dim + value_dim) + 4.0 * key_dim * value_dim)
    return fwd, 2.0 * fwd


def linear_part_flops(batch: int, seq_len: int, heads: int, key_dim: int, value_dim: int, part: str,
                      backward: bool = False, chunk: int = 64) -> float:
    """One linear-attention kernel's share of :func:`linear_flops`: ``"intra"`` ``2·C·(K+V)``,
    ``"states"`` / ``"output"`` ``2·K·V`` per token and head; backward twice that."""
    per = 2.0 * chunk * (key_dim + value_dim) if part == "intra" else 2.0 * key_dim * value_dim
    return float(batch) * seq_len * heads * per * (2.0 if backward else 1.0)


class _Span:
    """A compute event being timed (``with trace.compute(...) as ev``; ``ev.id`` is its id)."""

    __slots__ = ("trace", "event", "id", "_c0", "_w0")

    def __init__(self, trace: "Trace", event: dict):
        self.trace, self.event, self.id = trace, event, event["id"]

    def __enter__(self) -> "_Span":
        if self.trace.exclusive is not None:
            self.trace.exclusive.__enter__()
        self._c0, self._w0 = time.thread_time_ns(), time.perf_counter_ns()
        self.event["t"], self.event["w"] = self._c0 - self.trace._c_origin, self._w0 - self.trace._w_origin
        return self

    def __exit__(self, *exc) -> None:
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        self.event["cpu"], self.event["wall"] = c1 - self._c0, w1 - self._w0
        self.trace._c_last = c1
        if self.trace.exclusive is not None:
            self.trace.exclusive.__exit__(*exc)


class Trace:
    """The events of one rank (see the module docstring). ``meta`` describes the run (method,
    shape, ...) for the replay's checks; ``rank`` / ``world_size`` are filled by the first
    message or collective when not given.

    ``exclusive``: a context manager (a lock shared by the ranks of one machine, such as
    :class:`seqpar.bench.local_cores.MachineLock`) entered around every compute segment, so
    that no two ranks compute at once. For measuring on a machine with fewer cores than ranks: a
    segment's CPU time is then that of the kernel alone on a core (not inflated by other ranks'
    kernels evicting its caches), while the run's messages, order and dependencies are unchanged.
    The run's wall clock is meaningless then (the ranks take turns); only its trace is used."""

    def __init__(self, *, rank: int | None = None, world_size: int | None = None, meta: dict | None = None,
                 exclusive=None):
        self.rank, self.world_size = rank, world_size
        self.exclusive = exclusive
        self.meta = dict(meta or {})
        self.events: list[dict] = []
        self.phase = "fwd"
        self._c_origin, self._w_origin = time.thread_time_ns(), time.perf_counter_ns()
        self._c_last = self._c_origin

    # ----------------------------------------------------------------------------- recording
    def _add(self, type_: str, **fields) -> dict:
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        ev = {"id": len(self.events), "type": type_, "phase": self.phase, "t": c - self._c_origin,
              "w": w - self._w_origin, **fields}
        self.events.append(ev)
        self._c_last = c
        return ev

    def compute(self, name: str, *, flops: float = 0.0, shape: tuple = (), mask: str | None = None,
                deps=()) -> _Span:
        """Time one kernel call: ``with trace.compute("block_fwd", flops=...) as ev: ...``."""
        ev = {"id": len(self.events), "type": "compute", "phase": self.phase, "name": name, "flops": float(flops),
              "shape": list(shape), "mask": mask, "deps": sorted(set(deps))}
        self.events.append(ev)
        return _Span(self, ev)

    def send(self, src: int, dst: int, nbytes: int, *, chan: str, tag: int = 0, deps=()) -> int:
        self._bind(src)
        return self._add("send", src=src, dst=dst, bytes=int(nbytes), chan=chan, tag=int(tag),
                         deps=sorted(set(deps)))["id"]

    def recv(self, src: int, dst: int, nbytes: int, *, chan: str, tag: int = 0) -> int:
        self._bind(dst)
        return self._add("recv", src=src, dst=dst, bytes=int(nbytes), chan=chan, tag=int(tag))["id"]

    def wait(self, ids) -> None:
        ids = sorted(set(ids))
        if ids:
            self._add("wait", ids=ids)

    def collective(self, kind: str, me: int, members, nbytes: int, *, splits=None, chan: str = "",
                   async_op: bool = False, deps=()) -> int:
        self._bind(me)
        fields = {"kind": kind, "members": [int(m) for m in members], "bytes": int(nbytes), "chan": chan,
                  "async": bool(async_op), "deps": sorted(set(deps))}
        if splits is not None:
            fields["splits"] = [int(s) for s in splits]
        return self._add("coll", **fields)["id"]

    def begin(self, name: str) -> None:
        self.phase = "bwd" if name.endswith("bwd") else "fwd"
        self._add("begin", name=name)

    def end(self, name: str) -> None:
        self._add("end", name=name)

    @property
    def last_id(self) -> int:
        """The id of the latest event."""
        return len(self.events) - 1

    def _bind(self, me: int) -> None:
        if self.rank is None:
            self.rank = int(me)

    # ----------------------------------------------------------------------------- files
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "rank": self.rank, "world_size": self.world_size,
                "wall_origin_ns": self._w_origin, "meta": self.meta, "events": self.events}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n")

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "trace") -> "Trace":
        """A trace from :meth:`to_dict` output; ValueError naming ``source`` when it is not one."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source}: not a seqpar trace (expected format {FORMAT!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"{source}: trace version {data.get('version')!r}, this seqpar reads version "
                             f"{VERSION}; record the trace again with this version")
        if not isinstance(data.get("events"), list) or not isinstance(data.get("rank"), int):
            raise ValueError(f"{source}: a trace needs an integer 'rank' and a list of 'events'")
        out = cls(rank=data["rank"], world_size=data.get("world_size"), meta=data.get("meta") or {})
        out.events = data["events"]
        out._w_origin = int(data.get("wall_origin_ns", out._w_origin))
        return out

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        source = f"trace file {str(path)!r}"
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"{source}: cannot be read ({exc})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=source)


def active_trace() -> Trace | None:
    """The recorder of the enclosing :func:`trace` block (None outside one)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def trace(recorder: Trace):
    """Record every seqpar attention call inside the ``with`` block into ``recorder`` (a
    :class:`Trace` the caller owns; one per rank). An explicit ``trace=`` argument wins."""
    if not isinstance(recorder, Trace):
        raise ValueError(f"recorder: expected a seqpar.Trace, got {type(recorder).__name__}")
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)


def resolve(explicit: Trace | None) -> Trace | None:
    """The trace a call records into: ``explicit``, else the enclosing :func:`trace` block's."""
    if explicit is not None and not isinstance(explicit, Trace):
        raise ValueError(f"trace: expected a seqpar.Trace or None, got {type(explicit).__name__}")
    return explicit if explicit is not None else _ACTIVE.get()


def span(rec: Trace | None, name: str, **fields):
    """``rec.compute(name, **fields)``, or a shared no-op context when not tracing."""
    return _NULL if rec is None else rec.compute(name, **fields)


def begin(rec: Trace | None, name: str) -> None:
    if rec is not None:
        rec.begin(name)


def end(rec: Trace | None, name: str) -> None:
    if rec is not None:
        rec.end(name)


__all__ = ["FORMAT", "VERSION", "Trace", "active_trace", "attention_flops", "begin", "block_flops", "end",
           "linear_flops", "linear_part_flops", "resolve", "span", "trace"]
