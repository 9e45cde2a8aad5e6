"""RoPE that depends on the sequence length under context parallelism (seqpar.integrations.hf.rope).

transformers' "dynamic" RoPE (NTK scaling grown with the sequence, here a Llama) and "longrope"
(Phi-3's short / long factors) pick their frequencies from ``max(position_ids) + 1`` of each forward.
Unconverted, each rank would pick them from its own shard: measured before the fix, the logits of a
48-token sequence at N = 2 were 25% (zigzag_ring) to 67% (ring) off the single process, every
gradient too, with no error. The models here have ``max_position_embeddings`` (dynamic) or
``original_max_position_embeddings`` (longrope) of 16, below the sequences, so the length-dependent
branch is taken. Each case has a rank whose own positions would choose other frequencies than the
whole sequence's: dynamic scaling grows with the largest position (every shard's differs), and
longrope switches at 16 (ring at N = 3 over 48 tokens: rank 0's positions end at 15, short factors,
where the whole sequence takes the long ones). Every case fails without the fix.

Gemma-3 (one rotary module, a RoPE per layer type) with dynamic RoPE on its sliding layers only; packed
documents against transformers' packed forward of the whole input (the frequencies of the longest document).

Compared as in tests/test_hf.py (its `_cp_matches_single`: logits, loss and every summed gradient
against the float64 model, bound max(2e-5, 3x the fp32 single process's error)), and generate() on a
ShardedCache against single-process generate() as in tests/test_generate.py (tokens equal, logits
within 1e-4 relative: the run only reorders fp32 sums).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from model_folders import spread_weights  # noqa: E402
from test_generate import REL_TOL, _relative  # noqa: E402
from test_hf import _check, _cp_matches_single  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Phi3Config,  # noqa: E402
                          Phi3ForCausalLM)

from seqpar.integrations.hf import (IGNORE_INDEX, ShardedCache, apply_context_parallel,  # noqa: E402
                                    context_parallel_loss, shard_inputs, shift_labels)
from seqpar.integrations.hf.rope import length_dependent_layers  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, eos_token_id=2, bos_token_id=1)
HEAD_DIM = 16


def _dynamic(seed: int):
    return _sharpened(LlamaForCausalLM(LlamaConfig(**COMMON, max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})), seed)


def _longrope(seed: int):
    factors = dict(short_factor=[1.0] * (HEAD_DIM // 2), long_factor=[1.0 + i for i in range(HEAD_DIM // 2)])
    return _sharpened(Phi3ForCausalLM(Phi3Config(**COMMON, max_position_embeddings=64, original_max_position_embeddings=16,
                                                 rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16, **factors})), seed)


def _gemma3_dynamic(seed: int):
    # one rotary module with a RoPE per layer type (its rope_type a dict): dynamic on the sliding layers,
    # the default on the full ones (a window of 64 covers the sequence: the RoPE alone is under test)
    return _sharpened(Gemma3ForCausalLM(Gemma3TextConfig(
        **COMMON, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, max_position_embeddings=16, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})), seed)


def _static(seed: int):
    return _sharpened(LlamaForCausalLM(LlamaConfig(**COMMON, max_position_embeddings=16)), seed)


def _sharpened(model, seed: int):
    torch.manual_seed(seed)
    spread_weights(model)  # larger weights than the init's 0.02: sharper logits, a sharper comparison
    return model


MODELS = {"dynamic": _dynamic, "longrope": _longrope, "gemma3_dynamic": _gemma3_dynamic}


@pytest.mark.parametrize("kind, n, method", [("dynamic", 2, "zigzag_ring"), ("longrope", 3, "ring"),
                                             ("gemma3_dynamic", 2, "zigzag_ring"),
                                             pytest.param("dynamic", 3, "striped_ring", marks=pytest.mark.slow)])
def test_length_dependent_rope_matches_single_process(kind, n, method):
    T = 48
    _check(run_distributed(_cp_matches_single, n, MODELS[kind], method, 1, T, 7 + n, timeout=180), T)


def test_length_dependent_rope_usp_matches_single_process():
    T = 48  # usp 2 x 2: the largest position is reduced over both axes
    _check(run_distributed(_usp_case, 4, timeout=180), T)


def _usp_case():
    from test_hf import _compare, _references

    from seqpar import make_usp_groups
    from seqpar.integrations.hf import context_parallel_loss, shard_inputs

    ref = _dynamic(5)
    groups = make_usp_groups(None, 2)  # built once, for the model and the inputs' layout alike
    model = apply_context_parallel(copy.deepcopy(ref), group=groups, method="usp")
    ids = torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(5))
    refs = _references(ref, ids)
    batch = shard_inputs(ids, group=groups, method="usp")
    logits = model(**batch.model_kwargs()).logits
    loss = context_parallel_loss(logits, batch.labels)
    loss.backward()
    return _compare(refs, model, logits, loss, batch), batch.token_index.tolist()


def _packed_case(lengths: list[int], method: str):
    """Packed documents against transformers' own packed forward of the whole input (position ids restarting
    at each document, no mask: the documents attend apart), whose dynamic RoPE takes its frequencies from the
    longest document (``max(position_ids) + 1``), not each document's own length."""
    from test_hf import _compare

    ref = _dynamic(4)
    model = apply_context_parallel(copy.deepcopy(ref), method=method)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, 96, (1, T), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    refs = []
    for one in (ref, copy.deepcopy(ref).double()):
        logits = one(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, 96), shift_labels(ids, cu).reshape(-1), ignore_index=IGNORE_INDEX)
        loss.backward()
        refs.append((one, logits, loss))
    batch = shard_inputs(ids, cu_seqlens=cu, method=method)
    logits = model(**batch.model_kwargs()).logits
    loss = context_parallel_loss(logits, batch.labels)
    loss.backward()
    return _compare(refs, model, logits, loss, batch), batch.token_index.tolist()


def test_length_dependent_rope_packed_documents_match_single_process():
    # the 30-token document is longer than max_position_embeddings (16): the rank that holds only its first
    # positions would scale by its own; a document of length 1; 47 tokens, not divisible by 2
    lengths = [30, 1, 10, 6]
    _check(run_distributed(_packed_case, 2, lengths, "ring", timeout=180), sum(lengths))


def _generate(kind: str, method: str, length: int):
    ref = MODELS[kind](3)
    model = apply_context_parallel(copy.deepcopy(ref), method=method)
    prompt = torch.randint(4, 96, (1, length), generator=torch.Generator().manual_seed(3))
    kw = dict(do_sample=False, max_new_tokens=5, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    r = ref.generate(prompt, **kw)
    o = model.generate(prompt, cache=ShardedCache(), **kw)
    return torch.equal(r.sequences, o.sequences), _relative(o.logits, r.logits)


# longrope: ring at N = 2 over 30 tokens puts positions 0-14 on rank 0 (short factors alone) and 15-29
# on rank 1 (long), where the whole prompt takes the long ones
@pytest.mark.parametrize("kind, method, length", [("longrope", "ring", 30), pytest.param(
    "dynamic", "zigzag_ring", 37, marks=pytest.mark.slow)])
def test_length_dependent_rope_generate_matches_single_process(kind, method, length):
    for equal, rel in run_distributed(_generate, 2, kind, method, length, timeout=180):
        assert equal and rel <= REL_TOL, (kind, equal, rel)


def test_only_length_dependent_rope_is_changed():
    """A static RoPE keeps its module untouched (no hook, the class's forward); a length-dependent one
    gets the hook on the decoder model and a forward without the update."""
    static = apply_context_parallel(_static(0))
    assert length_dependent_layers(static.model.rotary_emb) == []
    assert "forward" not in vars(static.model.rotary_emb) and not static._seqpar_rope_hooks
    dynamic = apply_context_parallel(_dynamic(0))
    assert length_dependent_layers(dynamic.model.rotary_emb) == [None]
    assert "forward" in vars(dynamic.model.rotary_emb) and len(dynamic._seqpar_rope_hooks) == 1
    apply_context_parallel(dynamic)  # converting again replaces the hook rather than adding one
    assert len(dynamic._seqpar_rope_hooks) == 1
