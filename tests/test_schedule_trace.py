"""Traces built from the schedules alone (seqpar.bench.schedule_trace) equal, event by event (all
but the times), the traces real runs record: every method, forward and backward, on 2, 3 and 4
gloo ranks, the rank agreement's gather included (and absent when check_ranks is off). This is what
lets ``seqpar simulate`` replay 1024 ranks without running them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.bench.schedule_trace import Shape, rank_events, schedule_traces
from seqpar.bench.trace_check import check_traces
from seqpar.comm.fingerprint import STATE_WORDS
from seqpar.testing import run_distributed

T, HQ, HKV, D = 48, 4, 2, 8
TIMES = ("t", "w", "cpu", "wall")


def _recorded(method: str, n: int, check_ranks=None) -> dict:
    torch.manual_seed(0)
    tr = seqpar.Trace()
    if method in seqpar.LINEAR_METHODS:
        q, k, v = (torch.randn(1, T // n, HQ, D, requires_grad=True) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(1, T // n, HQ, D))
        out, _ = seqpar.linear_attention(q, k, v, g, method=method, trace=tr, check_ranks=check_ranks)
        out.sum().backward()
        return tr.to_dict()
    group = dist.group.WORLD
    full = [torch.randn(1, T, h, D) for h in (HQ, HKV, HKV, HQ)]
    q, k, v, dout = (seqpar.shard(x, method=method, group=group) for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kwargs = {"ulysses_degree": 2} if method == "usp" else {}
    with pytest.warns(UserWarning) if method == "usp" else _nothing():
        out = seqpar.attention(q, k, v, method=method, causal=True, trace=tr, check_ranks=check_ranks, **kwargs)
    out.backward(dout)
    return tr.to_dict()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _strip(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if k not in TIMES}


CASES = [("ring", 3), ("zigzag_ring", 2), ("zigzag_ring", 4), ("striped_ring", 3), ("allgather_kv", 3),
         ("token_ring", 3), ("lightseq", 4), ("ulysses", 2), ("usp", 4), ("zeco", 3), ("lasp2", 3), ("lasp1", 2)]


@pytest.mark.parametrize("method,n", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_schedule_traces_equal_recorded_traces(method, n):
    recorded = run_distributed(_recorded, n, method, n, timeout=120)
    linear = method in seqpar.LINEAR_METHODS
    built = schedule_traces(method, n, Shape(T, 1, HQ, HQ if linear else HKV, D, True, 4, 4, 4),
                            ulysses_degree=2 if method == "usp" else None, agreement=True)
    check_traces(built)
    for r in range(n):
        got, want = [_strip(e) for e in built[r].events], [_strip(e) for e in recorded[r]["events"]]
        assert len(got) == len(want), (method, r)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a == b, f"{method} rank {r} event {i}:\n built    {a}\n recorded {b}"


@pytest.mark.parametrize("method", ["zigzag_ring", "lasp2"])
def test_the_rank_agreement_is_traced_unless_it_is_off(method):
    """The default check_ranks combines a small state at the start of each forward: per round one
    message to the member 1, 2, 4, ... ahead and one from as far behind, then their wait, on the
    stream check_ranks, recorded like the payload's; off, the trace has none."""
    n = 3
    on = run_distributed(_recorded, n, method, n, timeout=120)
    off = run_distributed(_recorded, n, method, n, False, timeout=120)
    linear = method in seqpar.LINEAR_METHODS
    shape = Shape(T, 1, HQ, HQ if linear else HKV, D, True, 4, 4, 4)
    for r in range(n):
        check = [e for e in on[r]["events"] if e.get("chan") == "check_ranks"]
        assert [(e["type"], e.get("dst"), e.get("src")) for e in check] == \
            [("send", (r + 1) % n, r), ("recv", r, (r - 1) % n), ("send", (r + 2) % n, r), ("recv", r, (r - 2) % n)]
        assert all(e["bytes"] == 8 * STATE_WORDS == 56 and e["phase"] == "fwd" for e in check)
        assert [e["type"] for e in on[r]["events"][:7]] == ["begin", "send", "recv", "wait", "send", "recv", "wait"]
        assert not [e for e in off[r]["events"] if e.get("chan") == "check_ranks"]
        built = list(rank_events(method, n, r, shape, agreement=False))
        assert [_strip(e) for e in built] == [_strip(e) for e in off[r]["events"]]


def test_events_stream_lazily_and_forward_only_stops_early():
    s = Shape(1 << 20, heads=32, kv_heads=8, head_dim=128, esize=2)
    it = rank_events("ring", 1024, 5, s)
    first = [next(it) for _ in range(6)]  # 1024 ranks' schedules are never built whole
    assert [e["type"] for e in first] == ["begin", "send", "send", "recv", "recv", "compute"]
    # K and V of 1024 tokens, 8 heads, bf16: two tensors of one batch (no stacked copy)
    assert first[1]["bytes"] == first[2]["bytes"] == 1024 * 8 * 128 * 2
    fwd = list(rank_events("zigzag_ring", 4, 1, s, forward_only=True))
    assert {e["phase"] for e in fwd} == {"fwd"} and fwd[-1] == {**fwd[-1], "type": "end", "name": "attention fwd"}
