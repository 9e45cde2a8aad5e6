"""Context-parallel ``generate()`` on a left-padded batch (prompts of different lengths, as
``tokenizer(prompts, padding=True)`` with ``padding_side = "left"`` gives them) equals single-process
``generate()`` with the same mask.

Models: the real-format folders of tests/model_folders.py (a Llama with GQA 4/2; a gpt-oss with
sliding-window layers alternating with full ones and sinks), a GPT-2 (learned absolute positions:
the positions transformers derives from the mask matter) and, in the slow matrix, the Mistral and
Gemma-3 folders of test_generate.py. Three prompts of different lengths, greedy: the token ids are
equal and every step's scores within ``REL_TOL`` (1e-4 relative to the largest score, fp32): the
context-parallel run only reorders fp32 softmax sums (measured up to ~4e-7 here), while a pad that
is attended to, a wrong position or a lost slot moves scores by 1e-2 or more. A second turn (a few
more tokens after the generated ones, the mask of the whole sequence) runs on the same cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from model_folders import llama_folder, spread_weights, tiny_tokenizer, windowed_folder  # noqa: E402
from test_generate import REL_TOL, _config_folder, _load, _relative  # noqa: E402

from seqpar.integrations.hf import ShardedCache, apply_context_parallel  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402

TEXTS = ["the river", "a curious student walked across the bridge", "in winter the harbour"]
NEW, TURN = 4, 3


def _gpt2_folder(path) -> str:
    """A GPT-2 (learned absolute positions: the one kind of model whose outputs change when a padded
    row's positions are counted from its first column instead of its first real token; RoPE only
    sees differences) with the tiny tokenizer, random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_tokenizer(path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                       bos_token_id=tok.bos_token_id))
    spread_weights(model)  # larger than the default init: logits far from uniform
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_padded")
    return {"llama": str(llama_folder(root / "llama")), "windowed": str(windowed_folder(root / "windowed")),
            "gpt2": _gpt2_folder(root / "gpt2")}


def _batch(path):
    """The three prompts through the folder's own tokenizer, padded on the left."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    lengths = enc.attention_mask.sum(1).tolist()
    assert len(set(lengths)) == 3 and enc.attention_mask[:, 0].tolist().count(0) == 2, lengths  # 2 rows padded
    return tok, enc


def _padded(path, method, prefill, combine, seed, pad_check):
    """Greedy on the padded batch, then a second turn on the same cache; against the unconverted model.
    ``pad_check``: also generate with other ids in the pad slots (same mask) on the converted model."""
    tok, enc = _batch(path)
    ref, model = _load(path), _load(path)
    kw = dict(max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True,
              pad_token_id=tok.pad_token_id)
    r1 = ref.generate(**enc, **kw)
    apply_context_parallel(model, method=method)
    cache = ShardedCache(prefill=prefill, decode_combine=combine)
    o1 = model.generate(**enc, cache=cache, **kw)
    more = torch.randint(4, len(tok), (3, TURN), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([r1.sequences, more], 1)
    mask = torch.cat([enc.attention_mask, enc.attention_mask.new_ones(3, ids.shape[1] - enc.input_ids.shape[1])], 1)
    r2 = ref.generate(input_ids=ids, attention_mask=mask, cache=r1.cache, **kw)
    o2 = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **kw)
    got = {"tokens": torch.equal(o1.sequences, r1.sequences) and torch.equal(o2.sequences, r2.sequences),
           "scores": _relative(o1.scores + o2.scores, r1.scores + r2.scores), "sequence": o2.sequences,
           "history": [(h["phase"], h["prefill"], h["combine"]) for h in cache.history], "pads": cache.pads,
           "expected pads": (enc.attention_mask == 0).sum(1).tolist()}
    if pad_check:  # other ids (and so other K,V) in the pad slots: nothing the real tokens see changes
        other = enc.input_ids.masked_fill(enc.attention_mask == 0, 7)
        o3 = model.generate(input_ids=other, attention_mask=enc.attention_mask, cache=ShardedCache(), **kw)
        t = enc.input_ids.shape[1]
        got["pad ids"] = (torch.equal(o3.sequences[:, t:], o1.sequences[:, t:]), _relative(o3.scores, o1.scores))
    return got


def _cases(cases):
    return [_padded(*case) for case in cases]


# (folder, method, prefill, decode combine, seed, pad-id check): both prefill strategies (the first
# call on a padded batch is itself a prefill over an empty cache), both combines, GQA, windows + sinks
CASES_2 = [("llama", "zigzag_ring", "pass_kv", "allgather", 0, True), ("windowed", "ring", "pass_q", "tree", 1, True),
           ("gpt2", "zigzag_ring", "pass_q", "allgather", 4, False)]
CASES_3 = [("llama", "ulysses", "pass_q", "tree", 2, False),
           ("windowed", "zigzag_ring", "pass_kv", "allgather", 3, False)]
SLOW_METHODS = ["ring", "zigzag_ring", "striped_ring", "allgather_kv", "token_ring", "lightseq", "ulysses", "usp"]


def _check(results, cases):
    for case, per_rank in zip(cases, zip(*results)):
        for rank, got in enumerate(per_rank):
            assert got["tokens"] and got["scores"] <= REL_TOL, (case, rank, got["scores"])
            assert torch.equal(got["sequence"], per_rank[0]["sequence"])  # every rank the same
            assert got["pads"] == got["expected pads"]
            if "pad ids" in got:
                equal, rel = got["pad ids"]
                assert equal and rel <= 1e-6, (case, rank, rel)  # fp32 rounding at most (measured 0)
        phases = per_rank[0]["history"]
        if case[2] != "auto":  # the padded first call and the second turn both used the forced prefill
            assert [p for p in phases if p[0] == "prefill"] == [("prefill", case[2], None)] * 2, phases
            assert {p[2] for p in phases if p[0] == "decode"} == {case[3]}, phases


def test_padded_batch_matches_single_process_n2(folders):
    cases = [(folders[c[0]], *c[1:]) for c in CASES_2]
    _check(run_distributed(_cases, 2, cases, timeout=300), CASES_2)


def test_padded_batch_matches_single_process_n3(folders):
    cases = [(folders[c[0]], *c[1:]) for c in CASES_3]
    _check(run_distributed(_cases, 3, cases, timeout=300), CASES_3)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
def test_padded_batch_every_method_slow(folders, tmp_path, n):
    extra = {kind: _config_folder(tmp_path / kind, kind, tiny_tokenizer()) for kind in ("mistral", "gemma3")}
    names = ["llama", "windowed", "mistral", "gemma3"]
    cases = [(names[i % 4], m, ("pass_kv", "pass_q", "auto")[i % 3], ("allgather", "tree")[i % 2], i, i % 4 == 0)
             for i, m in enumerate(SLOW_METHODS)]
    _check(run_distributed(_cases, n, [({**folders, **extra}[c[0]], *c[1:]) for c in cases], timeout=900), cases)


def _second_turn(ref, model, enc, r, o, rows, greedy) -> bool:
    """A second turn on the caches of the first (``r``: transformers', ``o``: seqpar's), whose rows are
    now the first call's ``rows``: two more tokens each, the mask the earlier one's rows followed by
    ones; whether seqpar's tokens equal transformers' and its scores are within REL_TOL."""
    ids = torch.cat([r.sequences[rows], torch.full((len(rows), 2), 9)], 1)
    ones = enc.attention_mask.new_ones(len(rows), ids.shape[1] - enc.input_ids.shape[1])
    mask = torch.cat([enc.attention_mask[rows], ones], 1)
    r2 = ref.generate(input_ids=ids, attention_mask=mask, cache=r.cache, **greedy)
    o2 = model.generate(input_ids=ids, attention_mask=mask, cache=o.cache, **greedy)
    return torch.equal(o2.sequences, r2.sequences) and _relative(o2.scores, r2.scores) <= REL_TOL


def _sampling_and_beams(path):
    """Seeded sampling, and beam search (the cache's rows repeated and reordered with their pads), on
    the padded batch: the same sequences as the unconverted model; then a second turn after rows of
    a filled cache were selected, repeated and reordered across rows (the Cache API, by hand)."""
    tok, enc = _batch(path)
    ref, model = _load(path), _load(path)
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.9, top_p=0.95, pad_token_id=tok.pad_token_id)
    torch.manual_seed(7)
    expected = ref.generate(**enc, **kw)
    apply_context_parallel(model, method="zigzag_ring")
    torch.manual_seed(7)
    sampled = torch.equal(model.generate(**enc, cache=ShardedCache(), **kw), expected)
    beams = dict(num_beams=3, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    beam = torch.equal(ref.generate(**enc, **beams), model.generate(**enc, cache=ShardedCache(), **beams))
    # rows 2 and 0 kept (batch_select_indices), then a second turn: each keeps its own pads
    greedy = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=tok.pad_token_id)
    r, o = ref.generate(**enc, **greedy), model.generate(**enc, cache=ShardedCache(), **greedy)
    keep = torch.tensor([2, 0])
    r.cache.batch_select_indices(keep)
    o.cache.batch_select_indices(keep)
    selected = _second_turn(ref, model, enc, r, o, keep, greedy)
    # each row twice (batch_repeat_interleave), then across rows (reorder_cache): the pads follow their rows
    r, o = ref.generate(**enc, **greedy), model.generate(**enc, cache=ShardedCache(), **greedy)
    order = torch.tensor([4, 5, 0, 1, 2, 3])  # rows 2, 2, 0, 0, 1, 1
    for c in (r.cache, o.cache):
        c.batch_repeat_interleave(2)
        c.reorder_cache(order)
    repeated = _second_turn(ref, model, enc, r, o, torch.tensor([2, 2, 0, 0, 1, 1]), greedy)
    return sampled, beam, selected, repeated


def test_padded_sampling_beams_and_row_selection_match_single_process(folders):
    assert run_distributed(_sampling_and_beams, 2, folders["llama"], timeout=120) == [(True, True, True, True)] * 2


def _bad_masks(path):
    """Each mask context-parallel generation cannot apply, on every rank: the message (None: no error)."""
    tok, enc = _batch(path)
    model = _load(path)
    apply_context_parallel(model, method="zigzag_ring")
    ids, good = enc.input_ids, enc.attention_mask
    right = good.flip(1)
    hole = torch.ones_like(good)
    hole[1, 3] = 0
    empty = good.clone()
    empty[0] = 0
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    cache = ShardedCache()
    first = model.generate(input_ids=ids, attention_mask=good, cache=cache, **kw)
    calls = {
        "right padding": lambda: model.generate(input_ids=ids, attention_mask=right, cache=ShardedCache(), **kw),
        "hole": lambda: model.generate(input_ids=ids, attention_mask=hole, cache=ShardedCache(), **kw),
        "all-zero row": lambda: model.generate(input_ids=ids, attention_mask=empty, cache=ShardedCache(), **kw),
        "4-D": lambda: model(ids, attention_mask=good[:, None, None, :].expand(-1, 1, ids.shape[1], -1),
                             cache=ShardedCache()),
        "values": lambda: model(ids, attention_mask=good * 2, cache=ShardedCache()),
        # the second turn with the padding forgotten (all ones over the cached pads): refused
        "other pads": lambda: model(first[:, -1:], attention_mask=torch.ones_like(first), cache=cache),
        "no mask": lambda: model(first[:, -1:], cache=cache),
    }
    got = {}
    for name, call in calls.items():
        try:
            with torch.no_grad():
                call()
            got[name] = None
        except ValueError as exc:
            got[name] = str(exc)
    return got


def test_bad_masks_raise_on_every_rank(folders):
    for got in run_distributed(_bad_masks, 2, folders["llama"], timeout=180):
        for name, message in got.items():
            assert message is not None and message.startswith("attention_mask:"), (name, message)
        assert "padding_side = 'left'" in got["right padding"] and "padding_side = 'left'" in got["hole"]
        assert "all zeros" in got["all-zero row"] and "4-D" in got["4-D"]
        assert "was filled with" in got["other pads"] and "whole sequence" in got["no mask"]


def _ranks_differ(path, what):
    """Rank 1 passes other input than rank 0: ``"mask"``, the same ids with a mask of ones where rank 0
    passes the padded one (the token check's all-reduce has one size whatever each rank's padding);
    ``"shape"``, its prompts one column shorter (a check of one size on every rank runs before the
    token check, whose size follows the shape: gloo aborted a rank there, 'Received data size
    doesn't match'). The ValueError's message on each rank, None where none was raised."""
    tok, enc = _batch(path)
    model = _load(path)
    apply_context_parallel(model, method="zigzag_ring")
    other = dist.get_rank() == 1
    ids, mask = enc.input_ids, enc.attention_mask
    if other and what == "mask":
        mask = torch.ones_like(mask)
    if other and what == "shape":
        ids, mask = ids[:, :-1], mask[:, :-1]
    try:
        model.generate(input_ids=ids, attention_mask=mask, cache=ShardedCache(), max_new_tokens=1,
                       pad_token_id=tok.pad_token_id)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what,expected", [("mask", "different tokens (or attention_mask padding)"),
                                           ("shape", "inputs of different shapes")], ids=["mask", "shape"])
def test_ranks_that_disagree_raise_on_every_rank(folders, what, expected):
    for message in run_distributed(_ranks_differ, 2, folders["llama"], what, timeout=120):
        assert message is not None and expected in message, message


@pytest.mark.parametrize("window", [None, 3])
def test_local_partial_floors_match_float64(window):
    """Per-row floors (each batch row's first visible position) against a dense float64 softmax whose
    mask also hides the slots below the row's floor; rows that see nothing give out 0, lse -inf."""
    from seqpar.integrations.hf.cache_ops import local_partial, query_runs

    g = torch.Generator().manual_seed(4)
    pos = torch.tensor(sorted(set(torch.randint(0, 40, (30,), generator=g).tolist())), dtype=torch.int64)
    rows = list(range(6, 12)) + list(range(30, 36))
    floors = [0, 9, 9, 31]  # rows 1, 2 alike (computed together); row 3: the first run sees nothing
    q = torch.randn(4, len(rows), 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(4, pos.numel(), 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = local_partial(q, query_runs(rows), k, v, pos, scale=0.3, window=window, floors=floors)
    qp, kp = torch.tensor(rows)[:, None], pos[None, :]
    for b, floor in enumerate(floors):
        seen = (kp <= qp) & (kp >= floor) & ((kp > qp - window) if window else True)
        scores = torch.einsum("qhd,khd->hqk", q[b], k[b].repeat_interleave(2, 1)) * 0.3
        ref_lse = torch.logsumexp(scores.masked_fill(~seen, float("-inf")), -1)
        some = seen.any(-1)
        p = torch.exp(scores.masked_fill(~seen, float("-inf")) - ref_lse[..., None]).nan_to_num(0.0)
        ref = torch.einsum("hqk,khd->qhd", p, v[b].repeat_interleave(2, 1))
        assert torch.allclose(out[b, some], ref[some], atol=1e-12) and torch.allclose(lse[b][:, some], ref_lse[:, some])
        assert torch.all(out[b, ~some] == 0) and torch.all(torch.isneginf(lse[b][:, ~some])), b
        if floor > 6:  # the case is as described: some rows lie below their floor
            assert not some.all()


@pytest.mark.parametrize("chunk", [None, 1], ids=["one-chunk", "slot-by-slot"])
@pytest.mark.parametrize("floors", [[0, 30, 7, 30, 12], [0, 30, 7, 30, 45, 12]], ids=["top30", "top45"])
@pytest.mark.parametrize("window", [None, 3, 12])
def test_local_partial_decode_floors_match_float64(window, floors, chunk, monkeypatch):
    """A decode step (one query per batch row) under distinct floors takes the two-call path (the
    slots every row sees in one kernel call, those below the highest floor in one masked softmax):
    against a dense float64 softmax, rows above, below and at the window's edge, one row whose floor
    is above every slot it could see (out 0, lse -inf); GQA 4/2 without expanding K, V."""
    from seqpar.integrations.hf import cache_ops

    if chunk is not None:  # the masked part in chunks of one slot (a long padded range's path)
        monkeypatch.setattr(cache_ops, "_MASKED_CHUNK", chunk)
    g = torch.Generator().manual_seed(5)
    pos = torch.tensor(sorted(set(torch.randint(0, 40, (28,), generator=g).tolist())), dtype=torch.int64)
    first = 39
    # floors unsorted and repeated; 45 lies past the query (that row sees nothing, and no slot is
    # above every floor: the kernel call has none)
    q = torch.randn(len(floors), 1, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(len(floors), pos.numel(), 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    calls = []
    real = cache_ops._decode_floors
    cache_ops._decode_floors = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        out, lse = cache_ops.local_partial(q, [(0, 1, first)], k, v, pos, scale=0.3, window=window, floors=floors)
    finally:
        cache_ops._decode_floors = real
    assert calls == [1]
    for b, floor in enumerate(floors):
        seen = (pos <= first) & (pos >= floor) & ((pos > first - window) if window else True)
        scores = torch.einsum("hd,khd->hk", q[b, 0], k[b].repeat_interleave(2, 1)) * 0.3
        if not seen.any():
            assert torch.all(out[b] == 0) and torch.all(torch.isneginf(lse[b])), b
            continue
        ref_lse = torch.logsumexp(scores[:, seen], -1)
        ref = torch.einsum("hk,khd->hd", torch.softmax(scores[:, seen], -1), v[b][seen].repeat_interleave(2, 1))
        assert torch.allclose(out[b, 0], ref, atol=1e-12) and torch.allclose(lse[b][:, 0], ref_lse), b


def test_cli_generate_several_prompts(folders, tmp_path, capsys):
    """``seqpar generate --prompt A --prompt B --prompt C --nproc 2``: one batch padded on the left,
    each prompt's new tokens equal to single-process greedy ``generate()`` on the tokenizer's padded
    batch; a prompt given by file and one inline cannot be mixed (one flag, repeated)."""
    import json

    from seqpar.cli import main

    report = tmp_path / "report.json"
    argv = ["generate", "--model", folders["llama"], "--nproc", "2", "--max-new-tokens", str(NEW), "--json",
            str(report), "--no-progress", "--prefill", "pass_q"]
    assert main(argv + [a for text in TEXTS for a in ("--prompt", text)]) == 0
    got, printed = json.loads(report.read_text()), capsys.readouterr().out
    tok, enc = _batch(folders["llama"])
    ref = _load(folders["llama"]).generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    t = enc.input_ids.shape[1]
    assert [o["new_tokens"] for o in got["outputs"]] == ref[:, t:].tolist()  # no eos among them: nothing cut
    assert [o["prompt_tokens"] for o in got["outputs"]] == enc.attention_mask.sum(1).tolist()
    assert got["new_tokens"] == ref[0, t:].tolist() and got["choices"][0]["prefill"] == "pass_q"
    assert "--- prompt 3 of 3" in printed and "3 prompts in one batch" in printed
    files = []
    for i, text in enumerate(TEXTS[:2]):
        files += ["--prompt-file", str(tmp_path / f"p{i}.txt")]
        (tmp_path / f"p{i}.txt").write_text(text)
    with pytest.raises(SystemExit):
        main(argv + files + ["--prompt", TEXTS[2]])
    assert "not allowed with argument" in capsys.readouterr().err
    from seqpar.integrations.generate import GenerateConfig  # the Python API: the same rule, before any loading

    for given in (dict(prompt="a", prompt_file=str(tmp_path / "p0.txt")), {}):
        with pytest.raises(ValueError, match="prompt / prompt_file: give the prompts one way"):
            GenerateConfig(model=folders["llama"], **given)


def test_cli_generate_several_prompts_without_a_pad_token(folders, tmp_path):
    """A tokenizer without a pad token (as many base models'): several prompts are padded with its end
    of sequence and give what single-process ``generate()`` gives on the batch padded with ``<pad>``
    (a pad's id is never attended to). One rank: the padding is the CLI's, the same at any N."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from seqpar.cli import main

    bare = tmp_path / "no_pad"
    shutil.copytree(folders["llama"], bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "pad_token"}))
    assert AutoTokenizer.from_pretrained(bare).pad_token_id is None
    report = tmp_path / "report.json"
    assert main(["generate", "--model", str(bare), "--nproc", "1", "--max-new-tokens", str(NEW), "--json", str(report),
                 "--no-progress"] + [a for text in TEXTS for a in ("--prompt", text)]) == 0
    tok, enc = _batch(folders["llama"])
    ref = _load(folders["llama"]).generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    t = enc.input_ids.shape[1]
    assert [o["new_tokens"] for o in json.loads(report.read_text())["outputs"]] == ref[:, t:].tolist()
