"""How the validation's local rank processes use this machine's cores and memory.

The replay's machine gives every rank a compute device of its own; on a CPU host the ranks are
processes on shared cores, placed by the operating system. These helpers fix that placement for a
measurement (:mod:`.replay_validate`):

- :func:`own_core`: each rank's compute thread on a core of its own, when there are as many cores as
  ranks (compared with unpinned ranks for validation (a) by benchmarks/bench_a_pin.py);
- :func:`one_core` with a :class:`MachineLock`: all ranks on one core, computing one at a time, when
  there are more ranks than cores (N = 4, 8: each kernel's CPU time is then its own);
- :data:`STEADY_MALLOC`: glibc's malloc keeps freed memory, as a GPU's caching allocator does.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading

# glibc's malloc settings for the rank processes of a validation (environment variables, read when a
# process starts): keep freed memory instead of returning it to the system. By default glibc gives a
# large freed block back (munmap), so every fresh large tensor page-faults its memory in again, and
# those faults are CPU time of the kernel that allocates. Measured here (lasp2, one rank, T = 4096,
# 3 repeats): steps of 368-460 ms by default, 265-284 ms with these; one kernel (the backward's
# last) took 73-170 ms by default and 29-39 ms with them. Ten 64 MB element-wise ops: 327,700 page
# faults and 0.63 s by default, 0 and 0.09 s with both settings (glibc 2.36). A GPU run does not
# page-fault per tensor: PyTorch's CUDA caching allocator reuses its blocks, as glibc does here.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


class MachineLock:
    """A lock shared by every process of this machine that names the same file (``flock``): the
    ``exclusive`` of a :class:`seqpar.Trace`, so that the ranks' compute segments run one at a time.
    Re-entrant within a process (a segment inside a segment keeps it); picklable (the path)."""

    def __init__(self, path: str):
        self.path = str(path)
        self._fd, self._depth, self._mutex = None, 0, None

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def __enter__(self) -> "MachineLock":
        if self._mutex is None:
            self._mutex = threading.RLock()
        self._mutex.acquire()
        if self._depth == 0:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._mutex.release()


@contextlib.contextmanager
def one_core():
    """Run this thread on one CPU (the first this process may use) inside the block, then restore its
    affinity. :func:`_case_on_rank` pins every rank's compute thread to the same CPU when the ranks
    compute one at a time: each kernel (of every rank, and of the paired one-rank step) then runs on
    the same core, with that core's caches and its share of the host; the threads started before
    (gloo's) keep their affinity."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def check_own_cores(world_size: int) -> list[int]:
    """The CPUs this process may use, sorted; ValueError when there are fewer than ``world_size``
    (:func:`own_core` gives each rank one)."""
    cpus = sorted(os.sched_getaffinity(0))
    if world_size > len(cpus):
        raise ValueError(f"pin: {world_size} ranks cannot have a CPU each among this process's {len(cpus)}; "
                         f"run at most {len(cpus)} ranks pinned, or pass pin=False")
    return cpus


@contextlib.contextmanager
def own_core(rank: int, world_size: int):
    """Run this thread on a CPU of its own inside the block (rank ``r`` on the ``r``-th CPU this
    process may use), then restore its affinity; ValueError when there are fewer CPUs than
    ``world_size`` ranks. gloo's threads keep their affinity: the CPU they take from a rank is
    :attr:`Machine.transfer_cpu`.

    Unpinned, the scheduler at times wakes a rank that waited for a message on the core where the
    other rank computes; the woken thread then waits runnable, time its thread CPU time (what the
    replay computes with) does not count and its wall clock does. Measured at N = 2 here (schedstat's
    run-queue delay of the busiest rank's compute thread; LASP-2, ZeCO, LASP-1, Ulysses; 4-5 steps
    each): 1-14 ms per step of 120-260 ms unpinned, 1-7 ms pinned. Pinning did not make validation
    (a) closer, though: alternated with unpinned passes on one calibration, the replay's mean error
    was -2.7% either way (benchmarks/bench_a_pin.py, results/a_pin.md), so (a) runs unpinned."""
    cpus = check_own_cores(world_size)
    before = set(cpus)
    os.sched_setaffinity(0, {cpus[rank]})
    try:
        yield cpus[rank]
    finally:
        os.sched_setaffinity(0, before)


__all__ = ["STEADY_MALLOC", "MachineLock", "check_own_cores", "one_core", "own_core"]
