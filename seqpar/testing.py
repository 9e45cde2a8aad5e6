"""Test helpers: run a function on N local CPU ranks joined by gloo, from pools kept for the session.

Example::

    import torch
    import torch.distributed as dist
    from seqpar.testing import run_distributed

    def _scaled_rank_sum(scale):          # module level, so that it pickles by reference
        t = torch.tensor([float(dist.get_rank())]) * scale
        dist.all_reduce(t)                # the default group is the world of 4 ranks
        return t

    def test_scaled_rank_sum():
        out = run_distributed(_scaled_rank_sum, 4, 2.0, timeout=60)
        assert [o.item() for o in out] == [12.0] * 4    # 2 * (0 + 1 + 2 + 3), index = rank

The pools (:class:`seqpar.comm.pool.WorkerPool`, one per world size) are kept for the whole test
session, so each case costs no process start-up; :func:`shutdown_pools` (also at exit) stops them.
Failures never hang the caller: a case past its ``timeout`` kills the pool and raises
:class:`DistributedTimeout`; when ranks raise, the others get ``failure_grace`` seconds before they
are killed, and the ranks' own exception type is raised again when every rank raised it (so
``pytest.raises(ValueError, match=...)`` works), else :class:`RankError` (see
:mod:`seqpar.comm.pool` for the details). Inside ``fn`` the default gloo group spans the world.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable

from seqpar.comm.pool import (
    DEFAULT_FAILURE_GRACE,
    DEFAULT_TIMEOUT,
    DistributedTimeout,
    RankError,
    WorkerPool,
)

__all__ = ["DEFAULT_FAILURE_GRACE", "DEFAULT_TIMEOUT", "DistributedTimeout", "RankError", "WorkerPool", "get_pool",
           "run_distributed", "shutdown_pools"]

_POOLS: dict[int, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(world_size: int, *, threads_per_rank: int | None = None) -> WorkerPool:
    """The cached pool for ``world_size`` (created on first use; respawned after a kill).

    Passing a ``threads_per_rank`` different from the cached pool's restarts its workers.
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(world_size)
        if pool is None:
            pool = _POOLS[world_size] = WorkerPool(world_size, threads_per_rank=threads_per_rank or 1)
        elif threads_per_rank is not None and threads_per_rank != pool.threads_per_rank:
            pool.close()
            pool.threads_per_rank = threads_per_rank
        return pool


def shutdown_pools() -> None:
    """Kill every cached pool's workers (registered with :mod:`atexit`)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close(kill=True)


atexit.register(shutdown_pools)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function. ``timeout`` (seconds, for the whole case) is
    consumed here and never passed to ``fn``. Raises :class:`DistributedTimeout`,
    :class:`RankError`, or the ranks' own exception type when every rank raised it.
    """
    return get_pool(world_size).run(fn, args, kwargs, timeout=timeout)
