"""``ContextParallelTrainer`` under torchrun (CPU, gloo) against transformers' single-process ``Trainer``.

A plain HF Trainer script (this file's ``__main__``): a tiny Llama with GQA (4 query heads over 2 KV
heads, from ``tests/model_folders.py``), SGD (a wrong gradient scale moves the weights by the wrong
amount; no clipping, constant learning rate), real-text documents of awkward lengths (1 to 97 tokens)
packed by ``DataCollatorWithFlattening``, random sampling. One torchrun launch per world size runs its
configurations in sequence (2 ranks: cp 2 with gradient accumulation, ulysses, right padding,
torch_compile, bad inputs, and a trainer whose gradients are averaged instead of summed, which the
comparison must catch; 3 ranks: cp 3; 4 ranks: cp 2 x dp 2 under DDP, under FSDP2 (also
compiled) and from a streaming dataset, cp 4 usp with cp_options={"ulysses_degree": 2}, a bad batch
in one data-parallel group; resumes from the 2-rank runs' checkpoints at cp 4 (DDP) and cp 2 x dp 2
(FSDP2), and one refused).
Rank 0 saves the model with ``save_model`` and writes the logged losses and gradient norms; the
test reloads the saved folder with ``from_pretrained`` and compares with the plain ``Trainer`` run
in one process on batches ``dp`` times larger (the same examples per optimizer step).

Tolerances: both runs are fp32; the context-parallel one only reorders sums (blockwise softmax
merges, the loss and gradient summed over ranks, DDP's average of ``W``-scaled gradients), which
rounds at ~1e-7 relative per operation. Through 2 layers and 2 SGD steps of a model whose weights
move by ~1e-2 that stays near 1e-6 of each update; the issue's bounds, 1e-4 relative on every
parameter's update and 1e-4 on every logged loss (~5.8), leave room, while a gradient off by a
factor (a mean where a sum is due), a lost label or documents attending to each other move the
update by 1e-2 or more (checked: ``test_a_wrong_gradient_scale_is_caught``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

UPDATE_RTOL = 1e-4
LOSS_ATOL = 1e-4
# bf16 (8 significant bits, unit roundoff 2**-8 = 3.9e-3): both runs round activations and gradients to
# bf16, at different points (blockwise attention merges, the ranks' partial sums, FSDP2's bf16 weights
# against autocast's casts), so each gradient element differs by a few roundoffs: measured 6e-3 (DDP)
# and 9e-3 (FSDP2) relative on the updates; 3e-2 is ~8 roundoffs, and a wrong factor (a mean for a sum)
# is 0.5. The loss is a mean of fp32 cross-entropies of bf16 logits, where these errors average out
# (measured 7e-6 and 9e-5); 1e-2 is a third of bf16's spacing at the loss's ~5.8 (2**-5).
UPDATE_RTOL_BF16 = 3e-2
LOSS_ATOL_BF16 = 1e-2
STEPS = 2
N_DOCS = 48
LR = 0.5

# name -> (world, trainer options); "batch" is per_device_train_batch_size (sequences per cp group);
# "slow" ones run only with SEQPAR_SLOW=1 (each launch runs its world's configurations in sequence)
CONFIGS = {
    "cp2_zigzag_ga2": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=2, eval=True)),
    "cp2_ulysses": (2, dict(cp=2, method="ulysses", batch=4, ga=1, slow=True)),
    "cp2_right_padded": (2, dict(cp=2, method="ring", batch=3, ga=1, collator="pad")),
    "cp3_striped": (3, dict(cp=3, method="striped_ring", batch=3, ga=2)),
    "cp2_compile": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=1, compile="aot_eager")),
    "cp2_dp2_fsdp2_compile": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=1, fsdp=True, compile="aot_eager",
                                      slow=True)),
    # DDP's average over the ranks left as it is (no factor W): half the gradient at cp 2
    "wrong_scale": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=2, wrong_scale=True)),
    "cp2_dp2_ddp": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=2, eval=True)),
    # a streaming dataset: each group takes its slice of every dp x batch examples (accelerate's rule)
    "cp2_dp2_iterable": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=2, iterable=True)),
    "cp4_usp": (4, dict(cp=4, method="usp", options={"ulysses_degree": 2}, batch=4, ga=1)),
    "cp2_dp2_fsdp2": (4, dict(cp=2, method="allgather_kv", batch=2, ga=2, fsdp=True)),
    # gradient_checkpointing: the Trainer's own per-layer checkpointing around seqpar's attention
    "cp2_gc": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=2, gc={"use_reentrant": False})),
    "cp2_gc_reentrant": (2, dict(cp=2, method="ulysses", batch=3, ga=1, gc={"use_reentrant": True}, slow=True)),
    # under FSDP2 with the Trainer's kwargs: every_n_layers=2 checkpoints layer 0 of the 2
    "cp2_dp2_fsdp2_gc": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=2, fsdp=True,
                                 gc={"use_reentrant": False, "every_n_layers": 2})),
    "cp2_dp2_fsdp2_gc_reentrant": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=1, fsdp=True,
                                           gc={"use_reentrant": True}, slow=True)),
    # bf16: autocast (DDP), FSDP2's bf16 parameters (FSDP2) against the plain Trainer's autocast
    "cp2_bf16": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=2, bf16=True)),
    "cp2_dp2_fsdp2_bf16": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=1, fsdp=True, bf16=True)),
    # checkpoints: 4 steps straight (dying while saving the last) against 2 + resumed 2
    "cp2_resume": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=2, resume=True)),
    "cp2_dp2_fsdp2_resume": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=2, fsdp=True, resume=True)),
    "cp2_fsdp2_resume": (2, dict(cp=2, method="zigzag_ring", batch=4, ga=2, fsdp=True, resume=True)),
    # resumed at 4 ranks from the 2-rank runs' checkpoint-2 ("start"): another cp (DDP), another cp x dp with
    # the same sequences per micro-batch (FSDP2, DCP resharding 2 ranks' shards to 4)
    "cp4_from_cp2": (4, dict(cp=4, method="zigzag_ring", batch=3, ga=2, resume=True, start="cp2_resume")),
    "cp2_dp2_fsdp2_from_cp2": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=2, fsdp=True, resume=True,
                                       start="cp2_fsdp2_resume")),
    "cp4_fsdp2_from_cp2": (4, dict(cp=4, method="ulysses", batch=4, ga=2, fsdp=True, resume=True,
                                   start="cp2_fsdp2_resume", slow=True)),
    # to a smaller world: 2 ranks from the 4-rank FSDP2 checkpoint (own test, after a 4-rank launch)
    "cp2_fsdp2_from_cp2_dp2": (2, dict(cp=2, method="zigzag_ring", batch=4, ga=2, fsdp=True, resume=True,
                                       start="cp2_dp2_fsdp2_resume", slow=True, alone=True)),
    # load_best_model_at_end under FSDP2: the best checkpoint's shards come back into the sharded model
    "cp2_dp2_fsdp2_best": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=1, fsdp=True, best=True)),
}
# name -> (world, trainer options, text every rank's error must contain)
BAD = {
    "bad_left_padding": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=1, collator="left"), "not right-padded"),
    "bad_world": (2, dict(cp=3, method="zigzag_ring", batch=3, ga=1), "context_parallel_size: 3 does not divide"),
    "bad_method": (2, dict(cp=2, method="zeco", batch=3, ga=1), "cp_method='zeco'"),
    "bad_eval": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=1, eval="metrics"), "compute_metrics:"),
    "bad_dispatch": (2, dict(cp=2, method="zigzag_ring", batch=3, ga=1, iterable="dispatch"), "dispatch_batches"),
    "bad_one_group": (4, dict(cp=2, method="zigzag_ring", batch=2, ga=1, collator="left_group0"), "refused"),
    # 2 groups x 3 sequences from a checkpoint of 1 x 3: the data position would be another
    "bad_resume_batch": (4, dict(cp=2, method="zigzag_ring", batch=3, ga=2, resume=True, start="cp2_resume"),
                         "resume_from_checkpoint: "),
}


# ----------------------------------------------------------------------------- the training script


def _documents(tokenizer) -> list[dict]:
    from model_folders import text_documents

    cuts = [1, 2, 5, 17, 31, 50, 64, 79, 97]  # awkward lengths, a 1-token document among them
    docs = []
    for i, text in enumerate(text_documents(N_DOCS)):
        ids = tokenizer(text)["input_ids"][: cuts[i % len(cuts)]]
        docs.append({"input_ids": ids})
    return docs


class PadCollator:
    """Right (or left) padding with an attention mask and -100 labels on padding; ``side="left_group0"``
    left-pads only the batches of data-parallel group 0 (ranks 0 and 1 at cp 2)."""

    def __init__(self, pad_id: int, side: str = "right"):
        self.pad_id, self.side = pad_id, side

    def __call__(self, features):
        n = max(len(f["input_ids"]) for f in features)
        left = self.side == "left" or (self.side == "left_group0" and int(os.environ.get("RANK", 0)) < 2)
        ids, mask, labels = [], [], []
        for f in features:
            x, pad = list(f["input_ids"]), n - len(f["input_ids"])
            row, m = (x + [self.pad_id] * pad, [1] * len(x) + [0] * pad)
            if left:
                row, m = [self.pad_id] * pad + x, [0] * pad + [1] * len(x)
            ids.append(row)
            mask.append(m)
            labels.append([t if k else -100 for t, k in zip(row, m)])
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}


class Stream(torch.utils.data.IterableDataset):
    """The documents as a stream (no length, no sampler)."""

    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


class FlattenCollator:
    """transformers' DataCollatorWithFlattening, given only input_ids."""

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.inner = DataCollatorWithFlattening()

    def __call__(self, features):
        return self.inner([{"input_ids": f["input_ids"]} for f in features])


def _train(folder: str, out: str, opts: dict, world: int, cp_trainer: bool):
    """One training run; returns ([(logged loss, logged grad_norm) per step], trainer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    dp = world // opts["cp"] if cp_trainer else 1
    batch = opts["batch"] if cp_trainer else opts["batch"] * (world // opts["cp"])
    extra = {}
    if opts.get("fsdp") and cp_trainer:  # the reference is one process: no sharding
        extra = dict(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True})
    if opts.get("eval") == "metrics":  # evaluated at every step, with metrics on the predictions
        extra.update(eval_strategy="steps", eval_steps=1)
    if opts.get("iterable") is True:  # dispatch_batches would send every rank a slice of one batch
        extra.update(accelerator_config={"dispatch_batches": False})
    if opts.get("compile") and cp_trainer:
        extra.update(torch_compile=True, torch_compile_backend=opts["compile"])
    if opts.get("gc"):  # the names users set (deprecated aliases of activation_checkpointing*)
        extra.update(gradient_checkpointing=True, gradient_checkpointing_kwargs=opts["gc"])
    if opts.get("bf16"):
        extra.update(bf16=True)
    if opts.get("best"):  # the higher eval loss is "best": step 1's checkpoint, reloaded at the end
        extra.update(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                     load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    if opts.get("resume"):  # AdamW and a decaying schedule: moments, step counts and the lr must be restored
        extra.update(max_steps=2 * STEPS, save_strategy="steps", save_steps=STEPS, optim="adamw_torch",
                     learning_rate=1e-2, lr_scheduler_type="linear", weight_decay=0.1)
    args = TrainingArguments(**{**dict(
        output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=opts["ga"],
        max_steps=STEPS, learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
        warmup_steps=0, weight_decay=0.0, logging_steps=1, report_to=[], save_strategy="no", seed=7,
        use_cpu=True, disable_tqdm=True, remove_unused_columns=False, dataloader_drop_last=False,
        include_num_input_tokens_seen="non_padding", per_device_eval_batch_size=3), **extra})
    side = opts.get("collator", "flat")
    collator = FlattenCollator() if side == "flat" else PadCollator(tokenizer.pad_token_id, side)
    data = _documents(tokenizer)
    if opts.get("iterable"):
        data = Stream(data)
    kwargs = dict(model=model, args=args, train_dataset=data, data_collator=collator,
                  processing_class=tokenizer,
                  eval_dataset=_documents(tokenizer)[:11] if opts.get("eval") or opts.get("best") else None,
                  compute_metrics=(lambda p: {}) if opts.get("eval") == "metrics" else None)
    if cp_trainer:
        from seqpar.integrations.hf_trainer import ContextParallelTrainer

        cls = ContextParallelTrainer
        if opts.get("wrong_scale"):
            class cls(ContextParallelTrainer):  # noqa: N801 - a deliberately broken trainer
                def _loss_scale(self):
                    return 1
        if opts.get("crash_at"):
            class cls(cls):  # noqa: N801 - dies while writing the checkpoint of step crash_at (every rank)
                def _save_optimizer_and_scheduler(self, output_dir):
                    if self.state.global_step == opts["crash_at"]:
                        raise RuntimeError("simulated crash while saving")
                    return super()._save_optimizer_and_scheduler(output_dir)
        trainer = cls(**kwargs, context_parallel_size=opts["cp"], cp_method=opts["method"],
                                         cp_options=opts.get("options"))
        assert trainer.data_parallel_size == dp
    else:
        trainer = Trainer(**kwargs)
    forwards = [None, set()] if opts.get("compile") else _count_attention_forwards(trainer.model)
    try:
        trainer.train(resume_from_checkpoint=opts.get("resume_from"))
    except RuntimeError as exc:
        if "simulated crash" not in str(exc):
            raise
    if opts.get("fsdp") and cp_trainer:  # FSDP2 sharded the model (and no DDP is around it)
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        assert isinstance(trainer.model, FSDPModule) and isinstance(trainer.model.lm_head.weight, DTensor)
        assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    logged = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    logged.append(("tokens", trainer.state.num_input_tokens_seen))
    logged += [("attention_forwards", forwards[0]), ("attention_dtypes", sorted(forwards[1]))]
    if opts.get("eval") is True:  # 11 documents in batches of 3 (the groups take turns)
        logged.append(("eval", trainer.evaluate()["eval_loss"]))
    return logged, trainer


def _count_attention_forwards(model) -> list:
    """[forwards of the attention modules while training (a recomputation runs them again), the
    dtypes of their outputs]."""
    count = [0, set()]

    def hook(module, args, output):
        if module.training:  # also reentrant checkpointing's first forward, which runs without grad
            count[0] += 1
            count[1].add(str(output[0].dtype))

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_hook(hook)
    return count


def _resume(folder: str, out: str, opts: dict, world: int) -> dict:
    """Train 2 * STEPS steps straight, saving every STEPS, dying while writing the last checkpoint;
    then a new trainer resumes from the newest checkpoint (``resume_from_checkpoint=True``) to the end.
    Rank 0 keeps both runs' per-step losses and both final models."""
    from transformers.trainer_utils import get_last_checkpoint

    straight, trainer = _train(folder, out, dict(opts, crash_at=2 * STEPS), world, cp_trainer=True)
    trainer.save_model(os.path.join(out, "straight"))  # the weights after the last step (not checkpointed)
    newest = get_last_checkpoint(out)
    resumed, trainer = _train(folder, out, dict(opts, resume_from=True), world, cp_trainer=True)
    steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    return {"straight": straight, "resumed": resumed, "steps": steps, "newest_after_crash": os.path.basename(newest),
            "left": sorted(os.listdir(out))}, trainer


def _main(out_dir: str, folder: str, names: list[str]) -> None:
    """Run under torchrun: every configuration of ``names`` in sequence; rank 0 writes results.json."""
    import torch.distributed as dist

    results = {}
    table = {**CONFIGS, **BAD}
    for name in sorted(names, key=lambda n: bool(table[n][1].get("fsdp"))):  # FSDP last: accelerate's state
        world, opts, *_ = table[name]
        out = os.path.join(out_dir, name)
        try:
            if opts.get("start"):  # steps 3-4 from a 2-rank run's checkpoint-2
                start = os.path.join(os.environ["SEQPAR_TEST_START"], opts["start"], "checkpoint-2")
                losses, trainer = _train(folder, out, dict(opts, resume_from=start), world, cp_trainer=True)
                trainer.save_model(out)
                record = {"resumed": losses, "steps": [h["step"] for h in trainer.state.log_history if "loss" in h]}
            elif opts.get("resume"):
                record, trainer = _resume(folder, out, opts, world)
                trainer.save_model(out)
            else:
                losses, trainer = _train(folder, out, opts, world, cp_trainer=True)
                trainer.save_model(out)
                record = {"losses": losses, "launcher_precision": os.environ.get("ACCELERATE_MIXED_PRECISION"),
                          "best": trainer.state.best_model_checkpoint}
            if opts.get("compile"):  # Dynamo compiled graphs (a fall back to eager would compile none)
                from torch._dynamo.utils import counters

                record["graphs"] = int(counters["stats"]["unique_graphs"])
                record["breaks"] = sorted(counters["graph_break"])[:5]
        except ValueError as exc:
            record = {"error": f"{type(exc).__name__}: {exc}"}
        if not dist.is_initialized():  # a refusal before the Trainer initialised torch.distributed
            dist.init_process_group("gloo")
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, record)
        results[name] = every
    if dist.get_rank() == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    # before the interpreter exits: a gloo process group left alive aborts a rank at exit at times (SIGABRT,
    # "terminate called without an active exception"), and torchrun reports the whole launch failed
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the tests


SLOW = os.environ.get("SEQPAR_SLOW") == "1"


def _names(world: int) -> list[str]:
    table = {**CONFIGS, **BAD}
    return [n for n, (w, opts, *_) in table.items()
            if w == world and (SLOW or not opts.get("slow")) and not opts.get("alone")]


def _params(world: int) -> list:
    return [pytest.param(n, marks=[pytest.mark.slow] if o.get("slow") else [])
            for n, (w, o) in CONFIGS.items()
            if w == world and not (o.get("wrong_scale") or o.get("resume") or o.get("best"))]


def _launch(world: int, names: list[str], out: Path, folder: Path, timeout: float = 420,
            launcher: str = "torchrun", start: Path | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", SEQPAR_TEST_START=str(start), PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    if launcher == "accelerate":  # `accelerate launch`: its multi-process launcher (on CPU the ranks use gloo)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(port)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    cmd += [__file__, str(out), str(folder), *names]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, f"exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from model_folders import llama_folder

    return llama_folder(tmp_path_factory.mktemp("model") / "llama", hidden=32, heads=4, kv_heads=2)


def _reference(folder: Path, tmp: Path, name: str):
    """The plain Trainer in this process on the same global batches: losses and the updated weights."""
    world, opts = CONFIGS[name]
    logged, trainer = _train(str(folder), str(tmp / f"ref_{name}"), opts, world, cp_trainer=False)
    return logged, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _compare(folder: Path, tmp: Path, out: Path, name: str, results: dict) -> tuple[float, float]:
    """Asserts the run ``name`` equals the plain Trainer; returns (largest loss error, largest
    relative update error)."""
    from transformers import AutoModelForCausalLM

    world = CONFIGS[name][0]
    records = results[name]
    assert all("error" not in r for r in records), records
    ref_losses, ref_weights = _reference(folder, tmp, name)
    start = AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(str(out / name)).state_dict()  # save_model wrote the full model
    assert len(records) == world and all(r["losses"] == records[0]["losses"] for r in records)
    extras = {tag: value for tag, value in records[0]["losses"] if isinstance(tag, str)}
    want = {tag: value for tag, value in ref_losses if isinstance(tag, str)}
    losses = [row for row in records[0]["losses"] if not isinstance(row[0], str)]
    ref_losses = [row for row in ref_losses if not isinstance(row[0], str)]
    assert extras["tokens"] == want["tokens"], (name, extras, want)  # num_input_tokens_seen: the global batches
    if want["attention_forwards"] is not None:  # 2 layers, ga micro-batches a step; checkpointing runs them twice
        opts = CONFIGS[name][1]
        every = (opts.get("gc") or {}).get("every_n_layers", 1)
        expected = opts["ga"] * STEPS * (2 + (len(range(0, 2, every)) if opts.get("gc") else 0))
        assert extras["attention_forwards"] == want["attention_forwards"] == expected, (name, extras, want)
        dtype = "torch.bfloat16" if opts.get("bf16") else "torch.float32"  # bf16=True computes in bf16
        assert extras["attention_dtypes"] == want["attention_dtypes"] == [dtype], (name, extras, want)
    if "eval" in want:  # evaluate(): the same batches' mean loss
        print(f"{name}: eval_loss error {abs(extras['eval'] - want['eval']):.2e}")
        assert abs(extras["eval"] - want["eval"]) <= LOSS_ATOL, (name, extras, want)
    assert len(losses) == len(ref_losses) == STEPS
    loss_err = max(abs(got[0] - want[0]) for got, want in zip(losses, ref_losses))
    # the logged gradient norm: of the summed gradients (DDP) or of the sharded ones (FSDP2)
    norm_err = max(abs(got[1] - want[1]) / want[1] for got, want in zip(losses, ref_losses))
    assert set(saved) == set(ref_weights)
    update_err = 0.0
    for key, want in ref_weights.items():
        update, want_update = saved[key] - start[key], want - start[key]
        update_err = max(update_err, float((update - want_update).norm() / want_update.norm().clamp(min=1e-30)))
    print(f"{name}: loss error {loss_err:.2e}, grad_norm error {norm_err:.2e}, update error {update_err:.2e} "
          "(relative)")
    return loss_err, max(update_err, norm_err)


def _assert_equal(folder: Path, tmp: Path, out: Path, name: str, results: dict) -> None:
    loss_err, update_err = _compare(folder, tmp, out, name, results)
    bf16 = CONFIGS[name][1].get("bf16")
    loss_tol, update_tol = (LOSS_ATOL_BF16, UPDATE_RTOL_BF16) if bf16 else (LOSS_ATOL, UPDATE_RTOL)
    assert loss_err <= loss_tol and update_err <= update_tol, (name, loss_err, update_err)


def _assert_resumed(out: Path, name: str, results: dict) -> None:
    """Steps 3-4 resumed from checkpoint-2 equal the straight run's bit for bit (losses, gradient
    norms, tokens seen, final weights): the checkpoint holds the exact fp32 weights, optimizer
    moments and step counts, scheduler, RNG and data position, and the same batches then run the
    same operations. The checkpoint-4 the straight run died writing never became a checkpoint."""
    from safetensors.torch import load_file

    records = results[name]
    assert all("error" not in r for r in records), records
    record = records[0]
    assert all(r["straight"] == record["straight"] and r["resumed"] == record["resumed"] for r in records)
    assert record["newest_after_crash"] == "checkpoint-2", record  # not the half-written checkpoint-4
    assert record["left"] == ["checkpoint-2", "checkpoint-4", "straight"], record  # the resumed run's save replaced it
    assert record["steps"] == [1, 2, 3, 4], record
    straight, resumed = dict(map(tuple, record["straight"][4:])), dict(map(tuple, record["resumed"][4:]))
    assert record["resumed"][2:4] == record["straight"][2:4] and straight["tokens"] == resumed["tokens"], record
    ga = CONFIGS[name][1]["ga"]  # the resumed run trained steps 3 and 4 only
    assert (straight["attention_forwards"], resumed["attention_forwards"]) == (2 * ga * 4, 2 * ga * 2), record
    want = load_file(str(out / name / "straight" / "model.safetensors"))
    got = load_file(str(out / name / "model.safetensors"))
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want), name
    print(f"{name}: steps 3-4 losses {record['resumed'][2:4]} equal the straight run's; final weights equal")


def _assert_resumed_elsewhere(out: Path, name: str, results: dict, saved: tuple) -> None:
    """Steps 3-4 resumed from another world's checkpoint-2 (another cp, or cp x dp under FSDP2) against
    that run's uninterrupted steps 3-4. What must be exact: the examples of each step (the
    tokens seen, summed over the steps, are equal) and the restored state (weights, AdamW's moments and
    step counts, the schedule: a lost one moves the loss and the updates by far more than rounding).
    What may differ: the order of the sums (another cp and dp split the attention, the loss and the
    gradient reductions otherwise), fp32 rounding, ~1e-7 relative per operation, through two AdamW
    steps; the bounds of the comparisons with the plain Trainer (LOSS_ATOL on the losses, UPDATE_RTOL on
    the gradient norms and on the update of every weight from checkpoint-2) hold it. No dropout: the RNG
    states of the ranks a checkpoint lacks change nothing here."""
    from safetensors.torch import load_file

    records = results[name]
    assert all("error" not in r for r in records), records
    assert all(r == records[0] for r in records), records
    got, start = records[0], CONFIGS[name][1]["start"]
    want = saved[1][start][0]["straight"]
    assert got["steps"] == [1, 2, 3, 4] and got["resumed"][:2] == want[:2], (got, want)  # restored records
    assert dict(map(tuple, got["resumed"][4:]))["tokens"] == dict(map(tuple, want[4:]))["tokens"], (got, want)
    loss_err = max(abs(a[0] - b[0]) for a, b in zip(got["resumed"][2:4], want[2:4]))
    norm_err = max(abs(a[1] - b[1]) / b[1] for a, b in zip(got["resumed"][2:4], want[2:4]))
    base = load_file(str(saved[0] / start / "checkpoint-2" / "model.safetensors"))
    final = load_file(str(saved[0] / start / "straight" / "model.safetensors"))
    resumed = load_file(str(out / name / "model.safetensors"))
    update_err = max(float(((resumed[k] - base[k]) - (final[k] - base[k])).norm() / (final[k] - base[k]).norm())
                     for k in final)
    print(f"{name}: steps 3-4 from {start}'s checkpoint-2: loss error {loss_err:.2e}, grad_norm error "
          f"{norm_err:.2e}, update error {update_err:.2e} (relative)")
    assert loss_err <= LOSS_ATOL and max(norm_err, update_err) <= UPDATE_RTOL, (name, loss_err, norm_err, update_err)


def _assert_best_loaded(out: Path, name: str, results: dict) -> None:
    """load_best_model_at_end: the model after training is checkpoint-1's, bit for bit (not step 2's)."""
    from safetensors.torch import load_file

    records = results[name]
    assert all("error" not in r for r in records), records
    assert all(r["best"] == str(out / name / "checkpoint-1") for r in records), records
    final = load_file(str(out / name / "model.safetensors"))
    best, last = (load_file(str(out / name / f"checkpoint-{k}" / "model.safetensors")) for k in (1, 2))
    assert all(torch.equal(final[k], best[k]) for k in final) and not all(torch.equal(final[k], last[k]) for k in final)


@pytest.fixture(scope="module")
def world2(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("world2")
    return out, _launch(2, _names(2), out, folder)


@pytest.mark.parametrize("name", _params(2))
def test_world2_matches_single_process_trainer(world2, folder, tmp_path, name):
    out, results = world2
    _assert_equal(folder, tmp_path, out, name, results)


def test_a_wrong_gradient_scale_is_caught(world2, folder, tmp_path):
    """The same run with DDP's average left unscaled (half the gradient, half the logged loss at cp 2)
    fails both bounds by far."""
    out, results = world2
    loss_err, update_err = _compare(folder, tmp_path, out, "wrong_scale", results)
    assert loss_err > 100 * LOSS_ATOL and update_err > 100 * UPDATE_RTOL, (loss_err, update_err)


def test_world2_cp2_ddp_resumes_after_a_crash_while_saving(world2):
    out, results = world2
    _assert_resumed(out, "cp2_resume", results)
    _assert_resumed(out, "cp2_fsdp2_resume", results)


@pytest.mark.parametrize("name", [n for n, (w, *_) in BAD.items() if w == 2])
def test_bad_inputs_raise_on_every_rank(world2, name):
    _, results = world2
    expected = BAD[name][2]
    records = results[name]
    assert len(records) == 2 and all(expected in r.get("error", "") for r in records), records


def test_world4_cp2_dp2_ddp_fsdp2_and_a_bad_group(folder, world2, tmp_path_factory, tmp_path):
    out = tmp_path_factory.mktemp("world4")
    names = _names(4)
    results = _launch(4, names, out, folder, start=world2[0])
    records = results["bad_resume_batch"]  # 6 sequences per micro-batch from a checkpoint of 3: refused
    assert all("data-parallel group(s) x per_device_train_batch_size 3 = 3 sequences" in r.get("error", "")
               for r in records), records
    records = results["bad_one_group"]  # the group with the bad batch names it, the other says why it stops
    assert all("ValueError" in r.get("error", "") for r in records), records
    assert sum("not right-padded" in r["error"] for r in records) == 2, records
    for name in (n for n in names if n in CONFIGS):
        if CONFIGS[name][1].get("start"):
            _assert_resumed_elsewhere(out, name, results, world2)
        elif CONFIGS[name][1].get("resume"):
            _assert_resumed(out, name, results)
        elif CONFIGS[name][1].get("best"):
            _assert_best_loaded(out, name, results)
        else:
            _assert_equal(folder, tmp_path, out, name, results)


@pytest.mark.slow
def test_fsdp2_resumes_at_a_smaller_world(folder, tmp_path_factory):
    """FSDP2's 4-rank checkpoint (cp 2 x dp 2) resumed by 2 ranks (cp 2, the same 4 sequences per
    micro-batch): DCP gathers 4 ranks' shards into 2; steps 3-4 against the uninterrupted 4-rank run."""
    out4, out2 = tmp_path_factory.mktemp("saved4"), tmp_path_factory.mktemp("resumed2")
    saved = _launch(4, ["cp2_dp2_fsdp2_resume"], out4, folder)
    results = _launch(2, ["cp2_fsdp2_from_cp2_dp2"], out2, folder, start=out4)
    _assert_resumed_elsewhere(out2, "cp2_fsdp2_from_cp2_dp2", results, (out4, saved))


def test_world3_cp3(folder, tmp_path_factory, tmp_path):
    out = tmp_path_factory.mktemp("world3")
    results = _launch(3, ["cp3_striped"], out, folder)
    _assert_equal(folder, tmp_path, out, "cp3_striped", results)


def test_accelerate_launch_matches_single_process_trainer(folder, tmp_path_factory, tmp_path):
    """The same run started by `accelerate launch` instead of torchrun (its environment: mixed
    precision and dynamo set by the launcher) equals the single-process Trainer."""
    out = tmp_path_factory.mktemp("accelerate")
    results = _launch(2, ["cp2_zigzag_ga2"], out, folder, launcher="accelerate")
    assert [r["launcher_precision"] for r in results["cp2_zigzag_ga2"]] == ["no", "no"]  # accelerate's env
    _assert_equal(folder, tmp_path, out, "cp2_zigzag_ga2", results)


@pytest.mark.slow
def test_example_script_runs_under_torchrun(tmp_path):
    """examples/hf_trainer.py as a user runs it (2 ranks, cp 2, FSDP2): it trains and saves a model
    that from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    example = Path(__file__).parents[1] / "examples" / "hf_trainer.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(example),
           "--cp", "2", "--steps", "2", "--fsdp", "--output", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).config.num_key_value_heads == 2


# ----------------------------------------------------------------------------- in one process


def test_pack_batch_forms_and_refusals():
    from seqpar.integrations.hf_trainer import count_labels, pack_batch
    from transformers import DataCollatorWithFlattening

    flat = DataCollatorWithFlattening()([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}, {"input_ids": [9, 10]}])
    packed = pack_batch(flat)
    assert packed["cu_seqlens"].tolist() == [0, 3, 4, 6] and packed["cu_seqlens"].dtype == torch.int32
    assert count_labels(packed) == 2 + 0 + 1  # next-token labels inside each document only
    rows = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "labels": torch.tensor([[1, 2, 3], [4, 5, -100]]),
            "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    packed = pack_batch(rows)  # right padding: the padded token is dropped, rows become documents
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5]] and packed["cu_seqlens"].tolist() == [0, 3, 5]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]] and count_labels(packed) == 3
    refusals = {
        "not right-padded": dict(rows, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]])),
        "a padded token carries a label": dict(rows, labels=rows["input_ids"]),
        "pixel_values cannot be split": dict(rows, pixel_values=torch.zeros(2)),
        "has no labels": {"input_ids": rows["input_ids"]},
        "position goes from 1 to 5": {"input_ids": torch.zeros(1, 4, dtype=torch.long),
                                      "labels": torch.zeros(1, 4, dtype=torch.long),
                                      "position_ids": torch.tensor([[0, 1, 5, 6]])},
    }
    for expected, batch in refusals.items():
        with pytest.raises(ValueError, match=expected):
            pack_batch(batch)


def test_one_process_equals_trainer_and_bad_arguments(folder, tmp_path):
    """context_parallel_size=1 without torch.distributed: training and evaluate() give the plain
    Trainer's numbers; arguments are refused before any work."""
    from seqpar.integrations.hf_trainer import ContextParallelTrainer
    from transformers import TrainingArguments

    opts = dict(cp=1, method="zigzag_ring", batch=3, ga=2, collator="pad")
    runs = [_train(str(folder), str(tmp_path / str(cp)), opts, 1, cp_trainer=cp) for cp in (False, True)]
    (ref_losses, ref), (losses, ours) = runs
    assert losses[STEPS:] == ref_losses[STEPS:]  # num_input_tokens_seen, attention forwards and dtypes
    assert max(abs(a[0] - b[0]) for a, b in zip(losses[:STEPS], ref_losses[:STEPS])) <= LOSS_ATOL
    data = _documents(ref.processing_class or __import__("transformers").AutoTokenizer.from_pretrained(str(folder)))
    assert abs(ours.evaluate(data[:7])["eval_loss"] - ref.evaluate(data[:7])["eval_loss"]) <= LOSS_ATOL
    args = TrainingArguments(output_dir=str(tmp_path / "x"), use_cpu=True, report_to=[])
    for kwargs, expected in [(dict(context_parallel_size=0), "context_parallel_size"),
                             (dict(cp_method="zeco"), "cp_method='zeco'"),
                             (dict(cp_options={"window": 3}), "cp_options: unknown window"),
                             (dict(context_parallel_size=2), "does not divide the world of 1")]:
        with pytest.raises(ValueError, match=expected):
            ContextParallelTrainer(model=ours.model, args=args, **kwargs)
    both = TrainingArguments(output_dir=str(tmp_path / "y"), use_cpu=True, report_to=[], fsdp=True,
                             fsdp_config={"version": 2, "activation_checkpointing": True},
                             activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"activation_checkpointing: set both ways \(fsdp_config"):
        ContextParallelTrainer(model=ours.model, args=both)
    no_shards = TrainingArguments(output_dir=str(tmp_path / "z"), use_cpu=True, report_to=[], fsdp=True,
                                  fsdp_config={"version": 2}, eval_strategy="steps", save_strategy="steps",
                                  load_best_model_at_end=True, save_only_model=True)
    with pytest.raises(ValueError, match="load_best_model_at_end: under FSDP2 .* set save_only_model=False"):
        ContextParallelTrainer(model=ours.model, args=no_shards)
    # a checkpoint saved under FSDP2 (optimizer state in fsdp2_state/ only) resumed without fsdp: the
    # Trainer would load the model and silently start a new optimizer and schedule
    saved = tmp_path / "fsdp2_saved" / "checkpoint-2"
    ours.save_model(str(saved))
    ours.state.save_to_json(str(saved / "trainer_state.json"))
    torch.save(ours.lr_scheduler.state_dict(), saved / "scheduler.pt")
    (saved / "fsdp2_state").mkdir()
    with pytest.raises(ValueError, match="resume_from_checkpoint: .* was saved under FSDP2.* fsdp=True"):
        ours.train(resume_from_checkpoint=str(saved))
    # saved by 2 groups of 3 sequences: refused before anything loads; with ignore_data_skip (the data from
    # its beginning) the layout is not checked, and the FSDP2 refusal above comes next
    (saved / "context_parallel.json").write_text(json.dumps(
        {"world_size": 4, "context_parallel_size": 2, "data_parallel_size": 2, "per_device_train_batch_size": 3,
         "gradient_accumulation_steps": 2, "fsdp": True}))
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .* per_device_train_batch_size 3 = 6 sequences"
                                         r" .*this run takes 1 x 3 = 3"):
        ours.train(resume_from_checkpoint=str(saved))
    # 3 groups of 1 sequence (3 per micro-batch, as here) under group_by_length: the order of the examples
    # depends on per_device_train_batch_size, so another one is refused too
    layout = json.loads((saved / "context_parallel.json").read_text())
    (saved / "context_parallel.json").write_text(json.dumps(
        {**layout, "world_size": 3, "context_parallel_size": 1, "data_parallel_size": 3,
         "per_device_train_batch_size": 1}))
    ours.args.train_sampling_strategy = "group_by_length"
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .* this run takes 3: with train_sampling_strategy"):
        ours.train(resume_from_checkpoint=str(saved))
    ours.args.ignore_data_skip = True
    with pytest.raises(ValueError, match="resume_from_checkpoint: .* was saved under FSDP2"):
        ours.train(resume_from_checkpoint=str(saved))



def test_resume_layout_check(tmp_path):
    """check_layout (in one process; under torchrun: bad_resume_batch): the same sequences per micro-batch
    at another world, cp and dp pass; another count or accumulation is refused with the size that fits; a
    checkpoint without the file (the plain Trainer's) is left alone."""
    from seqpar.integrations.hf_trainer.checkpoints import check_layout, save_layout

    check_layout(tmp_path, world=8, cp=8, batch=1, accumulation=1)  # no context_parallel.json
    save_layout(tmp_path, world=2, cp=2, batch=4, accumulation=2, fsdp=True)
    for world, cp, batch in ((4, 4, 4), (4, 2, 2), (8, 2, 1), (1, 1, 4)):
        check_layout(tmp_path, world=world, cp=cp, batch=batch, accumulation=2)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .* 1 data-parallel group\(s\) x per_device_train"
                                         r"_batch_size 4 = 4 sequences.*this run takes 2 x 4 = 8.*per_device_train_"
                                         r"batch_size 2 at this run's 2 data-parallel group"):
        check_layout(tmp_path, world=4, cp=2, batch=4, accumulation=2)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .*gradient_accumulation_steps 1\. The Trainer"):
        check_layout(tmp_path, world=2, cp=2, batch=4, accumulation=1)
    with pytest.raises(ValueError, match=r"a world / context_parallel_size that divides 4"):
        check_layout(tmp_path, world=3, cp=1, batch=1, accumulation=2)
    # group_by_length: the order of the examples depends on per_device_train_batch_size (megabatches of
    # batch x accumulation; 1000 examples, 10 steps of 4 trained at 1 x 4: the next 40 at 2 x 2 share none)
    check_layout(tmp_path, world=4, cp=4, batch=4, accumulation=2, grouped=True)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .* per_device_train_batch_size 4, this run "
                                         r"takes 2: with train_sampling_strategy='group_by_length'"):
        check_layout(tmp_path, world=4, cp=2, batch=2, accumulation=2, grouped=True)
    # auto_find_batch_size: transformers restores the batch the saving run had found (trainer_state.json's
    # train_batch_size) after this check, so that one is compared, not the arguments' 8
    (tmp_path / "trainer_state.json").write_text('{"train_batch_size": 4}')
    check_layout(tmp_path, world=2, cp=2, batch=8, accumulation=2, auto_batch=True)
    with pytest.raises(ValueError, match=r"this run takes 1 x 8 = 8"):
        check_layout(tmp_path, world=2, cp=2, batch=8, accumulation=2)


def test_a_save_clears_every_stale_staging_folder(tmp_path):
    """A run that died while saving leaves its .tmp-checkpoint-N (ignored by resume and rotation); the
    next save removes it whatever its step, and keeps other folders."""
    from seqpar.integrations.hf_trainer.checkpoints import staging_dir

    for name in (".tmp-checkpoint-4", ".tmp-checkpoint-7", "checkpoint-2", ".tmp-other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text("x")
    staging = staging_dir(tmp_path / "checkpoint-6", writer=True)
    assert staging == tmp_path / ".tmp-checkpoint-6" and not any(staging.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-checkpoint-6", ".tmp-other", "checkpoint-2"]

if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], sys.argv[3:])
