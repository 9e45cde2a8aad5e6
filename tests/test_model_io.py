"""Model folders in and out: load_folder's validation, load_sharded_weights into FSDP2 shards on 1, 2
and 4 gloo ranks against transformers' own from_pretrained, and export_hf back to a folder that
from_pretrained loads with the original names, shapes and ties.

Loading and exporting copy values (with a cast only when dtypes differ, not here), so every
comparison is exact: torch.equal, no tolerance.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from model_folders import llama_folder, windowed_folder  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from seqpar.integrations.train.model_io import (build_meta_model, export_hf, load_folder,  # noqa: E402
                                                load_sharded_weights)
from seqpar.testing import run_distributed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(path))
    out = dict(model.state_dict())
    out.update({f"buffer:{k}": b for k, b in model.named_buffers()})
    return out


def _assert_same(model, ref: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert set(state) == {k for k in ref if not k.startswith("buffer:")}
    for name, value in state.items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(full, ref[name]), name
    for name, buf in model.named_buffers():  # RoPE inv_freq: recomputed, not read from the file
        assert torch.equal(buf, ref[f"buffer:{name}"]), name


# ---------------------------------------------------------------- validation

def test_load_folder_reads_config_tokenizer_and_weights(tmp_path):
    folder = load_folder(llama_folder(tmp_path / "m", sharded=True))
    assert folder.config.model_type == "llama" and folder.config.tie_word_embeddings
    assert len(folder.tokenizer) == folder.config.vocab_size
    assert "lm_head.weight" not in folder.weights and len(set(folder.weights.values())) > 1
    bare = load_folder(llama_folder(tmp_path / "bare", tokenizer=False))
    assert bare.tokenizer is None


def test_load_folder_refuses_bad_folders(tmp_path):
    path = llama_folder(tmp_path / "m")
    with pytest.raises(ValueError, match="--model: .* is not a folder"):
        load_folder(tmp_path / "absent")
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(ValueError, match="--model: .* has no config.json"):
        load_folder(tmp_path / "noconfig")
    os.remove(path / "model.safetensors")
    with pytest.raises(ValueError, match=r"--model: .* has no weights \(model.safetensors"):
        load_folder(path)
    small = llama_folder(tmp_path / "small", vocab_size=100)  # the tokenizer has 320 tokens
    with pytest.raises(ValueError, match="--model: the tokenizer .* 320 tokens .* 100 rows"):
        load_folder(small)
    sharded = llama_folder(tmp_path / "sharded", sharded=True)
    os.remove(sharded / "model-00002-of-00006.safetensors")
    with pytest.raises(ValueError, match="--model: .*index.json names shard files that are not there"):
        load_folder(sharded)


def test_pickled_weights_need_opt_in(tmp_path):
    path = llama_folder(tmp_path / "m")
    ref = _reference(path)
    torch.save({k: v for k, v in ref.items() if not k.startswith("buffer:") and k != "lm_head.weight"},
               path / "pytorch_model.bin")
    os.remove(path / "model.safetensors")
    with pytest.raises(ValueError, match="--model: .*pickled checkpoint .*--trust-pickle"):
        load_folder(path)
    folder = load_folder(path, trust_pickle=True)
    assert folder.pickled
    model = build_meta_model(folder.config)
    load_sharded_weights(model, folder)
    _assert_same(model, ref)


def test_sharded_pickles_with_an_index(tmp_path):
    path = llama_folder(tmp_path / "m", tied=False)
    ref = _reference(path)
    names = [k for k in ref if not k.startswith("buffer:")]
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, part in halves.items():
        torch.save({k: ref[k] for k in part}, path / file)
    index = {"weight_map": {k: f for f, part in halves.items() for k in part}}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    os.remove(path / "model.safetensors")
    with pytest.raises(ValueError, match="--model: .*pickled checkpoint"):
        load_folder(path)
    model = build_meta_model(load_folder(path, trust_pickle=True).config)
    load_sharded_weights(model, load_folder(path, trust_pickle=True))
    _assert_same(model, ref)


def test_mismatched_config_is_refused(tmp_path):
    path = llama_folder(tmp_path / "m")
    folder = load_folder(path)
    other = load_folder(llama_folder(tmp_path / "wide", hidden=48))
    with pytest.raises(ValueError, match="--model: .* has shape .* expects"):
        load_sharded_weights(build_meta_model(other.config), folder)


# ---------------------------------------------------------------- one process, no FSDP

@pytest.mark.parametrize("kind", ["tied", "untied_sharded", "windowed"])
def test_meta_model_loads_like_from_pretrained(tmp_path, kind):
    path = (windowed_folder(tmp_path / "m") if kind == "windowed"
            else llama_folder(tmp_path / "m", tied=kind == "tied", sharded="sharded" in kind))
    folder = load_folder(path)
    model = build_meta_model(folder.config)
    assert all(p.is_meta for p in model.parameters())
    assert load_sharded_weights(model, folder) == []
    _assert_same(model, _reference(path))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (kind == "tied")
    out = tmp_path / "export"
    export_hf(model, out, config=folder.config, tokenizer=folder.tokenizer, max_shard_size="20KB")
    _assert_same(AutoModelForCausalLM.from_pretrained(str(out)), _reference(path))


def test_gpt_oss_converted_on_meta_is_verified_once_filled(tmp_path):
    """gpt-oss' grouped-matmul experts have no meta kernel for fp32, so apply_context_parallel's 2-token
    dispatch check cannot run on the meta model (``seqpar train --model`` builds it there): the check
    is deferred, the attention raises until :func:`verify_context_parallel` ran on the filled model,
    and the verified model's logits equal from_pretrained's (one rank: the same sums)."""
    from seqpar.integrations.hf import apply_context_parallel, verify_context_parallel

    path = windowed_folder(tmp_path / "m")
    folder = load_folder(path)
    model = apply_context_parallel(build_meta_model(folder.config), method="zigzag_ring")
    load_sharded_weights(model, folder)
    ids = torch.randint(0, folder.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="verify_context_parallel"):
        model(input_ids=ids, use_cache=False)
    verify_context_parallel(model)
    verify_context_parallel(model)  # done once: a no-op now
    ref = AutoModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids, use_cache=False).logits, ref(input_ids=ids).logits,
                              rtol=1e-5, atol=1e-6)  # fp32: blockwise softmax vs sdpa's, same inputs


def test_bf16_checkpoint_into_fp32_master_weights(tmp_path):
    path = llama_folder(tmp_path / "m", dtype=torch.bfloat16)
    folder = load_folder(path)
    model = build_meta_model(folder.config)
    load_sharded_weights(model, folder)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref.state_dict()[name]), name  # bf16 -> fp32 is exact


# ---------------------------------------------------------------- FSDP2 on gloo ranks

def _fsdp_load_and_export(path: str, out: str | None, extra: str | None = None, extra_mesh_shape=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    folder = load_folder(path)
    model = build_meta_model(folder.config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    load_sharded_weights(model, folder)
    ref = _reference(path)
    _assert_same(model, ref)
    embed = model.model.embed_tokens.weight
    assert isinstance(embed, DTensor) and embed.to_local().shape[0] == -(-embed.shape[0] // world)
    tied = model.lm_head.weight is embed
    if out is not None:
        export_hf(model, out, config=folder.config, tokenizer=folder.tokenizer)
    if extra is not None:  # gpt-oss: 2 experts over 4 ranks leave 2 ranks with empty expert shards
        extra_mesh = (init_device_mesh("cpu", extra_mesh_shape, mesh_dim_names=("replicate", "shard"))
                      if extra_mesh_shape else mesh)
        other = build_meta_model(load_folder(extra).config)
        for layer in other.model.layers:
            fully_shard(layer, mesh=extra_mesh)
        fully_shard(other, mesh=extra_mesh)
        load_sharded_weights(other, extra)
        experts = other.model.layers[0].mlp.experts.down_proj
        assert experts.to_local().shape[0] == (0 if dist.get_rank() >= experts.shape[0] else 1) or extra_mesh_shape
        _assert_same(other, _reference(extra))
    return tied


@pytest.mark.parametrize("world,tied,sharded", [(1, False, True), pytest.param(2, True, False, marks=pytest.mark.slow),
                                                 (4, True, True)])
def test_fsdp_shards_load_and_export(tmp_path, world, tied, sharded):
    """A sharded model's parameters equal from_pretrained's; its export loads back the same."""
    path = llama_folder(tmp_path / "m", tied=tied, sharded=sharded)
    out = tmp_path / "export" if world != 2 else None
    extra = str(windowed_folder(tmp_path / "w")) if world == 4 else None
    assert run_distributed(_fsdp_load_and_export, world, str(path), out and str(out), extra,
                           timeout=240) == [tied] * world
    if out is None:
        return
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    _assert_same(exported, _reference(path))
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) == tied
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export.tmp")]


def test_export_failing_midway_leaves_nothing(tmp_path, monkeypatch):
    """The second safetensors shard fails to write (disk full): RuntimeError naming --export-hf, and
    neither the export folder nor its temporary folder is left behind."""
    import safetensors.torch

    path = llama_folder(tmp_path / "m")
    folder = load_folder(path)
    model = build_meta_model(folder.config)
    load_sharded_weights(model, folder)
    real, calls = safetensors.torch.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(RuntimeError, match="--export-hf: writing .*out failed: OSError: .*No space left"):
        export_hf(model, tmp_path / "out", config=folder.config, max_shard_size="20KB")
    assert len(calls) >= 2 and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def _export_into(out: str):
    model = build_meta_model(load_folder(out + "/../m").config)
    export_hf(model, out, config=model.config)


def test_export_refuses_non_empty_folder_on_every_rank(tmp_path):
    llama_folder(tmp_path / "m")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="--export-hf: .* exists and is not an empty folder"):
        run_distributed(_export_into, 2, str(tmp_path / "out"), timeout=120)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


@pytest.mark.slow
def test_hsdp_shards_load(tmp_path):
    """HSDP (fully_shard over a 2-D mesh: replicate 2 x shard 2): each replica holds the same rows."""
    path = llama_folder(tmp_path / "m", tied=False)
    run_distributed(_fsdp_load_and_export, 4, str(path), None, str(windowed_folder(tmp_path / "w")), (2, 2),
                    timeout=240)


class _FailingTokenizer:
    def save_pretrained(self, directory):
        raise OSError("disk full (simulated)")


def _export_failing(path: str, out: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    folder = load_folder(path)
    model = build_meta_model(folder.config)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    load_sharded_weights(model, folder)
    export_hf(model, out, config=folder.config, tokenizer=_FailingTokenizer())


def test_failed_export_is_raised_everywhere_and_leaves_nothing(tmp_path):
    path = llama_folder(tmp_path / "m")
    with pytest.raises(RuntimeError, match="--export-hf: writing .* failed: OSError: disk full"):
        run_distributed(_export_failing, 2, str(path), str(tmp_path / "out"), timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no out, no temporary folder
