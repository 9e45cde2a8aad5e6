"""``seqpar train --rope-theta / --rope-scaling / --max-position-embeddings``: a model's RoPE changed for
continued pretraining at a longer context.

A tiny Llama folder (tests/model_folders.py's tokenizer; weights ~N(0, 0.2), so that the RoPE moves the
loss visibly) trained at cp 2 (2 gloo ranks, FSDP2) with ``--rope-theta 300``, with a YaRN ``--rope-scaling``
(factor 4 from 16 positions, ``--max-position-embeddings 64``) and a "dynamic" one (frequencies from the
sequence's length, made the same on both ranks by hf/rope.py): the first step's loss
equals the float64 loss of the plain transformers model loaded from the folder with the same change made
to its config by hand, and differs from the unchanged model's; so does a Gemma-3 folder's (one RoPE per
layer type) with --rope-scaling keyed by layer type. The run's ``--json`` start line and its
checkpoint record the values; ``--export-hf`` writes a config that ``from_pretrained`` reads back to the
same RoPE, and the exported model's float64 loss is the run's; a resume with other values is refused,
naming the flags; bad values fail before any rank starts, naming the flag.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from model_folders import _save, spread_weights, text_documents, tiny_tokenizer  # noqa: E402

from seqpar.integrations.train import train  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402
from test_train_eval import _run  # noqa: E402

SEQ_LEN, BATCH = 64, 2
# cp 2's fp32 forward against float64 on the same weights: ~1e-7 relative per operation, averaging out
# over ~120 labels (measured below 1e-7); the changed RoPE moves the loss by more than 1e-3 relative
REF_RTOL = 1e-6
CHANGE = 1e-3
THETA = 300.0
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
# length-dependent: NTK scaling from the whole sequence's largest position past 16, whichever rank holds it
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("rope_flags")
    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    spread_weights(model)  # larger weights than the init's 0.02: the RoPE changes the loss visibly
    _save(model, tmp / "model", tok, False)
    data = tmp / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in text_documents(30, seed=2)))
    return tmp


def _args(tmp, name, *extra):
    return [str(a) for a in ("--model", tmp / "model", "--data", tmp / "docs.jsonl", "--seq-len", SEQ_LEN,
                             "--batch-size", BATCH, "--steps", 1, "--lr", 1e-30, "--no-progress",
                             "--json", tmp / f"{name}.jsonl", *extra)]


def _yarn_flags():
    return ("--rope-scaling", json.dumps(YARN), "--max-position-embeddings", 64)


def _loss(model_dir, tmp, rope_parameters=None, max_positions=None, packed=False) -> float:
    """Step 1's loss in float64 by the plain transformers model loaded from ``model_dir``, its config's
    RoPE changed by hand first: the first BATCH packed sequences, one document at a time (positions from
    0, no label across a boundary), the token-weighted mean. ``packed``: each sequence in one forward with
    its documents' restarting position ids (transformers' packed form), whose largest position chooses a
    length-dependent RoPE's frequencies, as seqpar's packed forward does (hf/rope.py)."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from seqpar.integrations.hf import IGNORE_INDEX, shift_labels
    from seqpar.integrations.train.tokens import open_token_data

    config = AutoConfig.from_pretrained(str(model_dir))
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    if max_positions is not None:
        config.max_position_embeddings = max_positions
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config).double().eval()
    data = open_token_data(str(tmp / "docs.jsonl"), AutoTokenizer.from_pretrained(str(model_dir)), SEQ_LEN, 0)
    total, labels = 0.0, 0
    with torch.no_grad():
        for i in range(BATCH):
            tokens, cu = data.sequence(i)
            if packed:
                positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
                targets = shift_labels(tokens[None], torch.tensor(cu))[0]
                logits = model(input_ids=tokens[None], position_ids=positions, use_cache=False).logits[0]
                total += float(F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"))
                labels += int((targets != IGNORE_INDEX).sum())
                continue
            for a, b in zip(cu[:-1], cu[1:]):
                segment = tokens[a:b][None]
                logits = model(input_ids=segment).logits[0, :-1]
                total += float(F.cross_entropy(logits, segment[0, 1:], reduction="sum"))
                labels += b - a - 1
    return total / labels


@pytest.fixture(scope="module")
def runs(folders):
    tmp = folders
    theta = run_distributed(_run, 2, _args(tmp, "theta", "--context-parallel", 2, "--rope-theta", THETA),
                            timeout=300)[0][0]
    yarn = run_distributed(_run, 2, _args(tmp, "yarn", "--context-parallel", 2, *_yarn_flags(), "--save",
                                          tmp / "ckpt", "--export-hf", tmp / "export"), timeout=300)[0][0]
    dynamic = run_distributed(_run, 2, _args(tmp, "dynamic", "--context-parallel", 2, "--rope-scaling",
                                             json.dumps(DYNAMIC)), timeout=300)[0][0]
    return {"theta": theta[0]["loss"], "yarn": yarn[0]["loss"], "dynamic": dynamic[0]["loss"]}


def test_changed_rope_at_cp2_equals_transformers(folders, runs):
    tmp = folders
    plain = _loss(tmp / "model", tmp)
    theta = _loss(tmp / "model", tmp, {"rope_type": "default", "rope_theta": THETA})
    yarn = _loss(tmp / "model", tmp, {**YARN, "rope_theta": 10000.0}, 64)
    dynamic = _loss(tmp / "model", tmp, {**DYNAMIC, "rope_theta": 10000.0}, packed=True)
    print(f"step-1 loss: --rope-theta {runs['theta']!r} (float64 {theta!r}), yarn {runs['yarn']!r} (float64 "
          f"{yarn!r}), dynamic {runs['dynamic']!r} (float64 {dynamic!r}), unchanged float64 {plain!r}")
    for name, want in (("theta", theta), ("yarn", yarn), ("dynamic", dynamic)):
        assert abs(runs[name] - want) <= REF_RTOL * want, name
        assert abs(want - plain) > CHANGE * plain, name  # the test fails if the flag is ignored


def test_values_recorded_in_log_and_checkpoint(folders, runs):
    tmp = folders
    start = json.loads((tmp / "yarn.jsonl").read_text().splitlines()[0])
    want = {"rope_parameters": {**YARN, "rope_theta": 10000.0}, "max_position_embeddings": 64}
    assert start["event"] == "start" and start["rope"] == want
    assert start["config"]["rope_scaling"] == json.dumps(YARN) and start["config"]["max_position_embeddings"] == 64
    theta = json.loads((tmp / "theta.jsonl").read_text().splitlines()[0])
    assert theta["rope"]["rope_parameters"] == {"rope_type": "default", "rope_theta": THETA}
    meta = json.loads((tmp / "ckpt" / "step_00000001" / "meta.json").read_text())
    assert meta["run"]["rope"] == want
    assert meta["model"]["config"]["rope_parameters"] == want["rope_parameters"]


def test_export_round_trips(folders, runs):
    """``from_pretrained`` of the export: the YaRN RoPE and length of the run, and its float64 loss (weights
    left as read: lr 1e-30) the run's; read with the original RoPE it would differ (the previous test)."""
    from transformers import AutoConfig

    tmp = folders
    config = AutoConfig.from_pretrained(str(tmp / "export"))
    assert config.rope_parameters == {**YARN, "rope_theta": 10000.0} and config.max_position_embeddings == 64
    got = _loss(tmp / "export", tmp)
    assert abs(runs["yarn"] - got) <= REF_RTOL * got


def test_resume_with_other_values_is_refused(folders, runs):
    tmp = folders
    ckpt = tmp / "ckpt" / "step_00000001"
    other = {**YARN, "factor": 2.0}
    for flags in (("--rope-scaling", json.dumps(other), "--max-position-embeddings", 32), ()):
        with pytest.raises(ValueError, match=r"--resume: .* another RoPE .*rope_parameters.*--rope-scaling"):
            train(_args(tmp, "resumed", *flags, "--steps", 2, "--resume", ckpt))
    # refused before any rank starts or reads the model (meta.json's model config, its RoPE entries), not by
    # the ranks after the build
    with pytest.raises(ValueError, match=r"--resume: .* another RoPE .*max_position_embeddings: checkpoint 64") as exc:
        train(_args(tmp, "resumed", "--steps", 2, "--resume", ckpt, "--nproc", 2, "--context-parallel", 2))
    assert "Rank 0 traceback" not in str(exc.value), str(exc.value)
    resumed = train(_args(tmp, "resumed", *_yarn_flags(), "--steps", 2, "--resume", ckpt))
    assert resumed.start_step == 1 and [r["step"] for r in resumed.history] == [1, 2]


@pytest.mark.parametrize("flags, match", [
    (("--rope-theta", -1), r"--rope-theta: expected a positive finite base"),
    (("--rope-theta", "inf"), r"--rope-theta: expected a positive finite base"),
    (("--rope-scaling", "{factor: 2}"), r"--rope-scaling: not valid JSON"),
    (("--rope-scaling", "[2]"), r"--rope-scaling: expected a non-empty JSON object"),
    (("--rope-scaling", '{"rope_type": "stretch", "factor": 2}'), r"--rope-scaling: 'rope_type' must be one of"),
    (("--rope-scaling", '{"rope_type": "yarn", "factor": 4}'), r"--rope-scaling: .*needs 'original_max_position"),
    (("--rope-scaling", '{"rope_type": "linear", "factr": 2}'), r"--rope-scaling: .*Missing required keys"),
    (("--rope-scaling", '{"rope_type": "linear", "factor": 0.5}'), r"--rope-scaling: .*factor field must be"),
    (("--rope-scaling", '{"rope_type": "linear", "factor": 2, "beta": 1}'), r"--rope-scaling: .*Unrecognized keys"),
    # seqpar's message every time (transformers logs its own, "Using the explicit factor", once per process)
    (("--rope-scaling", json.dumps(YARN), "--max-position-embeddings", 32),
     r"--rope-scaling/--max-position-embeddings: YaRN's factor 4.0 disagrees .* set --max-position-embeddings to 64"),
    # what transformers lets through: trained with every position rotated alike; or failing once built
    (("--rope-scaling", '{"rope_type": "linear", "factor": Infinity}'), r"--rope-scaling: 'factor' must be finite"),
    (("--rope-scaling", '{"rope_type": "linear", "factor": 2, "rope_theta": "1e4"}'), r"'rope_theta' must be a pos"),
    (("--rope-scaling", '{"rope_type": "linear", "factor": 2, "partial_rotary_factor": 0.5}'),
     r"--rope-scaling: 'partial_rotary_factor' is the model's architecture"),
    (("--max-position-embeddings", 0), r"--max-position-embeddings: expected a positive length"),
    # the length-dependent types go through --adaptive's refusal like a model folder's own (hf/rope.py)
    (("--rope-scaling", '{"rope_type": "dynamic", "factor": 2}', "--adaptive", "--nproc", 2),
     r"--adaptive: the model's RoPE \(dynamic\)"),
])
def test_bad_values_fail_before_any_rank_starts(folders, flags, match):
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process warnings as in a new process
    with pytest.raises(ValueError, match=match):
        train(_args(folders, "bad", *flags))


def test_per_layer_type_rope_at_cp2_equals_transformers(folders):
    """A tiny Gemma-3 folder (one sliding-window layer with its own RoPE, one full-attention layer):
    --rope-scaling keyed by layer type (the full layers linear x4, the sliding ones another base) at cp 2
    equals the float64 transformers model with the same nested rope_parameters set by hand."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tmp = folders
    tok = tiny_tokenizer()
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    spread_weights(model)
    _save(model, tmp / "gemma3", tok, False)
    scaling = {"full_attention": {"rope_type": "linear", "factor": 4.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    argv = [a if a != str(tmp / "model") else str(tmp / "gemma3")
            for a in _args(tmp, "gemma3", "--context-parallel", 2, "--rope-scaling", json.dumps(scaling))]
    got = run_distributed(_run, 2, argv, timeout=300)[0][0][0]["loss"]
    want = _loss(tmp / "gemma3", tmp, {"full_attention": {**scaling["full_attention"], "rope_theta": 1e6},
                                       "sliding_attention": scaling["sliding_attention"]})
    plain = _loss(tmp / "gemma3", tmp)
    print(f"gemma3 step-1 loss {got!r}, float64 {want!r}, unchanged {plain!r}")
    assert abs(got - want) <= REF_RTOL * want and abs(want - plain) > CHANGE * plain


def test_per_layer_type_rope(tmp_path):
    """Gemma-3 (one RoPE per layer type): --rope-theta is refused (which type's base?), a flat --rope-scaling
    too; one keyed by layer type changes that type only."""
    from seqpar.integrations.train.build import model_config
    from seqpar.integrations.train.config import parse_args

    path = tmp_path / "gemma3.json"
    path.write_text(json.dumps({"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 8,
                                "layer_types": ["sliding_attention", "full_attention"]}))
    base = ["--model-config", str(path), "--steps", 1]
    with pytest.raises(ValueError, match=r"--rope-theta: the model has one RoPE per layer type"):
        train([str(a) for a in (*base, "--rope-theta", 1e6)])
    with pytest.raises(ValueError, match=r"--rope-scaling: the model has one RoPE per layer type.*got keys rope_type"):
        train([str(a) for a in (*base, "--rope-scaling", '{"rope_type": "linear", "factor": 8}')])
    scaling = {"full_attention": {"rope_type": "linear", "factor": 8.0}}
    cfg = parse_args([str(a) for a in (*base, "--rope-scaling", json.dumps(scaling))])
    got = model_config(cfg, None).rope_parameters
    assert got["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    assert got["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_phi3_longrope_keeps_the_given_original_length():
    """Phi-3's config holds original_max_position_embeddings outside rope_parameters too, and transformers'
    standardisation copies that one in: the flag's value must land in both (else 16 would replace 64)."""
    from transformers import Phi3Config

    from seqpar.integrations.train import rope_flags
    from seqpar.integrations.train.config import parse_args

    config = Phi3Config(hidden_size=32, num_attention_heads=4, max_position_embeddings=256,
                        original_max_position_embeddings=16)
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0] * 4,
               "long_factor": [1.0, 2.0, 3.0, 4.0]}
    got = rope_flags.apply(config, parse_args(["--rope-scaling", json.dumps(scaling)]))
    assert got.rope_parameters == {**scaling, "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    assert got.original_max_position_embeddings == 64 and config.original_max_position_embeddings == 16


@pytest.mark.parametrize("state", ["logging.disable", "logger disabled", "a filter", "registry reset"])
def test_refusal_does_not_depend_on_the_process_logging(state, monkeypatch):
    """What transformers' RoPE validation only logs (a linear factor below 1) is refused whatever the
    process did to logging before: in the whole test session an earlier test's state let such a run
    train (factor 0.5, 'DID NOT RAISE'), where the file alone refused it."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from seqpar.integrations.train import rope_flags

    name = "transformers.modeling_rope_utils"
    logger = logging.getLogger(name)
    if state == "logging.disable":
        logging.disable(logging.WARNING)  # lifted below (logging.disable also clears the loggers' caches)
    elif state == "logger disabled":
        monkeypatch.setattr(logger, "disabled", True)
    elif state == "a filter":
        monkeypatch.setattr(logger, "filters", [logging.Filter("something.else")])
    else:  # the registry forgets the logger the module holds: getLogger(name) makes a new one
        monkeypatch.delitem(logging.root.manager.loggerDict, name)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    cfg = SimpleNamespace(rope_theta=None, rope_scaling='{"rope_type": "linear", "factor": 0.5}',
                          max_position_embeddings=None)
    try:
        with pytest.raises(ValueError, match="--rope-scaling: .*factor field must be"):
            rope_flags.apply(config, cfg)
        assert logging.root.manager.disable == (logging.WARNING if state == "logging.disable" else 0)
    finally:
        logging.disable(logging.NOTSET)
