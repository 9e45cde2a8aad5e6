"""The chunked loss (seqpar.integrations.loss): equal to the unchunked cross entropy and its gradients
for every chunk size (not dividing N, chunks whose tokens are all ignored), with bias and softcap,
through a transformers model (plain, Gemma-2's softcap, and FSDP2-sharded on 2 gloo ranks by
seqpar's parallelize with a tied lm_head), and its peak memory falls with the chunk size.

Tolerances: the chunked and unchunked fp32 computations differ only in the order of the sums over
tokens (the loss, the weight gradient), each rounding at ~6e-8 relative per addition: 1e-6 relative
to the largest magnitude (the issue's bound) holds with room for N=50. Against float64 the fp32 error
is that of the logits themselves (d=24 products: ~1e-6), so 1e-5. Through a whole model the
gradients pass two decoder layers of fp32 arithmetic: 1e-5.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.integrations.loss import causal_lm_loss, chunked_cross_entropy, default_chunk_size
from seqpar.testing import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

N, V, D = 50, 97, 24


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _inputs(dtype, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, D, generator=g) * 2).to(dtype).requires_grad_()
    weight = torch.randn(V, D, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_() if with_bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.3] = -100
    labels[8:24] = -100  # whole chunks of 8 and of 16 without a label
    return hidden, weight, bias, labels


def _reference(hidden, weight, bias, labels, softcap):
    z = F.linear(hidden, weight, bias).float() if hidden.dtype != torch.float64 else F.linear(hidden, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, labels, reduction="sum", ignore_index=-100)


def _grads(loss_fn, hidden, weight, bias):
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    for x in leaves:
        x.grad = None
    loss = loss_fn()
    (loss * 1.75).backward()  # a non-unit incoming gradient
    return loss.detach(), [x.grad.clone() for x in leaves]


@pytest.mark.parametrize("chunk_size", [1, 7, 8, 16, 64, None])
@pytest.mark.parametrize("with_bias,softcap", [(False, None), (True, 3.0)])
def test_chunked_equals_unchunked(chunk_size, with_bias, softcap):
    h, w, b, y = _inputs(torch.float32, with_bias)
    got, got_g = _grads(lambda: chunked_cross_entropy(h, w, y, chunk_size=chunk_size, bias=b, softcap=softcap,
                                                      backend="torch"), h, w, b)
    ref, ref_g = _grads(lambda: _reference(h, w, b, y, softcap), h, w, b)
    assert got.dtype == torch.float32 and _rel(got, ref) < 1e-6
    for a, r in zip(got_g, ref_g):
        assert _rel(a, r) < 1e-6
    h64, w64, b64 = (x.detach().double().requires_grad_() if x is not None else None for x in (h, w, b))
    exact, exact_g = _grads(lambda: _reference(h64, w64, b64, y, softcap), h64, w64, b64)
    assert _rel(got, exact) < 1e-5 and all(_rel(a, e) < 1e-5 for a, e in zip(got_g, exact_g))
    same64, same64_g = _grads(lambda: chunked_cross_entropy(h64, w64, y, chunk_size=chunk_size, bias=b64,
                                                            softcap=softcap), h64, w64, b64)
    assert _rel(same64, exact) < 1e-12 and all(_rel(a, e) < 1e-12 for a, e in zip(same64_g, exact_g))
    with torch.no_grad():  # the forward-only path gives the same loss
        assert _rel(chunked_cross_entropy(h, w, y, chunk_size=chunk_size, bias=b, softcap=softcap), ref) < 1e-6


def test_bf16_matches_the_models_own_recipe():
    h, w, _, y = _inputs(torch.bfloat16, False)
    got, got_g = _grads(lambda: chunked_cross_entropy(h, w, y, chunk_size=16), h, w, None)
    ref, ref_g = _grads(lambda: _reference(h, w, None, y, None), h, w, None)
    # Same bf16 logits, fp32 softmax; the gradients are rounded to bf16 (2^-8 relative) once per
    # product in both, summed in fp32 here and in bf16 matmul accumulators there: 2e-2.
    assert _rel(got, ref) < 1e-6 and all(_rel(a, r) < 2e-2 for a, r in zip(got_g, ref_g))
    assert got_g[0].dtype == torch.bfloat16 and got_g[1].dtype == torch.bfloat16


def test_every_label_ignored_gives_zero():
    h, w, _, y = _inputs(torch.float32, False)
    loss, (gh, gw) = _grads(lambda: chunked_cross_entropy(h, w, torch.full_like(y, -100), chunk_size=8), h, w, None)
    assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_bad_arguments_are_refused():
    h, w, _, y = _inputs(torch.float32, False)
    with pytest.raises(ValueError, match="hidden: expected"):
        chunked_cross_entropy(h[None], w, y)
    with pytest.raises(ValueError, match="labels: expected"):
        chunked_cross_entropy(h, w, y[:-1])
    with pytest.raises(ValueError, match="chunk_size: expected a positive int"):
        chunked_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="backend='liger'"):  # not installed here, or not CUDA
        chunked_cross_entropy(h, w, y, backend="liger")
    assert default_chunk_size(128256) == 523 and default_chunk_size(10**12) == 1


def test_liger_dispatch(monkeypatch):
    """Which backend runs (liger itself needs CUDA: its numbers are not checked here). A stand-in
    for liger-kernel's loss class records how it is called: (weight, hidden, labels, bias), sum."""
    import types

    import seqpar.integrations.loss as loss_mod

    calls = []

    class FakeLiger:
        def __init__(self, **kwargs):
            calls.append(kwargs)

        def __call__(self, weight, hidden, labels, bias):
            calls.append((weight.shape, hidden.shape, labels.shape, bias))
            return types.SimpleNamespace(loss=torch.tensor(1.5, dtype=torch.bfloat16))

    module = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    module.LigerFusedLinearCrossEntropyLoss = FakeLiger
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    h, w, _, y = _inputs(torch.float32, False)
    chunked_cross_entropy(h, w, y)  # auto on CPU tensors: the torch path
    assert calls == []
    with pytest.raises(ValueError, match="backend='liger' runs on CUDA tensors only"):
        chunked_cross_entropy(h, w, y, backend="liger")
    monkeypatch.setattr(loss_mod, "_liger", lambda backend, hidden: FakeLiger)  # as on a CUDA tensor
    out = chunked_cross_entropy(h, w, y, softcap=2.0)
    assert out.dtype == torch.float32 and out.item() == 1.5
    assert calls == [{"ignore_index": -100, "reduction": "sum", "softcap": 2.0},
                     ((V, D), (N, D), (N,), None)]


# ---------------------------------------------------------------- through a transformers model

def _model(kind: str, seed: int = 0):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    if kind == "gemma2":
        return Gemma2ForCausalLM(Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0,
                                              attn_logit_softcapping=None, sliding_window=16))
    return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))


def _model_reference(model, ids, labels):
    logits = model(ids).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_causal_lm_loss_equals_the_models_logits(kind):
    pytest.importorskip("transformers")
    model = _model(kind)
    ids = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    ref = _model_reference(model, ids, labels)
    ref.backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = causal_lm_loss(model, ids, labels, chunk_size=5)
    got.backward()
    assert _rel(got, ref) < 1e-6
    for n, p in model.named_parameters():
        assert _rel(p.grad, ref_g[n]) < 1e-5, n


def _fsdp_loss(path: str, chunk_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    from seqpar.integrations.parallelize import parallelize
    from seqpar.integrations.train.model_io import build_meta_model, load_folder, load_sharded_weights

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "cp"))
    folder = load_folder(path)
    model = parallelize(build_meta_model(folder.config), mesh)
    load_sharded_weights(model, folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, sharded once
    ids = torch.randint(0, folder.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(rank))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    loss = causal_lm_loss(model, ids, labels, chunk_size=chunk_size)
    loss.backward()
    return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_causal_lm_loss_under_fsdp(tmp_path):
    pytest.importorskip("transformers")
    from model_folders import llama_folder
    from transformers import AutoModelForCausalLM

    path = llama_folder(tmp_path / "m", tied=True)
    results = run_distributed(_fsdp_loss, 2, str(path), 6, timeout=240)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    total = 0
    for rank, (loss, _) in enumerate(results):  # the same batches in one process
        ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(rank))
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
        ref = _model_reference(model, ids, labels)
        total = total + ref
        assert _rel(loss, ref) < 1e-6
    total.backward()  # parallelize sums the ranks' gradients (divide factor 1)
    for rank_grads in (results[0][1], results[1][1]):
        for n, p in model.named_parameters():
            assert _rel(rank_grads[n], p.grad) < 1e-5, n


def _cp_loss(path: str, chunk_size: int, cu: list[int]):
    from torch.distributed.device_mesh import init_device_mesh

    from seqpar.integrations.hf import shard_inputs
    from seqpar.integrations.parallelize import parallelize
    from seqpar.integrations.train.model_io import build_meta_model, load_folder, load_sharded_weights

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "cp"))
    folder = load_folder(path)
    model = parallelize(build_meta_model(folder.config), mesh, cp_method="zigzag_ring")
    load_sharded_weights(model, folder)
    ids = torch.randint(0, folder.config.vocab_size, (1, cu[-1]), generator=torch.Generator().manual_seed(5))
    shard = shard_inputs(ids, cu_seqlens=cu, group=model.seqpar_cp_group, method="zigzag_ring")
    loss = causal_lm_loss(model, labels=shard.labels, chunk_size=chunk_size, **shard.model_kwargs())
    loss.backward()
    return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_causal_lm_loss_context_parallel_packed(tmp_path):
    """cp=2 (zigzag_ring) over two packed documents: the ranks' losses sum to the documents' loss and
    the summed gradients are the single-process ones (the kwargs reach the decoder unchanged)."""
    pytest.importorskip("transformers")
    from model_folders import llama_folder
    from transformers import AutoModelForCausalLM

    path = llama_folder(tmp_path / "m", tied=False)
    cu = [0, 11, 28]
    results = run_distributed(_cp_loss, 2, str(path), 4, cu, timeout=240)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    ids = torch.randint(0, model.config.vocab_size, (1, cu[-1]), generator=torch.Generator().manual_seed(5))
    ref = sum(_model_reference(model, ids[:, a:b], torch.cat([ids[:, a + 1:b], torch.full((1, 1), -100)], 1))
              for a, b in zip(cu, cu[1:]))
    ref.backward()
    assert _rel(results[0][0] + results[1][0], ref) < 1e-6
    for n, p in model.named_parameters():
        assert _rel(results[0][1][n], p.grad) < 1e-5, n


# ---------------------------------------------------------------- memory

def _peak(chunk_size, n=1024, v=2048, d=32):
    from seqpar.bench.memory import PeakMemory

    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=g)
    with PeakMemory("cpu") as m:
        if chunk_size is None:
            loss = F.cross_entropy(h @ w.t(), y, reduction="sum")
        else:
            loss = chunked_cross_entropy(h, w, y, chunk_size=chunk_size)
        loss.backward()
    return m.peak


def test_peak_memory_falls_with_the_chunk_size():
    unchunked = _peak(None)
    peaks = [_peak(c) for c in (1024, 256, 64)]
    logits = 1024 * 2048 * 4
    # Unchunked: the logits and their softmax gradient (at least 2 x [N, V] fp32). Chunked: one
    # chunk's logits and softmax (2 x [C, V]) over the gradients of hidden and weight.
    assert unchunked >= 2 * logits
    assert peaks[0] > peaks[1] > peaks[2] and peaks[2] < logits / 4
