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
import re
import time

import pytest
import torch

import seqpar
from seqpar.testing import RankError, WorkerPool

PG_TIMEOUT = 10.0  # seconds a survivor waits for a silent peer (the process group's timeout)
DEAD = 2


def _call(method):
    """One call of ``method`` on 3 ranks (3 heads: Ulysses needs a multiple of N); returns its output."""
    gen = torch.Generator().manual_seed(0)
    if method == "checkpoint barrier":  # a collective of the trainer (seqpar train's checkpointing)
        from seqpar.integrations.train.ckpt import _barrier

        return _barrier()
    if method in seqpar.LINEAR_METHODS:
        q, k, v = (torch.randn(1, 8, 3, 8, generator=gen).requires_grad_() for _ in range(3))
        return seqpar.linear_attention(q, k, v, -torch.rand(1, 8, 3, generator=gen), method=method)[0]
    q, k, v = (seqpar.shard(torch.randn(1, 24, 3, 8, generator=gen), method=method).requires_grad_()
               for _ in range(3))
    return seqpar.attention(q, k, v, method=method, causal=True)


def _names(message: str, peer: int, *, exactly: bool) -> bool:
    """Whether a PeerError message (after its "[after x s]" prefix) blames ``peer``: as the one peer,
    or (``exactly=False``) among the members of a collective."""
    blamed = message.split("] ", 1)[1].split(" failed")[0]
    return bool(re.search(rf"with rank {peer}$" if exactly else rf"with one of ranks \[.*\b{peer}\b", blamed))


def _ring_then_die(method, where):
    """Every rank completes one call; then rank DEAD crashes, "between calls" (the survivors meet it
    missing in the rank agreement of their next call) or "before backward" (in the method's own
    transfers: for ulysses its all-to-all)."""
    import torch.distributed as dist

    out = _call(method)  # every rank completes one forward
    if dist.get_rank() == DEAD:
        os._exit(1)  # a crash: no cleanup, sockets closed by the OS
    start = time.monotonic()
    try:
        _call(method) if where == "between calls" else out.sum().backward()
    except seqpar.PeerError as exc:
        raise seqpar.PeerError(f"[after {time.monotonic() - start:.1f} s] {exc}", peers=exc.peers) from None
    return "no error"


@pytest.mark.parametrize("method,where", [("zigzag_ring", "between calls"), ("ulysses", "before backward")])
def test_survivors_raise_peer_error_naming_the_dead_rank(method, where):
    pool = WorkerPool(3, failure_grace=3 * PG_TIMEOUT, pg_timeout=PG_TIMEOUT)
    try:
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            pool.run(_ring_then_die, (method, where), timeout=90)
        elapsed = time.monotonic() - start
    finally:
        pool.close(kill=True)
    errors = info.value.per_rank_errors
    assert errors[DEAD][0] == "WorkerDied", errors
    assert not info.value.stuck_ranks, f"survivors {info.value.stuck_ranks} hung: {errors}"
    for rank in (0, 1):
        kind, message, _ = errors[rank]
        assert kind == "PeerError", f"rank {rank}: {kind}: {message}"
        # the rank agreement names it exactly; Ulysses' all-to-all (a collective) names the group
        assert _names(message, DEAD, exactly=where == "between calls"), f"rank {rank}: {message}"
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
    """Rank 1 dies between two calls: the survivors' rank agreement of the second call (point to
    point with every member) names it exactly, whatever the method (LASP-2's own all-gather could only
    name the group)."""
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
        assert "check_ranks" in message and "with rank 1 failed" in message, f"rank {rank}: {message}"
    assert elapsed < 60, f"the survivors took {elapsed:.0f} s to give up"


SILENT_TIMEOUT = 2.0


def _with_a_silent_peer(method, where, flag):
    """Rank DEAD stays alive but stops communicating, ``where`` = "before the call" (the others wait
    in the rank agreement) or "before backward" (they wait in the method's own transfers: ring P2P,
    Ulysses' all-to-all, ZeCO's All-Scan chain and its helper thread, LASP-2's all-gather). It
    returns once the others have given up (``flag`` file), so the pool needs no respawn."""
    import torch.distributed as dist

    out = None if where == "before the call" else _call(method)
    if dist.get_rank() == DEAD:
        deadline = time.monotonic() + 12 * SILENT_TIMEOUT
        while time.monotonic() < deadline and sum(os.path.exists(f"{flag}.{r}") for r in range(DEAD)) < DEAD:
            time.sleep(0.05)
        return "stayed silent"
    start = time.monotonic()
    try:
        _call(method) if out is None else out.sum().backward()
    except seqpar.PeerError as exc:
        raise seqpar.PeerError(f"[after {time.monotonic() - start:.1f} s] {exc}", peers=exc.peers) from None
    finally:
        open(f"{flag}.{dist.get_rank()}", "w").close()
    return "no error"


@pytest.fixture(scope="module")
def silent_pool():
    pool = WorkerPool(3, failure_grace=10 * SILENT_TIMEOUT, pg_timeout=SILENT_TIMEOUT)
    yield pool
    pool.close(kill=True)


@pytest.mark.parametrize("method,where", [("ring", "before the call"), ("ring", "before backward"),
                                          ("ulysses", "before backward"), ("zeco", "before backward"),
                                          ("lasp2", "before backward"), ("checkpoint barrier", "before the call")])
def test_silent_peer_fails_after_the_group_timeout(silent_pool, tmp_path, method, where):
    """A peer that is alive but never communicates: the survivors give up after the group's timeout
    (not later), with a PeerError naming it, wherever they wait for it."""
    with pytest.raises(RankError) as info:
        silent_pool.run(_with_a_silent_peer, (method, where, str(tmp_path / "gave_up")), timeout=60)
    errors = info.value.per_rank_errors
    assert DEAD not in errors and not info.value.stuck_ranks, errors
    for rank in (0, 1):
        kind, message, _ = errors[rank]
        assert kind == "PeerError" and f"timeout of 0:00:0{SILENT_TIMEOUT:.0f}" in message, (rank, message)
        waited = float(message.split(" s]")[0].split("after ")[1])
        assert waited < 3 * SILENT_TIMEOUT, f"rank {rank} gave up after {waited} s"
        # the peer it waited on: the silent rank (or one of a collective's members), except on ZeCO's
        # reverse chain, where rank 0 waits on rank 1, which gave up on rank 2 at the same moment
        suspect = 1 if (method, rank) == ("zeco", 0) else DEAD
        assert _names(message, suspect, exactly=method in ("ring", "zeco")), f"rank {rank}: {message}"
        assert method != "checkpoint barrier" or message.split("] ", 1)[1].startswith("checkpoint barrier on")
    if where == "before the call" and method == "ring":  # the agreement names the silent rank exactly:
        # at N = 3 its rounds (1 and 2 ahead) reach every member directly, rank 1 sending to it,
        # rank 0 receiving from it
        assert all(f"check_ranks {role} on rank {r} with rank {DEAD} failed" in errors[r][1]
                   for r, role in ((0, "recv"), (1, "send"))), errors


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
