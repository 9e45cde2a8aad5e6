"""Tests of packed variable-length geometry ``seqpar.layouts.packed`` and of the packed schedules
derived from it (``seqpar.softmax.packed``).

Host-side properties run on hypothesis-generated packings (1-20 documents of 1-200
tokens, so length 1 and lengths not divisible by N or 2N occur, N = 1..8, every layout).
The expected index of every local row is recomputed here from the layout's definition
(padding at each document's end), independently of the library. Coverage of every ring-family
method's packed schedule is checked combinatorially: over all ranks and tasks the visible pairs
of the segments, mapped to global tokens, must be exactly the per-document causal (or full)
score matrix, each pair once. Shard/unshard run on real gloo ranks (N = 2, 4).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from packed_utils import gathered_segments, method_decl, ring_steps, shard_packed, unshard_packed
from seqpar.comm import CommStats
from seqpar.comm.agreement import check_same_on_ranks
from seqpar.layouts import LAYOUTS, PackedLayout, check_cu_seqlens
from seqpar.methods import RING_METHODS
from seqpar.softmax.packed import packed_schedule
from seqpar.testing import run_distributed

LAYOUTS = tuple(LAYOUTS)
PACKINGS = dict(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=20).map(tuple),
    n=st.integers(1, 8),
    kind=st.sampled_from(LAYOUTS),
)
# deadline off: the machine is shared (load spikes); each example takes ~0.1 s alone.
# SEQPAR_HYPOTHESIS_EXAMPLES=500 for a deeper local run (CI keeps 25).
FAST = settings(max_examples=int(os.environ.get("SEQPAR_HYPOTHESIS_EXAMPLES", "25")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_thread")


def expected_index(kind: str, n: int, lens, rank: int) -> list[int]:
    """Global index of every local row, straight from the definition of each layout."""
    out, start = [], 0
    for L in lens:
        m = 2 * n if kind == "zigzag" else n
        padded = -(-L // m) * m
        if kind == "contiguous":
            c = padded // n
            virtual = range(rank * c, (rank + 1) * c)
        elif kind == "zigzag":
            h = padded // (2 * n)
            virtual = [*range(rank * h, (rank + 1) * h), *range((2 * n - 1 - rank) * h, (2 * n - rank) * h)]
        else:
            virtual = range(rank, padded, n)
        out.extend(start + p if p < L else -1 for p in virtual)  # padding = virtual positions >= L
        start += L
    return out


@given(**PACKINGS)
@example(lens=(1,), n=8, kind="zigzag")
@example(lens=(1, 17, 2, 200), n=3, kind="striped")
@FAST
def test_index_maps(lens, n, kind):
    pl = PackedLayout(kind, n, lens)
    T = sum(lens)
    assert pl.total_tokens == T and pl.cu_seqlens[-1] == T and len(pl.cu_seqlens) == len(lens) + 1
    m = 2 * n if kind == "zigzag" else n
    assert pl.piece_lens == tuple(-(-L // m) * m // n for L in lens)
    seen = []
    for r in range(n):
        idx = pl.local_index(r)
        assert list(idx) == expected_index(kind, n, lens, r)
        assert len(idx) == pl.t_local
        for d, (a, b) in enumerate(zip(pl.local_cu_seqlens, pl.local_cu_seqlens[1:])):
            piece = idx[a:b]
            real = pl.real_lens[r][d]
            # real tokens form a prefix of every piece; all of them belong to document d
            assert all(g >= 0 for g in piece[:real]) and all(g == -1 for g in piece[real:])
            assert all(pl.cu_seqlens[d] <= g < pl.cu_seqlens[d + 1] for g in piece[:real])
        seen.extend(g for g in idx if g >= 0)
    assert sorted(seen) == list(range(T))  # a bijection onto the real tokens
    assert pl.num_padding == n * pl.t_local - T
    if kind == "striped":  # striped real counts differ by at most one between ranks
        for d in range(len(lens)):
            counts = [pl.real_lens[r][d] for r in range(n)]
            assert max(counts) - min(counts) <= 1


def covered_pairs(pl: PackedLayout, method: str, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted global keys q*T+k of every visible pair of every task of ``method``'s packed schedules
    on every rank, the expected ones)."""
    T, t, n = pl.total_tokens, pl.t_local, pl.n
    tri = torch.ones(t, t, dtype=torch.int16).tril()
    tmpl = {"none": torch.ones(t, t, dtype=torch.int16), "causal": tri, "causal_strict": tri.tril(-1)}
    idx = [torch.tensor(pl.local_index(r)) for r in range(n)]
    keys = []
    for r in range(n):
        for step in packed_schedule(method_decl(method), pl, r, causal).steps:
            for task in step.tasks:
                count = torch.zeros(t, t, dtype=torch.int16)
                for b in task.blocks:
                    for s in b.segments.segments:
                        count[s.q_start:s.q_start + s.q_len, s.k_start:s.k_start + s.k_len] += \
                            tmpl[s.mask][:s.q_len, :s.k_len]
                p, k = torch.nonzero(count, as_tuple=True)
                assert (count[p, k] == 1).all(), "a pair is computed twice within one task"
                gq, gk = idx[(r + task.q) % n][p], idx[(r + task.kv) % n][k]
                assert (gq >= 0).all() and (gk >= 0).all(), "a padding row or key is covered"
                keys.append(gq * T + gk)
    expected = []
    for a, b in zip(pl.cu_seqlens, pl.cu_seqlens[1:]):
        full = torch.ones(b - a, b - a, dtype=torch.bool)
        p, k = torch.nonzero(full.tril() if causal else full, as_tuple=True)
        expected.append((p + a) * T + k + a)
    return torch.sort(torch.cat(keys)).values, torch.sort(torch.cat(expected)).values


@given(lens=PACKINGS["lens"], n=PACKINGS["n"], method=st.sampled_from(RING_METHODS), causal=st.booleans())
@example(lens=(1, 2, 3, 16, 17), n=8, method="zigzag_ring", causal=True)
@example(lens=(1, 9, 4), n=4, method="striped_ring", causal=True)
@example(lens=(1, 9, 4, 30), n=5, method="lightseq", causal=True)
@example(lens=(1, 9, 4, 30), n=4, method="token_ring", causal=True)
@FAST
def test_packed_schedules_cover_each_document_once(lens, n, method, causal):
    """Every ring-family method's packed schedule (its dense plan per document, clipped to the real
    tokens) computes every visible (query, key) pair of every document exactly once, nothing else."""
    pl = PackedLayout(method_decl(method).layout, n, lens)
    got, expected = covered_pairs(pl, method, causal)
    assert torch.equal(got, expected)  # equal sorted lists: every pair exactly once, nothing else
    assert sum(pl.work(r, causal) for r in range(n)) == expected.numel()


@pytest.mark.parametrize("n", (2, 4, 8))
def test_zigzag_balance_long_documents(n):
    rng = random.Random(n)
    lens = tuple(rng.randint(300, 3000) for _ in range(24))
    zig = PackedLayout("zigzag", n, lens)
    assert zig.balance(causal=True) <= 1.02
    assert PackedLayout("striped", n, lens).balance(causal=True) <= 1.02
    assert PackedLayout("contiguous", n, lens).balance(causal=True) >= 1.3  # why zigzag exists
    assert zig.balance(causal=False) <= 1.02


def test_ring_steps_and_gathered():
    pl = PackedLayout("zigzag", 4, (1, 9, 30, 2, 17))
    for r in range(4):
        steps = ring_steps(pl, r, causal=True)
        assert [j for j, _ in steps] == [(r - s) % 4 for s in range(4)]
        assert sum(s.pairs for _, s in steps) == pl.work(r) == gathered_segments(pl, r, causal=True).pairs
        assert all(s.tq == s.tk == pl.t_local for _, s in steps)
        assert packed_schedule(method_decl("zigzag_ring"), pl, r, True) is \
            packed_schedule(method_decl("zigzag_ring"), pl, r, True)  # cached on the layout
    assert pl.local_cu_seqlens_tensor().dtype == torch.int32
    assert pl.local_cu_seqlens_tensor() is pl.local_cu_seqlens_tensor()  # cached, per layout


# ----------------------------------------------------------------------------- validation


BAD = {
    "not_at_zero": ([1, 5, 9], 9, "start at 0"),
    "not_increasing": ([0, 5, 5, 9], 9, "strictly increasing"),
    "decreasing": ([0, 6, 4, 9], 9, "strictly increasing"),
    "wrong_total": ([0, 5, 9], 10, "ends at 9"),
    "float_dtype": (torch.tensor([0.0, 5.0, 9.0]), 9, "dtype"),
    "bool_dtype": (torch.tensor([False, True]), 1, "dtype"),
    "two_d": (torch.tensor([[0, 5, 9]], dtype=torch.int32), 9, "1-D"),
    "float_list": ([0, 4.5, 9], 9, "int offsets"),
    "no_document": (torch.tensor([0], dtype=torch.int32), 0, "no document"),
    "not_a_sequence": ("0,5,9", 9, "int32 tensor"),
}


@pytest.mark.parametrize("cu,total,words", BAD.values(), ids=BAD.keys())
def test_bad_cu_seqlens(cu, total, words):
    with pytest.raises(ValueError, match=words) as info:
        check_cu_seqlens(cu, total, argument="cu_seqlens")
    assert "cu_seqlens" in str(info.value)
    with pytest.raises(ValueError, match="cu_seqlens"):
        shard_packed(torch.zeros(1, total, 2), cu, None, "zigzag")


def test_good_cu_seqlens():
    for cu in ([0, 1, 9], (0, 1, 9), torch.tensor([0, 1, 9], dtype=torch.int32), torch.tensor([0, 1, 9])):
        assert check_cu_seqlens(cu, 9) == (0, 1, 9)
    with pytest.raises(ValueError, match="layout"):
        PackedLayout("ring", 2, (3,))
    with pytest.raises(ValueError, match="rank"):
        PackedLayout("zigzag", 2, (3,)).local_index(2)


def test_single_device_round_trip():
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    x = torch.randn(1, 11, 3)
    for kind in LAYOUTS:
        local = shard_packed(x, cu, None, kind)
        assert torch.equal(unshard_packed(local, cu, None, kind), x)


# ----------------------------------------------------------------------------- distributed


def _round_trip(seed: int):
    """Every layout: shard -> unshard exact, local rows as the layout says, padding zero."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    rng = random.Random(seed)
    lens = [1, 2 * n + 1] + [rng.randint(1, 60) for _ in range(rng.randint(1, 8))]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    T = int(cu[-1])
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, 3, 4, generator=gen)
    labels = torch.randint(0, 1000, (1, T), generator=gen)
    for kind in LAYOUTS:
        pl = PackedLayout.from_cu_seqlens(cu, n, kind, total_tokens=T)
        for layout in (kind, pl):
            local = shard_packed(x, cu, None, layout)
            idx = torch.tensor(pl.local_index(rank))
            assert local.shape == (1, pl.t_local, 3, 4)
            assert torch.equal(local[0, idx >= 0], x[0, idx[idx >= 0]])
            assert not local[0, idx < 0].any()
            stats = CommStats()
            assert torch.equal(unshard_packed(local, cu, None, layout, stats=stats), x)
            assert stats.total() == (n - 1) * local.numel() * local.element_size()  # one all-gather
        lab = shard_packed(labels, cu, None, pl, dim=-1)
        assert torch.equal(unshard_packed(lab, None, None, pl, dim=-1), labels)


@pytest.mark.parametrize("n", (2, 4))
def test_shard_unshard_distributed(n):
    run_distributed(_round_trip, n, 11 + n, timeout=120)


def _mismatch():
    import torch.distributed as dist

    cu = [0, 3, 7] if dist.get_rank() == 0 else [0, 4, 7]
    check_same_on_ranks(cu)


def test_cu_seqlens_differs_across_ranks():
    with pytest.raises(ValueError, match="differs across ranks"):
        run_distributed(_mismatch, 2, timeout=60)
