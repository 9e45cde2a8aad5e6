"""Sequence-parallel gated linear attention (zeco, lasp2, lasp1) on gloo ranks.

Every case shards a global problem contiguously, runs forward and the backward of a random linear
functional of (o, final state) on every rank, and compares the output, every rank's final state and
the gradients of q, k, v, g and initial_state with a float64 token-by-token recurrence on the same
(rounded) inputs. It also checks the bytes every rank sent against ALGORITHMS.md §6/§8.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.comm.stats import CommStats
from seqpar.linear import linear_attention, reference_linear_attention
from seqpar.testing import run_distributed

DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16}
# Tolerance: the method's error may be at most 2x the error of an ideal single-device implementation
# in the same dtype (the recurrence in fp32 on the same inputs, result rounded to the dtype; STYLE.md
# §12), plus a floor for a baseline that is unusually lucky. fp32: both accumulate in fp32, in a
# different order -> ~1e-6 relative; a wrong incoming state, decay or document reset gives errors of
# order 1e-1. bf16: both round the result to bf16 (2^-9 relative), so the floor is a few bf16 ulps.
FACTOR = 2.0
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4e-3}


def _rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _inputs(spec):
    """Global inputs of a case, rounded to its dtype (same on every process)."""
    n, b, t, h, k, v = (spec[x] for x in ("n", "B", "T_local", "H", "K", "V"))
    dtype = DTYPES[spec["dtype"]]
    gen = torch.Generator().manual_seed(spec["seed"])

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    T = n * t
    x = {"q": rnd(b, T, h, k), "k": rnd(b, T, h, k), "v": rnd(b, T, h, v)}
    # decays of a few percent per token: the incoming state still matters a shard later
    if spec["g"] == "k":
        x["g"] = F.logsigmoid(rnd(b, T, h, k) + 3)
    elif spec["g"] == "s":
        x["g"] = F.logsigmoid(rnd(b, T, h) + 3)
    rows = 1 if spec["cu"] else b
    if spec["h0"]:
        x["h0"] = rnd(rows, h, k, v)
    x = {name: t_.to(dtype) for name, t_ in x.items()}
    x["W"] = rnd(b, T, h, v).to(dtype).double()                  # d loss / d o
    x["U"] = rnd(n, rows, h, k, v).float().double()              # d loss / d final state, per rank
    return x


def _rank_case(spec):
    rank = dist.get_rank()
    x = _inputs(spec)
    t = spec["T_local"]
    sl = slice(rank * t, (rank + 1) * t)
    loc = {name: x[name][:, sl].clone().requires_grad_() for name in ("q", "k", "v", "g") if name in x}
    h0 = x["h0"].clone().requires_grad_() if "h0" in x else None
    cu = None if spec["cu"] is None else torch.tensor(spec["cu"], dtype=torch.int32)
    stats = CommStats()
    o, ht = linear_attention(loc["q"], loc["k"], loc["v"], loc.get("g"), method=spec["method"],
                             initial_state=h0, output_final_state=spec["final"], cu_seqlens=cu, stats=stats)
    loss = (o.double() * x["W"][:, sl]).sum()
    if spec["final"]:
        loss = loss + (ht.double() * x["U"][rank]).sum()
    loss.backward()
    out = {"o": o.detach(), "ht": None if ht is None else ht.detach(), "bytes": stats.as_dict(),
           "dh0": None if h0 is None else h0.grad}
    out.update({"d" + name: loc[name].grad for name in loc})
    return out


def _reference(spec, x, dtype=torch.float64):
    """Output, final state and gradients of the whole problem from the token-by-token recurrence.

    ``dtype=float64``: the reference. Otherwise the tolerance baseline, an ideal single-device
    implementation in that dtype: the recurrence in float32 on the same inputs, its output and
    gradients rounded to ``dtype`` (independent of the chunked kernel and of the scan)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    names = [n_ for n_ in ("q", "k", "v", "g", "h0") if n_ in x]
    ins = {n_: x[n_].to(acc).clone().requires_grad_() for n_ in names}
    o, ht = reference_linear_attention(ins["q"], ins["k"], ins["v"], ins.get("g"),
                                       initial_state=ins.get("h0"), cu_seqlens=spec["cu"])
    loss = (o.double() * x["W"]).sum()
    if spec["final"]:
        loss = loss + (ht.double() * x["U"].sum(0)).sum()
    grads = torch.autograd.grad(loss, [ins[n_] for n_ in names])
    out = {"o": o.detach().to(dtype), "ht": ht.detach()}
    out.update({"d" + n_: gr.to(dtype) for n_, gr in zip(names, grads)})
    return out


def expected_bytes(spec, rank, es=4):
    """Bytes a rank sends, by "phase/primitive" (the states travel in fp32: ``es`` = 4, 8 for f64)."""
    n, b, h, k, v = (spec[x] for x in ("n", "B", "H", "K", "V"))
    rows = 1 if spec["cu"] else b
    state = rows * h * k * v * es
    if n == 1:
        return {}
    if spec["method"] == "lasp2":
        fwd = (n - 1) * rows * h * k * (v + 1) * es                # (N-1) copies of [S_loc | Gamma_end]
        bwd = (n - 1) * state * (2 if spec["final"] else 1)       # local dS_in terms (+ final-state grads)
        return {"fwd/all_gather_states": fwd, "bwd/all_gather_states": bwd}
    out = {}
    if rank < n - 1:
        out["fwd/allscan"] = state                               # exactly one state, whatever N
        if spec["final"]:
            out["bwd/reduce_final_state_grad"] = state
    if rank > 0:
        out["bwd/allscan"] = state
    if spec["final"] and rank == n - 1:
        out["fwd/broadcast_final_state"] = (n - 1) * state
    return out


def _check(spec, res):
    x = _inputs(spec)
    dtype = DTYPES[spec["dtype"]]
    ref = _reference(spec, x)
    base = _reference(spec, x, dtype) if dtype != torch.float64 else None

    def bound(name):
        return FACTOR * (_rel(base[name], ref[name]) if base else 0.0) + FLOOR[dtype]

    got = {name: torch.cat([r[name] for r in res], 1) for name in ("o", "dq", "dk", "dv", "dg") if name in res[0]
           and res[0][name] is not None}
    for name, val in got.items():
        e = _rel(val, ref[name])
        assert e <= bound(name), f"{name}: error {e:.2e} > {bound(name):.2e}"
    if spec["final"]:
        for rank, r in enumerate(res):
            e = _rel(r["ht"], ref["ht"])
            assert e <= bound("ht"), f"rank {rank} final state: error {e:.2e} > {bound('ht'):.2e}"
    else:
        assert all(r["ht"] is None for r in res)
    if spec["h0"]:
        e = _rel(sum(r["dh0"].double() for r in res), ref["dh0"])
        assert e <= bound("dh0"), f"d initial_state: error {e:.2e} > {bound('dh0'):.2e}"
        assert all(float(r["dh0"].abs().max()) == 0 for r in res[1:]), "d initial_state must live on rank 0"
    es = 8 if dtype == torch.float64 else 4
    for rank, r in enumerate(res):
        assert r["bytes"] == expected_bytes(spec, rank, es), f"rank {rank} sent {r['bytes']}"


def _spec(n, method, *, B=1, T_local=24, H=2, K=16, V=8, g="k", h0=True, final=True, cu=None,
          dtype="f32", seed=0):
    return dict(n=n, method=method, B=B, T_local=T_local, H=H, K=K, V=V, g=g, h0=h0, final=final, cu=cu,
                dtype=dtype, seed=seed)


# Documents of the packed N=4 stream (T_local = 24): one of length 1 at the start, one ending exactly
# on the shard edge 24, one spanning ranks 1..3, one of length 1 inside rank 3.
DOCS4 = [0, 1, 24, 80, 81, 96]

CASES = {
    "N1-zeco-gK-h0-final": _spec(1, "zeco", B=2, T_local=37),
    "N2-zeco-gK-h0-final-B2-T100": _spec(2, "zeco", B=2, T_local=100, K=20, V=12),
    "N2-lasp2-gK-h0-final-B2-T100": _spec(2, "lasp2", B=2, T_local=100, K=20, V=12),
    "N2-lasp1-gK-h0-final-B2-T100": _spec(2, "lasp1", B=2, T_local=100, K=20, V=12),
    "N2-zeco-nog-plain": _spec(2, "zeco", g=None, h0=False, final=False),
    "N2-lasp2-nog-plain": _spec(2, "lasp2", g=None, h0=False, final=False),
    "N2-lasp1-gS-final": _spec(2, "lasp1", g="s", h0=False),
    "N2-lasp1-K80-T65": _spec(2, "lasp1", K=80, V=24, T_local=65),
    "N2-zeco-gS-h0": _spec(2, "zeco", g="s", final=False, T_local=31),
    "N2-zeco-gK-f64": _spec(2, "zeco", dtype="f64"),
    "N2-zeco-gK-bf16": _spec(2, "zeco", dtype="bf16", B=2),
    "N2-zeco-packed": _spec(2, "zeco", T_local=40, cu=[0, 1, 30, 40, 41, 80]),
    "N4-zeco-gK-h0-final": _spec(4, "zeco", T_local=33),
    "N4-lasp2-gK-h0-final": _spec(4, "lasp2", T_local=33),
    "N4-lasp1-gK-h0-final": _spec(4, "lasp1", T_local=33),
    "N4-zeco-gS-final-B2": _spec(4, "zeco", g="s", h0=False, B=2),
    "N4-zeco-packed": _spec(4, "zeco", cu=DOCS4),
    "N4-lasp2-packed": _spec(4, "lasp2", cu=DOCS4, g="s"),
    "N4-lasp1-packed-nofinal": _spec(4, "lasp1", cu=DOCS4, final=False),
    "N4-zeco-bf16": _spec(4, "zeco", dtype="bf16"),
    "N4-zeco-T1-B2": _spec(4, "zeco", T_local=1, B=2),
    "N4-lasp2-packed-T1": _spec(4, "lasp2", T_local=1, cu=[0, 2, 3, 4]),
    "N4-lasp2-bf16": _spec(4, "lasp2", dtype="bf16"),
    "N8-zeco-gK-h0-final-packed": _spec(8, "zeco", T_local=20, cu=[0, 1, 2, 50, 60, 160]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_linear_attention_matches_recurrence(name):
    spec = CASES[name]
    res = run_distributed(_rank_case, spec["n"], spec, timeout=120)
    _check(spec, res)


def test_zeco_bytes_do_not_grow_with_n():
    """zeco: every rank but the last sends exactly one B*H*K*V state forward, for N = 2 and 4;
    lasp2: every rank receives (N-1)*B*H*K*(V+1) elements."""
    for method in ("zeco", "lasp2"):
        sent = {}
        for n in (2, 4):
            spec = _spec(n, method, B=2, final=False)
            res = run_distributed(_rank_case, n, spec, timeout=120)
            sent[n] = [r["bytes"] for r in res]
        state = 2 * 2 * 16 * 8 * 4
        if method == "zeco":
            for n in (2, 4):
                assert [s.get("fwd/allscan", 0) for s in sent[n]] == [state] * (n - 1) + [0]
        else:
            for n in (2, 4):
                assert all(s["fwd/all_gather_states"] == (n - 1) * 2 * 2 * 16 * 9 * 4 for s in sent[n])


def _subgroup_rank(spec):
    """Two independent 2-rank groups {0, 1} and {2, 3} of a 4-rank world run the same problem: the
    chain must address its peers by global rank."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    x = _inputs(spec)
    t = spec["T_local"]
    sl = slice((rank % 2) * t, (rank % 2 + 1) * t)
    loc = [x[name][:, sl].clone().requires_grad_() for name in ("q", "k", "v", "g")]
    h0 = x["h0"].clone().requires_grad_()
    stats = CommStats()
    o, ht = linear_attention(*loc, group=group, method=spec["method"], initial_state=h0,
                             output_final_state=True, stats=stats)
    ((o.double() * x["W"][:, sl]).sum() + (ht.double() * x["U"][rank % 2]).sum()).backward()
    out = {"o": o.detach(), "ht": ht.detach(), "dh0": h0.grad, "bytes": stats.as_dict()}
    out.update({"d" + name: t_.grad for name, t_ in zip(("q", "k", "v", "g"), loc)})
    return out


@pytest.mark.parametrize("method", ["zeco", "lasp2"])
def test_subgroups_address_peers_by_global_rank(method):
    spec = _spec(2, method)
    res = run_distributed(_subgroup_rank, 4, spec, timeout=120)
    _check(spec, res[:2])
    _check(spec, res[2:])


def _bad_rank(kind):
    q = torch.randn(1, 8, 2, 4)
    g = -torch.rand(1, 8, 2, 4)
    if kind == "g_positive":
        g[0, 3, 1, 2] = 0.5
    return linear_attention(q, q, q, g, method="zeco")


def test_bad_input_raises_on_every_rank_before_communicating():
    with pytest.raises(ValueError, match="g: the log-decay must be <= 0"):
        run_distributed(_bad_rank, 2, "g_positive", timeout=60)


def test_bench_linear_reports_time_and_bytes():
    from seqpar.bench.linear import bench_linear

    res = run_distributed(bench_linear, 2, "zeco", 256, 2, 16, 8, 1, None, timeout=120)
    for rank, r in enumerate(res):
        assert r["N"] == 2 and r["T_local"] == 128 and r["total_s"] > 0 and r["total_s_max"] >= r["total_s"]
        assert r["bytes_fwd"] == (2 * 16 * 8 * 4 if rank == 0 else 0)
        assert r["bytes_bwd"] == (2 * 16 * 8 * 4 if rank == 1 else 0)
