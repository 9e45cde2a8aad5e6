"""Per-rank traces (seqpar.tracing): every method's trace, forward and backward, dense, packed, USP
and linear, is complete and consistent (every send has its receive, dependencies point backwards,
collectives on all members), its FLOPs are the bench's formula and its bytes what CommStats counts;
tracing changes no result; the recorder is caller-owned and scoped."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.bench.machine import Machine
from seqpar.bench.replay import replay
from seqpar.bench.trace_check import check_traces, match_messages
from seqpar.comm import CommStats
from seqpar.testing import run_distributed
from seqpar.tracing import FORMAT, Trace, active_trace, attention_flops

SOFTMAX = ("ring", "zigzag_ring", "striped_ring", "allgather_kv", "token_ring", "lightseq", "ulysses", "usp")
T, HQ, HKV, D = 32, 4, 2, 8


def _softmax_step(method: str, n_ranks: int, packed: bool, traced: bool):
    """One causal fwd+bwd; returns (trace dict or None, out and grads, CommStats totals)."""
    torch.manual_seed(0)
    group = dist.group.WORLD
    cu = torch.tensor([0, 5, 19, 20, T], dtype=torch.int32) if packed else None
    full = [torch.randn(1, T, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ)]
    q, k, v, dout = (seqpar.shard(x, method=method, group=group, cu_seqlens=cu) for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    stats, tr = CommStats(), Trace(meta={"method": method}) if traced else None
    kwargs = {"ulysses_degree": 2} if method == "usp" else {}
    out = seqpar.attention(q, k, v, method=method, causal=True, cu_seqlens=cu, stats=stats, trace=tr, **kwargs)
    out.backward(dout)
    grads = [x.detach().clone() for x in (out, q.grad, k.grad, v.grad)]
    return (tr.to_dict() if tr else None), grads, {ph: stats.total(ph) for ph in ("fwd", "bwd")}


def _linear_step(method: str, traced: bool):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 16, 2, 8))
    stats, tr = CommStats(), Trace(meta={"method": method}) if traced else None
    if traced:
        with seqpar.trace(tr):  # the context manager: no plumbing
            out, _ = seqpar.linear_attention(q, k, v, g, method=method, stats=stats)
    else:
        out, _ = seqpar.linear_attention(q, k, v, g, method=method, stats=stats)
    out.sum().backward()
    return (tr.to_dict() if tr else None), [out.detach(), q.grad, k.grad, v.grad], \
        {ph: stats.total(ph) for ph in ("fwd", "bwd")}


def _traces(results):
    return [Trace.from_dict(r[0]) for r in results]


def _sent(trace: Trace, phase: str) -> int:
    """Payload bytes sent (CommStats counts no rank agreement: its stream check_ranks is left out)."""
    return sum(e["bytes"] for e in trace.events
               if e["type"] == "send" and e["phase"] == phase and e["chan"] != "check_ranks")


@pytest.mark.parametrize("method", SOFTMAX)
def test_softmax_traces_are_complete_and_consistent(method):
    n = 4 if method == "usp" else 2
    res = run_distributed(_softmax_step, n, method, n, False, True, timeout=120)
    traces = _traces(res)
    check_traces(traces, expect={"method": method})
    for tr, (_, _, sent) in zip(traces, res):
        kinds = {e["type"] for e in tr.events}
        assert {"begin", "end", "compute"} <= kinds
        assert [e["name"] for e in tr.events if e["type"] == "begin"] == ["attention fwd", "attention bwd"]
        if method not in ("allgather_kv", "ulysses", "usp"):  # point to point only: bytes = CommStats
            assert _sent(tr, "fwd") == sent["fwd"] and _sent(tr, "bwd") == sent["bwd"]
    fwd = sum(e["flops"] for tr in traces for e in tr.events if e["type"] == "compute" and e["phase"] == "fwd")
    bwd = sum(e["flops"] for tr in traces for e in tr.events if e["type"] == "compute" and e["phase"] == "bwd")
    assert (fwd, bwd) == pytest.approx(attention_flops(1, T, HQ, D, True))


@pytest.mark.parametrize("method", ("zigzag_ring", "token_ring", "ulysses"))
def test_packed_traces_are_consistent_and_count_visible_pairs(method):
    res = run_distributed(_softmax_step, 2, method, 2, True, True, timeout=120)
    traces = _traces(res)
    check_traces(traces)
    pairs = sum(s * (s + 1) // 2 for s in (5, 14, 1, 12))  # the documents' causal (query, key) pairs
    fwd = sum(e["flops"] for tr in traces for e in tr.events if e["type"] == "compute" and e["phase"] == "fwd")
    assert fwd == pytest.approx(4.0 * pairs * HQ * D)
    assert all(e["name"].startswith("varlen") for tr in traces for e in tr.events if e["type"] == "compute")


def _packed_offsets_step(kind: str, check_ranks: bool):
    """One packed forward with check_ranks on or off; the trace's events."""
    torch.manual_seed(0)
    group, cu = dist.group.WORLD, [0, 5, 19, 20, T]
    tr = Trace()
    if kind == "softmax":
        full = [torch.randn(1, T, h, D) for h in (HQ, HKV, HKV)]
        q, k, v = (seqpar.shard(x, method="zigzag_ring", group=group, cu_seqlens=cu) for x in full)
        seqpar.attention(q, k, v, method="zigzag_ring", causal=True, cu_seqlens=cu, check_ranks=check_ranks, trace=tr)
    else:
        # linear methods shard a packed batch densely (contiguous); the offsets go to the call only
        q, k, v = (seqpar.shard(torch.randn(1, T, 2, 8), method="zeco", group=group) for _ in range(3))
        seqpar.linear_attention(q, k, v, method="zeco", cu_seqlens=cu, check_ranks=check_ranks, trace=tr)
    return tr.to_dict()


@pytest.mark.parametrize("kind", ("softmax", "linear"))
def test_the_packed_offsets_check_is_traced(kind):
    """With check_ranks off a packed call still all-gathers a 3-number fingerprint of cu_seqlens (24
    bytes per rank, before any payload): the trace records it. With check_ranks on, the agreement's
    digest carries cu_seqlens and there is no separate gather."""
    off_traces = run_distributed(_packed_offsets_step, 2, kind, False, timeout=120)
    off = [t["events"] for t in off_traces]
    on = [t["events"] for t in run_distributed(_packed_offsets_step, 2, kind, True, timeout=120)]
    traces = _traces([(t,) for t in off_traces])
    check_traces(traces)  # the gather pairs up across ranks and the replay takes it
    assert replay(traces, Machine("cpu", intra_bw=1e9, intra_lat=1e-5)).step_s > 0
    for r in range(2):
        gathers = [e for e in off[r] if e.get("chan") == "check_cu_seqlens"]
        assert [(e["type"], e["kind"], e["bytes"], e["members"], e["phase"]) for e in gathers] == \
            [("coll", "all_gather", 24, [0, 1], "fwd")]
        first_payload = min(e["id"] for e in off[r] if e["type"] in ("send", "recv", "coll") and e is not gathers[0])
        assert gathers[0]["id"] < first_payload
        assert not [e for e in on[r] if e.get("chan") == "check_cu_seqlens"]
        assert [e for e in on[r] if e.get("chan") == "check_ranks"]


@pytest.mark.parametrize("method", ("zeco", "lasp2", "lasp1"))
def test_linear_traces_are_consistent(method):
    res = run_distributed(_linear_step, 3, method, True, timeout=120)
    traces = _traces(res)
    check_traces(traces, expect={"method": method})
    for tr, (_, _, sent) in zip(traces, res):
        names = {e["name"] for e in tr.events if e["type"] == "compute"}
        assert {"linear_intra", "linear_bwd_intra"} <= names
        if method != "lasp2":
            assert _sent(tr, "fwd") == sent["fwd"] and _sent(tr, "bwd") == sent["bwd"]
    if method == "zeco":  # a forwarded block waits for the block that arrived: a dependency on its receive
        middle = traces[1]
        for e in middle.events:
            if e["type"] == "send" and e["phase"] == "fwd" and e["chan"] != "check_ranks":
                assert [middle.events[d]["type"] for d in e["deps"]] == ["recv"]


def test_ring_dependencies_follow_the_schedule():
    """Step s computes with the K,V received at step s-1 (two receives: K and V travel as two tensors);
    dK,dV leave with the blocks that made them."""
    traces = _traces(run_distributed(_softmax_step, 2, "ring", 2, False, True, timeout=120))
    for tr in traces:
        ev = tr.events
        computes = [e for e in ev if e["type"] == "compute" and e["phase"] == "fwd"]
        assert computes[0]["deps"] == [] and all([ev[d]["type"] for d in c["deps"]] == ["recv", "recv"]
                                                 for c in computes[1:])
        assert len(computes) == 1 + tr.rank  # causal contiguous ring: rank r sees r earlier shards
        dkv = [e for e in ev if e["type"] == "send" and e["chan"] == "ring_dkv"]
        assert dkv and all(e["deps"] and all(ev[d]["type"] in ("compute", "recv") for d in e["deps"]) for e in dkv)
        messages, _, _ = match_messages(traces)
        assert len(messages) == sum(e["type"] == "send" for t in traces for e in t.events)


@pytest.mark.parametrize("method", ("zigzag_ring", "ulysses"))
def test_tracing_changes_no_result(method):
    on = run_distributed(_softmax_step, 2, method, 2, False, True, timeout=120)
    off = run_distributed(_softmax_step, 2, method, 2, False, False, timeout=120)
    for (_, a, _), (_, b, _) in zip(on, off):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_linear_tracing_changes_no_result():
    on, off = _linear_step("zeco", True), _linear_step("zeco", False)
    assert all(torch.equal(x, y) for x, y in zip(on[1], off[1]))


def test_the_recorder_is_scoped_and_explicit_wins():
    outer, inner = Trace(), Trace()
    assert active_trace() is None
    with seqpar.trace(outer):
        assert active_trace() is outer
        with seqpar.trace(inner):
            assert active_trace() is inner
        assert active_trace() is outer
    assert active_trace() is None
    explicit = Trace()
    q = torch.randn(1, 8, 2, 4)
    with seqpar.trace(outer):
        seqpar.attention(q, q, q, trace=explicit)
    assert explicit.events and not outer.events


def test_bad_recorders_and_files_raise(tmp_path):
    with pytest.raises(ValueError, match="recorder: expected a seqpar.Trace"):
        with seqpar.trace("on"):
            pass
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="trace: expected a seqpar.Trace"):
        seqpar.attention(q, q, q, trace=True)
    tr = Trace(rank=0, meta={"method": "ring"})
    seqpar.attention(q, q, q, trace=tr)
    path = tmp_path / "t.json"
    tr.save(path)
    assert Trace.load(path).events == tr.events
    data = tr.to_dict()
    path.write_text(str(data).replace(f"'version': {data['version']}", "'version': 99").replace("'", '"')
                    .replace("None", "null"))
    with pytest.raises(ValueError, match=r"t.json.*version 99"):
        Trace.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="t.json.*not valid JSON"):
        Trace.load(path)
    assert FORMAT == "seqpar-trace"


def _hf_traced(method: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqpar.integrations.hf import apply_context_parallel, context_parallel_loss, shard_inputs

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = apply_context_parallel(LlamaForCausalLM(config), method=method)
    batch = shard_inputs(torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(0)), method=method)
    rec = Trace(meta={"method": method})
    with seqpar.trace(rec):  # attention runs deep inside the model: no trace= argument to pass
        loss = context_parallel_loss(model(**batch.model_kwargs()).logits, batch.labels)
    loss.backward()  # outside the block: each call's backward records into the trace its forward had
    return rec.to_dict()


def test_a_transformers_model_is_traced_without_plumbing():
    pytest.importorskip("transformers")
    traces = [Trace.from_dict(d) for d in run_distributed(_hf_traced, 2, "zigzag_ring", timeout=180)]
    check_traces(traces, expect={"method": "zigzag_ring"})
    for tr in traces:  # two decoder layers: two attention calls, forward and backward
        names = [e["name"] for e in tr.events if e["type"] == "begin"]
        assert names == ["attention fwd"] * 2 + ["attention bwd"] * 2


def test_an_exclusive_trace_holds_its_lock_around_each_compute_segment_only():
    """``Trace(exclusive=lock)``: the lock is held while a kernel runs and timed, never across messages."""
    held = []

    class Recorder:
        def __enter__(self):
            held.append("enter")

        def __exit__(self, *exc):
            held.append("exit")

    rec = Trace(rank=0, world_size=2, exclusive=Recorder())
    with rec.compute("block_fwd", flops=1.0, shape=(1, 2, 3, 4, 5, 6)):
        assert held == ["enter"]
    rec.send(0, 1, 8, chan="ring")
    rec.wait([rec.last_id])
    assert held == ["enter", "exit"]
    with pytest.raises(RuntimeError), rec.compute("block_bwd"):
        raise RuntimeError("the kernel failed")
    assert held == ["enter", "exit", "enter", "exit"]  # released even when the kernel raises
    assert rec.events[0]["cpu"] >= 0 and "exclusive" not in rec.to_dict()  # the lock is not part of the file


def test_the_machine_lock_excludes_other_holders_reenters_and_pickles(tmp_path):
    import pickle
    import threading
    import time

    from seqpar.bench.local_cores import MachineLock

    path = str(tmp_path / "compute.lock")
    first, second = MachineLock(path), pickle.loads(pickle.dumps(MachineLock(path)))
    order = []

    def other():
        with second:  # another open file of the same path: as another rank process
            order.append("second")

    with first:
        with first:  # re-entrant: a segment inside a segment keeps the lock
            t = threading.Thread(target=other)
            t.start()
            time.sleep(0.2)
            order.append("first")
        time.sleep(0.1)
        assert order == ["first"]  # the inner exit did not release it
    t.join(5)
    assert order == ["first", "second"]
