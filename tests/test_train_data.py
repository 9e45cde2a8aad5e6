"""Tokenized training data (seqpar.integrations.train.tokens): text folders, JSONL and parquet/arrow
through datasets, tokenized with a real tokenizer, packed with document boundaries, deterministic and
resumable, and the errors that name --data.

The expected documents are computed here independently: ``[BOS] + tokenizer(text) + [EOS]`` with
the transformers tokenizer called directly.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

pytest.importorskip("transformers")

from model_folders import text_documents, tiny_tokenizer  # noqa: E402

from seqpar.integrations.train.tokens import Documents, PackedTokenSequences, open_token_data  # noqa: E402

DOCS = text_documents(14, seed=3)
SEQ = 64


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _expected(tok, texts):
    return [[tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]


def _write_text(folder, texts):
    folder.mkdir()
    for i, t in enumerate(texts):
        (folder / f"doc{i:03d}.txt").write_text(t)
    return folder


def _write_jsonl(path, texts, extra_blank=True):
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    if extra_blank:
        lines.insert(3, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def _epoch(data):
    return [data.sequence(i) for i in range(data.per_epoch)]


def test_packing_keeps_documents_and_boundaries(tmp_path, tok):
    data = open_token_data(_write_text(tmp_path / "d", DOCS), tok, SEQ, seed=5)
    expected = _expected(tok, DOCS)
    assert data.per_epoch * SEQ + data.unused == sum(map(len, expected))
    stream = []
    for tokens, cu in _epoch(data):
        assert tokens.dtype == torch.long and tokens.shape == (SEQ,)
        assert cu[0] == 0 and cu[-1] == SEQ and all(a < b for a, b in zip(cu, cu[1:]))
        for a, b in zip(cu[1:-1], cu[2:-1]):  # every inner boundary follows an EOS
            assert tokens[a - 1] == tok.eos_token_id
        stream += tokens.tolist()
    # Split the epoch's stream after each EOS: whole documents, each once, in a shuffled order.
    docs, cur = [], []
    for t in stream:
        cur.append(t)
        if t == tok.eos_token_id:
            docs.append(cur)
            cur = []
    assert all(d in expected for d in docs) and len({tuple(d) for d in docs}) == len(docs)
    assert len(docs) >= len(expected) - 2 and docs != expected[:len(docs)]
    assert tok.decode(docs[0][1:-1]) in DOCS  # the byte-level tokenizer gives the text back


def test_formats_give_the_same_stream(tmp_path, tok):
    pytest.importorskip("datasets")
    import datasets

    as_text = open_token_data(_write_text(tmp_path / "t", DOCS), tok, SEQ, seed=1)
    as_jsonl = open_token_data(_write_jsonl(tmp_path / "a.jsonl", DOCS), tok, SEQ, seed=1)
    datasets.Dataset.from_dict({"text": DOCS}).to_json(str(tmp_path / "b.json"))  # JSON Lines, .json
    as_json = open_token_data(tmp_path / "b.json", tok, SEQ, seed=1)
    (tmp_path / "j").mkdir()
    _write_jsonl(tmp_path / "j" / "a.jsonl", DOCS[:5])
    _write_jsonl(tmp_path / "j" / "b.jsonl", DOCS[5:])
    as_jsonl_folder = open_token_data(tmp_path / "j", tok, SEQ, seed=1)
    (tmp_path / "p").mkdir()
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).to_parquet(str(tmp_path / "p" / "x.parquet"))
    as_parquet = open_token_data(tmp_path / "p", tok, SEQ, seed=1, cache_dir=tmp_path / "cache")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "arrow"))
    as_arrow = open_token_data(tmp_path / "arrow", tok, SEQ, seed=1, pattern="*.arrow")
    reference = _epoch(as_text)
    for data in (as_jsonl, as_json, as_jsonl_folder, as_parquet, as_arrow):
        got = _epoch(data)
        assert len(got) == len(reference)
        for (a, cu_a), (b, cu_b) in zip(got, reference):
            assert torch.equal(a, b) and cu_a == cu_b
    assert len({as_text.fingerprint, as_jsonl.fingerprint, as_parquet.fingerprint}) == 3


def test_sequences_are_a_pure_function_of_the_index(tmp_path, tok):
    folder = _write_text(tmp_path / "d", DOCS)
    first = open_token_data(folder, tok, SEQ, seed=7)
    in_order = [first.sequence(i) for i in range(3 * first.per_epoch)]  # three epochs
    resumed = open_token_data(folder, tok, SEQ, seed=7)
    picks = list(range(len(in_order)))
    random.Random(0).shuffle(picks)
    for i in picks:  # any order, any start: the same sequence
        tokens, cu = resumed.sequence(i)
        assert torch.equal(tokens, in_order[i][0]) and cu == in_order[i][1]
    epochs = [torch.cat([t for t, _ in in_order[e * first.per_epoch:(e + 1) * first.per_epoch]]) for e in range(2)]
    assert not torch.equal(epochs[0], epochs[1])  # each epoch reshuffles
    other = open_token_data(folder, tok, SEQ, seed=8)
    assert not torch.equal(other.sequence(0)[0], in_order[0][0])
    assert first.fingerprint == resumed.fingerprint == other.fingerprint
    changed = open_token_data(_write_text(tmp_path / "e", DOCS[:-1]), tok, SEQ, seed=7)
    assert changed.fingerprint != first.fingerprint


def test_counts_are_cached_and_tokens_made_lazily(tmp_path, tok, monkeypatch):
    folder = _write_text(tmp_path / "d", DOCS)
    first = Documents.scan(folder, tok, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 1
    calls = []
    real = Documents._tokens
    monkeypatch.setattr(Documents, "_tokens", lambda self, texts: calls.append(len(texts)) or real(self, texts))
    again = Documents.scan(folder, tok, cache_dir=tmp_path / "cache")
    assert calls == [] and again.lengths == first.lengths  # counts from the cache
    data = PackedTokenSequences(again, SEQ, seed=0)
    _, cu = data.sequence(0)
    assert sum(calls) <= len(cu) - 1  # only the documents sequence 0 touches were tokenized


def test_tokenizer_without_bos(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast

    no_bos = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>", pad_token="<pad>")
    docs = Documents.scan(_write_text(tmp_path / "d", DOCS[:4]), no_bos)
    assert docs.read(1, 0, docs.lengths[1]) == no_bos(DOCS[1], add_special_tokens=False)["input_ids"] + [2]


def test_tokenizer_without_eos_is_refused(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast

    no_eos = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, bos_token="<bos>")
    with pytest.raises(ValueError, match="--model: the tokenizer has no EOS token"):
        Documents.scan(_write_text(tmp_path / "d", DOCS[:3]), no_eos)


def test_bad_data_names_the_flag(tmp_path, tok, monkeypatch):
    with pytest.raises(ValueError, match="--data: .* does not exist"):
        Documents.scan(tmp_path / "absent", tok)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.jsonl").write_text("\n\n")
    (tmp_path / "empty" / "nothing.txt").write_text("")
    with pytest.raises(ValueError, match="--data: no non-empty documents"):
        Documents.scan(tmp_path / "empty", tok)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match="--data: .*bad.jsonl at byte 17: not a JSON object with a string 'text'"):
        Documents.scan(tmp_path / "bad.jsonl", tok)
    with pytest.raises(ValueError, match="--data: the documents hold .* fewer than one sequence of --seq-len"):
        open_token_data(_write_text(tmp_path / "d", DOCS[:2]), tok, 10_000, seed=0)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if datasets were not installed
    with pytest.raises(ValueError, match=r"--data: reading x.parquet needs the datasets library: pip install 'seqpar\[data\]'"):
        Documents.scan(tmp_path / "p", tok)
