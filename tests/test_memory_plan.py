"""seqpar memory: the plan's arithmetic on hand-computed cases, the command line (table, JSON, plot,
the --device-memory fit and --search), bad input, and one configuration measured on gloo ranks
against the prediction (within 10%, as benchmarks/memory_validate.py does for the larger set)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from seqpar.bench.memory_cli import main, run
from seqpar.bench.memory_plan import ModelShape, Setup, attention_buffers, checkpoint_saved, layer_saved, plan
from seqpar.bench.memory_search import load_model, longest_fit, parse_bytes, search

# hidden 8, MLP 16, 2 layers, 2 query heads and 1 KV head of 4, vocabulary 10
TINY = ModelShape(name="tiny", hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10)
BENCH_DIR = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")


def _setup(**kw) -> Setup:
    base = dict(seq=8, world=2, cp=2, method="zigzag_ring", checkpointing="none", dtype="float32", loss_chunk=0,
                device="cpu")
    return Setup(**{**base, **kw})


def test_parameter_counts_and_static_bytes():
    # layer: q and o 8x8 each, k and v 8x4 each, gate/up/down 3 x 8x16, two norms of 8 = 128 + 64 + 384 + 16
    assert TINY.layer_params == 592
    # embeddings and head 10x8 each, final norm 8
    assert TINY.root_params == 168
    assert TINY.params == 2 * 592 + 168 == 1352
    moments = dict(plan(TINY, _setup()).moments)
    # 1352 parameters over 2 shards: 676 each; fp32 shard 4 B, AdamW exp_avg + exp_avg_sq 8 B
    assert moments["forward"]["parameters"] == 2704
    assert moments["forward"]["optimizer"] == 5408
    assert moments["optimizer"]["gradients"] == 2704


def test_saved_activations_per_token():
    # fp32: each norm keeps its fp32 input, normalised copy, output (3 x 4 x 8) + rsqrt 4 = 100
    # attention: q 32 + k 16 + v 16 + out 32 + lse 2 heads x 4 = 104; MLP: 4 tensors of 16 fp32 = 256
    assert layer_saved(TINY, _setup()) == {"norms": 200, "attention": 104, "mlp": 256}
    # bfloat16: norm 4 x 8 (fp32 input) + 2 x 2 x 8 + 4 = 68; attention 2 x (8+4+4+8) + 8 = 56; MLP 4 x 2 x 16
    assert layer_saved(TINY, _setup(dtype="bfloat16")) == {"norms": 136, "attention": 56, "mlp": 128}
    # ulysses on 2 ranks: each holds 1 query head and 1 KV head over all 8 tokens (4 local):
    # qh, kh, vh, outh 8 x 4 x 4 B = 128 each, lse 8 x 4 = 32, the local out 4 x 8 x 4 = 128 -> 672 / 4 tokens
    assert layer_saved(TINY, _setup(method="ulysses"))["attention"] == 168
    # checkpointing keeps the layer input (8 fp32), plus out (8 fp32) and lse (2 fp32) for "attention"
    assert checkpoint_saved(TINY, _setup(checkpointing="layer")) == 32
    assert checkpoint_saved(TINY, _setup(checkpointing="attention")) == 32 + 32 + 8
    assert checkpoint_saved(TINY, _setup()) == 560


def test_moments_by_hand():
    moments = dict(plan(TINY, _setup()).moments)
    # loss forward, 4 tokens a rank: static 8112; the root's gathered fp32 parameters 168 x 4 = 672;
    # per token: 2 layers x 560 + the final norm 100 + rotary cos/sin 2 x 4 x 4 + ids/positions/labels 24
    # = 1276 -> 5104; the loss: logits 10 x 4 and log-softmax 10 x 4 per token -> 320
    assert sum(moments["loss forward"].values()) == 8112 + 672 + 5104 + 320
    # loss backward: the loss gradient and log-softmax's gradient add 8 x 10 per token
    assert moments["loss backward"]["loss"] == 4 * (40 + 40 + 80)
    # the final norm's backward: its incoming gradient and that of its normalised input (4 x 8 each) and two
    # fp32 temporaries (4 x 8 each) a token, every layer's activations still held
    assert moments["final norm backward"]["layer"] == 4 * (32 + 32 + 64)
    assert moments["final norm backward"]["activations"] == moments["loss forward"]["activations"]
    # the ring's forward buffers: K,V of two steps 2 x 2 x 16, fp32 out + lse accumulators and a block's 4 x 10 x 2
    assert attention_buffers(TINY, _setup())["forward"] == 64 + 40 + 40
    # allgather_kv holds every rank's K,V: cp 2 x 2 x 16 bytes a token
    assert attention_buffers(TINY, _setup(method="allgather_kv"))["forward"] == 64 + 40 + 40
    assert attention_buffers(TINY, _setup(method="allgather_kv", cp=4, world=4))["forward"] == 4 * 32 + 40 + 40
    # the chunked loss, chunks of 2 tokens, fp32: the hidden-state gradient 4 x 8 x 4 tokens = 128 and the
    # head's fp32 gradient 4 x 10 x 8 = 320 from the start; at a chunk's weight gradient its fp32 softmax
    # 4 x 2 x 10 = 80 and the product g.T @ h 4 x 10 x 8 = 320; the full logits are never kept
    from seqpar.bench.memory_plan import loss_terms

    assert loss_terms(TINY, _setup(loss_chunk=2)) == {"forward": 448 + 400, "backward": 448, "kept": 0}
    # bfloat16: the hidden gradient 2 x 8 x 4 = 64; at the weight gradient the chunk's fp32 softmax 80, its
    # bf16 copy 40 and the bf16 product 160; backward casts the head's fp32 gradient to bf16 (160)
    assert loss_terms(TINY, _setup(loss_chunk=2, dtype="bfloat16")) == {"forward": 384 + 280, "backward": 384 + 160,
                                                                        "kept": 0}
    p = plan(TINY, _setup())
    assert p.peak == max(sum(v.values()) for _, v in p.moments)
    assert sum(p.components().values()) == p.peak


def test_checkpointing_and_cp_lower_the_peak_of_a_real_model():
    m = load_model("llama3-8b")
    assert abs(m.params - 8.03e9) < 0.01e9  # Llama-3-8B's published count
    assert abs(load_model("llama3-70b").params - 70.55e9) < 0.05e9
    base = Setup(seq=131072, world=8, cp=8, dtype="bfloat16")
    peaks = {ck: plan(m, Setup(seq=131072, world=8, cp=8, checkpointing=ck)).peak for ck in ("none", "attention", "layer")}
    assert peaks["none"] > peaks["attention"] > peaks["layer"]
    assert plan(m, Setup(seq=131072, world=8, cp=4)).peak > plan(m, base).peak
    assert plan(m, Setup(seq=131072, world=8, cp=8, loss_chunk=0)).peak > plan(m, base).peak


def test_longest_fit_is_the_boundary():
    m = load_model("llama3-8b")
    s = Setup(seq=16, world=8, cp=8, checkpointing="layer")
    limit = parse_bytes("80GB")
    best = longest_fit(m, s, limit)
    assert best % 16 == 0 and best > 0  # zigzag on 8 ranks: multiples of 16 tokens
    from dataclasses import replace

    assert plan(m, replace(s, seq=best)).peak <= limit < plan(m, replace(s, seq=best + 16)).peak
    assert longest_fit(m, s, 10**9) == 0  # 1 GB holds not even the optimizer state


def test_search_prefers_small_cp_and_light_checkpointing():
    m = load_model("llama3-8b")
    found = search(m, 131072, 8, Setup(seq=16, world=8, cp=8), parse_bytes("80GB") * 9 // 10)
    best = found["best"]
    assert best is not None and best.peak <= found["limit"]
    for p in (x for x in found["by_cp"].values() if x is not None):
        assert p.setup.cp >= best.setup.cp
    assert found["by_cp"][1] is None  # 128K tokens on one GPU: too long for 80 GB


def test_cli_table_json_plot(tmp_path, capsys):
    from seqpar.cli import main as seqpar_main

    png = tmp_path / "m.png"
    assert seqpar_main(["memory", "--model", "llama3-8b", "--seq", "128k", "--world", "8", "--checkpointing", "layer",
                 "--device-memory", "80GB", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "activations" in out and "fits" in out and "longest sequence" in out
    assert png.stat().st_size > 10_000
    assert main(["--model", "llama3-8b", "--seq-len", "128k", "--world", "8", "--device-memory", "80GB", "--search",
                 "--json"]) == 0  # --seq-len: seqpar train's spelling of --seq
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["setup"]["seq"] == 131072 and report["fits"] is False
    assert report["search"]["best"]["peak_bytes"] <= report["limit_bytes"]
    assert report["longest_seq"] < 131072


def test_cli_model_folder_and_fit_only(tmp_path):
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    report = run(["--model", str(tmp_path), "--world", "2", "--device-memory", "1GiB", "--dtype", "float32"])
    assert report["longest_seq"] > 0 and "plan" not in report
    assert report["params"] == 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 128) + 100 * 64 + 64


@pytest.mark.parametrize("argv, flag", [
    (["--model", "llama3-8b", "--seq", "128k", "--world", "8", "--cp", "3"], "--cp"),
    (["--model", "llama3-8b", "--seq", "100", "--world", "8"], "--seq"),
    (["--model", "llama3-8b", "--seq", "12x", "--world", "8"], "--seq"),
    (["--model", "llama3-8b", "--world", "8"], "--seq"),
    (["--model", "no-such-model", "--seq", "8k"], "--model"),
    (["--model", "llama3-8b", "--seq", "8k", "--method", "zeco"], "--method"),
    (["--model", "llama3-8b", "--seq", "8k", "--checkpointing", "full"], "--checkpointing"),
    (["--model", "llama3-8b", "--seq", "8k", "--dtype", "int8"], "--dtype"),
    (["--model", "llama3-8b", "--seq", "8k", "--device-memory", "lots"], "--device-memory"),
    (["--model", "llama3-8b", "--seq", "8k", "--search"], "--search"),
    (["--model", "llama3-8b", "--seq", "8k", "--world", "0"], "--world"),
    (["--model", "llama3-8b", "--seq", "8k", "--world", "64", "--method", "ulysses"], "--cp"),
    (["--model", "llama3-8b", "--seq", "8k", "--loss-chunk", "-1"], "--loss-chunk"),
])
def test_bad_input_names_the_flag(argv, flag, capsys):
    with pytest.raises(ValueError, match=flag):
        run(argv)
    assert main(argv) == 2
    assert flag in capsys.readouterr().err


def _measure(config, cp, method, checkpointing, dtype, seq):
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    from memory_validate import _measure_rank

    return _measure_rank(config, cp, method, checkpointing, dtype, seq)


def test_measured_peak_within_10_percent():
    """A real FSDP2 + zigzag_ring training step of a small Llama on 2 gloo ranks, with layer
    checkpointing: the busiest rank's measured peak (static tensors + profiler allocator events) is
    within 10% of the plan's."""
    from seqpar.testing import run_distributed

    config = {"hidden_size": 256, "intermediate_size": 640, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 8192}
    seq = 4096
    ranks = run_distributed(_measure, 2, config, 2, "zigzag_ring", "layer", "float32", seq, timeout=300)
    measured = max(r["peak"] for r in ranks)
    predicted = plan(ModelShape.from_dict(config), Setup(seq=seq, world=2, cp=2, method="zigzag_ring",
                                                         checkpointing="layer", dtype="float32", loss_chunk=0,
                                                         device="cpu")).peak
    assert abs(predicted / measured - 1) < 0.10, (predicted, measured)
