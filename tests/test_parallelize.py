"""``seqpar.integrations.parallelize``: FSDP2 over dp x cp with context-parallel attention gives the
single-device gradients.

A tiny Llama with tied embeddings (SmolLM2 style) and GQA, the same weights on every rank from one
seed. Each rank back-propagates its token-loss sum / the global label count; FSDP2 sums the
gradients over all dp x cp ranks. Compared with the unmodified model on the whole batch in one
process: the loss and every parameter gradient (gathered from the shards), fp32.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from seqpar.integrations.hf import IGNORE_INDEX, shard_inputs  # noqa: E402
from seqpar.integrations.parallelize import parallelize  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402
from model_folders import spread_weights  # noqa: E402

# The sharded model changes only the order of sums (blockwise softmax, gradient sums over ranks):
# ~1e-7 relative per operation through two layers; 2e-5 of the largest gradient leaves room, while a
# wrong divide factor (a mean instead of a sum) is off by a factor of dp x cp and a lost token by ~1e-2.
FP32_TOL = 2e-5
BF16_TOL = 5e-2
VOCAB, T, DOCS = 96, 48, (0, 20, 31, 48)


def _model(seed: int = 0, tied: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tied, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    spread_weights(model)  # larger than initializer_range: sharper logits, a sharper comparison
    return model


def _batches(dp: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (1, T), generator=g) for _ in range(dp)]


def _reference(model, batches):
    """Mean next-token loss over every label of every batch, and its gradients, in one process: the
    unmodified model runs each packed document alone (positions from 0, no attention across)."""
    from seqpar.integrations.hf import shift_labels

    model.zero_grad()
    loss_sum, count = 0.0, 0
    for ids in batches:
        labels = shift_labels(ids, torch.tensor(DOCS))
        for a, b in zip(DOCS, DOCS[1:]):
            logits = model(input_ids=ids[:, a:b], use_cache=False).logits
            loss_sum = loss_sum + F.cross_entropy(logits[0].float(), labels[0, a:b], ignore_index=IGNORE_INDEX,
                                                  reduction="sum")
        count += int((labels != IGNORE_INDEX).sum())
    total = loss_sum / count
    total.backward()
    return float(total.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _sharded_step(model, mesh, method, batches):
    """This rank's share of the loss over its dp slice, back-propagated; returns the global loss."""
    group = model.seqpar_cp_group
    dp_rank = dist.get_rank() // mesh["cp"].size()  # the meshes here put cp innermost
    shard = shard_inputs(batches[dp_rank], cu_seqlens=DOCS, group=group, method=method)
    logits = model(**shard.model_kwargs()).logits
    loss_sum = F.cross_entropy(logits[0].float(), shard.labels[0], ignore_index=IGNORE_INDEX, reduction="sum")
    stats = torch.tensor([float(loss_sum), float(shard.num_valid)], dtype=torch.float64)
    dist.all_reduce(stats)
    (loss_sum / stats[1]).backward()
    return float(stats[0] / stats[1])


def _case(shape, names, method, options=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = dist.get_world_size() // mesh["cp"].size()
    batches = _batches(dp)
    ref_loss, ref_grads = _reference(_model(), batches)
    model = parallelize(_model(), mesh, cp_method=method, **(options or {}))
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())  # fp32 masters
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    loss = _sharded_step(model, mesh, method, batches)
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32  # reduced in fp32 whatever the compute dtype
        grad, ref = p.grad.full_tensor(), ref_grads[name]
        errors[name] = float((grad - ref).abs().max() / ref.abs().max())
    local = sum(p.to_local().numel() for p in model.parameters())
    return errors, local, sum(p.numel() for p in model.parameters())


def _cases():
    results = {}
    results["dp2_cp2_zigzag"] = _case((2, 2), ("dp", "cp"), "zigzag_ring")
    results["cp4_usp_u2"] = _case((1, 4), ("dp", "cp"), "usp", {"ulysses_degree": 2})
    results["dp2_cp2_usp"] = _case((2, 2), ("dp", "cp"), "usp", {"ulysses_degree": 1})
    results["hsdp_2x1x2_ring"] = _case((2, 1, 2), ("dp_replicate", "dp_shard", "cp"), "ring")
    results["dp2_cp2_checkpointing_attention"] = _case((2, 2), ("dp", "cp"), "zigzag_ring",
                                                       {"checkpointing": "attention"})
    results["dp2_cp2_checkpointing_layer_bf16"] = _case((2, 2), ("dp", "cp"), "zigzag_ring",
                                                        {"checkpointing": "layer", "dtype": torch.bfloat16})
    return results


def test_fsdp2_gradients_equal_single_device_at_4_ranks():
    """dp 2 x cp 2 (zigzag_ring), cp 4 with USP (2 x 2 subgroups built once), dp 2 x cp 2 with USP
    (subgroups of each cp group), HSDP 2 replicas x (1 x cp 2), activation checkpointing (attention;
    layer with bf16 compute): loss and every gradient equal the single-device ones, parameters
    sharded 4 ways (2 for HSDP), fp32 master weights and gradients."""
    for rank_results in run_distributed(_cases, 4, timeout=300):
        for case, (errors, local, total) in rank_results.items():
            worst = max(errors, key=errors.get)
            # bf16 compute: 8 significant bits, ~4e-3 per rounding, through two layers and the
            # head; 5e-2 of the largest gradient still catches a missing or doubled rank (x2, x0.5)
            tol = BF16_TOL if case.endswith("bf16") else FP32_TOL
            assert errors[worst] <= tol, f"{case}: {worst} off by {errors[worst]:.2e}"
            shards = 2 if case.startswith("hsdp") else 4
            assert local <= total / shards + 64 * 4, f"{case}: {local} of {total} elements on one rank"


def _usp_conversion_builds_groups_once():
    from seqpar.integrations.hf import apply_context_parallel

    created = []
    real = dist.new_group

    def counting(*args, **kwargs):
        created.append(args)
        return real(*args, **kwargs)

    model = _model()
    dist.new_group = counting
    try:
        apply_context_parallel(model, group=None, method="usp", ulysses_degree=2)
        at_conversion = len(created)
        from seqpar import make_usp_groups

        groups = make_usp_groups(None, 2)  # the same layout for the inputs (U = 2)
        created.clear()
        ids = shard_inputs(_batches(1)[0], cu_seqlens=DOCS, group=groups, method="usp")
        model(**ids.model_kwargs()).logits.sum().backward()
        model(**ids.model_kwargs()).logits.sum().backward()
    finally:
        dist.new_group = real
    return at_conversion, len(created)


def test_usp_with_a_plain_group_builds_its_subgroups_at_conversion():
    """apply_context_parallel(method="usp") with a plain group builds the Ulysses and ring subgroups
    once (4 new groups at conversion on 4 ranks, U = 2), none in the forwards and backwards."""
    for at_conversion, during in run_distributed(_usp_conversion_builds_groups_once, 4, timeout=120):
        assert at_conversion == 4 and during == 0
