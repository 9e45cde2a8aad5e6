"""Sliding windows (``seqpar.attention(..., window=W)``) for every softmax method.

- Schedules, on the host: every windowed plan of every method verifies (each pair in the window
  computed exactly once, none outside, every message matched, every operand held) for N = 1..6
  and windows from 1 to beyond T; packed windowed schedules cover every document's windowed pairs
  exactly once; the number of steps of a truncated ring is counted.
- Exactness, on gloo ranks: every method x N = 2, 3, 4 x dense and packed x causal and symmetric,
  with W = 1, W below and not a multiple of the chunk, W = T - 1, W >= T and documents shorter
  than W, output and every gradient against a float64 reference (fp32, ``dist_utils.FP32_TOL``).
- Bytes, through ``CommStats``: exactly the formulas of docs/methods.md ("Sliding windows"), and
  with W = T/8 zigzag_ring sends at most a quarter of the windowless bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import FP32_TOL, world
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_ring import expected_bytes
from test_ulysses import ulysses_bytes

import seqpar
from seqpar.comm.usp_groups import make_usp_groups
from seqpar.kernels.masks import as_band
from seqpar.layouts import PackedLayout, layout_named
from seqpar.methods import DECLARED, RING_METHODS
from seqpar.softmax import plans
from seqpar.softmax.packed import packed_schedule
from seqpar.softmax.reference import reference_attention
from seqpar.softmax.registry import plan_builder
from seqpar.softmax.window import ring_window_plan, zigzag_window_plan
from seqpar.testing import run_distributed

METHODS = tuple(m.name for m in DECLARED if m.softmax)


def _decl(name):
    return next(m for m in DECLARED if m.name == name)


# ----------------------------------------------------------------------------- schedules (host)


@pytest.mark.parametrize("method", RING_METHODS)
def test_windowed_plans_verify(method):
    decl = _decl(method)
    build, layout = plan_builder(decl, windowed=True), layout_named(decl.layout)
    for n, causal in itertools.product(range(1, 7), (True, False)):
        t = 6 if layout.chunks == 2 else 5
        for window in (1, 2, 3, 5, 7, 11, t * n - 1, 100):
            plans.verify(lambda *a, **k: build(*a, transport=decl.transport, **k), n, t, causal, layout, window)


def _covered(pl: PackedLayout, method: str, causal: bool, window: int):
    """Sorted global pairs q*T+k of every block of every rank's packed windowed schedule."""
    T, n = pl.total_tokens, pl.n
    idx = [pl.local_index(r) for r in range(n)]
    keys = []
    for r in range(n):
        for step in packed_schedule(_decl(method), pl, r, causal, window).steps:
            for task in step.tasks:
                for b in task.blocks:
                    for s in b.segments.segments:
                        band = as_band(s.mask)
                        for i, j in itertools.product(range(s.q_len), range(s.k_len)):
                            if band.sees(i, j):
                                gq = idx[(r + task.q) % n][b.q.start + s.q_start + i]
                                gk = idx[(r + task.kv) % n][b.kv.start + s.k_start + j]
                                assert gq >= 0 and gk >= 0, "a padding row or key is covered"
                                keys.append(gq * T + gk)
    want = [p * T + k for a, e in zip(pl.cu_seqlens, pl.cu_seqlens[1:]) for p in range(a, e) for k in range(a, e)
            if (k <= p or not causal) and abs(p - k) < window]
    return sorted(keys), sorted(want)


@given(lens=st.lists(st.integers(1, 60), min_size=1, max_size=8).map(tuple), n=st.integers(1, 5),
       method=st.sampled_from(RING_METHODS), causal=st.booleans(), window=st.integers(1, 70))
@example(lens=(1, 13, 6, 29, 2), n=4, method="zigzag_ring", causal=True, window=4)
@example(lens=(40, 3), n=3, method="lightseq", causal=True, window=9)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_packed_windowed_schedules_cover_each_document_once(lens, n, method, causal, window):
    got, want = _covered(PackedLayout(_decl(method).layout, n, lens), method, causal, window)
    assert got == want


@pytest.mark.parametrize("window", [1, 2, 16, 17, 18, 33, 64, 200])
def test_truncated_ring_step_count(window):
    """A window of W tokens over shards of c = 16 (zigzag: chunks of 8) ends ceil((W-1)/c) steps
    after the diagonal (at most N/2, both directions meeting there), plus one step that brings the
    last dK,dV home: far fewer than the N + 1 steps of the ring."""
    n, c = 8, 16
    for build, chunk in ((ring_window_plan, c), (zigzag_window_plan, c // 2)):
        reach = min(math.ceil((window - 1) / chunk), n // 2)
        steps = [build(r, n, c, True, window=window).schedule(c).n for r in range(n)]
        assert max(steps) == 1 + reach + (reach > 0), (build.__name__, steps)


# ----------------------------------------------------------------------------- bytes formulas


def seen(layout, T, n, a, b, window, causal, keys=True):
    """Rows of member ``b``'s keys that some query of ``a`` sees (``keys``), or of ``a``'s queries
    that see some key of ``b``: the rows a windowed schedule moves between them."""
    qa, kb = layout.positions(T, n, a), layout.positions(T, n, b)
    if keys:
        return sum(any((p - x >= 0 or not causal) and abs(p - x) < window for p in qa) for x in kb)
    return sum(any((p - x >= 0 or not causal) and abs(p - x) < window for x in kb) for p in qa)


def zigzag_rows(n, h, window, a, b):
    """docs/methods.md's closed form for zigzag, causal: key chunk kappa of b sends
    min(h, max(0, W - 1 - (m - 1) h)) rows, m = chunks from kappa to the nearest later chunk of a."""
    chunks = lambda r: (r, 2 * n - 1 - r)
    total = 0
    for kappa in chunks(b):
        after = [c - kappa for c in chunks(a) if c > kappa]
        if after:
            total += min(h, max(0, window - 1 - (min(after) - 1) * h))
    return total


def window_bytes(method, n, r, T, B, hq, hkv, d, window, causal, esize=4):
    """(forward, backward) bytes rank ``r`` sends (docs/methods.md, "Sliding windows"): K,V rows
    to the members whose queries see them and dK,dV rows back (ring family, lightseq non-causal),
    or queries to the members whose keys they see and results back (token_ring); fp32 results."""
    lay = layout_named(_decl(method).layout)
    kv_row, q_row, out_row = 2 * B * hkv * d, B * hq * d, B * hq
    fwd = bwd = 0
    for o in range(n):
        if o == r:
            continue
        if method == "token_ring":
            sent = seen(lay, T, n, r, o, window, causal, keys=False)  # my queries go to o
            back = seen(lay, T, n, o, r, window, causal, keys=False)  # o's results go back
            fwd += sent * q_row * esize + back * (q_row * esize + out_row * 4)
            bwd += sent * (2 * q_row * esize + 2 * out_row * 4) + back * q_row * 4
        else:
            sent = seen(lay, T, n, o, r, window, causal)  # my K,V rows that o's queries see
            back = seen(lay, T, n, r, o, window, causal)  # the dK,dV I computed for o
            fwd += sent * kv_row * esize
            bwd += sent * kv_row * esize + back * kv_row * 4
    return fwd, bwd


def lightseq_bytes(n, r, T, B, hq, hkv, d, window, esize=4):
    """LightSeq, causal: pair (a, b), a > b, fetches b's K,V to a when a - b <= N/2, else a's
    queries go to b (the helper) and the partial results come back."""
    lay = layout_named("contiguous")
    kv_row, q_row, out_row = 2 * B * hkv * d, B * hq * d, B * hq
    fwd = bwd = 0
    for a, b in itertools.permutations(range(n), 2):
        if a <= b or r not in (a, b):
            continue
        if a - b <= n // 2:  # K,V of b to a, dK,dV back
            rows = seen(lay, T, n, a, b, window, True)
            fwd += rows * kv_row * esize if r == b else 0
            bwd += rows * (kv_row * esize if r == b else kv_row * 4)
        else:  # a's queries to b, results back
            rows = seen(lay, T, n, a, b, window, True, keys=False)
            fwd += rows * (q_row * esize if r == a else q_row * esize + out_row * 4)
            bwd += rows * ((2 * q_row * esize + 2 * out_row * 4) if r == a else q_row * 4)
    return fwd, bwd


def expected_window_bytes(method, n, r, T, B, hq, hkv, d, window, causal):
    if window >= T:  # no window: the method's own schedule
        return None
    if method == "allgather_kv":  # gathers whole shards: its bytes do not fall with W
        return expected_bytes(method, n, B, T // n, hkv, d, 4)
    if method == "ulysses":  # the local attention takes the window; the all-to-alls do not change
        return ulysses_bytes(n, r, B, T // n, hq, hkv, d, 4)
    if method == "lightseq" and causal:
        return lightseq_bytes(n, r, T, B, hq, hkv, d, window)
    return window_bytes(method, n, r, T, B, hq, hkv, d, window, causal)


def test_zigzag_closed_form_matches_the_definition():
    lay = layout_named("zigzag")
    for n, h, window in itertools.product((2, 3, 4, 5), (1, 3, 8), (1, 2, 3, 7, 9, 17, 40)):
        for a, b in itertools.permutations(range(n), 2):
            assert zigzag_rows(n, h, window, a, b) == seen(lay, 2 * n * h, n, a, b, window, True)


# ----------------------------------------------------------------------------- exactness on ranks


def _reference(glob, causal, window, cu=None, sinks=None):
    q, k, v = (t.double().clone().requires_grad_() for t in glob[:3])
    s = None if sinks is None else sinks.detach().double().clone().requires_grad_()
    docs = [(0, q.shape[1])] if cu is None else list(zip(cu, cu[1:]))
    out = torch.cat([reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal, window=window, sinks=s)
                     for a, b in docs], dim=1)
    out.backward(glob[3].double())
    return (out.detach(), q.grad, k.grad, v.grad) + (() if s is None else (s.grad,))


def _err(got, ref):
    # relative to the reference's largest value, or 1: with W = 1 a query sees only its own key, so
    # dq and dk are exactly zero in exact arithmetic and the fp32 result is rounding noise (~1e-7)
    return float((got.double() - ref).abs().max() / max(float(ref.abs().max()), 1.0))


def _batch(method, cases, ulysses_degree):
    """Every case on this rank: errors (out, dq, dk, dv) and the bytes this rank sent."""
    rank, n = world()
    kw = {"group": make_usp_groups(None, ulysses_degree), "ring_method": "zigzag_ring"} if method == "usp" else {}
    results = []
    for causal, window, T, lens, (hq, hkv, d), with_sinks in cases:
        gen = torch.Generator().manual_seed(T * 7 + window)
        extra, B, cu = {}, 2, None
        if lens is not None:
            cu, B = [0, *itertools.accumulate(lens)], 1
            T, extra = cu[-1], {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
        glob = [torch.randn(B, T, h, d, generator=gen) for h in (hq, hkv, hkv, hq)]
        local = [seqpar.shard(t, method=method, **kw, **extra) for t in glob]
        ql, kl, vl = (t.requires_grad_() for t in local[:3])
        # sinks (logits of the scores' order) with a window: applied after the merge, bytes unchanged
        sinks = (torch.randn(hq, generator=gen) * 2).requires_grad_() if with_sinks else None
        stats = seqpar.CommStats()
        out = seqpar.attention(ql, kl, vl, method=method, causal=causal, window=window, stats=stats, sinks=sinks,
                               **kw, **extra)
        out.backward(local[3])
        got = [seqpar.unshard(t, method=method, **kw, **extra) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
        if sinks is not None:  # each rank holds its share of ds: the whole gradient is their sum
            ds = sinks.grad.clone()
            dist.all_reduce(ds)
            got.append(ds)
        errs = [_err(a, b) for a, b in zip(got, _reference(glob, causal, window, cu, sinks))]
        results.append({"case": (causal, window, T, lens), "errs": errs, "fwd": stats.total("fwd"),
                        "bwd": stats.total("bwd")})
    return results


def _cases(n):
    heads = (6, 3, 16) if n == 3 else (4, 2, 16)  # Ulysses needs Hq divisible by N; GQA
    T = 10 * n  # shards of 10 tokens, zigzag chunks of 5
    # (causal, window, T, packed lengths, heads, sinks): sinks with a window in both forms, dense and packed
    dense = [(True, w, T, None, heads, w == 7) for w in (1, 3, 7, T - 1, T)] + \
            [(False, w, T, None, heads, w == 7) for w in (1, 7, T + 5)]
    lens = [1, 13, 6, 29, 2]  # documents shorter than W, of length 1, odd
    packed = [(True, w, 0, lens, heads, w == 9) for w in (1, 4, 9, 40)] + \
        [(False, w, 0, lens, heads, w == 9) for w in (4, 9)]
    return dense + packed


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("method", METHODS)
def test_window_exact(method, n):
    """fp32 forward and every gradient against float64, dense and packed, causal and symmetric, with
    attention sinks in four of the cases (ds against float64 too)."""
    res = run_distributed(_batch, n, method, _cases(n), 2 if n == 4 else 1, timeout=300)
    heads = _cases(n)[0][4]
    for rank, results in enumerate(res):
        for r in results:
            assert max(r["errs"]) <= FP32_TOL, f"{method} N={n} rank {rank} {r['case']}: errors {r['errs']}"
            causal, window, T, lens = r["case"]
            if lens is not None or method == "usp":  # packed rows travel as spans; usp: see test_usp
                continue
            want = expected_window_bytes(method, n, rank, T, 2, heads[0], heads[1], heads[2], window, causal)
            if want is not None:
                assert (r["fwd"], r["bwd"]) == want, f"{method} N={n} rank {rank} {r['case']}: bytes"


def _quarter(T, window):
    stats = [seqpar.CommStats(), seqpar.CommStats()]
    gen = torch.Generator().manual_seed(1)
    glob = [torch.randn(1, T, 4, 16, generator=gen) for _ in range(4)]
    local = [seqpar.shard(t, method="zigzag_ring") for t in glob]
    for w, s in zip((window, None), stats):
        seqpar.attention(*(t.clone().requires_grad_() for t in local[:3]), method="zigzag_ring", causal=True,
                         window=w, stats=s).backward(local[3])
    return [(s.total("fwd"), s.total("bwd")) for s in stats]


def test_zigzag_window_of_t_over_8_sends_a_quarter():
    """W = T/8 on zigzag_ring, N = 2: bytes equal the formula, and at most 1/4 of the windowless run."""
    T, n = 128, 2
    for rank, (win, full) in enumerate(run_distributed(_quarter, n, T, T // 8)):
        assert win == window_bytes("zigzag_ring", n, rank, T, 1, 4, 4, 16, T // 8, True)
        h = T // (2 * n)
        assert win[0] == (T // 8 - 1) * 2 * 4 * 16 * 4 == zigzag_rows(n, h, T // 8, 1 - rank, rank) * 2 * 4 * 16 * 4
        assert full == expected_bytes("zigzag_ring", n, 1, T // n, 4, 16, 4)
        assert sum(win) <= sum(full) / 4, (win, full)


# ----------------------------------------------------------------------------- bad input


def _bad(method, window, causal):
    x = torch.zeros(1, 8, 4, 16)
    try:
        seqpar.attention(x, x, x, method=method, causal=causal, window=window)
    except ValueError as e:
        return str(e)
    return None


def test_method_without_window_is_refused():
    from seqpar.methods import check_window

    toy = dataclasses.replace(_decl("ring"), name="toy", window=False, window_plan=None)
    with pytest.raises(ValueError, match="window=8: method='toy' does not serve a sliding window"):
        check_window(toy, 8)
    check_window(toy, None)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_bad_window_raises_on_every_rank(window):
    """A ValueError naming ``window`` on every rank, before any communication (nothing hangs)."""
    for message in run_distributed(_bad, 2, "zigzag_ring", window, True, timeout=60):
        assert message is not None and "window=" in message


def _disagree():
    rank, _ = world()
    x = torch.zeros(1, 8, 4, 16)
    try:
        seqpar.attention(x, x, x, method="zigzag_ring", causal=True, window=4 + rank, check_ranks=True)
    except ValueError as e:
        return str(e)
    return None


def test_ranks_that_disagree_on_the_window_raise():
    """With check_ranks, a window that differs between ranks is named on every rank (no hang)."""
    for message in run_distributed(_disagree, 2, timeout=60):
        assert message is not None and "window" in message
