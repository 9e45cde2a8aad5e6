"""Failure of a peer: when a rank dies between ring steps, the survivors raise ``seqpar.PeerError``
naming it, within the process group's timeout, instead of hanging.

A dedicated pool of 3 gloo ranks (not the shared one: a dead worker kills its pool) with a short
process-group timeout. Every rank runs one ring attention call, then rank 2 exits with
``os._exit(1)`` (no Python cleanup, as in a crash); ranks 0 and 1 enter the second call, whose first
ring step needs rank 2 (on a ring of 3 every rank is a neighbour of every other). Gloo reports a
crashed peer at once ("connection closed"); a silent peer takes the group timeout (second test).

Also here: numerics across ring sizes (the error against float64 does not grow from N=2 to N=4; the
full N = 2, 4, 8 table is benchmarks/results/numerics.md), with a control that shows the check
can fail.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import seqpar
from seqpar.testing import RankError, WorkerPool

PG_TIMEOUT = 10.0  # seconds a survivor waits for a silent peer (the process group's timeout)
DEAD = 2


def _ring_then_die(method):
    import torch.distributed as dist

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 8, generator=gen) for _ in range(3))
    local = [seqpar.shard(t, method=method) for t in (q, k, v)]
    seqpar.attention(*local, method=method, causal=True)  # every rank completes one call
    if rank == DEAD:
        os._exit(1)  # a crash: no cleanup, sockets closed by the OS
    start = time.monotonic()
    try:
        seqpar.attention(*local, method=method, causal=True)
    except seqpar.PeerError as exc:
        raise seqpar.PeerError(f"[after {time.monotonic() - start:.1f} s] {exc}", peers=exc.peers) from None
    return "no error"


def test_survivors_raise_peer_error_naming_the_dead_rank(method="zigzag_ring"):
    pool = WorkerPool(3, failure_grace=3 * PG_TIMEOUT, pg_timeout=PG_TIMEOUT)
    try:
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            pool.run(_ring_then_die, (method,), timeout=90)
        elapsed = time.monotonic() - start
    finally:
        pool.close(kill=True)
    errors = info.value.per_rank_errors
    assert errors[DEAD][0] == "WorkerDied", errors
    assert not info.value.stuck_ranks, f"survivors {info.value.stuck_ranks} hung: {errors}"
    for rank in (0, 1):
        kind, message, _ = errors[rank]
        assert kind == "PeerError", f"rank {rank}: {kind}: {message}"
        assert f"with rank {DEAD} failed" in message, f"rank {rank} does not name rank {DEAD}: {message}"
        assert "init_process_group" in message and "log" in message  # says what to do
    assert elapsed < 60, f"the survivors took {elapsed:.0f} s to give up"


def _linear_then_die(method, dead):
    """The same for linear attention: forward and backward (a chain 0 -> 1 -> 2, then back)."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=gen) for _ in range(3))
    g = -torch.rand(1, 8, 2, generator=gen)

    def step():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o, _ = seqpar.linear_attention(qq, kk, vv, g, method=method)
        o.sum().backward()

    step()
    if dist.get_rank() == dead:
        os._exit(1)
    start = time.monotonic()
    try:
        step()
    except seqpar.PeerError as exc:
        raise seqpar.PeerError(f"[after {time.monotonic() - start:.1f} s] {exc}", peers=exc.peers) from None
    return "no error"


@pytest.mark.parametrize("method", ["zeco", "lasp2"])
def test_linear_attention_survivors_raise_peer_error(method):
    """ZeCO's All-Scan chain (point to point) names the dead neighbour; LASP-2's all-gather names the
    other members (a collective cannot tell which one failed). Rank 1 dies: it is both survivors'
    neighbour on the chain."""
    pool = WorkerPool(3, failure_grace=3 * PG_TIMEOUT, pg_timeout=PG_TIMEOUT)
    try:
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            pool.run(_linear_then_die, (method, 1), timeout=90)
        elapsed = time.monotonic() - start
    finally:
        pool.close(kill=True)
    errors = info.value.per_rank_errors
    assert errors[1][0] == "WorkerDied" and not info.value.stuck_ranks, errors
    for rank in (0, 2):
        kind, message, _ = errors[rank]
        assert kind == "PeerError", f"rank {rank}: {kind}: {message}"
        named = "with rank 1 failed" if method == "zeco" else "ranks ["
        assert named in message and "1" in message.split("failed")[0], f"rank {rank}: {message}"
    assert elapsed < 60, f"the survivors took {elapsed:.0f} s to give up"


SILENT_TIMEOUT = 2.0


def _ring_with_a_silent_peer():
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    local = [seqpar.shard(torch.randn(1, 24, 2, 8, generator=gen), method="ring") for _ in range(3)]
    if dist.get_rank() == DEAD:
        time.sleep(6 * SILENT_TIMEOUT)  # alive but never joins the ring (e.g. stuck in a data loader)
        return "slept"
    start = time.monotonic()
    try:
        seqpar.attention(*local, method="ring", causal=True)
    except seqpar.PeerError as exc:
        raise seqpar.PeerError(f"[after {time.monotonic() - start:.1f} s] {exc}", peers=exc.peers) from None
    return "no error"


def test_silent_peer_fails_after_the_group_timeout():
    """A peer that is alive but never communicates: the survivors give up after the group's timeout."""
    pool = WorkerPool(3, failure_grace=2 * SILENT_TIMEOUT, pg_timeout=SILENT_TIMEOUT)
    try:
        with pytest.raises(RankError) as info:
            pool.run(_ring_with_a_silent_peer, timeout=60)
    finally:
        pool.close(kill=True)
    errors = info.value.per_rank_errors
    assert DEAD not in errors and info.value.stuck_ranks == [DEAD], errors  # killed with the pool
    for rank in (0, 1):
        kind, message, _ = errors[rank]
        assert kind == "PeerError" and f"timeout of 0:00:0{SILENT_TIMEOUT:.0f}" in message, (rank, message)
        waited = float(message.split(" s]")[0].split("after ")[1])
        assert waited < 3 * SILENT_TIMEOUT, f"rank {rank} gave up after {waited} s"
    assert f"recv on rank 0 with rank {DEAD} failed" in errors[0][1], errors[0][1]  # rank 0 waits on rank 2


# ----------------------------------------------------------------- numerics: no growth with N

GROWTH_LIMIT = 1.5  # issue 11: the error against float64 must not grow with the ring size beyond 1.5x


def _normwise_error(method, dtype_name, T, grad_comm_dtype=None):
    """Rank 0: the worst normwise error ||x - ref|| / ||ref|| over out, dq, dk, dv against float64.

    Normwise, not elementwise: the elementwise max is the final bf16/fp16 rounding of one element,
    which flips between 0.5x and 2x of itself whenever fp32 partial sums change order (measured at
    T=64: zigzag_ring fp16 7.2e-4 at N=2, 5.7e-4 at N=4), so its ratio measures that noise."""
    from dist_utils import global_inputs, reference_grads, run_method, world

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    low, hi = global_inputs(1, T, 8, 4, 32, 11, dtype)  # as in benchmarks/numerics.py
    got = run_method(method, True, low, grad_comm_dtype=grad_comm_dtype)
    if world()[0]:
        return None
    return max(float((a.double() - b).norm() / b.norm()) for a, b in zip(got, reference_grads(*hi, True)))


def _growth(method, dtype, grad_comm_dtype=None):
    from seqpar.testing import run_distributed

    e2, e4 = (run_distributed(_normwise_error, n, method, dtype, 256, grad_comm_dtype, timeout=120)[0] for n in (2, 4))
    return e2, e4


@pytest.mark.parametrize("method", ["zigzag_ring", "striped_ring", "ulysses"])
def test_error_does_not_grow_with_ring_size(method):
    """bf16 and fp16 at N=2 and N=4 (the N = 2, 4, 8 table: benchmarks/results/numerics.md): partial
    softmax results merge in fp32 and dK/dV travel in fp32, so a longer ring adds no rounding."""
    for dtype in ("bf16", "fp16"):
        e2, e4 = _growth(method, dtype)
        assert e4 <= GROWTH_LIMIT * e2, f"{method} {dtype}: error {e2:.2e} at N=2 grows to {e4:.2e} at N=4"


def test_growth_measurement_sees_rounding_on_the_wire():
    """Control: dK/dV accumulators rounded to bf16 at every hop (grad_comm_dtype="input") do grow
    with N (measured 1.31x from N=2 to 4, 1.77x to 8), so the check above can fail."""
    e2, e4 = _growth("zigzag_ring", "bf16", "input")
    assert e4 > 1.15 * e2, f"bf16 accumulators on the wire: {e2:.2e} at N=2, {e4:.2e} at N=4"
