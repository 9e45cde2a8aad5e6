"""Gradients through ``seqpar.attention(..., return_lse=True)``'s lse, for every softmax method on
gloo ranks.

Each case differentiates a loss of out and lse, ``(out * w).sum() + (lse * u).sum()`` with random
``w``, ``u`` (``torch.autograd.backward((out, lse), (w, u))``), or of the lse alone, and compares
every gradient (q, k, v, sinks: each rank's share summed over the group) with the float64
single-process reference built from plain torch (``reference_attention``'s softmax and
``reference_lse``'s logsumexp, differentiated by autograd). Cases: dense causal GQA; dense
non-causal with a window, sinks and MLA head dims (MQA); packed causal documents with sinks, whose
padding rows (lse ``-inf``) get a nonzero ``u`` (no NaN, no gradient from them); the lse alone
with sinks, and of packed documents; the stream layout (documents across ranks). The bytes sent
equal those of the same call differentiated through out alone, but for
Ulysses' and USP's one all-to-all of ``dlse`` (exactly its size). Then: the lse in one rank's
loss only; float64 (exact to rounding) and bf16 inputs; seqpar.checkpoint and torch.compile (aot_eager, fullgraph) against the
plain call; the ring-flash-attention drop-in's lse.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.comm.usp_groups import make_usp_groups
from seqpar.methods import DECLARED, head_shards
from seqpar.softmax.reference import reference_attention, reference_lse
from seqpar.testing import run_distributed

from dist_utils import BF16_FACTOR, BF16_FLOOR, FP32_TOL, case_geometry, rel_err, world

METHODS = tuple(m.name for m in DECLARED if m.softmax)
TIMEOUT = 300
NAMES = ("dq", "dk", "dv", "ds")

# (causal, window, lens (None: dense B=2, T=24), (Hq, Hkv, D, D_v), sinks, lse alone)
CASES = ((True, None, None, (4, 2, 8, 8), False, False),
         (False, 7, None, (4, 1, 8, 6), True, False),
         (True, None, (5, 11, 8), (4, 2, 8, 8), True, False),
         (True, None, None, (4, 2, 8, 8), True, True))
# packed documents, the lse alone: rows only delta' carries, through the packed kernels (every method at N=2)
PACKED_ALONE = ((True, None, (5, 11, 8), (4, 2, 8, 8), False, True),)
# the stream layout (method="ring"): documents cross rank boundaries; a window and sinks, and the lse alone
STREAM_CASES = ((True, 5, ("stream", 3, 13, 8), (4, 2, 8, 8), True, False),
                (True, None, ("stream", 7, 10, 7), (4, 2, 8, 8), False, True))


def _options(method: str, n: int) -> dict:
    """usp: the whole group as Ulysses axis at N=2, a pure ring axis (striped) at N=3, 2 x 2 at N=4."""
    if method != "usp":
        return {}
    degree, ring = {2: (2, "zigzag_ring"), 3: (1, "striped_ring"), 4: (2, "zigzag_ring")}[n]
    return {"group": make_usp_groups(None, degree), "ring_method": ring}


def _dlse_bytes(method, kw, hq, b, t_local) -> int:
    """Bytes of the dlse all-to-all (Ulysses, USP): each other member's heads of this rank's rows."""
    if method not in ("ulysses", "usp"):
        return 0
    axis = kw["group"].ulysses if method == "usp" else seqpar.comm.group_info(None)
    u, me = axis.size, axis.rank
    shards = head_shards(hq, u) if u > 1 else [hq]
    return b * t_local * (hq - shards[me]) * 4


def _reference(glob, w, u, sinks, causal, window, cu, dtype=torch.float64):
    """dq, dk, dv, ds of the reference computed in ``dtype`` (float64: the ground truth) for the loss
    (out * w).sum() + (lse * u).sum()."""
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in glob)
    s = None if sinks is None else sinks.to(dtype).clone().requires_grad_()
    args = {"causal": causal, "window": window, "cu_seqlens": cu, "sinks": s}
    lse = reference_lse(q, k, **args)
    torch.autograd.backward((reference_attention(q, k, v, **args), lse), (w.to(dtype), u.to(dtype)))
    grads = [x.grad for x in (q, k, v)]
    return grads + ([] if s is None else [s.grad])


def _call(method, kw, local, w, u, sinks, causal, window, extra, lse_only, through_lse=True):
    """fwd + bwd on fresh leaves: (local grads, ds summed over the group or None, bytes by primitive)."""
    leaves = [t.detach().clone().requires_grad_() for t in local]
    s = None if sinks is None else sinks.clone().requires_grad_()
    stats = seqpar.CommStats()
    out, lse = seqpar.attention(*leaves, method=method, causal=causal, window=window, sinks=s, stats=stats,
                                return_lse=True, **kw, **extra)
    if not through_lse:
        out.backward(w)
    elif lse_only:
        torch.autograd.backward(lse, u)
    else:
        torch.autograd.backward((out, lse), (w, u))
    ds = None
    if s is not None:
        ds = s.grad.clone()
        if world()[1] > 1:
            dist.all_reduce(ds)
    return [x.grad for x in leaves], ds, dict(stats.sent)


def _case(method, kw, index, case, only=None):
    """One case; ``only``: the rank whose loss alone has the lse term (the others' backward gets no dlse)."""
    causal, window, lens, (hq, hkv, d, dv), with_sinks, lse_only = case
    rank, n = world()
    gen = torch.Generator().manual_seed(17 * n + index)
    b, t, cu, extra = case_geometry(lens, method)
    glob = [torch.randn(b, t, h, x, generator=gen) for h, x in ((hq, d), (hkv, d), (hkv, dv))]
    w, u = torch.randn(b, t, hq, dv, generator=gen), torch.randn(b, hq, t, generator=gen)
    sinks = (torch.randn(hq, generator=gen) * 2) if with_sinks else None  # logits of the scores' order
    local = [seqpar.shard(x, method=method, **kw, **extra) for x in glob]
    lw = seqpar.shard(w, method=method, **kw, **extra)
    real = seqpar.shard(torch.ones_like(u), method=method, dim=2, **kw, **extra) > 0  # padding rows: False
    lu = torch.where(real, seqpar.shard(u, method=method, dim=2, **kw, **extra), 3.0)  # padding rows get 3
    grads, ds, sent = _call(method, kw, local, lw, lu, sinks, causal, window, extra, lse_only,
                            through_lse=only is None or rank == only)
    _, _, sent_out = _call(method, kw, local, lw, lu, sinks, causal, window, extra, lse_only, through_lse=False)
    lse_term = only is None or rank == only
    if only is not None or lse_only:  # the loss's global w and u: each rank's term of its own rows
        w = seqpar.unshard(lw if not (lse_only and lse_term) else torch.zeros_like(lw), method=method, **kw, **extra)
        u = seqpar.unshard(lu if lse_term else torch.zeros_like(lu), method=method, dim=2, **kw, **extra)
    want = _reference(glob, w, u, sinks, causal, window, cu)
    got = [seqpar.unshard(g, method=method, **kw, **extra) for g in grads] + ([] if ds is None else [ds])
    dlse_bytes = sent.pop(("bwd", "ulysses_dlse"), 0)
    sent_out.pop(("bwd", "ulysses_dlse"), None)  # (sent whenever return_lse=True, in the loss or not)
    return {"errs": [rel_err(g, r) if bool(r.abs().max() > 0) else float(g.abs().max()) for g, r in zip(got, want)],
            "finite": all(bool(torch.isfinite(g).all()) for g in grads),
            "bytes_same": sent == sent_out,
            "dlse_bytes": (dlse_bytes, _dlse_bytes(method, kw, hq, b, local[0].shape[1]))}


def _batch(method, cases, only=None, ring_method=None):
    _, n = world()
    kw = _options(method, n)
    if ring_method is not None:  # usp's ring axis
        kw["ring_method"] = ring_method
    return [_case(method, kw, i, case, only) for i, case in enumerate(cases)]


def _check(res, cases=CASES):
    for rank, rows in enumerate(res):
        for case, r in zip(cases, rows):
            where = f"rank {rank} case {case}"
            assert r["finite"], f"{where}: a gradient is not finite (padding rows' lse is -inf)"
            # fp32 against float64: every path accumulates in fp32 over <= 24 keys of O(1) scores
            # (~1e-6 relative, ds a sum of both signs included); dropping dlse anywhere is off by > 1e-1
            for name, e in zip(NAMES, r["errs"]):
                assert e <= FP32_TOL, f"{where}: {name} error {e:.2e}"
            assert r["bytes_same"], f"{where}: a gradient through the lse changed the bytes of the call"
            assert r["dlse_bytes"][0] == r["dlse_bytes"][1], f"{where}: dlse all-to-all bytes {r['dlse_bytes']}"


@pytest.mark.parametrize("method", METHODS)
def test_every_method(method):
    _check(run_distributed(_batch, 2, method, CASES + PACKED_ALONE, timeout=TIMEOUT), CASES + PACKED_ALONE)


@pytest.mark.parametrize("method", ["zigzag_ring", "token_ring", "usp"])
def test_three_ranks(method):
    _check(run_distributed(_batch, 3, method, CASES, timeout=TIMEOUT))


@pytest.mark.parametrize("method", ["token_ring", "lightseq", "usp", "ulysses"])
def test_lse_in_one_rank_loss(method):
    """Only rank 0's loss has the lse term: the others' backward gets no dlse, yet computes rank 0's
    rows from the delta' its bundles carry (usp at N=3: U=1, a pure ring axis); Ulysses' dlse
    all-to-all runs on every rank alike (zeros from the others), so nothing mismatches or hangs."""
    _check(run_distributed(_batch, 3, method, CASES, 0, timeout=TIMEOUT))


def test_lse_in_the_last_rank_loss_usp():
    """usp as 2 (Ulysses) x 2 (token_ring), only rank 3's loss holding the lse: the other Ulysses group
    gets no dlse, yet its ring members compute the query bundles of rank 3's group, whose rows of a
    loss of the lse alone only delta' carries (checked there though their own backward has no dlse).
    With the lse in rank 0's loss instead, no such bundle reaches a rank without dlse here: that case
    passes when the USP ring is not told of return_lse, this one fails."""
    _check(run_distributed(_batch, 4, "usp", CASES, 3, "token_ring", timeout=TIMEOUT))


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("zigzag_ring", "token_ring", "usp")])
def test_three_ranks_every_method(method):
    _check(run_distributed(_batch, 3, method, CASES, timeout=TIMEOUT))


@pytest.mark.parametrize("n", [2, 3])
def test_stream_layout(n):
    _check(run_distributed(_batch, n, "ring", STREAM_CASES, timeout=TIMEOUT), STREAM_CASES)


def test_usp_on_both_axes():
    """N=4 as 2 (Ulysses) x 2 (zigzag ring): dlse to head shards, then through the ring's bundles."""
    _check(run_distributed(_batch, 4, "usp", CASES, timeout=TIMEOUT))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ulysses", "allgather_kv"])
def test_four_ranks(method):
    _check(run_distributed(_batch, 4, method, CASES, timeout=TIMEOUT))


def _wrapped(method, seed):
    """One dense causal call (B=2, T=24, GQA, sinks) plain, inside seqpar.checkpoint and under
    torch.compile(aot_eager, fullgraph): every gradient for a loss of out and lse, and of lse alone."""
    _, n = world()
    kw = _options(method, n)
    gen = torch.Generator().manual_seed(seed)
    glob = [torch.randn(2, 24, h, 8, generator=gen) for h in (4, 2, 2, 4)]
    local = [seqpar.shard(x, method=method, **kw) for x in glob]
    u = seqpar.shard(torch.randn(2, 4, 24, generator=gen), method=method, dim=2, **kw)
    sinks = torch.randn(4, generator=gen) * 2

    def fn(q, k, v, s):
        out, lse = seqpar.attention(q, k, v, method=method, causal=True, sinks=s, return_lse=True, **kw)
        return out * 2.0, lse  # something after the attention, recomputed in backward

    def run(f, lse_only):
        leaves = [t.clone().requires_grad_() for t in local[:3]] + [sinks.clone().requires_grad_()]
        out, lse = f(*leaves)
        torch.autograd.backward((lse,) if lse_only else (out, lse), (u,) if lse_only else (local[3], u))
        return [x.grad for x in leaves]

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    res = {}
    for lse_only in (False, True):
        plain = run(fn, lse_only)
        res[lse_only] = ([torch.equal(a, b) for a, b in zip(plain, run(lambda *x: seqpar.checkpoint(fn, *x), lse_only))],
                         [rel_err(a, b) for a, b in zip(run(compiled, lse_only), plain)])
    torch._dynamo.reset()
    return res


@pytest.mark.parametrize("method", ["zigzag_ring", "ulysses"])
def test_checkpoint_and_compile(method):
    """seqpar.checkpoint replays (out, lse) and its backward takes the dlse: bit-identical to the
    plain call; the compiled backward op takes dlse as an input: equal to eager (the plain call is
    checked against float64 above)."""
    for rank, res in enumerate(run_distributed(_wrapped, 2, method, 5, timeout=TIMEOUT)):
        for lse_only, (same, errs) in res.items():
            where = f"rank {rank} ({'lse alone' if lse_only else 'out and lse'})"
            assert all(same), f"{where}: seqpar.checkpoint changed (dq, dk, dv, ds): {same}"
            # the same Function backward with the same dlse: equal but for ds, a sum over rows of both
            # signs that the compiled graph may order differently (fp32 rounding, far below a dropped dlse)
            assert max(errs) <= FP32_TOL, f"{where}: compiled differs from eager: {errs}"


def _bf16(method):
    """bf16 q, k, v (dense causal GQA, sinks), a loss of out and lse and of lse alone: errors against
    float64 on the same rounded inputs, and those of the reference computed in bf16 on one device."""
    _, n = world()
    kw = _options(method, n)
    gen = torch.Generator().manual_seed(21)
    glob = [torch.randn(2, 24, h, 8, generator=gen).to(torch.bfloat16) for h in (4, 2, 2, 4)]
    u, sinks = torch.randn(2, 4, 24, generator=gen), torch.randn(4, generator=gen) * 2
    local = [seqpar.shard(x, method=method, **kw) for x in glob]
    lu = seqpar.shard(u, method=method, dim=2, **kw)
    res = {}
    for lse_only in (False, True):
        w = glob[3] * (0 if lse_only else 1)
        grads, ds, _ = _call(method, kw, local[:3], local[3], lu, sinks, True, None, {}, lse_only)
        got = [seqpar.unshard(g, method=method, **kw) for g in grads] + [ds]
        want = _reference(glob[:3], w, u, sinks, True, None, None)
        base = _reference(glob[:3], w, u, sinks, True, None, None, torch.bfloat16)
        keep = [name != "dv" or not lse_only for name in NAMES]  # dv of a loss of the lse alone is 0
        res[lse_only] = [(name, rel_err(g, r), rel_err(c, r))
                         for name, g, r, c, k in zip(NAMES, got, want, base, keep) if k]
    return res


@pytest.mark.parametrize("method", ["zigzag_ring", "token_ring", "ulysses"])
def test_bf16(method):
    for rank, res in enumerate(run_distributed(_bf16, 2, method, timeout=TIMEOUT)):
        for lse_only, errs in res.items():
            # bf16 (STYLE.md §12): at most 2x as far from float64 as the reference computed in bf16 on
            # one device, plus dist_utils' floor
            for name, e, b in errs:
                assert e <= BF16_FACTOR * b + BF16_FLOOR, f"rank {rank} lse alone={lse_only} {name}: {e:.2e} vs bf16 {b:.2e}"


def _float64(method):
    """float64 q, k, v, sinks (dense causal GQA): every gradient against the float64 reference, for a
    loss of out and lse and of lse alone (float64 blocks run the reference kernel, from delta')."""
    _, n = world()
    kw = _options(method, n)
    gen = torch.Generator().manual_seed(4)
    glob = [torch.randn(2, 24, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4)]
    u = torch.randn(2, 4, 24, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    local = [seqpar.shard(x, method=method, **kw) for x in glob]
    lu = seqpar.shard(u, method=method, dim=2, **kw)
    errs = []
    for lse_only in (False, True):
        grads, ds, _ = _call(method, kw, local[:3], local[3], lu, sinks, True, None, {}, lse_only)
        want = _reference(glob[:3], glob[3] * (0 if lse_only else 1), u, sinks, True, None, None)
        got = [seqpar.unshard(g, method=method, **kw) for g in grads] + [ds]
        errs += [rel_err(g, r) if bool(r.abs().max() > 0) else float(g.abs().max()) for g, r in zip(got, want)]
    return errs


@pytest.mark.parametrize("method", ["zigzag_ring", "ulysses"])
def test_float64(method):
    for rank, errs in enumerate(run_distributed(_float64, 2, method, timeout=TIMEOUT)):
        # float64 rounding only (measured <= 1e-15); a dropped or doubled dlse is off by > 1e-1
        assert max(errs) <= 1e-12, f"rank {rank}: (dq, dk, dv, ds) x (out and lse, lse alone) errors {errs}"


def _dropin():
    """The ring-flash-attention drop-in's ``return_attn_probs=True`` lse in a loss (zigzag layout)."""
    import seqpar.compat.ring_flash_attn as rfa

    gen = torch.Generator().manual_seed(8)
    glob = [torch.randn(2, 24, h, 8, generator=gen) for h in (4, 2, 2, 4)]
    u = torch.randn(2, 4, 24, generator=gen)
    local = [seqpar.shard(x, method="zigzag_ring") for x in glob]
    leaves = [t.clone().requires_grad_() for t in local[:3]]
    out, lse, _ = rfa.zigzag_ring_flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    torch.autograd.backward((out, lse), (local[3], seqpar.shard(u, method="zigzag_ring", dim=2)))
    want = _reference(glob[:3], glob[3], u, None, True, None, None)
    return [rel_err(seqpar.unshard(x.grad, method="zigzag_ring"), r) for x, r in zip(leaves, want)]


def test_ring_flash_attn_dropin():
    """The drop-in's lse is differentiable (the peer's backward drops its gradient silently)."""
    for rank, errs in enumerate(run_distributed(_dropin, 2, timeout=TIMEOUT)):
        assert max(errs) <= FP32_TOL, f"rank {rank}: (dq, dk, dv) errors {errs}"  # fp32, as above
