"""Context-parallel inference, the edges of ``generate()`` with :class:`ShardedCache` that
tests/test_generate.py does not reach: prompts shorter than the ranks (1 and 2 tokens at N = 3: some
ranks hold only layout padding in the prefill), a plain forward on the cache (every row's logits,
and ``logits_to_keep``), a user ``StoppingCriteria``, and the flags of ``seqpar generate``.

References as in test_generate.py: the unconverted model in the same process, fp32, tokens equal and
logits within 1e-4 relative (the context-parallel run only reorders fp32 sums, ~1e-6; a lost slot or
a wrong position moves logits by 1e-2 or more).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from model_folders import windowed_folder  # noqa: E402
from test_generate import REL_TOL, _load, _relative  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

from seqpar.integrations.hf import ShardedCache, apply_context_parallel  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(windowed_folder(tmp_path_factory.mktemp("generate_cases") / "windowed"))


class _StopAtLength(StoppingCriteria):
    """A user stopping criterion: stop every row once the sequence reaches ``length`` tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def _edges(path):
    """Short prompts over two turns, a plain forward on the cache and a StoppingCriteria, each
    against the unconverted model; returns {case: (tokens equal, logits relative difference)}."""
    ref, model = _load(path), _load(path)
    apply_context_parallel(model, method="zigzag_ring")
    g = torch.Generator().manual_seed(3)
    kw = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    got = {}
    for length in (1, 2):  # shorter than N = 3 (and than 2N, the zigzag multiple)
        first, more = (torch.randint(4, ref.config.vocab_size, (1, t), generator=g) for t in (length, 2))
        r1 = ref.generate(first, max_new_tokens=4, **kw)
        o1 = model.generate(first, cache=ShardedCache(), max_new_tokens=4, **kw)
        r2 = ref.generate(torch.cat([r1.sequences, more], 1), cache=r1.cache, max_new_tokens=3, **kw)
        o2 = model.generate(torch.cat([o1.sequences, more], 1), cache=o1.cache, max_new_tokens=3, **kw)
        got[f"prompt {length}"] = (torch.equal(o1.sequences, r1.sequences) and torch.equal(o2.sequences, r2.sequences),
                                   _relative(o1.logits + o2.logits, r1.logits + r2.logits))
    ids = torch.randint(4, ref.config.vocab_size, (2, 11), generator=g)
    with torch.no_grad():  # a plain forward on the cache: every new row's logits, or the last 3
        for keep in (0, 3):
            a, b = model(ids, cache=ShardedCache(), logits_to_keep=keep).logits, ref(ids, logits_to_keep=keep).logits
            got[f"forward keep {keep}"] = (a.shape == b.shape, _relative([a], [b]))
    stop = dict(max_new_tokens=8, **kw)
    r = ref.generate(ids, stopping_criteria=StoppingCriteriaList([_StopAtLength(14)]), **stop)
    o = model.generate(ids, cache=ShardedCache(), stopping_criteria=StoppingCriteriaList([_StopAtLength(14)]), **stop)
    got["stopping criteria"] = (torch.equal(o.sequences, r.sequences) and o.sequences.shape[1] == 14,
                                _relative(o.logits, r.logits))
    return got


def test_short_prompts_forward_and_stopping_match_single_process(folder):
    results = run_distributed(_edges, 3, folder, timeout=240)
    for rank, got in enumerate(results):
        assert set(got) == {"prompt 1", "prompt 2", "forward keep 0", "forward keep 3", "stopping criteria"}
        for case, (equal, rel) in got.items():
            assert equal and rel <= REL_TOL, (rank, case, equal, rel)


@pytest.mark.parametrize("argv, fragment", [
    (["--prompt-file", "{prompt}"], "--model"),
    (["--model", "{missing}", "--prompt-file", "{prompt}"], "no config.json there"),
    (["--model", "{folder}", "--prompt-file", "{missing}"], "no such file"),
    (["--model", "{folder}", "--prompt-file", "{prompt}", "--method", "lasp2"], "invalid choice: 'lasp2'"),
    (["--model", "{folder}", "--prompt-file", "{prompt}", "--nproc", "0"], "--nproc 0: pass 1 or more"),
    (["--model", "{folder}", "--prompt-file", "{prompt}", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--model", "{folder}", "--prompt-file", "{prompt}", "--prefill", "ring"], "invalid choice: 'ring'"),
    (["--model", "{folder}", "--prompt-file", "{prompt}", "--prompt", "hi"], "not allowed with argument"),
    (["--model", "{folder}"], "one of the arguments --prompt-file --prompt is required"),
    (["--model", "{folder}", "--prompt", "hi", "--system", "be brief"], "--system: a system message needs --chat"),
])
def test_cli_generate_refuses_bad_flags(argv, fragment, tmp_path, capsys):
    """Each bad flag stops ``seqpar generate`` before any rank starts, naming the flag."""
    from seqpar.cli import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a prompt")
    names = {"prompt": str(prompt), "folder": str(tmp_path / "model"), "missing": str(tmp_path / "missing")}
    with pytest.raises(SystemExit) as exc:
        main(["generate", *(a.format(**names) for a in argv)])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_cli_generate_loads_quietly_off_rank_zero():
    """`seqpar generate` shows transformers' "Loading weights" bar on rank 0 only (not one per rank),
    none with --no-progress, and leaves the caller's setting as it was (``--nproc 1`` runs in the
    caller's process)."""
    from transformers.utils import logging as hf_logging

    from seqpar.integrations.generate.run import _quiet_loading

    assert hf_logging.is_progress_bar_enabled()
    with _quiet_loading(True):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    with _quiet_loading(False):
        assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with _quiet_loading(True):
            pass
        assert not hf_logging.is_progress_bar_enabled()  # a caller's "off" stays off
    finally:
        hf_logging.enable_progress_bar()


_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
             "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_cli_generate_chat_matches_single_process(folder, tmp_path, capsys):
    """``--chat --system --prompt`` at N = 2 generates what single-process greedy ``generate()`` gives
    on the chat template's ids (which differ from the plain text's); ``--chat`` with a tokenizer that
    has no template stops with one line naming the flag (exit 2)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from seqpar.cli import main

    chat = tmp_path / "chat"
    shutil.copytree(folder, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": _TEMPLATE}))
    report = tmp_path / "report.json"
    text = "the river walked into the quiet station"
    assert main(["generate", "--model", str(chat), "--prompt", text, "--chat", "--system", "be brief",
                 "--nproc", "2", "--max-new-tokens", "4", "--json", str(report), "--no-progress"]) == 0
    got = json.loads(report.read_text())
    tok = AutoTokenizer.from_pretrained(chat)
    ids = torch.as_tensor(tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]).reshape(1, -1)
    assert tok.decode(ids[0]).endswith("<user>" + text + "<eos><assistant>")
    assert ids.shape[1] > tok(text, return_tensors="pt").input_ids.shape[1]
    ref = _load(str(chat)).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                   pad_token_id=tok.pad_token_id)
    assert got["prompt_tokens"] == ids.shape[1] and got["new_tokens"] == ref[0, ids.shape[1]:].tolist()
    capsys.readouterr()
    assert main(["generate", "--model", folder, "--prompt", text, "--chat", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("seqpar generate: error: --chat: the tokenizer in") and len(err.splitlines()) == 1
