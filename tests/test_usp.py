"""USP (Ulysses x ring) on real gloo ranks: 2x2 at N=4, 2x4 and 4x2 at N=8, every group form.

Output and dq, dk, dv against a float64 reference on the same rounded inputs; bytes per rank =
Ulysses' (GQA-aware) volume over the Ulysses axis + the ring method's over the ring axis.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import seqpar
from seqpar.comm.usp_groups import describe_usp, make_usp_groups
from seqpar.layouts import layout_named, layout_of
from seqpar.testing import run_distributed

from dist_utils import global_inputs
from test_ulysses import check_errors, errors, kv_heads_needed, run_sharded, ulysses_bytes


RING_METHODS = ("ring", "zigzag_ring", "striped_ring", "allgather_kv")


def usp_bytes(ring_method, u, r, me_u, B, c, hq, hkv, d, esize):
    """(forward, backward) bytes of rank (me_u, ·): the Ulysses volume, then the ring method on
    U·c tokens with this rank's KV heads (K,V in the input dtype; dK,dV accumulators in fp32)."""
    uly_fwd, uly_bwd = ulysses_bytes(u, me_u, B, c, hq, hkv, d, esize)
    kv = 2 * B * u * c * len(kv_heads_needed(hq, hkv, u, me_u)) * d
    if r == 1:
        return uly_fwd, uly_bwd
    fwd = (r - 1) * kv * esize
    bwd = (r - 1) * kv * esize + (r - 1 if ring_method == "allgather_kv" else r) * kv * 4
    return uly_fwd + fwd, uly_bwd + bwd


def _group(form, u, r):
    """The USP group in one of the accepted forms, and the ulysses_degree to pass with it."""
    if form == "mesh":  # named dims, ring first: the names decide, not the order
        return init_device_mesh("cpu", (r, u), mesh_dim_names=("ring", "ulysses")), None
    if form == "mesh_ordered":  # unnamed dims: (ulysses, ring)
        return init_device_mesh("cpu", (u, r)), u
    if form == "pair":
        mesh = init_device_mesh("cpu", (u, r), mesh_dim_names=("ulysses", "ring"))
        return (mesh.get_group("ulysses"), mesh.get_group("ring")), None
    if form == "groups":
        return make_usp_groups(None, u), None
    return None, u  # "plain": the world and ulysses_degree (subgroups built on the call)


def _case(form, u, r, ring_method, causal, B, T, Hq, Hkv, D, dtype, seed):
    group, degree = _group(form, u, r)
    low, hi = global_inputs(B, T, Hq, Hkv, D, seed, dtype)
    stats = seqpar.CommStats()
    layout = {"ulysses_degree": degree, "ring_method": ring_method}
    got = run_sharded("usp", causal, low, group=group, stats=stats, layout=layout)
    errs, base = errors(got, low, hi, causal, dtype)
    axes = describe_usp(group, degree)
    uly = {ph: sum(b for (p, prim), b in stats.sent.items() if p == ph and prim.startswith("ulysses"))
           for ph in ("fwd", "bwd")}
    return {"errs": errs, "base": base, "fwd": stats.total("fwd"), "bwd": stats.total("bwd"), "u": axes.u,
            "uly": uly, "shape": (axes.ulysses_degree, axes.ring_degree)}


def _run(form, u, r, ring_method, causal, hq, hkv, dtype, B=1, c=6, d=64, seed=0):
    n = u * r
    res = run_distributed(_case, n, form, u, r, ring_method, causal, B, n * c, hq, hkv, d, dtype, seed)
    check_errors(res, dtype)
    esize = torch.finfo(dtype).bits // 8
    for rank, x in enumerate(res):
        assert x["shape"] == (u, r)
        uly = dict(zip(("fwd", "bwd"), ulysses_bytes(u, x["u"], B, c, hq, hkv, d, esize)))
        assert x["uly"] == uly, f"rank {rank}: Ulysses axis sent {x['uly']}, formula {uly}"
        if ring_method not in RING_METHODS:  # its own volume is checked by its own tests
            continue
        fwd, bwd = usp_bytes(ring_method, u, r, x["u"], B, c, hq, hkv, d, esize)
        assert x["fwd"] == fwd, f"rank {rank}: forward sent {x['fwd']} bytes, formula says {fwd}"
        assert x["bwd"] == bwd, f"rank {rank}: backward sent {x['bwd']} bytes, formula says {bwd}"



@pytest.mark.parametrize("ring_method", RING_METHODS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_usp_2x2(ring_method, causal):
    _run("mesh", 2, 2, ring_method, causal, 8, 2, torch.float32, B=2, d=80, seed=len(ring_method))


@pytest.mark.parametrize("ring_method", [m for m in seqpar.METHODS if m in ("token_ring", "lightseq")])
def test_usp_newer_ring_methods(ring_method):
    """Ring-family methods added to the registry later run on the ring axis unchanged."""
    _run("mesh", 2, 2, ring_method, True, 8, 2, torch.float32, seed=4)


@pytest.mark.parametrize("form,hq,hkv,dtype", [
    ("mesh_ordered", 4, 1, torch.bfloat16),  # Hkv=1: the single KV head goes to both Ulysses members
    ("pair", 8, 8, torch.bfloat16),
    ("groups", 12, 6, torch.float32),  # 6 query heads over 3 KV heads per member: uneven segments
    ("plain", 8, 2, torch.float32),
], ids=["mesh_ordered-hkv1-bfloat16", "pair-mha-bfloat16", "groups-q12-kv6-float32", "plain-gqa-float32"])
def test_usp_group_forms(form, hq, hkv, dtype):
    _run(form, 2, 2, "zigzag_ring", True, hq, hkv, dtype, seed=hq)


@pytest.mark.parametrize("form,u,r,ring_method,hq,hkv,dtype", [
    ("mesh", 2, 2, "zigzag_ring", 9, 3, torch.float32),  # SmolLM2-135M: 5 + 4 heads, KV head 1 on both
    ("groups", 2, 2, "striped_ring", 15, 5, torch.bfloat16),  # SmolLM2-360M
    ("plain", 4, 1, "zigzag_ring", 9, 3, torch.float32),  # 3 + 2 + 2 + 2
], ids=["2x2-smollm2", "2x2-q15-kv5-bfloat16", "4x1-smollm2"])
def test_usp_uneven_heads(form, u, r, ring_method, hq, hkv, dtype):
    _run(form, u, r, ring_method, True, hq, hkv, dtype, seed=hq + u)


@pytest.mark.parametrize("u,r", [(1, 2), (2, 1)], ids=["1x2", "2x1"])
def test_usp_degenerate_axes(u, r):
    _run("plain", u, r, "striped_ring", True, 4, 2, torch.float32, c=5, seed=2)


@pytest.mark.parametrize("form,u,r,ring_method,hkv", [
    ("mesh", 2, 4, "zigzag_ring", 2),
    ("groups", 4, 2, "striped_ring", 2),  # Hkv=2 < U=4: each KV head shared by two members
], ids=["2x4-zigzag", "4x2-striped-shared-kv"])
def test_usp_world_size_8(form, u, r, ring_method, hkv):
    _run(form, u, r, ring_method, True, 8, hkv, torch.float32, c=4, seed=9)


def _layout(form, u, r, ring_method):
    group, degree = _group(form, u, r)
    x = torch.arange(2 * 48 * 3, dtype=torch.float32).reshape(2, 48, 3)
    local = seqpar.shard(x, method="usp", group=group, ulysses_degree=degree, ring_method=ring_method)
    back = seqpar.unshard(local, method="usp", group=group, ulysses_degree=degree, ring_method=ring_method)
    axes = describe_usp(group, degree)
    # the composition, written out: piece u of the ring layout's super-shard j
    c = 48 // (u * r)
    want = layout_named(layout_of(ring_method)).token_indices(48, r, axes.j)[axes.u * c:(axes.u + 1) * c]
    return bool(torch.equal(back, x)), bool(torch.equal(local[0, :, 0], x[0, want, 0]))


@pytest.mark.parametrize("form", ["mesh", "pair", "plain"])
@pytest.mark.parametrize("ring_method", ["zigzag_ring", "striped_ring", "ring"])
def test_shard_unshard_roundtrip(form, ring_method):
    for back, layout in run_distributed(_layout, 4, form, 2, 2, ring_method):
        assert back and layout


def _bad(kind):
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16)
    if kind == "heads":  # 3 query heads, Ulysses degree 4
        seqpar.attention(q[:, :, :3], k[:, :, :1], v[:, :, :1], method="usp", ulysses_degree=4)
    elif kind == "mesh_shape":  # a 2x2 mesh but 4 Ulysses ranks asked for
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ulysses", "ring"))
        seqpar.attention(q[:, :, :4], k, v, method="usp", group=mesh, ulysses_degree=4)
    elif kind == "mesh_1d":
        seqpar.attention(q, k, v, method="usp", group=init_device_mesh("cpu", (4,)))
    elif kind == "ring_method":
        seqpar.attention(q, k, v, method="usp", ulysses_degree=2, ring_method="spiral_ring")
    elif kind == "not_ring_family":
        seqpar.attention(q, k, v, method="usp", ulysses_degree=2, ring_method="ulysses")
    elif kind == "degree":
        seqpar.attention(q, k, v, method="usp", ulysses_degree=3)
    elif kind == "length":
        seqpar.shard(torch.zeros(1, 10, 2), method="usp", ulysses_degree=2, ring_method="zigzag_ring")
    return dist.get_rank()


BAD = [("heads", r"q: Hq=3 .*ulysses_degree=4 .*ulysses_degree=2"), ("mesh_shape", r"group: .*2, 2.*ulysses_degree=4"),
       ("mesh_1d", "2-D DeviceMesh"), ("ring_method", "ring_method='spiral_ring'"),
       ("not_ring_family", "ring_method='ulysses'"), ("degree", "ulysses_degree=3"),
       ("length", r"multiple of R\*lcm\(2, U\) = 4")]


@pytest.mark.parametrize("kind,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_on_every_rank(kind, match):
    """Each rank raises the same ValueError before any communication: nothing hangs."""
    with pytest.raises(ValueError, match=match) as info:
        run_distributed(_bad, 4, kind, timeout=60)
    assert "[0, 1, 2, 3]" in str(info.value)
