"""seqpar.checkpoint: the checkpoint boundary at the attention output (ALGORITHMS.md §3).

A tiny Llama-style stack (RMSNorm, q/k/v/o projections, rotary, SwiGLU MLP) runs one training
step three ways: without checkpointing, with layer-boundary checkpointing
(``torch.utils.checkpoint`` around whole layers) and with ``seqpar.checkpoint``. Layer-boundary
checkpointing runs every attention forward (and its communication) twice per step,
``seqpar.checkpoint`` once; gradients are identical in all three.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_ckpt
from dist_utils import world

import seqpar
from seqpar.softmax import executor as ring_module
from seqpar.testing import run_distributed


class Block(torch.nn.Module):
    """One pre-norm Llama layer; attention goes through seqpar on this rank's shard."""

    def __init__(self, dim, hq, hkv, method, group=None, stats=None):
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, dim // hq
        self.method, self.group, self.stats = method, group, stats
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.wq = torch.nn.Linear(dim, hq * self.d, bias=False)
        self.wk = torch.nn.Linear(dim, hkv * self.d, bias=False)
        self.wv = torch.nn.Linear(dim, hkv * self.d, bias=False)
        self.wo = torch.nn.Linear(hq * self.d, dim, bias=False)
        self.w1 = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = torch.nn.Linear(2 * dim, dim, bias=False)

    def rotary(self, x, pos):
        half = self.d // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
        ang = (pos[:, None].double() * freq[None]).to(x.dtype)  # [T, half]
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x, pos):
        B, T, _ = x.shape
        h = self.norm1(x)
        q = self.rotary(self.wq(h).view(B, T, self.hq, self.d), pos)
        k = self.rotary(self.wk(h).view(B, T, self.hkv, self.d), pos)
        v = self.wv(h).view(B, T, self.hkv, self.d)
        a = seqpar.attention(q, k, v, method=self.method, causal=True, group=self.group, stats=self.stats)
        x = x + self.wo(a.reshape(B, T, -1))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def train_step(mode, method, layers=3, B=2, T_per_rank=6, dim=32, hq=4, hkv=2):
    """One forward+backward on this rank. Returns attention-forward calls, bytes by phase, grads."""
    rank, n = world()
    torch.manual_seed(0)  # the same weights everywhere
    stats = seqpar.CommStats()
    blocks = [Block(dim, hq, hkv, method, stats=stats) for _ in range(layers)]
    T = T_per_rank * n
    x = seqpar.shard(torch.randn(B, T, dim, generator=torch.Generator().manual_seed(1)), method=method)
    pos = seqpar.shard(torch.arange(T), method=method, dim=0)
    x.requires_grad_()
    calls = []
    real_forward = ring_module.ring_forward

    def counting_forward(*args, **kwargs):
        calls.append(1)
        return real_forward(*args, **kwargs)

    ring_module.ring_forward = counting_forward  # RingAttention.forward looks it up at call time
    try:
        h = x
        for blk in blocks:
            if mode == "layer":
                h = torch_ckpt.checkpoint(blk, h, pos, use_reentrant=False)
            elif mode == "remat":
                h = seqpar.checkpoint(blk, h, pos)
            else:
                h = blk(h, pos)
        (h.square().sum() / (B * T)).backward()
    finally:
        ring_module.ring_forward = real_forward
    grads = [x.grad] + [p.grad for blk in blocks for p in blk.parameters()]
    return {"calls": len(calls), "fwd": stats.total("fwd"), "bwd": stats.total("bwd"), "grads": grads,
            "sent": stats.as_dict()}


def three_ways(method):
    # usp: Ulysses degree 2 (gcd(N, ranks per node)), ring degree 2; the pooled worker keeps its environment
    previous = os.environ.get("LOCAL_WORLD_SIZE")
    if method == "usp":
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        return {mode: train_step(mode, method) for mode in ("none", "layer", "remat")}
    finally:
        if previous is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = previous


@pytest.mark.parametrize("method,n", [("lightseq", 3), ("token_ring", 2), ("zigzag_ring", 4)])
def test_remat_runs_attention_forward_once(method, n):
    layers = 3
    for rank, res in enumerate(run_distributed(three_ways, n, method)):
        none, layer, remat = res["none"], res["layer"], res["remat"]
        assert none["calls"] == layers
        assert layer["calls"] == 2 * layers, "layer-boundary checkpointing recomputes every attention"
        assert remat["calls"] == layers, "seqpar.checkpoint must not recompute the attention forward"
        per_call = none["fwd"] // layers
        assert per_call > 0
        assert layer["fwd"] == 2 * layers * per_call and remat["fwd"] == layers * per_call
        assert layer["bwd"] == remat["bwd"] == none["bwd"]
        for i, (a, b, c) in enumerate(zip(none["grads"], layer["grads"], remat["grads"])):
            assert torch.equal(a, b) and torch.equal(a, c), f"rank {rank}: gradient {i} differs"


@pytest.mark.parametrize("method,n", [("ulysses", 2), ("usp", 4)])
def test_remat_ulysses_repeats_only_the_qkv_all_to_all(method, n):
    """Ulysses and USP replay their attention (and USP its ring) and the output's all-to-all; the
    recomputation repeats only the all-to-all of q, k, v, whose head shards their backward needs."""
    for rank, res in enumerate(run_distributed(three_ways, n, method)):
        none, layer, remat = res["none"], res["layer"], res["remat"]
        qkv = "fwd/ulysses_qkv"
        assert none["sent"][qkv] > 0 and remat["sent"][qkv] == 2 * none["sent"][qkv]
        assert {k: b for k, b in remat["sent"].items() if k != qkv} == {k: b for k, b in none["sent"].items()
                                                                       if k != qkv}
        assert layer["fwd"] == 2 * none["fwd"]  # layer-boundary checkpointing repeats everything
        for i, (a, b, c) in enumerate(zip(none["grads"], layer["grads"], remat["grads"])):
            assert torch.equal(a, b) and torch.equal(a, c), f"rank {rank}: gradient {i} differs"


def test_single_device():
    res = three_ways("zigzag_ring")
    assert [res[m]["calls"] for m in ("none", "layer", "remat")] == [3, 6, 3]
    for a, c in zip(res["none"]["grads"], res["remat"]["grads"]):
        assert torch.equal(a, c)


def test_recomputation_must_repeat_the_calls():
    """A function that calls attention differently when recomputed is refused, not silently wrong."""
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    state = {"calls": 0}

    def fn(x):
        state["calls"] += 1
        rows = x if state["calls"] == 1 else x[:, :4]  # another shape on recomputation
        return seqpar.attention(rows, rows, rows, causal=True) * 2

    y = seqpar.checkpoint(fn, q)
    with pytest.raises(RuntimeError, match="seqpar.checkpoint"):
        y.sum().backward()
