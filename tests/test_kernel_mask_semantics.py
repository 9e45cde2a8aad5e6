"""The masks the GPU backends' calls mean, checked on the CPU against seqpar's block masks.

Each backend turns a reduced block (:func:`seqpar.kernels.plan_block`: top-left ``causal``, plain,
or a window :class:`Band`) or a packed call into kernel arguments. Here those arguments are fed to a
plain emulation of each kernel's documented masking rule and the result is compared, element by
element, with the band seqpar means, for every shape and band of small blocks (square, half, tall,
wide, window bands of every reach) and for packed documents:

- FlashAttention-2 (torch's ``aten._flash_attention_forward/_backward`` and flash-attn 2,
  ``flash_api.cpp`` ``mha_fwd`` / ``mha_varlen_fwd`` / ``mha_bwd``): bottom-right aligned, query ``i``
  sees keys ``i + Tk - Tq - left .. i + Tk - Tq + right``; a bound ``>= seqlen_k`` (``max_seqlen_k``
  packed) becomes -1, any negative bound is unbounded, ``is_causal`` sets ``right = 0``;
- FlashAttention-4 (``interface._resolve_causal_local_window`` and ``mask.py``): the same alignment,
  ``None`` unbounded, never clamped, ``causal`` sets ``right = 0``;
- cuDNN (torch's ``_scaled_dot_product_cudnn_attention``): ``is_causal`` top-left, ``j <= i``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from seqpar.kernels import Band, plan_block
from seqpar.kernels.flash import window_size
from seqpar.kernels.flash4 import _mask_args
from seqpar.kernels.torch_flash import flash_pieces, varlen_refusal
from seqpar.kernels.varlen import VarlenSegments

SIZES = range(1, 10)


def _grid(tq: int, tk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(tq)[:, None], torch.arange(tk)[None, :]


def band_mask(tq: int, tk: int, band: Band) -> torch.Tensor:
    """seqpar's meaning: top-left, ``lo <= j - i <= hi``."""
    i, j = _grid(tq, tk)
    return (j - i >= (band.lo if band.lo is not None else -tq)) & (j - i <= (band.hi if band.hi is not None else tk))


def fa2_mask(tq: int, tk: int, causal: bool, left: int, right: int, clamp_k: int | None = None) -> torch.Tensor:
    """FlashAttention-2's rule for one (document of a) call."""
    clamp_k = tk if clamp_k is None else clamp_k
    left, right = (-1 if w >= clamp_k else w for w in (left, right))
    if causal:
        right = 0
    i, j = _grid(tq, tk)
    diag = i + tk - tq
    return ((j >= diag - left) | (left < 0)) & ((j <= diag + right) | (right < 0))


def fa4_mask(tq: int, tk: int, causal: bool, window_size_left, window_size_right) -> torch.Tensor:
    """FlashAttention-4's rule (``None`` unbounded, no clamping)."""
    right = 0 if causal else window_size_right
    i, j = _grid(tq, tk)
    diag = i + tk - tq
    ok = torch.ones(tq, tk, dtype=torch.bool)
    if window_size_left is not None:
        ok &= j >= diag - window_size_left
    if right is not None:
        ok &= j <= diag + right
    return ok


def cudnn_mask(tq: int, tk: int, causal: bool) -> torch.Tensor:
    i, j = _grid(tq, tk)
    return (j <= i) | (not causal)


def _bands(tq: int, tk: int):
    yield from ("none", "causal", "causal_strict")
    for lo, hi in itertools.product(range(-tq - 1, tk + 1), repeat=2):
        if lo <= hi:
            yield Band(lo, hi)
        yield Band(None, hi)
        yield Band(lo, None)


def _reduced_blocks():
    """Every non-empty reduced block of small shapes: ``(plan, the mask seqpar means on it)``."""
    for tq, tk in itertools.product(SIZES, SIZES):
        for mask in _bands(tq, tk):
            plan = plan_block(tq, tk, mask)
            if plan.empty:
                continue
            band = mask if isinstance(mask, Band) else {"none": Band(), "causal": Band(None, 0),
                                                        "causal_strict": Band(None, -1)}[mask]
            full = band_mask(tq, tk, band)
            want = full[plan.q_start:plan.q_stop, plan.k_start:plan.k_stop]
            assert want.sum() == full.sum(), (tq, tk, mask)  # nothing visible outside the plan
            yield plan, want


BLOCKS = list(_reduced_blocks())


def test_blocks_cover_every_kind():
    kinds = {(p.window is not None, p.causal, (p.rows > p.keys) - (p.rows < p.keys)) for p, _ in BLOCKS}
    assert kinds >= {(False, True, 0), (False, True, 1), (False, False, 0), (False, False, 1), (False, False, -1),
                     (True, False, 0), (True, False, 1), (True, False, -1)}
    assert any(p.causal and p.rows >= 2 * p.keys for p, _ in BLOCKS)  # the split tall causal block
    assert any(p.window is not None and window_size(p.rows, p.keys, p.window)[1] >= p.keys for p, _ in BLOCKS)


def test_torch_flash_calls_mean_seqpars_masks():
    """torch_cuda's direct flash calls (:func:`flash_pieces`: one call, or two on disjoint rows),
    with ``is_causal`` as passed (``left < 0 and right == 0``), give exactly the block's mask;
    where they cannot (a band whose right bound the kernel clamps) they refuse."""
    refused = 0
    for plan, want in BLOCKS:
        pieces = flash_pieces(plan.rows, plan.keys, plan.causal, plan.window)
        if pieces is None:
            assert plan.window is not None
            refused += 1
            continue
        got = torch.zeros_like(want)
        for rows, (left, right) in pieces:
            n = rows.stop - rows.start
            assert not got[rows].any(), "pieces overlap"
            got[rows] = fa2_mask(n, plan.keys, left < 0 and right == 0, left, right)
        assert torch.equal(got, want), (plan, pieces)
    assert refused


def test_flash_attn_calls_mean_seqpars_masks():
    """flash-attn 2's block calls: ``causal`` only on square blocks (``square_causal_only``), windows
    by :func:`window_size` where its clamp leaves them exact (``window_native``)."""
    for plan, want in BLOCKS:
        if plan.causal and not plan.square:
            continue  # refused by the capability: dispatch picks another backend
        if plan.window is not None and flash_pieces(plan.rows, plan.keys, False, plan.window) is None:
            continue  # window_native False: plain pieces
        left, right = window_size(plan.rows, plan.keys, plan.window)
        assert torch.equal(fa2_mask(plan.rows, plan.keys, plan.causal, left, right), want), plan


def test_flash4_calls_mean_seqpars_masks():
    """FlashAttention-4: one call for every reduced block (its bounds are not clamped)."""
    for plan, want in BLOCKS:
        args = _mask_args(plan.rows, plan.keys, plan.causal, plan.window)
        assert torch.equal(fa4_mask(plan.rows, plan.keys, **args), want), (plan, args)


def test_cudnn_calls_mean_seqpars_masks():
    """cuDNN gets named masks only (no window capability): top-left ``is_causal`` on any shape."""
    for plan, want in BLOCKS:
        if plan.window is None:
            assert torch.equal(cudnn_mask(plan.rows, plan.keys, plan.causal), want), plan


def _random_segments(gen: torch.Generator):
    segs, q0, k0 = [], 0, 0
    for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
        tq, tk = (int(x) for x in torch.randint(1, 12, (2,), generator=gen))
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        lo = int(torch.randint(-tq - 1, 3, (1,), generator=gen))
        mask = ["none", "causal", "causal_strict", Band(lo, lo + int(torch.randint(0, tk + 3, (1,), generator=gen)))][kind]
        segs.append((q0, tq, k0, tk, mask))
        q0, k0 = q0 + tq, k0 + tk
    return VarlenSegments.build(segs, q0, k0)


def _want(segs: VarlenSegments) -> torch.Tensor:
    want = torch.zeros(segs.tq, segs.tk, dtype=torch.bool)
    for s in segs.segments:
        band = s.mask if isinstance(s.mask, Band) else {"none": Band(), "causal": Band(None, 0),
                                                        "causal_strict": Band(None, -1)}[s.mask]
        want[s.q_start:s.q_start + s.q_len, s.k_start:s.k_start + s.k_len] |= band_mask(s.q_len, s.k_len, band)
    return want


@pytest.mark.parametrize("kernel", ["fa2", "fa4"])
def test_packed_calls_mean_seqpars_masks(kernel):
    """Packed calls, per document bottom-right: FlashAttention-2 clamps against ``max_seqlen_k`` of
    the whole call (refused by :func:`varlen_refusal` where that would show a key), FlashAttention-4
    does not clamp."""
    gen = torch.Generator().manual_seed(0)
    served = 0
    for _ in range(300):
        segs = _random_segments(gen)
        calls = segs.packed_calls()
        if kernel == "fa2" and varlen_refusal(calls):
            continue
        served += 1
        got = torch.zeros(segs.tq, segs.tk, dtype=torch.bool)
        for c in calls:
            for d, ((qs, nq), (ks, nk)) in enumerate(zip(c.q_rows, c.k_rows)):
                assert (c.cu_q[d + 1] - c.cu_q[d], c.cu_k[d + 1] - c.cu_k[d]) == (nq, nk)
                if kernel == "fa2":
                    m = fa2_mask(nq, nk, c.causal, *c.window, clamp_k=c.max_k)
                else:
                    left, right = (None if w < 0 else w for w in c.window)
                    m = fa4_mask(nq, nk, c.causal, left, right)
                got[qs:qs + nq, ks:ks + nk] |= m
        assert torch.equal(got, _want(segs)), segs
    assert served > 100
