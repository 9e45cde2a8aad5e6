"""``seqpar train --model DIR``: a real-format model folder (tiny Llama, tied embeddings, GQA, a real
BPE tokenizer, saved with ``save_pretrained``; built by tests/model_folders.py, no downloads), its
weights read into FSDP2 shards, trained on tokenized documents.

The same 3 fp32 steps on one process (no sharding), on cp 2 x dp 2 and on cp 3 give the same losses
and gradient norms; at 4 ranks each rank stores about a quarter of the parameters and optimizer
state; checkpoints resume at another cp degree and world size; the exports of one rank and of
cp 2 x dp 2 load in transformers with the original names and shapes, and agree.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from model_folders import llama_folder, text_documents  # noqa: E402

from seqpar.integrations.train import train  # noqa: E402

# Every configuration computes the same sums in another order (blockwise softmax, gradient sums over
# ranks in FSDP2's reduce-scatter, sharded norm): fp32 rounding, ~1e-7 relative per operation, and
# AdamW's 1/sqrt(v) amplifies it on later steps to ~1e-6 here. 2e-5 (the bound) still
# catches a lost label, a wrong mask or position (~1e-3), or a gradient scaled by dp or cp (x2, x3).
RTOL = 2e-5
# Shards of dim 0 over 4 ranks: ceil(rows / 4) rows each, so a rank stores at most ~1/4 of each
# parameter (and of AdamW's two moments) plus the rounding of small rows; the bound.
SHARE = 1.15 / 4
MIB = 2**20


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A model big enough that 1 MiB of slack is small against a quarter of it (3.4M parameters,
    13 MiB fp32), and 40 documents as text files."""
    tmp = tmp_path_factory.mktemp("fsdp")
    model = llama_folder(tmp / "model", tied=True, hidden=384, intermediate=1024, heads=4, kv_heads=2)
    data = tmp / "data"
    data.mkdir()
    for i, doc in enumerate(text_documents(40)):
        (data / f"doc{i:03d}.txt").write_text(doc)
    return tmp, model, data


def _args(folders, name, *extra):
    tmp, model, data = folders
    return ["--model", str(model), "--data", str(data), "--seq-len", "64", "--batch-size", "2", "--steps", "3",
            "--lr", "1e-3", "--no-progress", "--log-every", "1000", "--json", str(tmp / f"{name}.jsonl"),
            *map(str, extra)]


def _records(folders, name):
    lines = [json.loads(line) for line in (folders[0] / f"{name}.jsonl").read_text().splitlines()]
    return lines[0], [r for r in lines if "step" in r], lines[-1]


def _close(a: dict, b: dict, what: str):
    for step in b:
        assert abs(a[step] - b[step]) <= RTOL * abs(b[step]), f"{what} step {step}: {a[step]!r} vs {b[step]!r}"


@pytest.fixture(scope="module")
def runs(folders):
    tmp = folders[0]
    one = train(_args(folders, "one", "--export-hf", tmp / "export_one"))
    four = train(_args(folders, "four", "--nproc", 4, "--context-parallel", 2, "--save", tmp / "ckpt",
                       "--save-every", 2, "--export-hf", tmp / "export_four"))
    return one, four


def _norms(result):
    return {r["step"]: r["grad_norm"] for r in result.history}


def test_cp2_dp2_equals_one_rank(folders, runs):
    one, four = runs
    assert sorted(one.losses) == [1, 2, 3]
    _close(four.losses, one.losses, "loss")
    _close(_norms(four), _norms(one), "grad_norm")


def test_cp3_equals_one_rank(folders, runs):
    one, _ = runs
    three = train(_args(folders, "three", "--nproc", 3, "--context-parallel", 3))
    _close(three.losses, one.losses, "loss")
    _close(_norms(three), _norms(one), "grad_norm")


def test_four_ranks_store_a_quarter(folders, runs):
    start1, steps1, end1 = _records(folders, "one")
    start4, steps4, end4 = _records(folders, "four")
    params = start1["params"]
    assert start4["params"] == params and 3_000_000 < params < 4_000_000
    assert all(isinstance(r[k], int) for r, k in [(start4, "param_bytes_local"), (end4, "optim_bytes_local")])
    full = params * 4  # fp32
    assert start1["param_bytes_local"] == full and end1["optim_bytes_local"] >= 2 * full  # one process: all
    assert start4["param_bytes_local"] <= SHARE * full + MIB, start4["param_bytes_local"] / full
    assert end4["optim_bytes_local"] <= SHARE * 2 * full + MIB, end4["optim_bytes_local"] / (2 * full)
    for rec in steps1 + steps4:
        assert {"step", "loss", "grad_norm", "tokens_per_s", "peak_mem_mib", "mfu"} <= set(rec)
        assert rec["mfu"] is None  # CPU: no peak FLOP/s known
        assert rec["model_flops"] > 6 * params * rec["tokens"]  # plus attention


def _resume(folders, runs, name, *extra):
    """The cp 2 x dp 2 run's step-2 checkpoint resumed with ``extra``: the uninterrupted step-3 loss."""
    _, four = runs
    res = train(_args(folders, name, "--resume", folders[0] / "ckpt" / "step_00000002", *extra))
    assert res.start_step == 2 and sorted(res.losses) == [1, 2, 3]
    _close({3: res.losses[3]}, {3: four.losses[3]}, name)
    _close({3: res.history[-1]["grad_norm"]}, {3: four.history[-1]["grad_norm"]}, name)


def test_resume_sharded_checkpoint_in_one_process(folders, runs):
    """4 ranks (cp 2 x dp 2, FSDP2 shards) -> one unsharded process."""
    _resume(folders, runs, "resume1")


@pytest.mark.slow
def test_resume_sharded_checkpoint_at_cp3(folders, runs):
    """4 ranks (cp 2 x dp 2) -> 3 ranks (cp 3): other shards, another cp degree."""
    _resume(folders, runs, "resume3", "--nproc", 3, "--context-parallel", 3)


def test_usp_with_hsdp_trains_like_one_rank(folders, runs):
    """--cp-method usp on cp 2 x dp 2 (its Ulysses and ring subgroups built once per cp group), with
    --replicas 2 (HSDP: parameters sharded over the 2 ranks of a cp group, replicated across the 2
    dp groups, gradients all-reduced across them): the one-process losses and gradient norms; each
    rank stores half of the parameters."""
    one, _ = runs
    usp = train(_args(folders, "usp", "--nproc", 4, "--context-parallel", 2, "--cp-method", "usp",
                      "--replicas", 2))
    _close(usp.losses, one.losses, "loss")
    _close(_norms(usp), _norms(one), "grad_norm")
    start, _, _ = _records(folders, "usp")
    assert start["param_bytes_local"] <= 1.15 / 2 * start["params"] * 4 + MIB


def test_exports_load_in_transformers_and_agree(folders, runs):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    tmp, model_dir, _ = folders
    original = AutoModelForCausalLM.from_pretrained(str(model_dir))
    one = AutoModelForCausalLM.from_pretrained(str(tmp / "export_one"))
    four = AutoModelForCausalLM.from_pretrained(str(tmp / "export_four"))
    shapes = {n: tuple(p.shape) for n, p in original.state_dict().items()}
    assert {n: tuple(p.shape) for n, p in four.state_dict().items()} == shapes
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f, \
            safe_open(str(tmp / "export_four" / "model.safetensors"), "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())  # the original's tensor names (tied: no lm_head)
    assert four.lm_head.weight is four.model.embed_tokens.weight
    p1, p4, p0 = one.state_dict(), four.state_dict(), original.state_dict()
    # 3 AdamW steps move weights by up to 3e-3 (lr 1e-3 each). The runs' gradients differ by fp32
    # rounding, which Adam's g / sqrt(v) amplifies where a gradient is near 0 (measured: 1.02e-5 at
    # one of 73728 elements); 1e-4 still catches a shard gathered in the wrong place (the weights
    # themselves are ~2e-2) or a missing update (~1e-3).
    for name in p0:
        assert not torch.equal(p1[name], p0[name]) or p0[name].dim() == 1  # trained
        torch.testing.assert_close(p4[name], p1[name], rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert (tmp / "export_four" / "tokenizer.json").is_file()


def test_gpt_oss_folder_trains(folders, tmp_path):
    """A gpt-oss folder (MoE experts without a meta kernel in fp32, sinks, sliding windows): the model is
    built on meta, so apply_context_parallel's dispatch check runs once its weights are filled."""
    from model_folders import windowed_folder

    oss = windowed_folder(tmp_path / "oss")
    res = train(_args(folders, "oss", "--model", oss, "--steps", "1"))
    assert sorted(res.losses) == [1] and 0 < res.losses[1] < 10


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_fail_before_any_rank_starts(folders, tmp_path):
    """Each raises ValueError naming the flag from the parent process, before the 4 ranks are spawned."""
    from seqpar.integrations.train import main

    _, model, _ = folders
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((model / "config.json").read_text())
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    big_vocab = llama_folder(tmp_path / "small_embedding", vocab_size=100)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    base = _args(folders, "bad", "--nproc", 4, "--context-parallel", 2)
    cases = [
        (["--context-parallel", "3"], r"--context-parallel 3 does not divide the 4 ranks"),
        (["--export-hf", tmp_path / "full"], r"--export-hf: .*full exists and is not an empty folder"),
        (["--model", no_weights], r"--model: .*no_weights has no weights"),
        (["--model", no_config], r"--model: .*no_config has no config.json"),
        (["--model", big_vocab], r"--model: the tokenizer in .* has \d+ tokens but the model's embedding has 100"),
        (["--data", empty], r"--data: no non-empty documents"),
        (["--replicas", "3"], r"--replicas 3: must be a positive divisor of the 2 data-parallel groups"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            train(base + list(map(str, extra)))
    assert main(base + ["--data", str(empty)]) == 2  # the command: one line, exit status 2


# ----------------------------------------------------------------------------- --adaptive on FSDP2


def _adaptive_with_an_empty_group():
    """A plan whose groups hold 2, 0 and 0 sequences on 4 ranks, run by the trainer's AdaptiveRunner on
    a model sharded over all 4 ranks; returns the loss and relative gradient errors against one process."""
    import contextlib

    import torch.distributed as dist
    from test_parallelize import DOCS, T, _batches, _model, _reference
    from torch.distributed.device_mesh import init_device_mesh

    from seqpar.integrations.parallelize import parallelize
    from seqpar.integrations.train.adaptive import AdaptiveRunner
    from seqpar.integrations.train.build import Runtime
    from seqpar.schedulers.plan import GroupPlan, Plan

    rank = dist.get_rank()
    batches = _batches(2)
    ref_loss, ref_grads = _reference(_model(), batches)
    runner = AdaptiveRunner(4, rank)
    model = _model()
    runner.register(model)
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "cp"))
    runner.model = parallelize(model, mesh)
    plan = Plan(4, (GroupPlan(0, 2, "zigzag_ring", (0, 1)), GroupPlan(2, 1, "ring", ()),
                    GroupPlan(3, 1, "zigzag_ring", ())), 0.0)
    rt = Runtime(4, rank, 4, rank, mesh, None, torch.device("cpu"))
    loss, _ = runner.step(plan, [T, T], lambda i: (batches[i][0], list(DOCS)), rt,
                          autocast=contextlib.nullcontext())
    errors = {"loss": abs(loss - ref_loss) / ref_loss}
    for name, p in model.named_parameters():
        ref = ref_grads[name]
        errors[name] = float((p.grad.full_tensor() - ref).abs().max() / ref.abs().max())
    return errors


def test_adaptive_group_without_sequences_keeps_fsdp_in_step():
    """Ranks 2 and 3 hold no sequence this step: each runs one zero-weight 2-token pass, so every rank
    enters the same FSDP2 all-gathers and reduce-scatters (no hang), and the gradients are the
    one-process gradients of the 2 sequences (fp32 rounding, see test_parallelize)."""
    from seqpar.testing import run_distributed

    for errors in run_distributed(_adaptive_with_an_empty_group, 4, timeout=300):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RTOL, f"{worst}: {errors[worst]:.2e}"
