"""``seqpar train``: the same losses at every context-parallel degree (FSDP2 over all ranks), resumable
across degrees, atomic checkpoints, clear errors.

A tiny Llama with GQA (2 layers, 4 query / 2 KV heads) on the default data (the Python standard
library's sources), 128 tokens per step, run through the trainer's Python entry (``train(argv)``);
``--nproc N`` spawns a fresh pool of N gloo ranks for each run (as a user's command does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from seqpar.integrations.train import ckpt as trainer_ckpt  # noqa: E402
from seqpar.integrations.train import main, train  # noqa: E402
from seqpar.integrations.train.config import load_model_config  # noqa: E402

TINY = {"model_type": "llama", "vocab_size": 259, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}
# Losses of the same step at different CP degrees differ only by fp32 rounding of reordered sums
# (blockwise softmax, gradient all-reduce); after 5 AdamW steps that is ~1e-7 relative here. 2e-5
# leaves room for other summation orders; a wrong label, mask or position would change the loss by
# more than 1e-3.
LOSS_RTOL = 2e-5


def _args(tmp, *extra, steps=5, config=None):
    path = tmp / "model.json"
    path.write_text(json.dumps(config or TINY))
    return ["--model-config", str(path), "--seq-len", "128", "--steps", str(steps), "--no-progress",
            "--log-every", "1000", *map(str, extra)]


def _close(a: dict, b: dict, steps) -> None:
    for s in steps:
        assert abs(a[s] - b[s]) <= LOSS_RTOL * abs(b[s]), f"step {s}: loss {a[s]!r} vs {b[s]!r}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted run at CP=1 (one process) and one at CP=4 (4 ranks) saving at steps 3 and 5."""
    tmp = tmp_path_factory.mktemp("train")
    cp1 = train(_args(tmp, "--context-parallel", 1))
    cp4 = train(_args(tmp, "--nproc", 4, "--context-parallel", 4, "--save", tmp / "ckpt", "--save-every", 3,
                      "--json", tmp / "log.jsonl", "--loss-chunk", 7))  # chunks of 7 of 32 local tokens
    return tmp, cp1, cp4


def test_cp1_and_cp4_losses_match(runs):
    _, cp1, cp4 = runs
    assert sorted(cp1.losses) == sorted(cp4.losses) == [1, 2, 3, 4, 5]
    assert cp1.packed and cp4.packed  # documents keep their boundaries
    _close(cp4.losses, cp1.losses, range(1, 6))
    assert cp1.losses[5] < cp1.losses[1]


def test_json_log_and_checkpoints(runs):
    tmp, _, cp4 = runs
    lines = [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert {"loss", "tokens_per_s", "peak_mem_mib", "lr"} <= set(steps[0])
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "end"
    names = sorted(p.name for p in (tmp / "ckpt").iterdir())
    assert names == ["step_00000003", "step_00000005"]  # no temporary directory left behind
    assert all(trainer_ckpt.is_complete(tmp / "ckpt" / n) for n in names)
    assert cp4.checkpoint == str(tmp / "ckpt" / "step_00000005")


def test_resume_with_another_cp_degree_skips_partial_checkpoints(runs):
    """Saved at step 3 with CP=4, resumed with CP=2: steps 4-5 match the uninterrupted CP=4 run. The
    folder also holds what a crash while saving leaves (a temporary dir, a step dir without the
    COMPLETE marker): ``--resume`` must pass over both."""
    tmp, _, cp4 = runs
    save = tmp / "resume"
    shutil.copytree(tmp / "ckpt" / "step_00000003", save / "step_00000003")
    partial = save / "step_00000004"
    shutil.copytree(tmp / "ckpt" / "step_00000005", partial)
    (partial / trainer_ckpt.COMPLETE).unlink()
    shutil.copytree(tmp / "ckpt" / "step_00000005", save / ".tmp-step_00000005")
    assert trainer_ckpt.latest_checkpoint(save) == save / "step_00000003"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        trainer_ckpt.resolve_resume(str(partial), None)

    cp2 = train(_args(tmp, "--nproc", 2, "--context-parallel", 2, "--save", save, "--resume"))
    assert cp2.start_step == 3
    _close(cp2.losses, cp4.losses, [4, 5])
    assert [cp2.losses[s] for s in (1, 2, 3)] == [cp4.losses[s] for s in (1, 2, 3)]  # history restored
    assert trainer_ckpt.latest_checkpoint(save) == save / "step_00000005"


def test_checkpoint_failing_midway_leaves_no_step(tmp_path, monkeypatch):
    """DCP fails after writing part of the state: no step folder appears, the latest complete
    checkpoint stays the one before, and the next save of the same step succeeds."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    first = trainer_ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1})
    real = dcp.save

    def failing(state, checkpoint_id, **kwargs):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", failing)
    with pytest.raises(OSError, match="No space left"):
        trainer_ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2})
    assert not trainer_ckpt.step_dir(tmp_path, 2).exists()
    assert trainer_ckpt.latest_checkpoint(tmp_path) == first
    monkeypatch.setattr(dcp, "save", real)
    second = trainer_ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2})
    assert trainer_ckpt.latest_checkpoint(tmp_path) == second and trainer_ckpt.is_complete(second)


def _final_state(tmp, checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(load_model_config(str(tmp / "model.json")))
    optimizer = torch.optim.AdamW(model.parameters())
    trainer_ckpt.load_checkpoint(checkpoint, model, optimizer, trainer_ckpt.model_fingerprint(model))
    return model.state_dict(), optimizer.state_dict()["state"]


def test_crash_then_resume_equals_uninterrupted(tmp_path):
    """A run that dies in step 5 (after its step-4 checkpoint) and is restarted with the same command
    plus --resume ends with bitwise the parameters and optimizer state of an uninterrupted run."""
    whole = train(_args(tmp_path, "--save", tmp_path / "a", steps=6))
    crash = _args(tmp_path, "--save", tmp_path / "b", "--save-every", 2, steps=6)
    with pytest.raises(RuntimeError, match="injected crash at step 5"):
        train(crash + ["--crash-at-step", "5"])
    assert trainer_ckpt.latest_checkpoint(tmp_path / "b") == tmp_path / "b" / "step_00000004"
    again = train(crash + ["--resume"])
    assert again.start_step == 4 and again.losses == whole.losses
    (p1, o1), (p2, o2) = _final_state(tmp_path, whole.checkpoint), _final_state(tmp_path, again.checkpoint)
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert all(torch.equal(o1[k][n], o2[k][n]) for k in o1 for n in o1[k])


def test_adaptive_plans_and_matches_single_rank(runs):
    """One sequence a step on 4 ranks (a group without a sequence runs a zero-weight pass so that
    FSDP2's collectives stay matched: tests/test_train_fsdp.py forces that case)."""
    tmp, cp1, _ = runs
    adaptive = train(_args(tmp, "--nproc", 4, "--adaptive", "--batch-size", 1))
    _close(adaptive.losses, cp1.losses, range(1, 6))
    assert all(sum(g[1] for g in r["groups"]) == 4 for r in adaptive.history)  # the groups tile the ranks


def test_adaptive_mixed_groups_match_single_rank_parameters(tmp_path):
    """--adaptive with 8 sequences a step on 4 ranks runs through the scheduler's executor
    (GroupCache, train_step; each group packs its sequences' documents into one stream): its losses
    and its parameters after 2 AdamW steps equal a one-rank run of the same batches, so the
    gradients (all-reduced over the plan's groups) are the single-rank ones."""
    one = train(_args(tmp_path, "--batch-size", 8, "--save", tmp_path / "one", steps=2))
    adaptive = train(_args(tmp_path, "--nproc", 4, "--adaptive", "--batch-size", 8, "--save", tmp_path / "ad",
                           steps=2))
    _close(adaptive.losses, one.losses, range(1, 3))
    for r in adaptive.history:
        assert sorted(g[0] for g in r["groups"]) == sorted({g[0] for g in r["groups"]})  # distinct blocks
        assert sum(g[1] for g in r["groups"]) == 4 and sum(g[3] for g in r["groups"]) == 8
    (p1, _), (p2, _) = _final_state(tmp_path, one.checkpoint), _final_state(tmp_path, adaptive.checkpoint)
    # AdamW moves each weight by ~lr = 1e-3 a step, so a wrong gradient (a missing or doubled rank
    # in the all-reduce, a wrong normaliser) moves parameters by ~1e-3; fp32 rounding of reordered
    # sums, amplified by Adam's 1/sqrt(v) on tiny gradients, stays far below 1e-5 here.
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _calibration_file(tmp_path, methods):
    from seqpar.bench.calibrate import build_models
    from seqpar.schedulers.calibration import save_calibration
    from test_calibrate import _synthetic_measurements

    cluster, cost = build_models(_synthetic_measurements(world=4), methods)
    path = tmp_path / "cal.json"
    save_calibration(path, cluster, cost.with_group_scales({m: {1: (1.0, 1.0), 2: (0.8, 1.2)} for m in methods}), command="test")
    return path


def test_adaptive_plans_with_a_calibration_file(tmp_path):
    """--calibration: the scheduler plans with the file's methods (here only ring) and machine, moved to
    the model's shape; the step is still the single-rank one."""
    from seqpar.integrations.train.config import adaptive_models, parse_args

    cal = _calibration_file(tmp_path, ["ring", "ulysses"])
    cfg = parse_args(_args(tmp_path, "--adaptive", "--calibration", cal))  # writes model.json
    cluster, cost = adaptive_models(cfg, 4, load_model_config(cfg.model_config))
    assert cluster.world_size == 4 and cost.method_names == ("ring",)  # ulysses is not an --adaptive method
    assert (cost.n_heads, cost.hidden, cost.kv_hidden, cost.layers) == (4, 64, 32, 2)
    assert cost.coeffs("ring").group_scale == ((1, 1.0, 1.0), (2, 0.8, 1.2))
    one = train(_args(tmp_path, "--batch-size", 8, steps=1))
    adaptive = train(_args(tmp_path, "--nproc", 4, "--adaptive", "--batch-size", 8, "--calibration", cal, steps=1))
    _close(adaptive.losses, one.losses, [1])
    assert all(g[2] == "ring" for r in adaptive.history for g in r["groups"] if g[1] > 1)


def test_calibration_needs_adaptive_and_a_usable_file(tmp_path):
    with pytest.raises(ValueError, match="--calibration: only the adaptive scheduler"):
        train(_args(tmp_path, "--calibration", tmp_path / "none.json", steps=1))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="calibration file .*bad.json.*not valid JSON"):
        train(_args(tmp_path, "--nproc", 2, "--adaptive", "--calibration", tmp_path / "bad.json", steps=1))
    with pytest.raises(ValueError, match="none of the methods --adaptive runs"):
        train(_args(tmp_path, "--nproc", 2, "--adaptive", "--calibration", _calibration_file(tmp_path, ["ulysses"]),
                    steps=1))


def test_layer_checkpointing_matches_and_bf16_plot(runs, tmp_path):
    """--checkpointing layer on cp 2 trains exactly like one process; --dtype bfloat16 on cp 2 (FSDP2's
    mixed precision: bf16 compute, fp32 master weights and gradient sums) computes the same first loss
    within bf16 rounding, and --plot writes the curve."""
    _, cp1, _ = runs
    layer = train(_args(tmp_path, "--nproc", 2, "--context-parallel", 2, "--checkpointing", "layer"))
    _close(layer.losses, cp1.losses, range(1, 6))
    bf16 = train(_args(tmp_path, "--nproc", 2, "--context-parallel", 2, "--dtype", "bfloat16",
                       "--plot", tmp_path / "loss.png", steps=2))
    # bf16 keeps 8 significant bits (~4e-3 per rounding, through two layers and the head): 2e-2 of the
    # loss; a wrong mask, label or position moves the first loss by far more at this size
    assert abs(bf16.losses[1] - cp1.losses[1]) <= 2e-2 * cp1.losses[1], (bf16.losses[1], cp1.losses[1])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in bf16.history)
    assert (tmp_path / "loss.png").stat().st_size > 0


# ----------------------------------------------------------------------------- bad input


def test_seq_len_not_fitting_the_layout_is_padded_per_document(tmp_path):
    args = _args(tmp_path, "--nproc", 4, "--context-parallel", 4, "--seq-len", 100, steps=1)  # the last wins
    assert train(args).history[0]["tokens"] == 100  # seqpar pads every packed document to the layout itself


def test_context_parallel_must_divide_the_world(tmp_path):
    with pytest.raises(ValueError, match="--context-parallel 3 does not divide the 4 ranks"):
        train(_args(tmp_path, "--nproc", 4, "--context-parallel", 3))


def test_empty_data_folder(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(ValueError, match="--data: no non-empty files"):
        train(_args(tmp_path, "--data", tmp_path / "data"))
    assert main(_args(tmp_path, "--data", tmp_path / "data")) == 2  # the command prints one line, exits 2


def test_checkpoint_from_a_different_model(runs, tmp_path):
    src, _, _ = runs
    other = dict(TINY, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match=r"saved from a different model \(.*hidden_size: checkpoint 64, this run 32"):
        train(_args(tmp_path, "--resume", src / "ckpt" / "step_00000003", config=other))


def test_attention_checkpointing_matches_uncheckpointed(runs, tmp_path):
    """--checkpointing attention (rematerialisation-aware) trains exactly like no checkpointing."""
    _, cp1, _ = runs
    res = train(_args(tmp_path, "--nproc", 2, "--context-parallel", 2, "--checkpointing", "attention",
                      "--loss-chunk", 0))  # and the unchunked loss (full logits)
    _close(res.losses, cp1.losses, range(1, 6))


def test_compile_matches_eager(runs, tmp_path):
    """--compile (each decoder layer through torch.compile, inductor; seqpar.attention one opaque
    op in the graph) trains like eager: steps 2-5 check the earlier steps' gradients."""
    _, cp1, _ = runs
    res = train(_args(tmp_path, "--compile"))
    _close(res.losses, cp1.losses, range(1, 6))


@pytest.mark.slow
def test_compile_context_parallel_matches_eager(runs, tmp_path):
    _, cp1, _ = runs
    res = train(_args(tmp_path, "--compile", "--nproc", 2, "--context-parallel", 2))
    _close(res.losses, cp1.losses, range(1, 6))


def test_non_finite_loss_and_norm_are_null_in_the_json_log(tmp_path, monkeypatch):
    """A NaN loss (steps 2 and 3) and an inf gradient (step 2) injected into an fp32 run are written as null, which
    strict JSON parsers accept (NaN and Infinity are not JSON); the record keeps its other fields, the
    end record and the plot are still written; the start record's config says "inf" for --timeout inf.
    Any other non-finite value is refused, not written."""
    import math

    from seqpar.integrations.train import step as train_step
    from seqpar.integrations.train.log import strict_record

    real, calls = train_step.forward_backward, []

    def forward_backward(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = float("inf")
        return out * float("nan") if len(calls) >= 2 else out

    monkeypatch.setattr(train_step, "forward_backward", forward_backward)
    log, plot = tmp_path / "log.jsonl", tmp_path / "loss.png"
    res = train(_args(tmp_path, "--json", log, "--plot", plot, "--timeout", "inf", "--save", tmp_path / "c", steps=3))

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    lines = [json.loads(line, parse_constant=refuse) for line in log.read_text().splitlines()]
    steps = [r for r in lines if "step" in r]
    assert math.isnan(res.history[1]["loss"]) and res.history[1]["grad_norm"] == math.inf  # in memory: as computed
    assert steps[1]["loss"] is None and steps[1]["grad_norm"] is None and set(steps[1]) == set(steps[0])
    assert {k: v for k, v in steps[1].items() if k not in ("loss", "grad_norm")} == \
        {k: v for k, v in res.history[1].items() if k not in ("loss", "grad_norm")}
    assert steps[0]["loss"] == res.history[0]["loss"] and lines[0]["config"]["timeout"] == "inf"
    assert lines[-1]["event"] == "end" and lines[-1]["final_loss"] is None and lines[-1]["tokens_per_s"] > 0
    assert plot.stat().st_size > 0
    with pytest.raises(ValueError, match="not JSON compliant"):
        json.dumps(strict_record({"step": 1, "tokens_per_s": math.inf}), allow_nan=False)
    # the checkpoint's meta.json is strict JSON too: the non-finite values as text (its None stays null:
    # test_train_fp16's skipped steps), read back as floats by a resume (which plots them)
    meta = json.loads((tmp_path / "c" / "step_00000003" / "meta.json").read_text(), parse_constant=refuse)
    assert [r["loss"] for r in meta["history"][1:]] == ["nan", "nan"] and meta["history"][1]["grad_norm"] == "inf"
    plot.unlink()
    again = train(_args(tmp_path, "--save", tmp_path / "c", "--resume", "--plot", plot, steps=4))
    assert again.history[0] == res.history[0] and math.isnan(again.history[1]["loss"]) and len(again.history) == 4
    assert again.history[1]["grad_norm"] == math.inf
    assert plot.stat().st_size > 0
