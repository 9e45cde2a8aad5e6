"""Single-process checks of the linear-attention family: the chunked kernel against the float64
recurrence (extreme decays, awkward lengths, packed documents), the scan primitives' folds, geometry,
and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqpar.kernels.linear_chunk import chunk_gla_bwd, chunk_gla_fwd, naive_recurrent_gla
from seqpar.linear import build_shard, linear_attention


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _problem(B, T, H, K, V, g, n_seq, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    x = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)]
    if g == "k":
        x.append(F.logsigmoid(rnd(B, T, H, K) * 2))
    elif g == "s":
        x.append(F.logsigmoid(rnd(B, T, H) * 2))
    elif g == "steep":  # exp(-30 * 64) underflows: every exponent the kernel forms must stay <= 0
        x.append(-30 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64))
    else:
        x.append(None)
    x.append(rnd(n_seq, H, K, V))
    return x


@pytest.mark.parametrize("B,T,K,V,g,cu", [
    (1, 1, 8, 8, "k", None),                       # T = 1
    (2, 100, 20, 12, "k", None),                   # odd sizes, two chunks, padding
    (1, 150, 16, 8, "steep", None),
    (2, 64, 16, 8, "s", None),
    (1, 77, 16, 8, None, None),
    (1, 150, 16, 8, "k", [0, 1, 40, 41, 130, 150]),  # documents of length 1
], ids=["T1", "odd-T100-K20", "steep-decay", "scalar", "nodecay", "packed"])
def test_chunk_kernel_matches_recurrence(B, T, K, V, g, cu):
    n_seq = B if cu is None else len(cu) - 1
    q, k, v, gg, h0 = _problem(B, T, 2, K, V, g, n_seq)
    ins = [t.clone().requires_grad_() for t in (q, k, v, gg, h0) if t is not None]
    o, ht = naive_recurrent_gla(*ins[:3], ins[3] if gg is not None else None, None, ins[-1], cu)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ref = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), ins)
    o2, ht2 = chunk_gla_fwd(q, k, v, gg, None, h0, cu)
    got = chunk_gla_bwd(q, k, v, gg, do, None, h0, dht, cu)
    got = [x for x in got if x is not None]
    assert _rel(o2, o) < 1e-12 and _rel(ht2, ht) < 1e-12
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), got, ref):
        assert torch.isfinite(a).all() and _rel(a, b) < 1e-11, name


def test_fp32_kernel_is_finite_under_steep_decay():
    q, k, v, g, h0 = (t.float() for t in _problem(1, 200, 2, 16, 8, "steep", 1))
    o, ht = chunk_gla_fwd(q, k, v, g, None, h0)
    dq, dk, dv, dg, dh0 = chunk_gla_bwd(q, k, v, g, torch.ones_like(o), None, h0, torch.ones_like(ht))
    assert all(torch.isfinite(t).all() for t in (o, ht, dq, dk, dv, dg, dh0))


def test_packed_geometry():
    # N = 4, T_local = 24: docs [0,1) [1,24) [24,80) [80,81) [81,96)
    cu = [0, 1, 24, 80, 81, 96]
    s = [build_shard(r, 4, 1, 24, cu) for r in range(4)]
    assert s[0].seq_lens == (1, 23) and s[0].in_seqs == (0,) and s[0].passes == (False,)
    assert s[1].seq_lens == (24,) and s[1].in_seqs == (-1,) and s[1].passes == (False,)  # starts a doc
    assert s[2].seq_lens == (24,) and s[2].in_seqs == (0,) and s[2].passes == (True,)
    assert s[3].seq_lens == (8, 1, 15) and s[3].in_seqs == (0,) and s[3].out_seqs == (2,)


def _good():
    q = torch.randn(1, 8, 2, 4)
    return q, q.clone(), torch.randn(1, 8, 2, 3), -torch.rand(1, 8, 2, 4)


@pytest.mark.parametrize("change,match", [
    (dict(k=torch.randn(1, 8, 2, 5)), "k: shape"),
    (dict(v=torch.randn(1, 7, 2, 3)), "v: shape"),
    (dict(g=-torch.rand(1, 8, 3)), "g: shape"),
    (dict(g=torch.full((1, 8, 2, 4), 0.1)), "g: the log-decay must be <= 0"),
    (dict(initial_state=torch.randn(1, 2, 4, 4)), "initial_state: expected shape"),
    (dict(method="ring"), "method='ring' is not a linear-attention method"),
    (dict(cu_seqlens=torch.tensor([0, 5, 9], dtype=torch.int32)), "cu_seqlens: is the GLOBAL"),
    (dict(cu_seqlens=torch.tensor([1, 8], dtype=torch.int32)), "cu_seqlens starts at 1: the offsets must start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 5, 5, 8], dtype=torch.int32)), "cu_seqlens is not strictly increasing"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens has dtype torch.float32"),
    (dict(scale=-1.0), "scale:"),
    (dict(output_final_state=1), "output_final_state:"),
], ids=["k-shape", "v-shape", "g-shape", "g-positive", "h0-shape", "method", "cu-total", "cu-start",
        "cu-empty-doc", "cu-dtype", "scale", "final-flag"])
def test_bad_input(change, match):
    q, k, v, g = _good()
    args = dict(k=k, v=v, g=g)
    kwargs = {}
    for key, val in change.items():
        (args if key in args else kwargs)[key] = val
    with pytest.raises(ValueError, match=match):
        linear_attention(q, args["k"], args["v"], args["g"], **kwargs)


def test_packed_needs_batch_one():
    q = torch.randn(2, 8, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens: packed input must have batch size 1"):
        linear_attention(q, q, q, cu_seqlens=[0, 8])
