"""Public API: shard/unshard round trips, the module wrapper, and bad input raising before communication."""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.testing import run_distributed

from dist_utils import world


def _qkv(B=1, T=8, Hq=4, Hkv=2, D=16, dtype=torch.float32):
    return torch.randn(B, T, Hq, D, dtype=dtype), torch.randn(B, T, Hkv, D, dtype=dtype), \
        torch.randn(B, T, Hkv, D, dtype=dtype)


def test_methods_listed():
    assert set(seqpar.METHODS) >= {"ring", "zigzag_ring", "striped_ring", "allgather_kv"}


@pytest.mark.parametrize("method", seqpar.METHODS)
def test_single_device_matches_reference(method):
    """Without torch.distributed the call is a plain (exact) attention on one device."""
    from seqpar.softmax.reference import reference_attention

    q, k, v = (t.double() for t in _qkv())
    out = seqpar.attention(q, k, v, method=method, causal=True)
    ref = reference_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


BAD = [
    ("q_4d", lambda q, k, v: (q[0], k, v, {}), "q"),
    ("kv_shape", lambda q, k, v: (q, k, v[:, :4], {}), "v"),
    ("dtype", lambda q, k, v: (q, k.double(), v, {}), "dtype"),
    ("heads", lambda q, k, v: (q[:, :, :3], k, v, {}), "Hq"),
    ("head_dim", lambda q, k, v: (q[..., :8], k, v, {}), "q"),
    ("method", lambda q, k, v: (q, k, v, {"method": "spiral"}), "method"),
    ("backend", lambda q, k, v: (q, k, v, {"backend": "warp_drive"}), "backend"),
    ("zigzag_odd", lambda q, k, v: (q[:, :7], k[:, :7], v[:, :7], {"method": "zigzag_ring"}), "multiple of 2N|odd"),
    ("scale", lambda q, k, v: (q, k, v, {"softmax_scale": -1.0}), "softmax_scale"),
    ("causal", lambda q, k, v: (q, k, v, {"causal": "yes"}), "causal"),
    ("group", lambda q, k, v: (q, k, v, {"group": "world"}), "group"),
    ("grad_comm", lambda q, k, v: (q, k, v, {"grad_comm_dtype": "int8"}), "grad_comm_dtype"),
]


@pytest.mark.parametrize("name,make,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_single_device(name, make, match):
    q, k, v, kw = make(*_qkv())
    with pytest.raises(ValueError, match=match):
        seqpar.attention(q, k, v, **kw)


def test_packed_single_device():
    """cu_seqlens on one device: per-document attention of the packed stream; bad offsets raise."""
    from seqpar.softmax.reference import reference_attention

    q, k, v = (t[:1] for t in _qkv())
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    local = [seqpar.shard(t, cu_seqlens=cu) for t in (q, k, v)]  # zigzag pads documents to even lengths
    assert local[0].shape[1] == 10
    out = seqpar.unshard(seqpar.attention(*local, causal=True, cu_seqlens=cu), cu_seqlens=cu)
    assert torch.allclose(out, reference_attention(q, k, v, causal=True, cu_seqlens=cu), atol=1e-5)
    with pytest.raises(ValueError, match="q has shape"):  # the unpadded stream is not a local shard
        seqpar.attention(q, k, v, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        seqpar.attention(*local, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32))


def _bad_on_ranks(kind):
    rank, n = world()
    q, k, v = _qkv(T=8)
    if kind == "length":
        seqpar.shard(torch.zeros(1, 10, 2, 4), method="zigzag_ring")  # 10 is not a multiple of 2N = 4
    elif kind == "heads":
        seqpar.attention(q[:, :, :3], k, v)
    elif kind == "method":
        seqpar.attention(q, k, v, method="ringg")
    elif kind == "dtype":
        seqpar.attention(q.half(), k, v)


@pytest.mark.parametrize("kind", ["length", "heads", "method", "dtype"])
def test_bad_input_raises_on_every_rank(kind):
    """Each rank raises the same ValueError before any communication: nothing hangs."""
    with pytest.raises(ValueError) as info:
        run_distributed(_bad_on_ranks, 2, kind, timeout=30)
    assert "0, 1" in str(info.value) or "[0, 1]" in str(info.value)


def _roundtrip(method, dim):
    x = torch.arange(2 * 24 * 3, dtype=torch.float32).reshape(2, 24, 3) if dim == 1 else \
        torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)
    local = seqpar.shard(x, method=method, dim=dim)
    back = seqpar.unshard(local, method=method, dim=dim)
    return bool(torch.equal(back, x)), local.shape[dim]


@pytest.mark.parametrize("method", ["ring", "zigzag_ring", "striped_ring", "allgather_kv", "zeco"])
@pytest.mark.parametrize("dim", [1, 0])
def test_shard_unshard_roundtrip(method, dim):
    for same, t_local in run_distributed(_roundtrip, 4, method, dim):
        assert same and t_local == 6


def _module_case():
    torch.manual_seed(0)
    q, k, v = _qkv(T=16)
    mod = seqpar.SequenceParallelAttention(method="striped_ring", causal=True)
    local = [seqpar.shard(t, method="striped_ring") for t in (q, k, v)]
    out = seqpar.unshard(mod(*local), method="striped_ring")
    from seqpar.softmax.reference import reference_attention

    return float((out - reference_attention(q, k, v, causal=True)).abs().max())


def test_module_wrapper():
    assert max(run_distributed(_module_case, 2)) < 1e-5


def test_bench_cli_smoke(tmp_path):
    """`seqpar bench` runs a row on 2 local ranks, checks it against one rank and writes JSON."""
    import json

    from seqpar.cli import main

    path = tmp_path / "rows.json"
    rc = main(["bench", "--seq-lens", "64", "--nproc", "2", "--methods", "zigzag_ring,ulysses", "--repeats", "1",
               "--warmup", "0", "--no-progress", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert rc == 0 and [r["method"] for r in rows] == ["zigzag_ring", "ulysses"]
    for r in rows:
        assert r["error"] == "" and r["max_error"] < 1e-5 and r["efficiency"] > 0 and r["step_ms"] > 0
        assert r["bytes_fwd"] > 0
