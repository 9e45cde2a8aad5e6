"""Planning ahead: plan batch i+1 in a background worker while step i trains.

>>> with PlanAhead(cluster) as ahead:
...     ahead.submit(lengths_of_batch[0])
...     for i in range(steps):
...         if i + 1 < steps:
...             ahead.submit(lengths_of_batch[i + 1])   # planned while step i runs
...         plan = ahead.result()                      # plan of batch i (FIFO)
...         run_step(plan)

A thread is the default: HiGHS and numpy spend much of the solve outside the Python interpreter
lock (measured on the loaded 2-core dev machine: a pure-Python loop in the main thread kept 57% of
its speed while a 3 s MILP ran in the worker), and a training loop mostly waits on the device. ``use_process=True`` plans in a separate
process instead (what FlexSP does for its 5-15 s SCIP solves), at the cost of starting one.
"""

from __future__ import annotations

import collections
import multiprocessing
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Sequence

from .cluster import ClusterSpec
from .cost import CostModel, _check_lens
from .plan import Plan
from .planner import SOLVERS, plan_batch


def _plan_worker(seq_lens: list[int], cluster: ClusterSpec, cost_model: CostModel | None,
                 methods: tuple[str, ...] | None, time_limit: float | None, solver: str) -> Plan:
    return plan_batch(seq_lens, cluster, cost_model, methods, time_limit, solver)


class PlanAhead:
    """A one-worker planning queue: :meth:`submit` batches' lengths, :meth:`result` plans in order.

    The planning arguments are fixed at construction (the same as :func:`plan_batch`). Input errors
    are raised by :meth:`submit` (lengths) or by :meth:`result` (anything found while planning).
    """

    def __init__(self, cluster: ClusterSpec, cost_model: CostModel | None = None,
                 methods: Sequence[str] | None = None, time_limit: float | None = 0.1, solver: str = "milp",
                 *, use_process: bool = False):
        if not isinstance(cluster, ClusterSpec):
            raise ValueError(f"cluster: expected a ClusterSpec, got {type(cluster).__name__}")
        if solver not in SOLVERS:
            raise ValueError(f"solver={solver!r}: choose one of {', '.join(SOLVERS)}")
        self._args = (cluster, cost_model, None if methods is None else tuple(methods), time_limit, solver)
        self._pool: Executor = (ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
                                if use_process else ThreadPoolExecutor(1, thread_name_prefix="seqpar-plan"))
        self._pending: collections.deque[Future] = collections.deque()
        self._closed = False

    def submit(self, seq_lens: Sequence[int]) -> None:
        """Queue one batch for planning (returns at once)."""
        if self._closed:
            raise ValueError("PlanAhead: submit() after close()")
        lens = _check_lens(seq_lens)
        self._pending.append(self._pool.submit(_plan_worker, lens, *self._args))

    def result(self, timeout: float | None = None) -> Plan:
        """The plan of the oldest submitted batch, waiting for it (``timeout`` seconds at most)."""
        if not self._pending:
            raise ValueError("PlanAhead: result() with nothing submitted; call submit(seq_lens) first")
        future = self._pending[0]
        plan = future.result(timeout=timeout)  # TimeoutError leaves it queued
        self._pending.popleft()
        return plan

    @property
    def pending(self) -> int:
        """Batches submitted whose plans were not taken yet."""
        return len(self._pending)

    def close(self) -> None:
        """Stop the worker (queued plans are finished first)."""
        self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "PlanAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
