"""Hugging Face integration: a context-parallel transformers model equals the unmodified one.

Tiny Llama and Qwen2 models with GQA (4 query heads, 2 KV heads), built from configs (no download),
and the models whose attention uses per-layer options: Mistral (a sliding window on every layer),
Qwen2 with use_sliding_window (global layers below max_window_layers), Gemma-3 and Gemma-2 (local
and global layers alternating; Gemma-2's softcapping refused, or off), gpt-oss (sinks on every
layer, 128-token windows on alternating layers: a window of WINDOW tokens here).
Every rank builds the same model from the same seed; the reference is the unmodified model run on
the whole sequence in one process. Compared: logits of every local token, the loss, and every
parameter gradient (summed over the context-parallel ranks), in fp32.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,  # noqa: E402
                          GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from seqpar.integrations.hf import (IGNORE_INDEX, apply_context_parallel, context_parallel_loss,  # noqa: E402
                                    packed_position_ids, shard_inputs, shift_labels)
import seqpar  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402
from model_folders import spread_weights  # noqa: E402

# Both fp32 models are compared with the same model in float64. The context-parallel model only
# changes the order of the softmax sums (blockwise with a running max) and of the gradient sums over
# ranks, which round at ~1e-7 relative per operation: through two layers and the LM head that stays
# below ~1e-6 of the largest magnitude, and 2e-5 leaves room, while a wrong mask, a lost label or a
# wrong position gives errors of order 1e-2 or more. A gradient whose terms cancel (gpt-oss's router
# bias: each token's routing softmax gradient sums to 0) is further from float64 in the
# single-process fp32 model too (up to 2.0e-5 measured): there the bound is a multiple of that
# model's own error, never below 2e-5. The two fp32 models are two summation orders, i.e. two draws
# of the same rounding noise: measured up to 2.1x apart (router bias, N=4, striped_ring), so 3x.
FP32_TOL = 2e-5
NOISE_FACTOR = 3
VOCAB = 96
WINDOW = 5  # smaller than the sequences and than most documents, larger than a zigzag chunk at N=4
ALTERNATING = ["sliding_attention", "full_attention"]



def _build(kind: str, seed: int):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = MODELS[kind](common)
    # initializer_range 0.02 makes near-uniform logits; larger weights make the comparison sharper
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # gpt-oss's experts are [E, in, out]
                p.normal_(0, 0.2)
            elif name.endswith("sinks"):  # gpt-oss's sink logits, of the order of the scores
                p.normal_(0, 1.0)
    return model


MODELS = {
    "llama": lambda c: LlamaForCausalLM(LlamaConfig(**c)),
    "qwen2": lambda c: Qwen2ForCausalLM(Qwen2Config(**c)),  # biases on q, k, v
    "mistral": lambda c: MistralForCausalLM(MistralConfig(**c, head_dim=16, sliding_window=WINDOW)),
    # layer 0 global (below max_window_layers), layer 1 windowed
    "qwen2_window": lambda c: Qwen2ForCausalLM(Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW,
                                                           max_window_layers=1)),
    "gemma3": lambda c: Gemma3ForCausalLM(Gemma3TextConfig(**c, head_dim=16, query_pre_attn_scalar=16,
                                                           sliding_window=WINDOW, layer_types=ALTERNATING)),
    "gemma2": lambda c: Gemma2ForCausalLM(Gemma2Config(**c, head_dim=16, query_pre_attn_scalar=16,
                                                       sliding_window=WINDOW, attn_logit_softcapping=None)),
    "gemma2_softcap": lambda c: Gemma2ForCausalLM(Gemma2Config(**c, head_dim=16, sliding_window=WINDOW)),
    "gpt_oss": lambda c: _gpt_oss(c, sliding_window=WINDOW, layer_types=ALTERNATING),
    "gpt_oss_global": lambda c: _gpt_oss(c, layer_types=["full_attention"] * 2),  # sinks alone
}


def _gpt_oss(common, **kw):
    # YaRN's defaults expect 4096 x 32 positions (a smaller maximum only makes transformers warn)
    config = GptOssConfig(**{**common, "max_position_embeddings": 131072}, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, **kw)
    return GptOssForCausalLM(config)


def _rel(a: torch.Tensor, r: torch.Tensor) -> float:
    a, r = a.detach(), r.detach()
    return float((a.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30))


def _references(ref, ids, cu=None):
    """The unmodified fp32 model ``ref`` and its float64 copy on the whole batch (with ``cu``: every
    document on its own), after backward: ``[(model, logits, loss), (model64, logits, loss)]``."""
    ref64 = copy.deepcopy(ref).double()
    ref64.config._experts_implementation = "eager"  # gpt-oss: torch's grouped_mm has no float64
    bounds = [(0, ids.shape[1])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    targets = shift_labels(ids, cu)
    out = []
    for model in (ref, ref64):
        logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in bounds], dim=1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE_INDEX)
        loss.backward()
        out.append((model, logits, loss))
    return out


def _compare(refs, model, logits, loss, batch):
    """``(error, bound)`` of logits, loss and every summed gradient: the error against the float64
    model, the bound max(FP32_TOL, NOISE_FACTOR x the fp32 single-process model's error)."""
    (ref, ref_logits, ref_loss), (ref64, logits64, loss64) = refs
    valid = batch.token_index >= 0
    rows = batch.token_index[valid]

    def pair(got, fp32, f64):
        return _rel(got, f64), max(FP32_TOL, NOISE_FACTOR * _rel(fp32, f64))

    errs = {"logits": pair(logits[:, valid], ref_logits[:, rows], logits64[:, rows]),
            "loss": pair(loss.reshape(1), ref_loss.reshape(1), loss64.reshape(1))}
    for (name, p), p_ref, p64 in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
        grad = p.grad.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(grad)  # each rank holds its share of the gradient
        errs[name] = pair(grad, p_ref.grad, p64.grad)
    return errs


def _cp_matches_single(kind, method, B, T, seed):
    """``kind``: a model family of :func:`_build`, or a function ``seed -> model`` (e.g. test_mla's)."""
    ref = kind(seed) if callable(kind) else _build(kind, seed)
    model = apply_context_parallel(copy.deepcopy(ref), method=method)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    refs = _references(ref, ids)

    batch = shard_inputs(ids, method=method)
    logits = model(**batch.model_kwargs()).logits
    loss = context_parallel_loss(logits, batch.labels)
    loss.backward()
    return _compare(refs, model, logits, loss, batch), batch.token_index.tolist()


def _check(results, T):
    owned = sorted(i for _, index in results for i in index if i >= 0)
    assert owned == list(range(T)), "the ranks' shards must hold every token exactly once"
    for rank, (errs, _) in enumerate(results):
        for name, (err, bound) in errs.items():
            assert err <= bound, f"rank {rank} {name}: relative error {err:.2e} > {bound:.1e}"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", ["zigzag_ring", "ring", "striped_ring"])
def test_llama_gqa_matches_single_process(n, method):
    T = 24  # 12 / 6 tokens per rank: zigzag chunks of 6 / 3
    _check(run_distributed(_cp_matches_single, n, "llama", method, 2, T, 11 * n, timeout=180), T)


def test_qwen2_matches_single_process():
    _check(run_distributed(_cp_matches_single, 2, "qwen2", "zigzag_ring", 1, 20, 5, timeout=180), 20)


def _packed_matches_per_document(kind, method, lengths, seed):
    ref = _build(kind, seed)
    model = apply_context_parallel(copy.deepcopy(ref), method=method)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(seed))
    refs = _references(ref, ids, cu)  # every document on its own through the unmodified model

    batch = shard_inputs(ids, cu_seqlens=cu, method=method)
    logits = model(**batch.model_kwargs()).logits
    loss = context_parallel_loss(logits, batch.labels)
    loss.backward()
    return _compare(refs, model, logits, loss, batch), batch.token_index.tolist()


@pytest.mark.parametrize("n,method", [(2, "zigzag_ring"), (4, "zigzag_ring"), (4, "ring"), (4, "striped_ring")])
def test_packed_documents_match_per_document_forward(n, method):
    lengths = [5, 1, 11, 7, 2]  # a document of length 1; none divisible by N or 2N
    _check(run_distributed(_packed_matches_per_document, n, "llama", method, lengths, 3, timeout=180), sum(lengths))


# ----------------------------------------------------------------------------- single process


class _PackedStandIn:
    """Single-device stand-in for seqpar's packed path, to check this integration's plumbing now:
    ``shard`` appends 3 zero tokens of padding (as the library may), ``attention`` is the
    per-document reference on the real tokens and zeros on the padding."""

    def __init__(self, real_shard):
        self.real_shard, self.calls = real_shard, 0

    def shard(self, x, *, group=None, method="zigzag_ring", dim=1, cu_seqlens=None):
        if cu_seqlens is None:
            return self.real_shard(x, group=group, method=method, dim=dim)
        return torch.cat([x, torch.zeros_like(x.narrow(dim, 0, 3))], dim)

    def unshard(self, x, *, group=None, method="zigzag_ring", dim=1, cu_seqlens=None):
        return x.narrow(dim, 0, x.shape[dim] - 3)

    def attention(self, q, k, v, *, causal, softmax_scale=None, cu_seqlens=None, **kwargs):
        from seqpar.softmax.reference import reference_attention

        assert cu_seqlens is not None and cu_seqlens.dtype == torch.int32, "cu_seqlens must reach attention"
        self.calls += 1
        T = int(cu_seqlens[-1])
        out = reference_attention(q[:, :T], k[:, :T], v[:, :T], causal=causal, softmax_scale=softmax_scale,
                                  cu_seqlens=cu_seqlens)
        return torch.cat([out, torch.zeros_like(q[:, T:])], dim=1)


def test_packed_plumbing_with_a_single_device_stand_in(monkeypatch):
    """cu_seqlens reaches every attention call, padding is skipped, positions restart per document:
    the model equals the unmodified one run on each document separately."""
    import seqpar.integrations.hf.convert as convert
    import seqpar.integrations.hf.inputs as inputs

    stand_in = _PackedStandIn(inputs.shard)
    monkeypatch.setattr(inputs, "shard", stand_in.shard)
    monkeypatch.setattr(convert, "attention", stand_in.attention)
    errs, index = _packed_matches_per_document("llama", "zigzag_ring", [5, 1, 11, 7, 2], 3)
    assert index[-3:] == [-1, -1, -1] and sorted(index[:-3]) == list(range(26))
    assert stand_in.calls == 2  # one per decoder layer
    for name, (err, bound) in errs.items():
        assert err <= bound, f"{name}: relative error {err:.2e} > {bound:.1e}"



def test_labels_are_shifted_before_sharding_and_stop_at_documents():
    ids = torch.arange(10, 20)[None]
    cu = torch.tensor([0, 4, 5, 10], dtype=torch.int32)
    assert shift_labels(ids).tolist() == [[*range(11, 20), IGNORE_INDEX]]
    assert shift_labels(ids, cu).tolist() == [[11, 12, 13, -100, -100, 16, 17, 18, 19, -100]]
    assert packed_position_ids(cu, 10).tolist() == [[0, 1, 2, 3, 0, 0, 1, 2, 3, 4]]
    batch = shard_inputs(ids)  # a single device holds everything
    assert batch.labels.tolist() == shift_labels(ids).tolist()
    assert batch.position_ids.tolist() == [list(range(10))]
    assert "cu_seqlens" not in batch.model_kwargs() and batch.model_kwargs()["use_cache"] is False


def test_user_labels_keep_their_ignored_positions():
    ids = torch.arange(8)[None]
    labels = ids.clone()
    labels[0, 3] = IGNORE_INDEX  # e.g. a prompt token
    assert shard_inputs(ids, labels=labels).labels.tolist() == [[1, 2, -100, 4, 5, 6, 7, -100]]


def test_single_device_model_matches_reference():
    ref = _build("llama", 1)
    model = apply_context_parallel(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 10))
    got = model(**shard_inputs(ids).model_kwargs()).logits
    assert _rel(got, ref(input_ids=ids).logits) <= FP32_TOL
    assert model.config._attn_implementation.startswith("seqpar")
    assert ref.config._attn_implementation != model.config._attn_implementation


# ----------------------------------------------------------------------------- bad input


class _OwnAttention(torch.nn.Module):
    """A custom attention that does its own math instead of calling the AttentionInterface."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, hidden_states, **kwargs):
        return self.proj(hidden_states), None


def test_custom_attention_module_is_named():
    model = _build("llama", 0)
    model.model.layers[1].self_attn = _OwnAttention()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn \(_OwnAttention\).*AttentionInterface"):
        apply_context_parallel(model)
    assert not model.config._attn_implementation.startswith("seqpar")  # left as it was


def test_bad_arguments():
    model = _build("llama", 0)
    with pytest.raises(ValueError, match="method='nope' is not a known method"):
        apply_context_parallel(model, method="nope")
    with pytest.raises(ValueError, match="options: unknown backnd"):
        apply_context_parallel(model, backnd="reference")
    with pytest.raises(ValueError, match="options: unknown sinks.* sets .*sinks"):  # per layer, from s_aux
        apply_context_parallel(model, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="group: expected None"):
        apply_context_parallel(model, group="world")
    with pytest.raises(ValueError, match="not a transformers PreTrainedModel|expected a transformers"):
        apply_context_parallel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="cu_seqlens: must start at 0"):
        shard_inputs(torch.zeros(1, 6, dtype=torch.long), cu_seqlens=[0, 3, 3, 6])
    with pytest.raises(ValueError, match="one stream"):
        shard_inputs(torch.zeros(2, 6, dtype=torch.long), cu_seqlens=[0, 6])
    model = apply_context_parallel(model)
    with pytest.raises(ValueError, match="attention_mask: .*cu_seqlens"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4, 4)[None])


def _shard_odd_length(T):
    return shard_inputs(torch.zeros(1, T, dtype=torch.long), method="zigzag_ring")


def test_length_not_fitting_the_layout_says_how_to_pad():
    with pytest.raises(ValueError, match=r"multiple of 4 \(2N\)\. Pad the sequence to 8 tokens"):
        run_distributed(_shard_odd_length, 2, 6, timeout=120)


# ----------------------------------------------------------------------------- per-layer options
# Each layer's sliding_window / s_aux reaches seqpar.attention as window= / sinks=. The CI runs every
# model at N = 2, 3, 4, dense and packed; SEQPAR_SLOW=1 adds gpt-oss (windows and sinks) with every
# other method at N = 4.

_WINDOWED = ("mistral", "qwen2_window", "gemma3", "gemma2", "gpt_oss")


def _layer_case(kind, n, packed, method="zigzag_ring"):
    return pytest.param(kind, n, packed, method, id=f"{kind}-N{n}-{'packed' if packed else 'dense'}-{method}")


def _run_layer_case(kind, n, packed, method):
    if packed:
        lengths = [5, 1, 11, 7, 2]  # a document of length 1; two longer than the window
        _check(run_distributed(_packed_matches_per_document, n, kind, method, lengths, 3, timeout=300), sum(lengths))
    else:
        _check(run_distributed(_cp_matches_single, n, kind, method, 2, 24, 7 * n, timeout=300), 24)


# every model at N = 2, 3, 4, dense and packed (36 cases, ~30 s on 2 cores), and gpt-oss's sinks through
# ulysses with 4 heads on 3 ranks (2 + 1 + 1)
CI_LAYER_CASES = [_layer_case(kind, n, packed) for kind in (*_WINDOWED, "gpt_oss_global") for n in (2, 3, 4)
                  for packed in (False, True)] + [_layer_case("gpt_oss_global", 3, False, "ulysses")]


@pytest.mark.parametrize("kind,n,packed,method", CI_LAYER_CASES)
def test_per_layer_window_and_sinks_match_single_process(kind, n, packed, method):
    _run_layer_case(kind, n, packed, method)


SLOW_LAYER_CASES = [_layer_case("gpt_oss", 4, packed, method) for method in seqpar.METHODS if method != "zigzag_ring"
                    for packed in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,n,packed,method", SLOW_LAYER_CASES)
def test_per_layer_options_full_matrix(kind, n, packed, method):
    _run_layer_case(kind, n, packed, method)


def test_softcapping_is_refused_when_applied():
    """Gemma-2's attention-logit softcapping changes the kernel: refused by apply_context_parallel,
    naming the layer and the config attribute, and the model is left as it was."""
    model = _build("gemma2_softcap", 0)
    with pytest.raises(ValueError, match=r"softcap: model\.layers\.0\.self_attn \(Gemma2Attention\) .*"
                                         r"attn_logit_softcapping.*\(2 of 2 attention layers alike\)"):
        apply_context_parallel(model)
    assert not model.config._attn_implementation.startswith("seqpar")


def _llama4(seed, chunk=None, temperature=False):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, intermediate_size_mlp=96,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=1, floor_scale=4, attention_chunk_size=chunk,
                              max_position_embeddings=256, pad_token_id=0, attn_temperature_tuning=temperature)
    torch.manual_seed(seed)
    model = Llama4ForCausalLM(config)
    model.config._experts_implementation = "eager"  # float64 reference: torch's grouped_mm has no float64
    spread_weights(model)
    return model


def test_llama4_chunked_attention_and_temperature_tuning_are_refused():
    """Llama-4's chunked layers (a token sees its own chunk of attention_chunk_size) and its query
    temperature on layers without RoPE (from the positions of the tokens a layer holds: a shard's under
    context parallelism) read the sequence's layout: measured before the refusal, logits 1.2-1.3
    (chunks of 8 in 48 tokens) and 1.3e-2 (temperature) relative off the single process at N = 2,
    with no error. Refused, naming the config attribute; the model is left as it was."""
    for model, what in ((_llama4(0, chunk=8), r"chunked attention \(attention_chunk_size=8"),
                        (_llama4(0, temperature=True), r"model\.layers\.3\.self_attn scales its queries.*"
                                                       r"attn_temperature_tuning=False")):
        with pytest.raises(ValueError, match=what):
            apply_context_parallel(model)
        assert not model.config._attn_implementation.startswith("seqpar")


def test_llama4_without_them_matches_single_process():
    """With full attention on every layer and no temperature tuning (the RoPE and NoPE layers, MoE,
    qk norm as Llama-4 has them), the converted model equals the single process."""
    T = 48
    _check(run_distributed(_cp_matches_single, 2, _llama4, "zigzag_ring", 1, T, 3, timeout=180), T)
