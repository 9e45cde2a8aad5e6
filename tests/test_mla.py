"""A value head dim different from the query/key head dim (MLA models: DeepSeek-V2/V3 use D = 192,
D_v = 128) through every softmax method.

- Exactness, on gloo ranks (N = 2, 3): every method, dense causal and non-causal, a sliding window
  with attention sinks, one packed case and a call inside ``seqpar.checkpoint``: output
  ``[B, T, Hq, D_v]`` and every gradient against float64 (fp32, ``dist_utils.FP32_TOL``).
- Nothing pads V: the K,V-passing methods send exactly ``(D + D_v) / (2 D)`` of the bytes of the same
  call with ``D_v = D`` (forward and backward).
- Kernels: the reference and torch's CPU op (which pads inside the call) agree with float64 at
  D 24 / D_v 12; backends that need equal head dims refuse with a reason, and dispatch lists it.
- A tiny ``DeepseekV3ForCausalLM`` (D 24 = 16 + 8 rotary, D_v 12) converted with
  ``apply_context_parallel`` matches the single-process model: logits, loss, every gradient; and its
  ``generate()`` with a ``ShardedCache`` (unpadded and left-padded, both prefills, both combines, a
  second turn) the single-process ``generate()``'s tokens and scores.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from dist_utils import FP32_TOL, world
from model_folders import spread_weights
from test_window import _err, _reference  # the float64 reference per document, with windows and sinks

import seqpar
from seqpar.comm.usp_groups import make_usp_groups
from seqpar.kernels import Band, block_backward, block_forward, select_backend
from seqpar.methods import DECLARED
from seqpar.testing import run_distributed

METHODS = tuple(m.name for m in DECLARED if m.softmax)
D, DV = 24, 12
KV_PASSING = ("ring", "zigzag_ring", "striped_ring", "allgather_kv")


def _one(method, kw, causal, window, lens, sinks_on, ckpt, dv, seed):
    """One call on this rank: (errors against float64, forward bytes, backward bytes)."""
    n = world()[1]
    hq, hkv = (6, 3) if n == 3 else (4, 2)
    gen = torch.Generator().manual_seed(seed)
    extra, B, cu, T = {}, 2, None, 12 * n
    if lens is not None:
        cu, B = [0, *torch.tensor(lens).cumsum(0).tolist()], 1
        T, extra = cu[-1], {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    glob = [torch.randn(B, T, h, d, generator=gen) for h, d in ((hq, D), (hkv, D), (hkv, dv), (hq, dv))]
    local = [seqpar.shard(t, method=method, **kw, **extra) for t in glob]
    ql, kl, vl = (t.requires_grad_() for t in local[:3])
    sinks = (torch.randn(hq, generator=gen) * 2).requires_grad_() if sinks_on else None
    stats = seqpar.CommStats()

    def attend(q, k, v):
        return seqpar.attention(q, k, v, method=method, causal=causal, window=window, stats=stats, sinks=sinks,
                                **kw, **extra)

    out = seqpar.checkpoint(attend, ql, kl, vl) if ckpt else attend(ql, kl, vl)
    assert out.shape == (*ql.shape[:3], dv), out.shape
    out.backward(local[3])
    got = [seqpar.unshard(t, method=method, **kw, **extra) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    if sinks is not None:  # each rank holds its share of ds
        ds = sinks.grad.clone()
        dist.all_reduce(ds)
        got.append(ds)
    errs = [_err(a, b) for a, b in zip(got, _reference(glob, causal, window, cu, sinks))]
    return errs, stats.total("fwd"), stats.total("bwd")


# (causal, window, packed lengths, sinks, inside seqpar.checkpoint)
CASES = [(True, None, None, False, False), (False, None, None, False, True), (True, 5, None, True, False),
         (True, None, [5, 13, 2, 16], False, False)]


def _all_methods(methods):
    n = world()[1]
    out = {}
    for method in methods:
        kw = {"group": make_usp_groups(None, 2 if n % 2 == 0 else n), "ring_method": "zigzag_ring"} \
            if method == "usp" else {}
        runs = []
        for i, case in enumerate(CASES):
            lens = case[2]
            if lens is not None and n == 3:
                lens = [5, 13, 2, 16, 3, 9]
            runs.append(_one(method, kw, case[0], case[1], lens, case[3], case[4], DV, 100 + i))
        if method in KV_PASSING:  # the same dense call with D_v = D: bytes of K,V rows scale with D + D_v
            runs.append(_one(method, kw, True, None, None, False, False, D, 100))
        out[method] = runs
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_every_method_exact_with_a_value_head_dim(n):
    """fp32 forward and every gradient against float64 with D 24, D_v 12: every method, dense causal
    and not (inside seqpar.checkpoint), a window with sinks, packed documents; K,V bytes exact."""
    res = run_distributed(_all_methods, n, METHODS, timeout=600)
    for rank, per in enumerate(res):
        for method, runs in per.items():
            for case, (errs, _, _) in zip(CASES, runs):
                assert max(errs) <= FP32_TOL, f"{method} N={n} rank {rank} {case}: errors {errs}"
            if method in KV_PASSING:
                (_, fwd, bwd), (_, fwd_eq, bwd_eq) = runs[0], runs[-1]
                ratio = (D + DV) / (2 * D)  # V rows carry D_v, nothing padded
                assert fwd == pytest.approx(fwd_eq * ratio), (method, fwd, fwd_eq)
                assert bwd == pytest.approx(bwd_eq * ratio), (method, bwd, bwd_eq)


@pytest.mark.parametrize("mask", ["none", "causal", "causal_strict", Band(-5, 0)])
def test_kernels_with_a_value_head_dim(mask):
    """The reference and torch's CPU op (zero-padded inside the call) against float64, GQA 4/2."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, t, h, d, generator=gen, dtype=torch.float64) for t, h, d in
               ((12, 4, D), (10, 2, D), (10, 2, DV)))
    out, lse = block_forward(q, k, v, scale=0.3, mask=mask, backend="reference")
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    assert out.shape == (1, 12, 4, DV)
    grads = block_backward(dout, q, k, v, out, lse, scale=0.3, mask=mask, backend="reference")
    # float64 reference through autograd of plain torch
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qa, ka.repeat_interleave(2, dim=2)) * 0.3
    band = Band(-10**9, 0) if mask == "causal" else Band(-10**9, -1) if mask == "causal_strict" else \
        Band(-10**9, 10**9) if mask == "none" else mask
    seen = torch.tensor([[band.sees(i, j) for j in range(10)] for i in range(12)])
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, va.repeat_interleave(2, dim=2))
    ref.backward(dout)
    assert (out - ref).abs().max() < 1e-12
    for g, r in zip(grads, (qa.grad, ka.grad, va.grad)):
        assert (g - r).abs().max() < 1e-12
    o32, l32 = block_forward(q.float(), k.float(), v.float(), scale=0.3, mask=mask, backend="torch_cpu")
    g32 = block_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse.float(), scale=0.3,
                         mask=mask, backend="torch_cpu")
    assert _err(o32, out) <= FP32_TOL  # fp32 rounding of a few dozen-term sums
    for g, r in zip(g32, grads):
        assert g.shape == r.shape and _err(g, r) <= FP32_TOL


def test_backends_needing_equal_head_dims_refuse():
    """A backend without ``caps.value_dim`` refuses D_v != D with a reason (here the reference with
    that capability taken away); the Triton kernel, flash-attn 2 and torch's CUDA ops lack it."""
    import dataclasses

    from seqpar.kernels.dispatch import BACKENDS
    from seqpar.kernels.reference import ReferenceBackend
    q, k, v = torch.randn(1, 8, 4, D), torch.randn(1, 8, 2, D), torch.randn(1, 8, 2, DV)
    equal_only = ReferenceBackend()
    equal_only.caps = dataclasses.replace(equal_only.caps, value_dim=False)
    assert equal_only.refusal(q, k, v, "causal", False, True) == \
        "value head dim 12 != query/key head dim 24 (MLA): this kernel needs equal head dims"
    assert equal_only.refusal(q, k, k, "causal", False, True) is None
    names = {b.name for b in BACKENDS if not b.caps.value_dim}
    assert {"triton", "flash_attn", "torch_cuda"} <= names, names
    assert {b.name for b in BACKENDS if b.caps.value_dim} >= {"reference", "torch_cpu"}
    assert select_backend(q, k, v, mask="causal").name == "torch_cpu"


# ----------------------------------------------------------------------------- a DeepSeek-V3 model


def _deepseek(seed):
    from test_hf import VOCAB
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                              q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=DV, first_k_dense_replace=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    spread_weights(model)  # larger weights than initializer_range: a sharper comparison (as test_hf)
    return model


@pytest.mark.parametrize("method", ["zigzag_ring", "ulysses"])
def test_deepseek_v3_matches_single_process(method):
    """A tiny DeepseekV3ForCausalLM (q 24 = 16 + 8 rotary, v 12), N = 2: logits, loss and every
    parameter gradient as the single-process model (bounds of test_hf)."""
    from test_hf import _check, _cp_matches_single
    _check(run_distributed(_cp_matches_single, 2, _deepseek, method, 2, 24, 13, timeout=300), 24)


def _deepseek_generate(padded, prefill, combine):
    """Greedy generate() on a batch of 3 (left-padded or not) with a ShardedCache, then a second turn on
    the same cache (a prefill over the cached prefix): whether the tokens equal the single-process
    model's and the largest relative score difference (test_generate's measure)."""
    from test_generate import _relative

    from seqpar.integrations.hf import ShardedCache, apply_context_parallel

    ref, model = _deepseek(0).eval(), _deepseek(0).eval()
    apply_context_parallel(model, method="zigzag_ring")
    ids = torch.randint(4, 60, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4], mask[1, :2] = 0, 0
    kw = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    cache = ShardedCache(prefill=prefill, decode_combine=combine)
    r1 = ref.generate(input_ids=ids, attention_mask=mask, **kw)
    o1 = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **kw)
    more = torch.cat([r1.sequences, torch.full((3, 3), 9)], 1)
    mask2 = torch.cat([mask, mask.new_ones(3, more.shape[1] - ids.shape[1])], 1)
    r2 = ref.generate(input_ids=more, attention_mask=mask2, cache=r1.cache, **kw)
    o2 = model.generate(input_ids=more, attention_mask=mask2, cache=cache, **kw)
    same = torch.equal(o1.sequences, r1.sequences) and torch.equal(o2.sequences, r2.sequences)
    return same, _relative(o1.scores + o2.scores, r1.scores + r2.scores)


@pytest.mark.parametrize("padded, prefill, combine", [(False, "pass_kv", "allgather"), (True, "pass_q", "tree")],
                         ids=["unpadded", "left_padded"])
def test_deepseek_v3_generate_matches_single_process(padded, prefill, combine):
    """generate() of the DeepSeek-V3 model with a ShardedCache at N = 2 (the cache's partial outputs
    and their combines carry V's head dim, 12, not q's, 24): the same tokens as the single-process
    model and every step's scores within test_generate's 1e-4 (fp32 reordering only: measured ~8e-7;
    accumulators of q's head dim raised before)."""
    from test_generate import REL_TOL

    for same, rel in run_distributed(_deepseek_generate, 2, padded, prefill, combine, timeout=300):
        assert same and rel <= REL_TOL, (same, rel)
