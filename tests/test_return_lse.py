"""``seqpar.attention(..., return_lse=True)``: the merged log-sum-exp of this rank's rows, for every
softmax method on gloo ranks.

Each case runs the call twice on the same shards, with and without ``return_lse``, forward and
backward: ``out`` and every gradient must be bit-identical (the lse changes nothing else), the lse
must match the float64 reference lse of the unsharded sequence sharded with ``seqpar.shard``
(``-inf`` on packed padding rows), and the bytes sent must be equal except for Ulysses' and USP's one
extra all-to-all of the lse (exactly its size) and the one of its gradient in backward (sent by every
member whenever ``return_lse=True``, zeros here: the lse is not in the loss). Cases: dense causal GQA, dense non-causal with a
window, sinks and MLA head dims (MQA), packed causal documents with sinks; the stream layout; the
compiled call; the ring-flash-attention drop-in's ``return_attn_probs`` (one forward, not two).
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.comm.usp_groups import make_usp_groups
from seqpar.methods import DECLARED
from seqpar.softmax.reference import reference_lse
from seqpar.testing import run_distributed

from dist_utils import FP32_TOL, case_geometry, rel_err, world

METHODS = tuple(m.name for m in DECLARED if m.softmax)
TIMEOUT = 300

# (causal, window, lens (None: dense B=2, T=24), (Hq, Hkv, D, D_v), sinks)
CASES = ((True, None, None, (4, 2, 8, 8), False),
         (False, 7, None, (4, 1, 8, 6), True),
         (True, None, (5, 11, 8), (4, 2, 8, 8), True))
# the stream layout (method="ring"): documents cross rank boundaries; a window, and sinks
STREAM_CASES = ((True, None, ("stream", 7, 10, 7), (4, 2, 8, 8), False),
                (True, 5, ("stream", 3, 13, 8), (4, 2, 8, 8), True))


def _options(method: str, n: int) -> dict:
    """usp: the whole group as Ulysses axis at N=2, a pure ring axis (striped) at N=3, 2 x 2 at N=4."""
    if method != "usp":
        return {}
    degree, ring = {2: (2, "zigzag_ring"), 3: (1, "striped_ring"), 4: (2, "zigzag_ring")}[n]
    return {"group": make_usp_groups(None, degree), "ring_method": ring}


def _lse_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over rows that see a key, relative to max(|want|, 1); inf when a row's
    finiteness differs (a padding row must be -inf exactly, a real row finite)."""
    finite = torch.isfinite(got)
    if not torch.equal(finite, torch.isfinite(want)) or bool((got[~finite] != -torch.inf).any()):
        return float("inf")
    seen = torch.isfinite(want)
    diff = (got.double()[seen] - want[seen]).abs().max()
    return float(diff / max(float(want[seen].abs().max()), 1.0))


def _call(method, kw, local, sinks, causal, window, extra, return_lse):
    """fwd + bwd on fresh leaves; returns (results, lse or None, bytes sent by primitive)."""
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in local[:3])
    s = None if sinks is None else sinks.clone().requires_grad_()
    stats = seqpar.CommStats()
    res = seqpar.attention(ql, kl, vl, method=method, causal=causal, window=window, sinks=s, stats=stats,
                           return_lse=return_lse, **kw, **extra)
    out, lse = res if return_lse else (res, None)
    out.backward(local[3])  # the lse not in the loss: its gradient is None (tests/test_lse_grad.py: with one)
    grads = [out.detach(), ql.grad, kl.grad, vl.grad] + ([] if s is None else [s.grad])
    meta = None if lse is None else (lse.requires_grad, lse.grad_fn is not None)
    return grads, None if lse is None else lse.detach(), dict(stats.sent), meta


def _expected_lse(method, kw, glob, sinks, causal, window, cu, extra):
    """The float64 reference lse of the global sequence, sharded like the rows (padding rows -inf)."""
    want = reference_lse(glob[0].double(), glob[1].double(), causal=causal, window=window, cu_seqlens=cu,
                         sinks=None if sinks is None else sinks.double())
    rows = seqpar.shard(want, method=method, dim=2, **kw, **extra)
    real = seqpar.shard(torch.ones_like(want), method=method, dim=2, **kw, **extra)  # padding rows: 0
    return torch.where(real > 0, rows, -torch.inf)


def _lse_bytes(method, kw, hq, b, t_local) -> tuple[int, int]:
    """Bytes of the lse's all-to-all (Ulysses, USP): this member's heads to each other member's rows;
    and of its gradient's in backward: this rank's rows of each other member's heads."""
    if method not in ("ulysses", "usp"):
        return 0, 0
    axis = kw["group"].ulysses if method == "usp" else seqpar.comm.group_info(None)
    u, me = axis.size, axis.rank
    h_me = seqpar.methods.head_shards(hq, u)[me] if u > 1 else hq
    return (u - 1) * b * t_local * h_me * 4, b * t_local * (hq - h_me) * 4  # (lse, its gradient)


def _batch(method, cases):
    rank, n = world()
    kw = _options(method, n)
    rows = []
    for causal, window, lens, (hq, hkv, d, dv), with_sinks in cases:
        gen = torch.Generator().manual_seed(11 * n + len(rows))
        b, t, cu, extra = case_geometry(lens, method)
        glob = [torch.randn(b, t, h, x, generator=gen) for h, x in ((hq, d), (hkv, d), (hkv, dv), (hq, dv))]
        sinks = (torch.randn(hq, generator=gen) * 2) if with_sinks else None  # logits of the scores' order
        local = [seqpar.shard(x, method=method, **kw, **extra) for x in glob]
        with_lse, lse, sent, grad_meta = _call(method, kw, local, sinks, causal, window, extra, True)
        plain, _, sent_plain, _ = _call(method, kw, local, sinks, causal, window, extra, False)
        want = _expected_lse(method, kw, glob, sinks, causal, window, cu, extra)
        extra_bytes = sent.pop(("fwd", "ulysses_lse"), 0), sent.pop(("bwd", "ulysses_dlse"), 0)
        rows.append({
            "identical": all(torch.equal(a, p) for a, p in zip(with_lse, plain)),
            "lse_err": _lse_error(lse, want),
            "lse_meta": (tuple(lse.shape), lse.dtype, *grad_meta),
            "want_shape": (b, hq, local[0].shape[1]),
            "bytes_same": sent == sent_plain,
            "extra_bytes": (extra_bytes, _lse_bytes(method, kw, hq, b, local[0].shape[1])),
        })
    return rows


def _check(res, cases=CASES):
    for rank, rows in enumerate(res):
        for i, r in enumerate(rows):
            where = f"rank {rank} case {cases[i]}"
            assert r["identical"], f"{where}: out or a gradient changed with return_lse=True"
            # fp32: the lse is merged in fp32 over <= 24 keys of O(1) scores (~1e-7 relative); a wrong
            # mask, row order or missing sink term is off by > 1e-2
            assert r["lse_err"] <= FP32_TOL, f"{where}: lse error {r['lse_err']:.2e}"
            # differentiable (seqpar.softmax.lse): gradients through it are tests/test_lse_grad.py's
            assert r["lse_meta"] == (r["want_shape"], torch.float32, True, True), f"{where}: {r['lse_meta']}"
            assert r["bytes_same"], f"{where}: return_lse changed the bytes of the rest of the call"
            assert r["extra_bytes"][0] == r["extra_bytes"][1], f"{where}: lse all-to-all bytes {r['extra_bytes']}"


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_every_method(method, n):
    _check(run_distributed(_batch, n, method, CASES, timeout=TIMEOUT))


def test_usp_on_both_axes():
    """N=4 as 2 (Ulysses) x 2 (zigzag ring): the ring's lse, head-sharded, back to sequence shards."""
    _check(run_distributed(_batch, 4, "usp", CASES, timeout=TIMEOUT))


@pytest.mark.slow
def test_ulysses_four_ranks():
    _check(run_distributed(_batch, 4, "ulysses", CASES, timeout=TIMEOUT))


@pytest.mark.parametrize("n", [2, 3])
def test_stream_layout(n):
    _check(run_distributed(_batch, n, "ring", STREAM_CASES, timeout=TIMEOUT), STREAM_CASES)


def _leaves(method, kw, hq=4, hkv=2, d=8, seed=3):
    """Sharded fp32 q, k, v (fresh leaves), dout and sinks of one dense global sequence (B=2, T=24)."""
    gen = torch.Generator().manual_seed(seed)
    glob = [torch.randn(2, 24, h, d, generator=gen) for h in (hq, hkv, hkv, hq)]
    sinks = torch.randn(hq, generator=gen) * 2
    local = [seqpar.shard(x, method=method, **kw) for x in glob]

    def fresh():
        return [t.clone().requires_grad_() for t in local[:3]] + [sinks.clone().requires_grad_()]
    return fresh, local[3]


def _run_fn(fn, leaves, dout):
    """``fn(*leaves) -> (out, lse)``, backward through out: (out, lse, every leaf's gradient)."""
    out, lse = fn(*leaves)
    out.backward(dout)
    return [out.detach(), lse.detach()] + [x.grad for x in leaves], lse.requires_grad


def _compiled(method):
    """Eager and ``torch.compile(fullgraph=True, backend="aot_eager")`` of the same call on this rank."""
    _, n = world()
    kw = _options(method, n)
    fresh, dout = _leaves(method, kw)

    def fn(q, k, v, s):
        return seqpar.attention(q, k, v, method=method, causal=True, sinks=s, return_lse=True, **kw)

    from torch._dynamo.backends.registry import lookup_backend

    ops = []

    def recording(gm, example_inputs):  # aot_eager, after noting the graph's seqpar ops and constants
        ops.extend((n.args[-2:], dict(n.kwargs)) for n in gm.graph.nodes if "attention_fwd" in str(n.target))
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    eager, _ = _run_fn(fn, fresh(), dout)
    compiled, needs_grad = _run_fn(torch.compile(fn, backend=recording, fullgraph=True), fresh(), dout)
    torch._dynamo.reset()
    (constants, kwargs), = ops  # one op, asked for the lse
    q, k, v, s = fresh()  # the fake implementation's shapes, strides and dtypes are the real op's
    torch.library.opcheck(torch.ops.seqpar.attention_fwd.default, (q, k, v, s, None, *constants), kwargs,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    same = [torch.equal(a, b) for a, b in zip(eager[:5], compiled[:5])]
    return same, rel_err(compiled[5], eager[5]), needs_grad, kwargs


@pytest.mark.parametrize("method", ["zigzag_ring", "ulysses"])
def test_compiled_equals_eager(method):
    """The compiled op returns the lse as one more output (ring family: a copy of its saved lse;
    Ulysses: the lse brought back to sequence shards), differentiable; out, lse and gradients (the
    lse not in the loss) equal eager exactly."""
    for rank, (same, ds_err, needs_grad, kwargs) in enumerate(run_distributed(_compiled, 2, method, timeout=TIMEOUT)):
        assert kwargs == {"with_lse": True}, f"rank {rank}: the graph's op was called with {kwargs}"
        assert all(same), f"rank {rank}: compiled differs from eager in (out, lse, dq, dk, dv): {same}"
        # ds: a sum over rows of both signs, which the compiled backward may order differently
        # (Ulysses: ~2e-7 apart, with or without return_lse); fp32 rounding, far below a wrong term
        assert ds_err <= FP32_TOL, f"rank {rank}: compiled ds differs from eager by {ds_err:.2e}"
        assert needs_grad, f"rank {rank}: the compiled lse does not require grad"


def _checkpointed(method):
    """The same call plain and inside seqpar.checkpoint (its recomputation replays the forward)."""
    _, n = world()
    kw = _options(method, n)
    fresh, dout = _leaves(method, kw, seed=5)

    stats = {"plain": seqpar.CommStats(), "checkpoint": seqpar.CommStats()}

    def fn(q, k, v, s, which):
        out, lse = seqpar.attention(q, k, v, method=method, causal=True, sinks=s, return_lse=True,
                                    stats=stats[which], **kw)
        return out * 2.0, lse  # something after the attention, recomputed in backward

    plain, _ = _run_fn(lambda *x: fn(*x, "plain"), fresh(), dout)
    ckpt, _ = _run_fn(lambda *x: seqpar.checkpoint(fn, *x, "checkpoint"), fresh(), dout)
    return [torch.equal(a, b) for a, b in zip(plain, ckpt)], [dict(s.sent) for s in stats.values()]


@pytest.mark.parametrize("method", ["zigzag_ring", "ulysses"])
def test_checkpoint(method):
    """Inside seqpar.checkpoint the recomputation replays (out, lse): results and bytes (the
    forward's communication, the lse's all-to-all included, once) equal the plain call's."""
    for rank, (same, (plain, ckpt)) in enumerate(run_distributed(_checkpointed, 2, method, timeout=TIMEOUT)):
        assert all(same), f"rank {rank}: seqpar.checkpoint changed (out, lse, dq, dk, dv, ds): {same}"
        if method == "ulysses":  # its recomputation repeats the q, k, v all-to-all (seqpar.checkpoint's docs)
            ckpt[("fwd", "ulysses_qkv")] //= 2
        assert plain == ckpt, f"rank {rank}: bytes sent differ under checkpoint: {plain} vs {ckpt}"


def _changed_in_place(method):
    """The returned lse changed in place, inside the function and after it returns, plain and
    inside seqpar.checkpoint: out, the lse and every gradient as with an untouched lse."""
    fresh, dout = _leaves(method, {}, seed=7)

    def fn(q, k, v, s):
        out, lse = seqpar.attention(q, k, v, method=method, causal=True, sinks=s, return_lse=True)
        lse.sub_(1.0)  # e.g. rescaling before a merge
        return out * lse.exp().transpose(1, 2).unsqueeze(-1), lse

    def run(f):
        leaves = fresh()
        out, lse = f(*leaves)
        lse.mul_(0.5)  # after the call: the caller owns it
        out.backward(dout)
        return [out.detach(), lse] + [x.grad for x in leaves]

    plain = run(fn)
    ckpt = run(lambda *x: seqpar.checkpoint(fn, *x))
    return [torch.equal(a, b) for a, b in zip(plain, ckpt)], all(bool(torch.isfinite(g).all()) for g in ckpt[2:])


@pytest.mark.parametrize("method", ["zigzag_ring", "ulysses"])
def test_returned_lse_is_the_callers(method):
    """Changing the returned lse in place neither breaks backward (the ring family saves its lse)
    nor changes what seqpar.checkpoint replays (it recorded that lse): before the copy the plain
    ring call raised in backward and the checkpointed one returned inf gradients."""
    for rank, (same, finite) in enumerate(run_distributed(_changed_in_place, 2, method, timeout=TIMEOUT)):
        assert finite and all(same), f"rank {rank}: (out, lse, dq, dk, dv, ds) under checkpoint equal plain: {same}"


def _bad_flag(value, check_ranks):
    fresh, _ = _leaves("ring", {})
    q, k, v, _ = fresh()
    try:
        seqpar.attention(q, k, v, method="ring", return_lse=value, check_ranks=check_ranks)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("check_ranks", [None, False])
def test_return_lse_must_be_a_bool(check_ranks):
    for rank, message in enumerate(run_distributed(_bad_flag, 2, "yes", check_ranks, timeout=60)):
        assert message is not None and "return_lse" in message, f"rank {rank}: {message}"


def _compat_counts():
    """Messages and bytes the executor sends for one zigzag_ring_flash_attn_func call with and without
    return_attn_probs (counted at the executor's exchange, which every ring step goes through)."""
    import seqpar.compat.ring_flash_attn as rfa
    import seqpar.softmax.executor as executor

    fresh, dout = _leaves("zigzag_ring", {}, hkv=4)
    sent = []
    exchange = executor.exchange

    def counting(info, sends, recvs, **kw):
        sent.append(sum(t.numel() * t.element_size() for t, _, _ in sends))
        return exchange(info, sends, recvs, **kw)

    counts = {}
    executor.exchange = counting
    try:
        for probs in (False, True):
            sent.clear()
            q, k, v, _ = fresh()
            res = rfa.zigzag_ring_flash_attn_func(q, k, v, causal=True, return_attn_probs=probs)
            (res[0] if probs else res).backward(dout)
            counts[probs] = (len(sent), sum(sent))
    finally:
        executor.exchange = exchange
    return counts


def test_compat_return_attn_probs_runs_the_forward_once():
    """The drop-in's lse comes from the same seqpar.attention call (return_lse=True): a call with
    return_attn_probs=True sends what one without sends (before: a second forward's messages too).
    Its values are checked against float64 in tests/test_compat_ring_flash_attn.py."""
    for rank, counts in enumerate(run_distributed(_compat_counts, 2, timeout=TIMEOUT)):
        assert counts[False][0] > 0, f"rank {rank}: nothing counted {counts}"
        assert counts[True] == counts[False], f"rank {rank}: (messages, bytes) {counts}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_lse_dtype_one_device(dtype):
    """float64 inputs give a float64 lse, the others fp32 (one device, no process group)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 16, h, 8, generator=gen, dtype=torch.float64).to(dtype) for h in (4, 2, 2))
    out, lse = seqpar.attention(q, k, v, method="ring", causal=True, return_lse=True)
    want = reference_lse(q.double(), k.double(), causal=True)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # float64: rounding only (measured 0); bf16: the reference sees the same rounded inputs, the CPU
    # kernel keeps some steps in bf16 (measured <= 1.7e-5 relative over 5 seeds, as the compat tests'
    # 1.3e-5); a wrong mask or scale moves the lse by 1e-2 or more
    assert _lse_error(lse, want) <= (1e-12 if dtype == torch.float64 else 1e-4)


def _module(method):
    """seqpar.SequenceParallelAttention(...)(q, k, v, sinks=s, return_lse=True) against the function."""
    _, n = world()
    kw = _options(method, n)
    fresh, _ = _leaves(method, kw, seed=9)
    q, k, v, s = fresh()
    layer = seqpar.SequenceParallelAttention(method=method, causal=True, window=9, **kw)
    got = layer(q, k, v, sinks=s, return_lse=True)
    want = seqpar.attention(q, k, v, method=method, causal=True, window=9, sinks=s, return_lse=True, **kw)
    return [torch.equal(a, b) for a, b in zip(got, want)], torch.is_tensor(layer(q, k, v, sinks=s))


@pytest.mark.parametrize("method", ["striped_ring", "usp"])
def test_module_form(method):
    for rank, (same, plain) in enumerate(run_distributed(_module, 2, method, timeout=TIMEOUT)):
        assert same == [True, True] and plain, f"rank {rank}: module (out, lse) {same}, plain call a tensor: {plain}"
