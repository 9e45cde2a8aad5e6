"""``seqpar train --eval-data PATH --eval-every N --eval-batches K``: the held-out loss.

A tiny real-format Llama folder (tests/model_folders.py: tied embeddings, GQA, a BPE tokenizer) trained
3 fp32 steps on text files, 2 sequences of 64 tokens a step; the held-out documents are a JSONL file,
5 sequences evaluated after steps 2 and 3. The evaluation of one process, of cp 2 (2 ranks, FSDP2) and of
cp 2 x dp 2 with USP (4 ranks: 5 sequences over 2 data-parallel groups, so one group runs a weight-0
pass) agree, and the one-process value equals the same loss computed in float64 by the plain
transformers model loaded from the run's export, document by document. The step records are the same
with and without evaluation, one process and 2 ranks. A run resumed from the step-2 checkpoint
evaluates step 3 to the same value. Bad flags fail before any rank starts.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from model_folders import llama_folder, text_documents  # noqa: E402

from seqpar.integrations.train import train  # noqa: E402
from seqpar.integrations.train.config import parse_args  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402

# Other configurations compute the same sums in another order (blockwise softmax, FSDP2's gradient
# reduce-scatter, the sharded norm): fp32 rounding, ~1e-7 relative per operation, which AdamW's
# 1/sqrt(v) amplifies in the weights over 3 steps to ~1e-6 of the loss (test_train_fsdp's bound).
# 2e-5 still catches a lost or double-counted sequence (each is ~20% of the labels and moves the
# mean by ~1e-2), a label crossing a document boundary, or a mean taken per rank instead of per label.
RTOL = 2e-5
# Against the float64 reference on the same (exported fp32) weights only the fp32 forward's rounding
# differs (~1e-7 per operation, averaging out over 300 labels): measured 1e-8 relative.
REF_RTOL = 1e-6
SEQ_LEN, K = 64, 5
# fields of a step record that are a function of the computation alone (not of the clock or of memory)
EXACT = ("step", "loss", "lr", "grad_norm", "tokens", "world", "model_flops", "context_parallel")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    model = llama_folder(tmp / "model", tied=True, hidden=32, heads=4, kv_heads=2)
    data = tmp / "data"
    data.mkdir()
    for i, doc in enumerate(text_documents(30)):
        (data / f"doc{i:03d}.txt").write_text(doc)
    held = tmp / "held.jsonl"
    held.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in text_documents(20, seed=1)))
    return tmp, model, data, held


def _args(folders, name, *extra):
    tmp, model, data, _ = folders
    return [str(a) for a in ("--model", model, "--data", data, "--seq-len", SEQ_LEN, "--batch-size", 2, "--steps", 3,
                             "--lr", 1e-3, "--no-progress", "--log-every", 1000, "--json", tmp / f"{name}.jsonl",
                             *extra)]


def _eval(folders):
    return ("--eval-data", folders[3], "--eval-every", 2, "--eval-batches", K)


def _run(argv: list[str]):
    """Rank 0's (step records, eval records) of ``seqpar train argv`` on this pool's ranks (the
    persistent test pools, instead of --nproc's new processes) or in this process."""
    from seqpar.integrations.train.trainer import _rank_main

    result = _rank_main(parse_args(argv))
    return None if result is None else (result.history, result.evals)


@pytest.fixture(scope="module")
def runs(folders):
    """One process with evaluation (saving at step 2, exporting, plotting; the plot's lines recorded),
    without it; cp 2 with and without; cp 2 x dp 2 with USP."""
    from matplotlib.figure import Figure

    tmp = folders[0]
    plotted, savefig = [], Figure.savefig

    def recording(fig, *args, **kwargs):
        plotted.extend((line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines)
        return savefig(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", recording)
        one = train(_args(folders, "one", *_eval(folders), "--save", tmp / "ckpt", "--save-every", 2,
                          "--export-hf", tmp / "export", "--plot", tmp / "loss.png"))
    plain = train(_args(folders, "plain"))
    cp2 = run_distributed(_run, 2, _args(folders, "cp2", *_eval(folders), "--context-parallel", 2), timeout=300)[0]
    cp2_plain = run_distributed(_run, 2, _args(folders, "cp2_plain", "--context-parallel", 2), timeout=300)[0]
    four = run_distributed(_run, 4, _args(folders, "four", *_eval(folders), "--context-parallel", 2, "--cp-method",
                                          "usp"), timeout=300)[0]
    return {"one": (one.history, one.evals), "plain": (plain.history, plain.evals), "cp2": cp2,
            "cp2_plain": cp2_plain, "four": four, "plotted": plotted}


def _close(got: list[dict], want: list[dict], rtol: float) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, 3]
    for a, b in zip(got, want):
        assert a["eval_tokens"] == b["eval_tokens"] and a["eval_sequences"] == b["eval_sequences"] == K
        assert abs(a["eval_loss"] - b["eval_loss"]) <= rtol * abs(b["eval_loss"]), (a, b)


def _reference(model_dir, held, count: int) -> tuple[float, int]:
    """The token-weighted mean loss of the first ``count`` evaluation sequences, computed in float64 by
    the plain transformers model, one document segment at a time (positions from 0, no label across a
    boundary); the sequences come from seqpar's packing of ``held`` with the evaluation seed."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqpar.integrations.train.evaluate import EVAL_SEED
    from seqpar.integrations.train.tokens import open_token_data

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).double().eval()
    data = open_token_data(held, AutoTokenizer.from_pretrained(str(model_dir)), SEQ_LEN, EVAL_SEED)
    total, labels = 0.0, 0
    with torch.no_grad():
        for i in range(count):
            tokens, cu = data.sequence(i)
            for a, b in zip(cu[:-1], cu[1:]):
                segment = tokens[a:b][None]
                logits = model(input_ids=segment).logits[0, :-1]
                total += float(F.cross_entropy(logits, segment[0, 1:], reduction="sum"))
                labels += b - a - 1
    return total / labels, labels


def test_one_process_equals_plain_transformers(folders, runs):
    tmp, _, _, held = folders
    _, evals = runs["one"]
    want, labels = _reference(tmp / "export", held, K)  # the weights after step 3, as the run exported them
    got = evals[-1]
    print(f"eval loss {got['eval_loss']!r}, float64 reference {want!r}")
    assert got["step"] == 3 and got["eval_tokens"] == labels
    assert abs(got["eval_loss"] - want) <= REF_RTOL * want
    assert got["eval_ppl"] == pytest.approx(math.exp(got["eval_loss"]), rel=1e-12)


def test_context_parallel_and_data_parallel_equal_one_process(runs):
    _close(runs["cp2"][1], runs["one"][1], RTOL)
    _close(runs["four"][1], runs["one"][1], RTOL)  # usp, cp 2 x dp 2: one group runs a weight-0 pass


def test_evaluation_leaves_training_as_it_was(runs):
    """Step records with and without evaluation: bit-identical (data order, RNG, learning rate, FSDP2's
    state after a no_grad forward)."""
    for with_eval, without in (("one", "plain"), ("cp2", "cp2_plain")):
        got, want = runs[with_eval][0], runs[without][0]
        assert [{k: r[k] for k in EXACT} for r in got] == [{k: r[k] for k in EXACT} for r in want], with_eval
    assert runs["plain"][1] == []


def test_records_lines_end_record_and_plot(folders, runs, capsys):
    tmp = folders[0]
    lines = [json.loads(line) for line in (tmp / "one.jsonl").read_text().splitlines()]
    evals = [r for r in lines if r.get("event") == "eval"]
    assert evals == runs["one"][1]
    assert [r.get("event", r.get("step")) for r in lines] == ["start", 1, 2, "eval", 3, "eval", "end"]
    assert set(evals[0]) == {"event", "step", "eval_loss", "eval_ppl", "eval_tokens", "eval_sequences", "eval_s"}
    assert lines[-1]["final_eval_loss"] == evals[-1]["eval_loss"]
    assert "final_eval_loss" not in [json.loads(x) for x in (tmp / "plain.jsonl").read_text().splitlines()][-1]
    train_line, eval_line = runs["plotted"]
    assert train_line[:2] == ("train", [1, 2, 3]) and eval_line[0] == "eval (held-out)"
    assert eval_line[1:] == ([2, 3], [r["eval_loss"] for r in evals])


def test_resume_evaluates_the_same_value(folders, runs):
    """The step-2 checkpoint resumed in one process and at cp 2: step 3's evaluation equals the
    uninterrupted run's (bitwise in one process), and the step-2 evaluation is restored; resumed with
    another --eval-batches, it is not."""
    tmp = folders[0]
    resumed = train(_args(folders, "resumed", *_eval(folders), "--resume", tmp / "ckpt" / "step_00000002"))
    assert resumed.start_step == 2 and len(resumed.evals) == 2 and resumed.evals[0] == runs["one"][1][0]
    assert resumed.evals[1]["eval_loss"] == runs["one"][1][1]["eval_loss"]
    _, evals = run_distributed(_run, 2, _args(folders, "resumed2", *_eval(folders), "--context-parallel", 2,
                                              "--resume", tmp / "ckpt" / "step_00000002"), timeout=300)[0]
    _close(evals, runs["one"][1], RTOL)
    # another evaluation set: the saved evaluations are not mixed in
    other = train(_args(folders, "resumed3", *_eval(folders)[:-1], K - 1, "--resume", tmp / "ckpt" / "step_00000002"))
    assert [(r["step"], r["eval_sequences"]) for r in other.evals] == [(3, K - 1)]


def test_text_folder_default_flags_and_autocast(tmp_path, capsys):
    """Byte-level data (--model-config, no --model), --eval-data a folder of text files, no other eval flag:
    one evaluation, after the last step, of the 4 sequences the folder holds (--eval-batches' default 32
    capped, said at start). In one process bfloat16 evaluates under autocast, like its training forward:
    with the weights left as initialised (lr 1e-30) it differs from the fp32 evaluation by bf16's
    rounding (8 significant bits, 3.9e-3 per rounding, averaged over ~500 labels of near-uniform
    logits: measured 1.5e-5 relative; the bound 1e-3), and is not equal to it (fp32: no autocast)."""
    from test_trainer import TINY

    (tmp_path / "model.json").write_text(json.dumps(TINY))
    held = tmp_path / "held"
    held.mkdir()
    for i, doc in enumerate(text_documents(3, seed=2)):
        (held / f"{i}.txt").write_text((doc + " ") * (1 + 150 // len(doc)))  # 506 bytes + BOS, EOS: 512 tokens
    evals = {}
    for dtype in ("float32", "bfloat16"):
        res = train(["--model-config", str(tmp_path / "model.json"), "--seq-len", "128", "--steps", "2",
                     "--lr", "1e-30", "--no-progress", "--dtype", dtype, "--eval-data", str(held)])
        evals[dtype] = res.evals
    out = capsys.readouterr().out
    assert "evaluation at the end: 4 x 128 tokens of" in out and "--eval-batches 32 asked for more" in out
    assert [(r["step"], r["eval_sequences"]) for r in evals["float32"]] == [(2, 4)]
    fp32, bf16 = evals["float32"][0]["eval_loss"], evals["bfloat16"][0]["eval_loss"]
    assert evals["bfloat16"][0]["eval_tokens"] == evals["float32"][0]["eval_tokens"]
    assert 0 < abs(bf16 - fp32) <= 1e-3 * fp32, (bf16, fp32)


@pytest.mark.slow
@pytest.mark.parametrize("world, extra", [(2, ("--adaptive",)), (3, ("--context-parallel", 3)),
                                          (4, ("--adaptive", "--dtype", "bfloat16"))])
def test_adaptive_and_cp3_equal_one_process(folders, runs, world, extra):
    """--adaptive plans the 5 sequences in batches of 2 (the last batch leaves a group without a
    sequence: a weight-0 pass); cp 3 shards 64 tokens over 3 ranks. bf16 (FSDP2 mixed precision)
    against the fp32 run: bf16 keeps 8 significant bits (3.9e-3 per rounding), but the mean over 313
    labels of near-uniform logits averages them out: measured 4.9e-6 relative. 1e-3 leaves room and
    still catches a loss computed in bf16 itself (its rounding alone is 4e-3 of 5.8) or a lost sequence
    (eval_tokens, exact)."""
    name = "_".join(map(str, ("w", world, *extra))).replace("-", "")
    evals = run_distributed(_run, world, _args(folders, name, *_eval(folders), *extra), timeout=300)[0][1]
    print(name, [abs(a["eval_loss"] / b["eval_loss"] - 1) for a, b in zip(evals, runs["one"][1])])
    _close(evals, runs["one"][1], 1e-3 if "bfloat16" in extra else RTOL)


@pytest.mark.parametrize("extra, message", [
    (("--eval-every", 2), "--eval-every: evaluation needs held-out data; add --eval-data"),
    (("--eval-batches", 4), "--eval-batches: evaluation needs held-out data"),
    (("--eval-data", "{held}", "--eval-every", -1), "--eval-every: expected a number of steps >= 0"),
    (("--eval-data", "{held}", "--eval-batches", 0), "--eval-batches: expected a positive number"),
    (("--eval-data", "{tmp}/missing.jsonl"), "--eval-data: .*does not exist"),
    (("--eval-data", "{tmp}/short.jsonl"), "--eval-data: the documents hold .* fewer than one sequence"),
    (("--eval-data", "{tmp}/bad.jsonl"), "--eval-data: .*bad.jsonl at byte 0: not a JSON object"),
])
def test_bad_eval_flags(folders, extra, message):
    tmp, _, _, held = folders
    (tmp / "short.jsonl").write_text(json.dumps({"text": "too short"}) + "\n")
    (tmp / "bad.jsonl").write_text(json.dumps({"title": "no text field"}) + "\n")
    extra = [str(e).format(held=held, tmp=tmp) for e in extra]
    with pytest.raises(ValueError, match=message):
        train(_args(folders, "bad", *extra, "--nproc", 2))  # refused before any rank starts
