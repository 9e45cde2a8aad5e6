"""Ranks that disagree, default settings: every rank raises a ValueError naming the disagreeing rank
and argument, fast; no rank returns, hangs or dies.

Every method (softmax and linear) x every kind of disagreement, at N=2 and N=3, on dedicated pools
whose process groups have a 20 s timeout (``WorkerPool(pg_timeout=20)``, as a user would set it).
The last rank is the one that disagrees:

==========  =====================================================================================
kind        what the last rank passes differently
==========  =====================================================================================
length      2 more local tokens
heads       twice the heads
head_dim    D = 16 instead of 8
dtype       bfloat16 instead of float32
causal      causal=False (linear attention is causal by definition: output_final_state=True, the
            option that adds a communication)
cu_seqlens  packed documents split elsewhere (same total length)
method      another method of the same kind
group       a TokenRingGroups instead of the plain group (usp: another ulysses_degree); not for the
            linear methods, which take plain groups only
==========  =====================================================================================

Without the default check these cases abort a process in gloo (``Received data size doesn't match
expected size``), hang until the group's timeout, or return a wrong result (lightseq, and the ring
rank whose receive is larger): ``test_without_the_check`` (slow) records what happens then.
One pool run per (N, method) holds all its kinds; each rank catches every case's exception and
returns ``(kind, type name, message, seconds)``. A rank that dies fails the run (``WorkerDied``), one
that hangs fails it by the run's 60 s timeout.
"""

from __future__ import annotations

import time

import pytest
import torch

import seqpar
from seqpar.methods import LINEAR_METHODS, METHODS
from seqpar.testing import RankError, WorkerPool

PG_TIMEOUT = 20.0
PROMISE = 60.0  # seconds within which every rank must have raised (the bound)
KINDS = ("length", "heads", "head_dim", "dtype", "causal", "cu_seqlens", "method", "group")
T_LOCAL, D = 4, 8


def _kinds(method: str) -> tuple[str, ...]:
    return tuple(k for k in KINDS if not (k == "group" and method in LINEAR_METHODS))


def _other_method(method: str) -> str:
    if method in LINEAR_METHODS:
        return "lasp2" if method != "lasp2" else "zeco"
    return "striped_ring" if method != "striped_ring" else "ring"


def _call(method: str, kind: str, n: int, odd: bool, groups, check_ranks=None):
    """This rank's call for case ``kind``: the odd (last) rank passes one thing differently."""
    gen = torch.Generator().manual_seed(0)
    t = T_LOCAL + (2 if kind == "length" and odd else 0)
    h = n * (2 if kind == "heads" and odd else 1)  # a multiple of N: Ulysses splits heads
    d = 2 * D if kind == "head_dim" and odd else D
    dtype = torch.bfloat16 if kind == "dtype" and odd else torch.float32
    who = _other_method(method) if kind == "method" and odd else method
    cu = None
    if kind == "cu_seqlens":
        cu = torch.tensor([0, 3 if odd else 1, n * T_LOCAL], dtype=torch.int32)
    if method in LINEAR_METHODS:
        q, k, v = (torch.randn(1, t, h, d, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
        g = -torch.rand(1, t, h, generator=gen).to(dtype)
        return seqpar.linear_attention(q, k, v, g, method=who, cu_seqlens=cu, check_ranks=check_ranks,
                                       output_final_state=kind == "causal" and odd)
    if cu is not None:  # the packed stream as seqpar.shard lays it out for this rank's offsets
        x = torch.randn(1, n * T_LOCAL, h, d, generator=gen)
        q = k = v = seqpar.shard(x, method=method, cu_seqlens=cu).requires_grad_()
    else:
        q, k, v = (torch.randn(1, t, h, d, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
    extra = {}
    if kind == "group" and odd:
        extra = {"ulysses_degree": 1} if method == "usp" else {"group": groups}
    return seqpar.attention(q, k, v, method=who, causal=not (kind == "causal" and odd), cu_seqlens=cu,
                            check_ranks=check_ranks, **extra)


def _mismatches(method: str):
    """On every rank: each kind's outcome as (kind, type name, message, seconds); never raises."""
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    groups = seqpar.TokenRingGroups() if "group" in _kinds(method) and method != "usp" else None
    out = []
    for kind in _kinds(method):
        start = time.monotonic()
        try:
            _call(method, kind, n, rank == n - 1, groups)
            outcome = ("returned", "")
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded and judged by the test
            outcome = (type(exc).__name__, str(exc))
        out.append((kind, *outcome, time.monotonic() - start))
    return out


def _named_argument(method: str, kind: str) -> str:
    """Words every rank's message must hold after ``rank <odd> passed``."""
    if kind == "causal":
        return "output_final_state" if method in LINEAR_METHODS else "causal"
    if kind == "group" and method == "usp":
        return "ulysses_degree"
    return {"dtype": "q of dtype", "cu_seqlens": "cu_seqlens", "method": "method",
            "group": "group"}.get(kind, "q of shape")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def pool(request):
    pool = WorkerPool(request.param, pg_timeout=PG_TIMEOUT, failure_grace=2 * PG_TIMEOUT)
    pool.start()  # spawning is not part of the measured times
    yield pool
    pool.close(kill=True)


@pytest.mark.parametrize("method", list(METHODS) + list(LINEAR_METHODS))
def test_every_rank_raises_naming_the_rank_and_argument(pool, method):
    n, odd = pool.world_size, pool.world_size - 1
    start = time.monotonic()
    try:
        results = pool.run(_mismatches, (method,), timeout=PROMISE)
    except RankError as exc:  # a rank died (gloo abort) or raised outside a case
        pytest.fail(f"{method} N={n}: {exc}")
    assert time.monotonic() - start < PROMISE
    for rank, cases in enumerate(results):
        assert [c[0] for c in cases] == list(_kinds(method))
        for kind, outcome, message, seconds in cases:
            where = f"{method} N={n} {kind} rank {rank}"
            assert outcome == "ValueError", f"{where}: {outcome}: {message}"
            assert f"rank {odd} passed {_named_argument(method, kind)}" in message, f"{where}: {message}"
            assert seconds < 5.0, f"{where}: raised after {seconds:.1f} s"  # the check gathers no payload


def _control(method: str):
    """The length case without the check: what the ranks do then (caught, so a survivor reports)."""
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    start = time.monotonic()
    try:
        _call(method, "length", n, rank == n - 1, None, check_ranks=False)
        return "returned", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, time.monotonic() - start


@pytest.mark.slow
def test_without_the_check():
    """Control (opt-in: SEQPAR_SLOW=1, ~3 min): the length case at N=2 with ``check_ranks=False``,
    one fresh pool per method. Records per method whether a rank returned (a wrong result), died or
    waited for the group's timeout; the check is what makes the matrix above pass."""
    bad = {}
    for method in list(METHODS) + list(LINEAR_METHODS):
        pool = WorkerPool(2, pg_timeout=PG_TIMEOUT, failure_grace=2 * PG_TIMEOUT)
        try:
            bad[method] = pool.run(_control, (method,), timeout=PROMISE)
        except RankError as exc:
            bad[method] = {r: e[0] for r, e in exc.per_rank_errors.items()}
        finally:
            pool.close(kill=True)
    print("\n".join(f"{m}: {o}" for m, o in bad.items()))
    outcomes = [str(o) for o in bad.values()]
    assert any("returned" in o for o in outcomes) and any("WorkerDied" in o for o in outcomes), bad


# ---------------------------------------------------------------- the fingerprint (one process)


@pytest.mark.parametrize("entry,module", [("attention", "seqpar.softmax.api"),
                                          ("linear_attention", "seqpar.linear.api"),
                                          ("unshard", "seqpar.layouts.shard")])
def test_the_fingerprint_holds_every_parameter(monkeypatch, entry, module):
    """Every parameter of the entry point is compared across ranks (an option added later too: the
    entry point hands its locals() to the fingerprint), except those that never shape communication."""
    import importlib
    import inspect

    from seqpar.comm.fingerprint import GRAD_FIELD, LOCAL_ONLY

    seen = {}

    def capture(infos, name, fields, prepare, **kwargs):
        seen.update(fields)
        return prepare()

    monkeypatch.setattr(importlib.import_module(module), "agreed", capture)
    x = torch.randn(1, 4, 2, 8)
    if entry == "linear_attention":
        seqpar.linear_attention(x, x, x)
    elif entry == "attention":
        seqpar.attention(x, x, x)
    else:
        seqpar.unshard(x)
    params = set(inspect.signature(getattr(seqpar, entry)).parameters) - LOCAL_ONLY
    assert set(seen) - {GRAD_FIELD} >= params and not set(seen) & LOCAL_ONLY, sorted(seen)


def test_new_options_and_groups_are_described():
    from seqpar.comm.fingerprint import call_fields, field_digest

    x = torch.zeros(1, 4, 2, 8)
    base = {"q": x, "window": (128, 0), "sinks": 4, "stats": seqpar.CommStats(), "check_ranks": None}
    fields = call_fields(base)
    assert fields["window"] == "(128, 0)" and fields["sinks"] == "4" and "stats" not in fields
    assert fields["q"] == "shape (1, 4, 2, 8); dtype torch.float32; device cpu"
    assert field_digest("e", fields) != field_digest("e", call_fields({**base, "window": (64, 0)}))
    assert call_fields({"cu_seqlens": [0, 3, 8]})["cu_seqlens"] == call_fields(
        {"cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int32)})["cu_seqlens"]  # a list or a tensor


def test_the_check_travels_on_the_cpu_when_the_group_takes_cpu_tensors():
    """gloo, or a group created with backend="cpu:gloo,cuda:nccl", carries the check on the CPU (no
    device synchronisation); an NCCL-only group on the inputs' device."""
    from seqpar.comm import GroupInfo
    from seqpar.comm.fingerprint import check_device

    class Group:  # what a ProcessGroup reports about the devices its backends serve
        def __init__(self, *types):
            self._device_types = [torch.device(t) for t in types]

    both = GroupInfo(Group("cpu", "cuda"), 0, 2, (0, 1))
    nccl = GroupInfo(Group("cuda"), 0, 2, (0, 1))
    assert check_device(both, torch.device("cuda", 0)).type == "cpu"
    assert check_device(nccl, torch.device("cuda", 1)) == torch.device("cuda", 1)


def _verdicts(odd_ones):
    """quick_agreement on the world group for each (disagreeing rank, failing rank) case."""
    import torch.distributed as dist

    from seqpar.comm import group_info
    from seqpar.comm.fingerprint import quick_agreement

    me, info = dist.get_rank(), group_info(None)
    return [quick_agreement([info], "e", {"x": str(me == odd)}, me == failing) for odd, failing in odd_ones]


@pytest.mark.parametrize("n", [5, 8])
def test_the_quick_agreement_reaches_every_rank_in_log_rounds(n):
    """The dissemination rounds (1, 2, 4, ... ahead) combine every member's state on every member,
    also for N not a power of two: one rank's different digest, or one rank's local failure, makes
    every rank answer False; nothing different, every rank True. Each rank sends ceil(log2 N)
    messages per call (not N - 1)."""
    from seqpar.comm.fingerprint import agreement_offsets
    from seqpar.testing import run_distributed

    cases = [(-1, -1)] + [(r, -1) for r in range(n)] + [(-1, r) for r in range(n)]
    res = run_distributed(_verdicts, n, cases, timeout=120)
    assert all(v == [True] + [False] * (2 * n) for v in res), res
    assert agreement_offsets(n) == [1, 2, 4] and agreement_offsets(2) == [1] and agreement_offsets(1) == []


def _device_states(digests, failing):
    import torch
    import torch.distributed as dist

    from seqpar.comm.fingerprint import _reduce_on_device, reduce_state
    from seqpar.comm.groups import group_info

    me, info = dist.get_rank(), group_info(None)
    words = digests[me]
    state = [int(me == failing), *words, *words]
    # the NCCL-only path, run on gloo's CPU all-reduce (the same collective, real values)
    return _reduce_on_device(info, state, torch.device("cpu"), None), reduce_state(info, state, tag=77)


def test_the_device_path_of_the_agreement_reduces_like_the_cpu_path():
    """A group with NCCL only combines the states in one all-reduce (max over [failed, words,
    ~words]) instead of an all-gather: every rank gets any failure and each word's smallest and
    largest value, extreme int64 words included (the complement does not overflow): the same state
    as the CPU dissemination's rounds, for every case."""
    from seqpar.comm.fingerprint import DIGEST_LEN
    from seqpar.testing import run_distributed

    n, lo, hi = 5, -(1 << 63), (1 << 63) - 1
    same = [[lo, -1, 0, hi][:DIGEST_LEN]] * n
    one_word = [list(d) for d in same]
    one_word[3][2] += 1
    extremes = [[hi, lo, 7, -7][:DIGEST_LEN], [lo, hi, 7, -7][:DIGEST_LEN]] + [[0, 0, 7, -7][:DIGEST_LEN]] * (n - 2)
    for digests, failing in ((same, -1), (same, 2), (one_word, -1), (extremes, -1)):
        res = run_distributed(_device_states, n, digests, failing, timeout=120)
        want = [int(failing >= 0), *map(min, zip(*digests)), *map(max, zip(*digests))]
        for device, cpu in res:
            assert device == want and cpu == want, (device, cpu, want)
        k = DIGEST_LEN
        assert (res[0][0][1:1 + k] == res[0][0][1 + k:]) == (digests is same)
