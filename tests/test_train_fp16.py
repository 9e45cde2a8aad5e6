"""``seqpar train --dtype float16``: dynamic loss scaling (torch's ``GradScaler`` in one process,
``ShardedGradScaler`` over FSDP2's sharded gradients).

A tiny Llama (test_trainer's) on the default data, 2 sequences of 128 tokens a step. The 2-rank
(cp 2, FSDP2) run and the one-process (autocast) run agree on every step's loss, gradient norm,
scale and skip, also when an inf put into one rank's gradient skips a step (on both ranks). With
``--loss-scale-init 2**20`` and ``--loss-scale-growth-interval 2`` the 2-rank run sits at its fp16
overflow edge (gradients times 2**19 overflow, times 2**18 do not): in 5 steps it skips, halves,
grows the scale back and overflows again; resumed from its step-3 checkpoint it replays steps 4-5
bit for bit, and --adaptive follows the same scales. A loss pushed below fp16's range trains like
fp32 only with the scaler.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from seqpar.integrations.train import ckpt as trainer_ckpt  # noqa: E402
from seqpar.integrations.train import train  # noqa: E402
from seqpar.integrations.train.config import parse_args  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402

from test_trainer import _final_state  # noqa: E402  (a checkpoint's parameters and AdamW state)

TINY = {"model_type": "llama", "vocab_size": 259, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}
EDGE = ("--dtype", "float16", "--loss-scale-init", 2.0**20, "--loss-scale-growth-interval", 2)
STEPS = 5  # at EDGE on 2 ranks: steps 1, 2 overflow, 3, 4 clean (the scale doubles), 5 overflows again
# FSDP2's fp16 run computes everything in fp16 (norms' weights and residual adds too); autocast's
# one-process run only the matmuls. fp16 keeps 11 significant bits (4.9e-4 per rounding), but the
# loss is a mean of 256 fp32 log-softmaxes whose independent roundings average out: measured, the
# two runs' losses differ by <= 2e-5 relative over 8 AdamW steps and their gradient norms by
# <= 2e-4. The bounds leave room for other summation orders and still catch a gradient that was not
# unscaled (x 2**19), a microbatch scaled twice or not at all (x 2**19 on half the gradient), or a
# skipped step applied (its update moves the next loss by ~1e-2).
LOSS_RTOL = 2e-4
NORM_RTOL = 2e-3


def _args(tmp, *extra, steps=STEPS):
    path = tmp / "model.json"
    path.write_text(json.dumps(TINY))
    return ["--model-config", str(path), "--seq-len", "128", "--batch-size", "2", "--steps", str(steps),
            "--no-progress", "--log-every", "1000", *map(str, extra)]


def _close(a: float | None, b: float | None, rtol: float, what: str) -> None:
    assert (a is None) == (b is None), f"{what}: {a!r} vs {b!r}"
    if a is not None:
        assert abs(a - b) <= rtol * abs(b), f"{what}: {a!r} vs {b!r}"


def _same_steps(got: list[dict], want: list[dict]) -> None:
    """Step records equal: the same loss scale and skip, loss and grad norm (None when skipped)
    within the fp16 bounds."""
    for a, b in zip(got, want, strict=True):
        what = f"step {b['step']}"
        assert (a["loss_scale"], a["skipped"]) == (b["loss_scale"], b["skipped"]), what
        _close(a["loss"], b["loss"], LOSS_RTOL, what + " loss")
        _close(a["grad_norm"], b["grad_norm"], NORM_RTOL, what + " grad_norm")


def _train_on_ranks(argv: list[str], inf_at_step=None, warned: list | None = None):
    """Rank 0's step records of ``seqpar train argv`` run on this pool's ranks (the persistent test
    pool, instead of ``--nproc``'s new processes) or in this process. ``inf_at_step`` (a step or a
    collection of steps): after that step's backward the last rank alone puts an inf into its part of
    the first parameter's gradient.
    ``warned``: a list, returned with the records, that gets every warning this rank saw."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from seqpar.integrations.train import step as train_step
    from seqpar.integrations.train.trainer import _rank_main

    real, calls = train_step.forward_backward, []
    last = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
    inf_steps = {inf_at_step} if isinstance(inf_at_step, int) else set(inf_at_step or ())

    def forward_backward(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        calls.append(1)  # one call per step (the fixed mesh)
        if len(calls) in inf_steps and last:
            grad = next(model.parameters()).grad
            with torch.no_grad():
                (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
        return out

    train_step.forward_backward = forward_backward
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _rank_main(parse_args(argv))
    finally:
        train_step.forward_backward = real
    history = None if result is None else result.history
    return history if warned is None else (history, warned + [str(w.message) for w in caught])


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    """fp16 at torch's default scale (2**16, no overflow of its own here), an inf injected into a
    gradient at step 2: in one process, and on 2 ranks (cp 2, only rank 1's gradient) saving every step."""
    tmp = tmp_path_factory.mktemp("fp16_inf")
    one = _train_on_ranks(_args(tmp, "--dtype", "float16", steps=3), 2)
    cp2 = run_distributed(_train_on_ranks, 2, _args(tmp, "--dtype", "float16", "--context-parallel", 2, "--save",
                                                      tmp / "c", "--save-every", 1, steps=3), 2, [], timeout=300)
    return tmp, one, cp2[0][0], [message for _, messages in cp2 for message in messages]


def test_no_warning_from_the_sharded_scaler(injected):
    """torch's DTensor inf check warns about the scaler's [1]-shaped found_inf on every rank at the
    first step and again after each checkpoint (the save's catch_warnings resets the once-registry); the
    trainer keeps it from the user."""
    *_, messages = injected
    assert not [m for m in messages if "non-scalar tensor" in m], messages


def test_cp2_equals_one_process(injected):
    _, one, cp2, _ = injected
    _same_steps(cp2, one)


def test_inf_on_one_rank_skips_the_step_everywhere(injected):
    """Rank 1's gradient holds an inf after step 2's backward, rank 0's are finite: both skip (the
    checkpoints of steps 1 and 2 hold the same parameters and AdamW state, each rank's shard saved by
    that rank), the scale halves, and step 3 updates again."""
    tmp, _, history, _ = injected
    assert [r["skipped"] for r in history] == [False, True, False]
    assert [r["loss_scale"] for r in history] == [2.0**16, 2.0**16, 2.0**15]
    assert history[1]["grad_norm"] is None and history[2]["grad_norm"] > 0
    (p1, o1), (p2, o2), (p3, _) = [_final_state(tmp, trainer_ckpt.step_dir(tmp / "c", s)) for s in (1, 2, 3)]
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert all(torch.equal(o1[k][n], o2[k][n]) for k in o1 for n in o1[k])  # moments and AdamW's step
    assert not any(torch.equal(p2[k], p3[k]) for k in p2)


def test_replicas_skip_together(injected):
    """--replicas 2 on 2 ranks (HSDP, each rank a whole replica), the inf on rank 1 only: DTensor's inf
    check reduces over the shard dims only, so it is the scaler's all-reduce over the world that makes
    rank 0 skip too; every step equals the one-process run with the same inf."""
    tmp, one, _, _ = injected
    hsdp = run_distributed(_train_on_ranks, 2, _args(tmp, "--dtype", "float16", "--replicas", 2, steps=3), 2,
                           timeout=300)[0]
    assert [r["skipped"] for r in hsdp] == [False, True, False]
    _same_steps(hsdp, one)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--context-parallel", 2), ("--replicas", 2)], ids=["cp2_dp2", "hsdp"])
def test_four_ranks_skip_together_and_equal_one_process(tmp_path, layout):
    """4 ranks (cp 2 x dp 2; HSDP: 2 replicas of 2 shards), 4 sequences a step, an inf on rank 3 only
    at step 2: every rank skips it, and every step equals the one-process run with the same inf."""
    one = _train_on_ranks(_args(tmp_path, "--dtype", "float16", "--batch-size", 4, steps=3), 2)
    four = run_distributed(_train_on_ranks, 4, _args(tmp_path, "--dtype", "float16", "--batch-size", 4, *layout,
                                                     steps=3), 2, timeout=600)[0]
    assert [r["skipped"] for r in four] == [False, True, False]
    _same_steps(four, one)


# ----------------------------------------------------------------------------- the overflow edge


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """fp16 at the overflow edge on 2 ranks (cp 2, the command's --nproc), saving every step."""
    tmp = tmp_path_factory.mktemp("fp16_edge")
    cp2 = train(_args(tmp, *EDGE, "--nproc", 2, "--context-parallel", 2, "--save", tmp / "ckpt", "--save-every", 1,
                      "--json", tmp / "cp2.jsonl", steps=STEPS))
    return tmp, cp2


def test_the_scale_halves_on_overflow_and_grows_after_clean_steps(edge):
    _, cp2 = edge
    # torch's rule: x 0.5 after a skipped step, x 2 after 2 clean steps in a row, else unchanged
    scale, clean = 2.0**20, 0
    for rec in cp2.history:
        assert rec["loss_scale"] == scale, rec
        clean = 0 if rec["skipped"] else clean + 1
        scale, clean = (scale / 2, 0) if rec["skipped"] else ((scale * 2, 0) if clean == 2 else (scale, clean))
    skipped = [r["step"] for r in cp2.history if r["skipped"]]
    grown = [r["step"] for r, nxt in zip(cp2.history, cp2.history[1:]) if nxt["loss_scale"] > r["loss_scale"]]
    assert skipped and grown and max(skipped) > min(grown), (skipped, grown)  # halved, grown, overflowed again
    assert all(math.isfinite(r["loss"]) for r in cp2.history)


def test_json_records_loss_scale_and_skipped(edge, tmp_path):
    tmp, _ = edge
    records = list(map(json.loads, (tmp / "cp2.jsonl").read_text().splitlines()))
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert type(r["loss_scale"]) is float and type(r["skipped"]) is bool
        assert (r["grad_norm"] is None) == r["skipped"]  # no norm of inf/NaN gradients is reported
    # the end record counts the skipped steps and gives the scale after the last one (step 5 overflowed)
    end = records[-1]
    assert end["event"] == "end" and steps[-1]["skipped"]
    assert (end["skipped_steps"], end["loss_scale"]) == (sum(r["skipped"] for r in steps), steps[-1]["loss_scale"] / 2)
    bf16 = train(_args(tmp_path, "--dtype", "bfloat16", "--json", tmp_path / "bf16.jsonl", steps=1))
    bf16_end = json.loads((tmp_path / "bf16.jsonl").read_text().splitlines()[-1])
    assert not {"loss_scale", "skipped", "skipped_steps"} & (set(bf16.history[0]) | set(bf16_end))  # no scaler


def test_resume_replays_the_scale_exactly(edge):
    """Resumed at step 3 (scale 2**18 after two skips, one clean step towards growth), steps 4-5 equal
    the uninterrupted run bit for bit: a lost scale or growth tracker changes which steps overflow."""
    tmp, cp2 = edge
    assert [r["skipped"] for r in cp2.history[:3]] == [True, True, False]
    assert trainer_ckpt.has_scaler(tmp / "ckpt" / "step_00000003")
    args = _args(tmp, *EDGE, "--context-parallel", 2, "--resume", tmp / "ckpt" / "step_00000003")
    resumed = run_distributed(_train_on_ranks, 2, args, timeout=300)[0]
    keys = ("step", "loss", "grad_norm", "loss_scale", "skipped", "lr")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in cp2.history]


def test_one_process_resumes_the_saved_scale_and_says_so(edge, tmp_path, capsys):
    """The 2-rank run's step-3 checkpoint resumed in one process with another --loss-scale-init: the
    saved scale (2**18, one clean step towards growth) goes on, as torch's load_state_dict does, and
    the run says so; step 4 then grows the scale and matches the 2-rank step 4 within fp16 rounding."""
    tmp, cp2 = edge
    res = train(_args(tmp_path, *EDGE[:2], "--loss-scale-init", 1024, "--resume", tmp / "ckpt" / "step_00000003",
                      steps=4))
    assert "loss scale 262144 restored from the checkpoint (--loss-scale-init 1024 applies to a fresh start only)" \
        in capsys.readouterr().out
    a, b = res.history[-1], cp2.history[3]
    assert (a["step"], a["loss_scale"], a["skipped"]) == (4, 2.0**18, False) == (b["step"], b["loss_scale"], b["skipped"])
    _close(a["loss"], b["loss"], LOSS_RTOL, "step 4 loss")
    _close(a["grad_norm"], b["grad_norm"], NORM_RTOL, "step 4 grad_norm")


def test_adaptive_scales_like_the_fixed_mesh(edge):
    """--adaptive (the scheduler's groups on the same FSDP2 fp16 shards) at the overflow edge: the same
    skips and scales as the cp 2 run, losses and norms within fp16 rounding. (The cp 2 run saved
    after every step, from step 1 on with no optimizer state yet; this one saves nothing, so a
    checkpoint that changed the optimizer's state would show here too.)"""
    tmp, cp2 = edge
    adaptive = run_distributed(_train_on_ranks, 2, _args(tmp, *EDGE, "--adaptive"), timeout=300)[0]
    _same_steps(adaptive, cp2.history)


def test_fp32_checkpoint_resumes_in_fp16_and_back(edge, tmp_path):
    """A checkpoint without a scaler (fp32) loads into an fp16 run (fresh scale: --loss-scale-init's,
    recorded as the float32 number the loss was multiplied by), and an fp16 one into an fp32 run (its
    scaler state ignored)."""
    tmp, _ = edge
    train(_args(tmp_path, "--save", tmp_path / "f32", steps=1))
    assert not trainer_ckpt.has_scaler(tmp_path / "f32" / "step_00000001")
    res = train(_args(tmp_path, "--dtype", "float16", "--loss-scale-init", 1000.1, "--resume", tmp_path / "f32",
                      steps=2))
    assert res.start_step == 1 and res.history[1]["loss_scale"] == float(torch.tensor(1000.1, dtype=torch.float32))
    back = train(_args(tmp_path, "--resume", tmp / "ckpt" / "step_00000002", steps=3))
    assert back.start_step == 2 and "loss_scale" not in back.history[-1]


# ----------------------------------------------------------------------------- underflow


def _grads_after_one_step(tmp, dtype: str, scale_init: float | None, shrink: float):
    """The trainer's own pieces (build, data, forward_backward, optimizer_step) on one process, with
    the loss multiplied by ``shrink``: as if the step held 1 / shrink times as many tokens. Returns
    the gradients (unscaled), the parameter updates of one AdamW step and the step's reported norm. ``scale_init`` None with
    float16: no scaler (what the trainer did before it scaled fp16 losses)."""
    import contextlib

    from seqpar.integrations.hf import shard_inputs
    from seqpar.integrations.train.build import build_model, setup_runtime
    from seqpar.integrations.train.config import open_data
    from seqpar.integrations.train.step import forward_backward, make_scaler, optimizer_step

    extra = ("--dtype", dtype) + (("--loss-scale-init", scale_init) if scale_init else ())
    cfg = parse_args(_args(tmp, *extra, steps=1))
    rt = setup_runtime(cfg)
    model = build_model(cfg, rt, None)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)  # the trainer's
    data = open_data(cfg, None)
    shards = [shard_inputs(tokens[None], cu_seqlens=cu, group=model.seqpar_cp_group, method=cfg.cp_method)
              for tokens, cu in map(data.sequence, range(2))]  # step 1's sequences, as static_step takes them
    count = sum(b.num_valid for b in shards) / shrink
    autocast = torch.autocast("cpu", dtype=torch.float16) if dtype == "float16" else contextlib.nullcontext()
    scaler = make_scaler(cfg, rt) if scale_init else None
    forward_backward(model, shards, count, autocast, cfg.loss_chunk, scaler)
    norm, skipped = optimizer_step(optimizer, params, math.inf, scaler)
    assert not skipped
    return [p.grad.clone() for p in params], [p.detach() - b for p, b in zip(params, before)], norm


def test_scaling_rescues_gradients_below_fp16_range(tmp_path):
    """The loss times 2**-16 (as if a step held 65536 times the tokens): the backward's fp16 values
    fall under fp16's smallest subnormal (6e-8). Without a scaler the gradients of every q, k, v,
    gate, up projection and norm weight flush to exactly zero (autocast keeps the residual stream
    and the loss head in fp32, so the others only lose entries) and AdamW leaves those weights
    where they were; with the scaler (2**24) every gradient and update is fp32's within fp16
    rounding."""
    shrink = 2.0**-16
    ref_g, ref_u, ref_norm = _grads_after_one_step(tmp_path, "float32", None, shrink)
    raw_g, raw_u, _ = _grads_after_one_step(tmp_path, "float16", None, shrink)
    fix_g, fix_u, fix_norm = _grads_after_one_step(tmp_path, "float16", 2.0**24, shrink)
    _close(fix_norm, ref_norm, 5e-3, "grad_norm")  # the true gradients' norm, not the scaled ones
    flushed = [i for i, g in enumerate(raw_g) if not g.any()]
    assert len(flushed) >= 13 and all(ref_g[i].any() for i in flushed)
    assert all(not raw_u[i].any() and ref_u[i].any() for i in flushed)  # these weights did not move
    for i, (f, r) in enumerate(zip(fix_g, ref_g)):
        # fp16 products of 11-bit operands (4.9e-4 per rounding), summed over 256 tokens: measured
        # <= 8e-4 relative per tensor; a flushed or unscaled gradient is off by ~1 or 2**24
        assert torch.linalg.vector_norm(f - r) <= 5e-3 * torch.linalg.vector_norm(r), i
    for i, (f, r) in enumerate(zip(fix_u, ref_u)):
        # AdamW's first update is lr * g / (|g| + eps): as close as the gradients, except entries at
        # fp16's rounding of a cancelling sum (whose sign may flip), so bounded in norm, not entrywise
        assert torch.linalg.vector_norm(f - r) <= 5e-2 * torch.linalg.vector_norm(r), (i, float(
            torch.linalg.vector_norm(f - r) / torch.linalg.vector_norm(r)))


# ----------------------------------------------------------------------------- the scale's floor


def test_overflow_at_every_step_stops_at_the_scale_floor(tmp_path):
    """An inf in a gradient at every step (rank 1 only, cp 2): the scale halves 3 -> 1.5 -> 0.75 -> 0.375;
    below --loss-scale-min 0.75 every rank raises after step 3's record is written (torch's scaler
    would halve on to 0 and train no more, silently)."""
    from seqpar.integrations.train.step import LossScaleError

    log = tmp_path / "log.jsonl"
    argv = _args(tmp_path, "--dtype", "float16", "--context-parallel", 2, "--loss-scale-init", 3,
                 "--loss-scale-min", 0.75, "--json", log, "--save", tmp_path / "c", "--save-every", 1, steps=5)
    with pytest.raises(LossScaleError, match=r"fell to 0.375 after step 3, below --loss-scale-min 0.75.*3 step\(s\) "
                                             r"in a row skipped.*lower --lr.*bfloat16") as info:
        run_distributed(_train_on_ranks, 2, argv, range(1, 6), timeout=300)
    assert "raised on ranks [0, 1]" in str(info.value)
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "step" in r]
    assert [(r["step"], r["loss_scale"], r["skipped"]) for r in steps] == [(1, 3.0, True), (2, 1.5, True),
                                                                          (3, 0.75, True)]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["step_00000001", "step_00000002"]  # not step 3


def test_default_floor_is_one_and_main_says_what_to_try(tmp_path, monkeypatch, capsys):
    """One process, --loss-scale-init 2: the scale reaches 0.5 after step 2's overflow, below the default
    floor of 1; ``seqpar train`` prints one line and exits 1. Started at 0.5, the floor is 0.5."""
    from seqpar.integrations.train import main
    from seqpar.integrations.train import step as train_step

    real = train_step.forward_backward

    def overflowing(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        with torch.no_grad():
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(train_step, "forward_backward", overflowing)
    assert main(_args(tmp_path, "--dtype", "float16", "--loss-scale-init", 2, steps=4)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("seqpar train: error: --dtype float16: the loss scale fell to 0.5 after step 2, below "
                              "--loss-scale-min 1:"), err
    # --loss-scale-init below 1 without --loss-scale-min: the floor is the initial scale, not 1
    assert main(_args(tmp_path, "--dtype", "float16", "--loss-scale-init", 0.5, steps=4)) == 1
    assert "fell to 0.25 after step 1, below --loss-scale-min 0.5:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize("extra, message", [
    (("--loss-scale-init", 1024), "--loss-scale-init: only --dtype float16 scales the loss"),
    (("--dtype", "bfloat16", "--loss-scale-growth-interval", 5), "--loss-scale-growth-interval: only --dtype float16"),
    (("--dtype", "float16", "--loss-scale-init", 0), "--loss-scale-init: expected a positive finite scale"),
    (("--dtype", "float16", "--loss-scale-init", "inf"), "--loss-scale-init: expected a positive finite scale"),
    (("--dtype", "float16", "--loss-scale-growth-interval", 0), "--loss-scale-growth-interval: expected a positive"),
    (("--dtype", "float16", "--loss-scale-growth-interval", 10**20), "--loss-scale-growth-interval: expected a positive"),
    # outside float32's normal range: torch's error at the first step (1e40); a scale of 0, NaN parameters and
    # no step reported skipped (1e-50)
    (("--dtype", "float16", "--loss-scale-init", 1e40), "--loss-scale-init: the scale is held in float32"),
    (("--dtype", "float16", "--loss-scale-init", 1e-50), "--loss-scale-init: the scale is held in float32"),
    (("--loss-scale-min", 0.5), "--loss-scale-min: only --dtype float16 scales the loss"),
    (("--dtype", "float16", "--loss-scale-min", 0), r"--loss-scale-min: expected a scale in \[1.18e-38, "),
    (("--dtype", "float16", "--loss-scale-min", "nan"), "--loss-scale-min: expected a scale"),
    (("--dtype", "float16", "--loss-scale-min", 1e5), "--loss-scale-min: .*--loss-scale-init 65536.*got 100000"),
    (("--dtype", "float16", "--loss-scale-init", 8, "--loss-scale-min", 16), "--loss-scale-min: .*--loss-scale-init 8"),
])
def test_bad_loss_scale_flags(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        train(_args(tmp_path, *extra, "--nproc", 2, steps=1))  # refused before any rank starts
