"""Local ranks: N persistent worker processes joined by one gloo group, for commands that run on
this machine's CPU ranks (``seqpar bench``, ``seqpar calibrate``, ``seqpar train --nproc N``) and for
the test harness (:mod:`seqpar.testing`).

Spawning a rank costs about a second (mostly ``import torch``), so a :class:`WorkerPool` spawns its
ranks once (``spawn`` start method), joins them in a gloo process group once (TCP rendezvous on a
free localhost port) and then serves any number of cases sent over pipes.

Failures never hang the caller:

* A case still running after ``timeout`` seconds kills the pool (SIGKILL) and raises
  :class:`DistributedTimeout` naming the ranks that did not answer.
* When a rank raises, the others get ``failure_grace`` seconds (default 5) to finish; ranks
  still running then (typically blocked in a collective with the failed one) are killed.
* When every rank raised the same exception type, that type is raised again (so
  ``pytest.raises(ValueError, match=...)`` works) with rank 0's message, then
  ``(raised on ranks [0, 1, ...])`` and rank 0's traceback; otherwise :class:`RankError`.
* A worker that dies (signal, ``os._exit``) is reported as a failure of its rank.

Raised errors carry ``per_rank_errors = {rank: (type_name, message, traceback_text)}``.
A killed pool respawns on its next run. A pool whose ranks all answered is kept; after a
failed case its process groups are re-created, which drops messages left unmatched.

Inside ``fn``, the default gloo group spans the world; ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``OMP_NUM_THREADS`` are set and
``torch.get_num_threads()`` is ``threads_per_rank`` (default 1). Groups that ``fn`` creates
(``new_group``, ``init_device_mesh``) are destroyed when the case ends: do not cache them.
``fn``, its arguments and its results must pickle; tensors are copied by value.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_FAILURE_GRACE", "DEFAULT_TIMEOUT", "DistributedTimeout", "LocalRanks", "RankError", "WorkerPool"]

DEFAULT_TIMEOUT = 120.0
DEFAULT_FAILURE_GRACE = 5.0
_HOST = "127.0.0.1"
_RESET_TIMEOUT = 60.0  # seconds to re-create the process groups after a failed case
_STORE_TIMEOUT = timedelta(seconds=300)


class RankError(RuntimeError):
    """``fn`` failed on some ranks; the message holds every failed rank's remote traceback."""

    def __init__(self, message: str, per_rank_errors: dict[int, tuple[str, str, str]] | None = None,
                 stuck_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.per_rank_errors = dict(per_rank_errors or {})
        self.stuck_ranks = list(stuck_ranks or [])  # ranks killed after the grace period

    @property
    def ranks(self) -> list[int]:
        """The ranks that failed (raised or died)."""
        return sorted(self.per_rank_errors)


class DistributedTimeout(TimeoutError):
    """Some ranks did not answer within the case's timeout; the pool was killed.

    ``ranks`` lists them; ``per_rank_errors`` has a ``("DistributedTimeout", ...)`` entry each.
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])
        self.per_rank_errors = {r: ("DistributedTimeout", "did not finish", "") for r in self.ranks}


class _Failure(NamedTuple):
    exc_type: type | None  # None when the type could not travel (or the worker died)
    type_name: str
    message: str
    traceback: str


# ----------------------------------------------------------------------------- worker side


def _describe(exc: BaseException) -> tuple[bytes | None, str, str, str]:
    try:
        type_bytes: bytes | None = pickle.dumps(type(exc))  # by reference; fails if not importable
    except Exception:
        type_bytes = None
    try:
        message = str(exc)
    except Exception:
        message = f"<unprintable {type(exc).__name__}>"
    return type_bytes, type(exc).__name__, message, "".join(traceback.format_exception(exc))


def _exit_with_parent(parent_pid: int) -> None:
    while True:  # never outlive the test session, even when stuck in a collective
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(rank: int, world_size: int, conn: Connection, port: int, prefix: str,
                 threads: int, pg_timeout: float | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(threads)
    with contextlib.suppress(Exception):  # prints from fn survive the worker being killed
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    store, pg_map = None, dist.distributed_c10d._world.pg_map
    kind, body = "reset", prefix
    while kind != "stop":
        groups = set(pg_map)
        try:
            if kind == "reset":  # (re)create the default group; drops stale unmatched messages
                if dist.is_initialized():
                    dist.destroy_process_group()
                store = store or dist.TCPStore(_HOST, port, is_master=False, timeout=_STORE_TIMEOUT)
                dist.init_process_group("gloo", store=dist.PrefixStore(body, store), rank=rank,
                                        world_size=world_size,
                                        timeout=None if pg_timeout is None else timedelta(seconds=pg_timeout))
                reply = pickle.dumps(("ready", os.getpid()))
            else:
                fn, args, kwargs = pickle.loads(body)
                result = fn(*args, **kwargs)
                try:
                    reply = pickle.dumps(("ok", result))
                except Exception as exc:
                    raise TypeError(f"the value returned by fn does not pickle: {exc}") from exc
        except BaseException as exc:
            reply = pickle.dumps(("err", _describe(exc)))
        for group in set(pg_map) - groups if kind == "run" else ():  # groups that fn created
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
        conn.send_bytes(reply)
        try:
            kind, body = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent side


@contextlib.contextmanager
def _patched_environ(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _from_wire(body: tuple[bytes | None, str, str, str]) -> _Failure:
    type_bytes, type_name, message, tb = body
    try:
        exc_type = pickle.loads(type_bytes) if type_bytes is not None else None
    except Exception:  # the exception's class is not importable here
        exc_type = None
    return _Failure(exc_type, type_name, message, tb)


class WorkerPool:
    """``world_size`` persistent worker processes forming one gloo group.

    The ranks are spawned lazily by the first :meth:`run` (or :meth:`start`) and again after
    the pool was killed. ``failure_grace`` and ``threads_per_rank`` may be changed between
    cases (``threads_per_rank`` and ``pg_timeout`` take effect on the next spawn).
    ``pg_timeout`` (seconds, None = torch's default) is the ``timeout=`` of the ranks'
    ``init_process_group``: how long a send/recv/collective waits for a peer before failing
    (tests of peer failure use a few seconds, with a ``failure_grace`` longer than that).
    """

    def __init__(self, world_size: int, *, threads_per_rank: int = 1,
                 failure_grace: float = DEFAULT_FAILURE_GRACE, start_timeout: float = 300.0,
                 pg_timeout: float | None = None) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank!r}")
        if pg_timeout is not None and not pg_timeout > 0:
            raise ValueError(f"pg_timeout must be > 0 seconds or None, got {pg_timeout!r}")
        self.pg_timeout = pg_timeout
        self.world_size = world_size
        self.threads_per_rank = threads_per_rank
        self.failure_grace = failure_grace
        self.start_timeout = start_timeout
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._store: dist.TCPStore | None = None
        self._generation = 0
        self._lock = threading.RLock()

    @property
    def pids(self) -> list[int]:
        """PIDs of the current worker processes (empty while no pool is running)."""
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Spawn the ranks and initialise their process group, unless already running."""
        with self._lock:
            if self.alive:
                return
            self.close(kill=True)
            ctx = mp.get_context("spawn")
            self._store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False,
                                        timeout=_STORE_TIMEOUT)
            prefix = self._next_prefix()
            env = {"MASTER_ADDR": _HOST, "MASTER_PORT": str(self._store.port),
                   "WORLD_SIZE": str(self.world_size), "OMP_NUM_THREADS": str(self.threads_per_rank)}
            try:
                for rank in range(self.world_size):
                    parent_end, child_end = ctx.Pipe(duplex=True)
                    proc = ctx.Process(target=_worker_main, name=f"seqpar-rank{rank}",
                                       args=(rank, self.world_size, child_end, self._store.port,
                                             prefix, self.threads_per_rank, self.pg_timeout))
                    with _patched_environ({**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}):
                        proc.start()  # the spawned interpreter inherits os.environ
                    child_end.close()
                    self._procs.append(proc)
                    self._conns.append(parent_end)
                error = self._await_ready(self.start_timeout, "worker start-up")
            except BaseException:
                self.close(kill=True)
                raise
            if error is not None:
                raise RuntimeError(f"could not start a {self.world_size}-rank worker pool") from error

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None,
            *, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank."""
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        message = pickle.dumps(("run", pickle.dumps((fn, tuple(args), dict(kwargs or {})))))
        with self._lock:
            self.start()
            try:
                for conn in self._conns:
                    with contextlib.suppress(OSError):  # a dead worker is reported by _collect
                        conn.send_bytes(message)
                replies, failures, pending, died = self._collect(time.monotonic() + timeout,
                                                                 self.failure_grace)
            except BaseException:  # e.g. KeyboardInterrupt: the ranks' state is unknown
                self.close(kill=True)
                raise
            if pending or died:
                self.close(kill=True)
            elif failures and not self._reset_groups():
                self.close(kill=True)
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        if failures:
            raise _failure_exception(failures, sorted(pending), self.world_size, name,
                                     self.failure_grace)
        if pending:
            raise DistributedTimeout(
                f"{name} did not finish within {timeout:g} s on rank(s) {sorted(pending)} "
                f"(world size {self.world_size}); the worker pool was killed and will be "
                f"respawned by the next call", ranks=sorted(pending))
        return [replies[rank] for rank in range(self.world_size)]

    def close(self, *, kill: bool = False) -> None:
        """Stop the workers (politely unless ``kill``; stragglers are killed after 3 s)."""
        procs, conns, self._procs, self._conns = self._procs, self._conns, [], []
        for conn in conns if not kill else []:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("stop", None)))
        deadline = time.monotonic() + (0.0 if kill else 3.0)
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(10.0)
        for conn in conns:
            conn.close()
        self._store = None

    def _next_prefix(self) -> str:
        self._generation += 1
        return f"seqpar-ranks/{self._generation}/"

    def _await_ready(self, timeout: float, what: str) -> Exception | None:
        """Collect every rank's "ready"; on failure kill the pool and return the error."""
        _, failures, pending, _ = self._collect(time.monotonic() + timeout, None)
        if not failures and not pending:
            return None
        self.close(kill=True)
        if failures:
            return _failure_exception(failures, sorted(pending), self.world_size, what, 0.0)
        return DistributedTimeout(f"{what}: rank(s) {sorted(pending)} not ready after "
                                  f"{timeout:g} s", ranks=sorted(pending))

    def _reset_groups(self) -> bool:
        """Re-create the ranks' process groups; False (pool killed) if that fails."""
        message = pickle.dumps(("reset", self._next_prefix()))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:
                return False
        return self._await_ready(_RESET_TIMEOUT, "process group reset") is None

    def _collect(self, deadline: float, grace: float | None
                 ) -> tuple[dict[int, Any], dict[int, _Failure], set[int], bool]:
        """Wait for one reply per rank until ``deadline`` (or ``grace`` after a failure)."""
        pending = set(range(self.world_size))
        replies: dict[int, Any] = {}
        failures: dict[int, _Failure] = {}
        died = False
        cutoff = deadline
        while pending:
            remaining = cutoff - time.monotonic()
            if remaining <= 0:
                break
            owners: dict[Any, int] = {}
            for rank in pending:
                owners[self._conns[rank]] = rank
                owners[self._procs[rank].sentinel] = rank
            for ready in wait(list(owners), remaining):
                rank = owners[ready]
                if rank not in pending:
                    continue
                pending.discard(rank)
                conn = self._conns[rank]
                try:
                    if not conn.poll():  # process gone but the pipe is still held open
                        raise EOFError
                    status, body = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    failures[rank] = self._death(rank)
                    died = True
                except Exception as exc:  # the reply does not unpickle in this process
                    failures[rank] = _Failure(None, type(exc).__name__, f"could not unpickle "
                                              f"the reply of rank {rank}: {exc}", "")
                else:
                    if status == "err":
                        failures[rank] = _from_wire(body)
                    else:
                        replies[rank] = body
                if failures and grace is not None and cutoff == deadline:
                    cutoff = min(deadline, time.monotonic() + grace)
        return replies, failures, pending, died

    def _death(self, rank: int) -> _Failure:
        proc = self._procs[rank]
        proc.join(2.0)
        code = proc.exitcode
        how = f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by signal {next((g.name for g in signal.Signals if g == -code), -code)}"
        return _Failure(None, "WorkerDied", f"worker process of rank {rank} (pid {proc.pid}) "
                        f"{how} before answering", "")


def _failure_exception(failures: dict[int, _Failure], stuck: list[int], world_size: int,
                       name: str, grace: float) -> Exception:
    """The exception to raise for a case in which some ranks failed."""
    per_rank = {r: (f.type_name, f.message, f.traceback) for r, f in sorted(failures.items())}
    ranks = sorted(failures)
    types = {f.exc_type for f in failures.values()}
    exc_type = types.pop() if len(types) == 1 else None
    if (len(failures) == world_size and isinstance(exc_type, type)
            and issubclass(exc_type, Exception)):
        first = failures[0]
        text = f"{first.message} (raised on ranks {ranks})\n\nRank 0 traceback:\n{first.traceback}"
        try:
            exc = exc_type(text)
        except Exception:
            exc = None
        if isinstance(exc, exc_type) and first.message in str(exc):
            with contextlib.suppress(Exception):
                exc.per_rank_errors = per_rank  # type: ignore[attr-defined]
            return exc
    lines = [f"{name} failed on rank(s) {ranks} of {world_size}"]
    if stuck:
        lines[0] += (f"; rank(s) {stuck} were still running {grace:g} s after the first failure "
                     f"(probably blocked in a collective) and were killed with the pool")
    for rank, f in sorted(failures.items()):
        lines.append(f"\n--- rank {rank}: {f.type_name}: {f.message}")
        if f.traceback:
            lines.append(f.traceback.rstrip())
    return RankError("\n".join(lines), per_rank_errors=per_rank, stuck_ranks=stuck)


class LocalRanks:
    """The worker pools of one command, by world size, closed when the command ends.

    ``with LocalRanks(threads_per_rank=1) as ranks: ranks.run(fn, 4, *args, timeout=600)`` runs
    ``fn`` on 4 local ranks and returns the results by rank; a later run on 4 ranks reuses them.
    Nothing outlives the ``with`` block (no process-wide pool).
    """

    def __init__(self, *, threads_per_rank: int = 1) -> None:
        self.threads_per_rank = threads_per_rank
        self._pools: dict[int, WorkerPool] = {}

    def pool(self, world_size: int) -> WorkerPool:
        """The pool of ``world_size`` ranks (spawned on its first run)."""
        if world_size not in self._pools:
            self._pools[world_size] = WorkerPool(world_size, threads_per_rank=self.threads_per_rank)
        return self._pools[world_size]

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
            **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on ``world_size`` ranks; the results indexed by rank."""
        return self.pool(world_size).run(fn, args, kwargs, timeout=timeout)

    def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    def __enter__(self) -> "LocalRanks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
