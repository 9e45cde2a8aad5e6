"""Context-parallel inference: ``generate()`` with :class:`ShardedCache` equals single-process
``generate()`` with transformers' default cache.

Models: real-format folders from tests/model_folders.py (a Llama with GQA, 4 query heads over 2 KV
heads; a gpt-oss with sliding-window layers alternating with full ones, and sinks on every layer)
and two saved here (a Mistral with a window on every layer; a Gemma-3 alternating local and global).
Each rank loads the folder, converts its copy and generates from the whole prompt; the reference is
the unconverted model in the same process. Compared, in fp32: the tokens (equal) and every step's
logits. The context-parallel run changes only the order of the softmax sums (blockwise, running
max, fp32 merge) and of the hidden-row gather (a sum with one non-zero term: exact); through two
layers and the LM head that is ~1e-6 of the largest logit (measured up to 1.5e-6 at N = 4), so 1e-4
relative leaves room while a lost slot, a wrong position or a wrong window moves logits by 1e-2 or
more. The prompt (13 tokens) is not a multiple of 2N for N = 2, 3, 4; a second turn (7 more
tokens, then decoding) runs on the same cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from model_folders import llama_folder, spread_weights, windowed_folder  # noqa: E402

from seqpar.comm import CommStats  # noqa: E402
from seqpar.integrations.hf import ShardedCache, apply_context_parallel  # noqa: E402
from seqpar.integrations.hf.cache_ops import choose_combine, choose_prefill  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402

REL_TOL = 1e-4  # see the module docstring: measured <= 1.5e-6
PROMPT, TURN, NEW = 13, 7, 6


def _config_folder(path, kind: str, tokenizer=None) -> str:
    """A Mistral (a 5-token window on every layer) or Gemma-3 (5-token local layers alternating with
    global ones) folder of random weights, GQA 4/2; with ``tokenizer`` (saved there too) its
    vocabulary and special ids."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=5, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
        common.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, query_pre_attn_scalar=16,
                                                   layer_types=["sliding_attention", "full_attention"]))
    spread_weights(model)  # larger than the default init: logits far from uniform
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_models")
    return {"llama": str(llama_folder(root / "llama")), "windowed": str(windowed_folder(root / "windowed")),
            "mistral": _config_folder(root / "mistral", "mistral"), "gemma3": _config_folder(root / "gemma3", "gemma3")}


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(vocab: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # ids from 4 on: the folders' special tokens (<bos>, <eos>, <pad>, <unk>) are 0-3, and a <pad> in
    # the prompt would make generate() build a padding mask
    return torch.randint(4, vocab, (batch, PROMPT), generator=g), torch.randint(4, vocab, (batch, TURN), generator=g)


def _relative(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def _kv_bytes(cache) -> int:
    return sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in cache.layers)


def _two_turns(path, method, prefill, combine, batch, seed):
    """Greedy generate, then a second turn on the same cache; against the unconverted model."""
    ref, model = _load(path), _load(path)
    first, more = _prompts(ref.config.vocab_size, batch, seed)
    kw = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, output_scores=True,
              return_dict_in_generate=True, pad_token_id=ref.config.pad_token_id)
    r1 = ref.generate(first, **kw)
    apply_context_parallel(model, method=method)
    cache = ShardedCache(prefill=prefill, decode_combine=combine, stats=CommStats())
    o1 = model.generate(first, cache=cache, **kw)
    ref_bytes, cp_bytes = _kv_bytes(r1.cache), cache.kv_bytes()
    r2 = ref.generate(torch.cat([r1.sequences, more], 1), cache=r1.cache, **kw)
    o2 = model.generate(torch.cat([o1.sequences, more], 1), cache=cache, **kw)
    t1, t2 = o1.sequences.shape[1], o2.sequences.shape[1]  # decoded slots: t1 - 1 and t2 - 1 never fed
    return {"tokens": torch.equal(o1.sequences, r1.sequences) and torch.equal(o2.sequences, r2.sequences),
            "logits": _relative(o1.logits + o2.logits, r1.logits + r2.logits),
            "scores": _relative(o1.scores + o2.scores, r1.scores + r2.scores),
            "history": [(h["phase"], h["prefill"], h["combine"]) for h in cache.history],
            "ref_bytes": ref_bytes, "cp_bytes": cp_bytes, "comm": cache.comm_summary(),
            "per_token_bytes": 2 * ref.config.num_hidden_layers * batch * ref.config.num_key_value_heads
            * ref.config.head_dim * 4, "sequence": o2.sequences, "length": t2 - 1,
            "decoded": set(range(PROMPT, t1 - 1)) | set(range(t1 + TURN, t2 - 1)),
            "slots": cache.layers[0].positions.tolist(),
            "shape": (ref.config.num_hidden_layers, batch, ref.config.num_attention_heads, ref.config.head_dim)}


def _cases(cases):
    return [_two_turns(*case) for case in cases]


# (folder, method, prefill, decode combine, batch, seed): every prefill choice, both combines,
# windows + sinks (gpt-oss), windows on every layer (Mistral), alternating local/global layers
# (gpt-oss, Gemma-3), batch 2, and both automatic choices
CASES_2 = [("llama", "zigzag_ring", "pass_kv", "allgather", 1, 0), ("llama", "ring", "pass_q", "tree", 2, 1),
           ("windowed", "striped_ring", "pass_q", "allgather", 1, 2),
           ("windowed", "zigzag_ring", "pass_kv", "tree", 1, 3), ("llama", "token_ring", "auto", "auto", 1, 4),
           ("mistral", "zigzag_ring", "pass_q", "tree", 1, 10)]
CASES_3 = [("llama", "zigzag_ring", "pass_q", "tree", 1, 5), ("windowed", "allgather_kv", "pass_kv", "allgather", 2, 6),
           ("gemma3", "ring", "pass_kv", "allgather", 1, 11)]
CASES_4 = CASES_2 + [("windowed", "lightseq", "pass_q", "tree", 2, 7), ("llama", "ulysses", "pass_kv", "tree", 1, 8),
                     ("llama", "usp", "pass_q", "allgather", 1, 9)]


def _check(results, cases, n):
    for case, per_rank in zip(cases, zip(*results)):
        for rank, got in enumerate(per_rank):
            assert got["tokens"], (case, rank)
            assert got["logits"] <= REL_TOL and got["scores"] <= REL_TOL, (case, rank, got["logits"])
            assert torch.equal(got["sequence"], per_rank[0]["sequence"])  # every rank the same
        phases = per_rank[0]["history"]
        assert phases[0] == ("prefill", "method", None)
        prefill, combine = case[2], case[3]
        turn2 = next(h for h in phases[1:] if h[0] == "prefill")
        decodes = {h[2] for h in phases if h[0] == "decode"}
        if prefill != "auto":
            assert turn2[1] == prefill and decodes == {combine}, (case, phases)
        else:  # the rule's own choices for this shape (GQA 4/2; small partials: the all-gather)
            assert turn2[1] == choose_prefill(TURN, PROMPT + NEW - 1 + NEW, 4, 2, n, flops=4e14, bandwidth=5e10,
                                              itemsize=4)
            assert decodes == {"allgather"}
        if case[0] == "llama":  # 1/N of the single-device cache, up to one layout pad per rank
            total = sum(r["cp_bytes"] for r in per_rank)
            assert total == per_rank[0]["ref_bytes"], case
            per_token = per_rank[0]["per_token_bytes"]
            assert max(r["cp_bytes"] for r in per_rank) <= total / n + 2 * per_token, case
            # after both turns: every position on one rank only, decoded ones on member p mod N (round robin)
            assert sorted(sum((r["slots"] for r in per_rank), [])) == list(range(per_rank[0]["length"])), case
            for rank, r in enumerate(per_rank):
                assert {p for p in r["slots"] if p in r["decoded"]} == {p for p in r["decoded"] if p % n == rank}
        comm = per_rank[0]["comm"]
        assert comm["prefill_bytes"] > 0 and comm["decode_bytes_per_token"] == _decode_bytes(n, decodes, per_rank[0])


def _decode_bytes(n, combines, got) -> int:
    """Bytes a rank sends per decoded token (CommStats: an all-gather (N-1)·m, an all-reduce
    2(N-1)·m/N): the token check's all-reduce of 4B float64 (B ids and B pad counts, each with its
    negation), then per layer the all-gather of the fp32 (out, lse) [B, 1, Hq, D + 1] or the tree's
    two all-reduces (lse max [B, Hq, 1], the sums)."""
    layers, b, hq, d = got["shape"]
    partial = b * hq * (d + 1) * 4
    per_layer = (n - 1) * partial if combines == {"allgather"} else 2 * (n - 1) * (b * hq * 4) // n + 2 * (n - 1) * partial // n
    return 2 * (n - 1) * 32 * b // n + layers * per_layer


def test_generate_matches_single_process_n2(folders):
    cases = [(folders[c[0]], *c[1:]) for c in CASES_2]
    _check(run_distributed(_cases, 2, cases, timeout=300), CASES_2, 2)


def test_generate_matches_single_process_n3(folders):
    cases = [(folders[c[0]], *c[1:]) for c in CASES_3]
    _check(run_distributed(_cases, 3, cases, timeout=300), CASES_3, 3)


@pytest.mark.slow
def test_generate_matches_single_process_n4(folders):
    cases = [(folders[c[0]], *c[1:]) for c in CASES_4]
    _check(run_distributed(_cases, 4, cases, timeout=600), CASES_4, 4)


def _sampling(path, seed_per_rank):
    ref, model = _load(path), _load(path)
    first, _ = _prompts(ref.config.vocab_size, 1, 11)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.9, top_p=0.95, pad_token_id=ref.config.pad_token_id)
    torch.manual_seed(7)
    expected = ref.generate(first, **kw)
    apply_context_parallel(model, method="zigzag_ring")
    torch.manual_seed(7 + (dist.get_rank() if seed_per_rank else 0))
    try:
        return torch.equal(model.generate(first, cache=ShardedCache(), **kw), expected)
    except ValueError as exc:
        return str(exc)


def _bad_inputs(path):
    """Each bad call, on every rank; returns the message each raised (None: it did not raise)."""
    from transformers import DynamicCache

    model = _load(path)
    plain = _load(path)
    ids, _ = _prompts(model.config.vocab_size, 2, 12)
    apply_context_parallel(model, method="zigzag_ring")
    padded = torch.ones_like(ids)
    padded[0, -3:] = 0  # right padding (left padding works: test_generate_padded.py)
    other = dist.new_group(list(range(dist.get_world_size())))
    calls = {
        "right padding": lambda: model.generate(ids, attention_mask=padded, cache=ShardedCache(), max_new_tokens=2),
        "other group": lambda: model.generate(ids, cache=ShardedCache(group=other), max_new_tokens=2),
        "not converted": lambda: plain.generate(ids, cache=ShardedCache(), max_new_tokens=2),
        "default cache": lambda: model.generate(ids, cache=DynamicCache(), max_new_tokens=2),
        "gradients": lambda: model(ids, cache=ShardedCache()),
        # 12 tokens: a multiple of 2N, so each rank's whole prompt would pass for a zigzag shard
        "no cache": lambda: model.generate(ids[:, :12], use_cache=False, max_new_tokens=2, pad_token_id=0),
        "bad choice": lambda: ShardedCache(prefill="ring"),
    }
    got = {}
    for name, call in calls.items():
        try:
            call()
            got[name] = None
        except ValueError as exc:
            got[name] = str(exc)
    got["still works"] = model.generate(ids, cache=ShardedCache(), max_new_tokens=2, do_sample=False,
                                        pad_token_id=model.config.pad_token_id).shape[1] == PROMPT + 2
    return got


def test_sampling_same_tokens_on_every_rank(folders):
    assert run_distributed(_sampling, 2, folders["llama"], False, timeout=120) == [True, True]
    # different seeds per rank: every rank stops with the same clear error instead of diverging
    for message in run_distributed(_sampling, 2, folders["llama"], True, timeout=120):
        assert isinstance(message, str) and "seed every rank the same" in message


def test_bad_input_raises_on_every_rank(folders):
    expected = {"right padding": "attention_mask", "other group": "one ShardedCache per group",
                "not converted": "apply_context_parallel", "default cache": "ShardedCache(group=...)",
                "gradients": "for inference", "bad choice": "prefill='ring'",
                "no cache": "use_cache=False: generate() on a context-parallel model"}
    for got in run_distributed(_bad_inputs, 2, folders["llama"], timeout=180):
        for name, fragment in expected.items():
            assert got[name] is not None and fragment in got[name], (name, got[name])
        assert got["still works"]


def test_rules():
    # Meta's rule: a fresh-ish prompt (new/total above 2*Hkv/Hq) passes K,V; a short turn over a long
    # cache passes queries, unless the turn is long enough for the ring's compute to hide the K,V
    assert choose_prefill(1000, 1000, 32, 8, 4, flops=1e18, bandwidth=1.0, itemsize=2) == "pass_kv"
    assert choose_prefill(100, 100000, 32, 8, 4, flops=1e18, bandwidth=1.0, itemsize=2) == "pass_q"
    assert choose_prefill(100, 100000, 32, 8, 4, flops=1.0, bandwidth=1e18, itemsize=2) == "pass_kv"
    # decode: the all-gather's N - 1 latencies against the tree's 4 log2 N
    assert choose_combine(4, 16512, 128, latency=1e-5, bandwidth=5e10) == "allgather"
    assert choose_combine(64, 16512, 128, latency=1e-5, bandwidth=5e10) == "tree"
    assert choose_combine(16, 16512, 128, latency=1e-5, bandwidth=5e10) == "allgather"
    assert choose_combine(16, 64 * 16512, 64 * 128, latency=1e-5, bandwidth=5e10) == "tree"  # batch 64: by size


def test_cli_generate_end_to_end(folders, tmp_path, capsys):
    """``seqpar generate --nproc 2`` prints what single-process greedy generate() gives."""
    import json

    from transformers import AutoTokenizer

    from seqpar.cli import main

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the river walked into the quiet station and found an ancient letter about the winter")
    report = tmp_path / "report.json"
    assert main(["generate", "--model", folders["llama"], "--prompt-file", str(prompt), "--nproc", "2",
                 "--method", "zigzag_ring", "--max-new-tokens", "5", "--json", str(report), "--no-progress",
                 "--decode-combine", "tree"]) == 0
    printed = capsys.readouterr().out
    got = json.loads(report.read_text())
    tok = AutoTokenizer.from_pretrained(folders["llama"])
    ids = tok(prompt.read_text(), return_tensors="pt").input_ids
    ref = _load(folders["llama"]).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                          do_sample=False, pad_token_id=tok.pad_token_id)
    assert got["new_tokens"] == ref[0, ids.shape[1]:].tolist()
    assert got["ranks"] == 2 and got["prompt_tokens"] == ids.shape[1] and len(got["kv_bytes_per_rank"]) == 2
    assert "tokens/s" in printed and "KV bytes per rank" in printed and got["text"] in printed
    assert got["decode_combine"] == ["tree"] and got["choices"][0]["prefill"] == "method"
    # sampling, on one rank (the ranks' agreement under sampling: test_sampling_same_tokens_on_every_rank)
    assert main(["generate", "--model", folders["llama"], "--prompt-file", str(prompt), "--max-new-tokens", "6",
                 "--sample", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--json", str(report),
                 "--no-progress"]) == 0
    torch.manual_seed(3)
    ref = _load(folders["llama"]).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True,
                                          temperature=0.8, top_p=0.9, pad_token_id=tok.pad_token_id)
    assert json.loads(report.read_text())["new_tokens"] == ref[0, ids.shape[1]:].tolist()


def _cache_api(path):
    """crop, batch_select_indices, beam search (batch_repeat_interleave, reorder_cache), eos stopping
    and output_hidden_states on the sharded cache, each against the same on transformers' cache."""
    ref, model = _load(path), _load(path)
    first, more = _prompts(ref.config.vocab_size, 2, 13)
    apply_context_parallel(model, method="zigzag_ring")
    kw = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=ref.config.pad_token_id)
    r, o = ref.generate(first, max_new_tokens=4, **kw), model.generate(first, cache=ShardedCache(), max_new_tokens=4, **kw)
    got = {"first": torch.equal(r.sequences, o.sequences)}
    cache = o.cache
    r.cache.crop(-2)
    cache.crop(-2)
    got["crop length"] = cache.get_seq_length() == r.cache.get_seq_length()
    r.cache.batch_select_indices(torch.tensor([1]))
    cache.batch_select_indices(torch.tensor([1]))
    again = torch.cat([r.sequences[1:, :-2], more[1:]], 1)
    r2, o2 = ref.generate(again, cache=r.cache, max_new_tokens=4, **kw), model.generate(again, cache=cache,
                                                                                        max_new_tokens=4, **kw)
    got["crop+select"] = torch.equal(r2.sequences, o2.sequences) and _relative(o2.logits, r2.logits) <= REL_TOL
    beams = dict(num_beams=3, max_new_tokens=5, do_sample=False, pad_token_id=ref.config.pad_token_id)
    got["beams"] = torch.equal(ref.generate(first, **beams), model.generate(first, cache=ShardedCache(), **beams))
    stop = int(r.sequences[0, PROMPT + 2])  # greedy's third new token as eos: both stop there
    hs = dict(max_new_tokens=6, eos_token_id=stop, output_hidden_states=True, **kw)
    r3, o3 = ref.generate(first[:1], **hs), model.generate(first[:1], cache=ShardedCache(), **hs)
    got["eos"] = torch.equal(r3.sequences, o3.sequences) and r3.sequences.shape[1] < PROMPT + 6
    got["hidden"] = all(_relative(a, b) <= REL_TOL for a, b in zip(o3.hidden_states[0], r3.hidden_states[0]))
    # a forward that raises after layer 0 stored its slots: the next call on the cache drops them
    cache, fail = ShardedCache(), model.model.layers[1].register_forward_pre_hook(_raise)
    try:
        model.generate(first, cache=cache, **kw)
    except RuntimeError:
        pass
    fail.remove()
    o4 = model.generate(first, cache=cache, max_new_tokens=4, **kw)
    got["after a failed forward"] = torch.equal(o4.sequences, r.sequences) and _relative(o4.logits, r.logits) <= REL_TOL
    return got


def _raise(*args):
    raise RuntimeError("a fault injected by the test")


def test_cache_api_matches_transformers(folders):
    for got in run_distributed(_cache_api, 2, folders["llama"], timeout=180):
        assert all(got.values()), got


@pytest.mark.parametrize("window", [None, 1, 3, 7, 40])
def test_local_partial_matches_float64(window):
    """Queries in runs against slots at scattered increasing positions (prefill shards, round-robin
    decode slots), causal and windowed: equal to a dense float64 softmax over the visible slots."""
    from seqpar.integrations.hf.cache_ops import local_partial, query_runs

    g = torch.Generator().manual_seed(window or 0)
    pos = torch.tensor(sorted(set(torch.randint(0, 60, (40,), generator=g).tolist())), dtype=torch.int64)
    rows = list(range(10, 16)) + list(range(44, 52)) + [58]  # three runs, the positions of the query rows
    q = torch.randn(2, len(rows), 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, pos.numel(), 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = local_partial(q, query_runs(rows), k, v, pos, scale=0.3, window=window)
    ref, ref_lse = _dense(q, rows, k, v, pos, window)
    qp, kp = torch.tensor(rows)[:, None], pos[None, :]
    some = ((kp <= qp) & ((kp > qp - window) if window else True)).any(-1)  # rows that see a slot; others: out 0, lse -inf
    assert torch.allclose(out[:, some], ref[:, some], atol=1e-12, rtol=1e-10)
    assert torch.allclose(lse[..., some], ref_lse[..., some], atol=1e-12)
    assert torch.all(torch.isneginf(lse[..., ~some])) and torch.all(out[:, ~some] == 0)


def _dense(q, rows, k, v, pos, window):
    """float64 softmax of the query rows at positions ``rows`` over the slots at ``pos`` (causal, window)."""
    qp, kp = torch.tensor(rows)[:, None], pos[None, :]
    seen = (kp <= qp) & ((kp > qp - window) if window else True)
    group = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) * 0.3
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v.repeat_interleave(group, 2)), lse


def _spread_float64(window):
    """Every rank holds a scattered share of 50 cached slots plus its zigzag share of 12 new tokens;
    query passing, K,V passing and both decode combines against one dense float64 softmax."""
    from seqpar.comm import group_info
    from seqpar.integrations.hf.cache_ops import combine_replicated, local_partial, pass_kv, pass_q, query_runs
    from seqpar.layouts import Zigzag

    info = group_info(None)
    n, rank = info.size, info.rank
    g = torch.Generator().manual_seed(5)  # the same global tensors on every rank
    total, past = 62, 50
    k, v = (torch.randn(1, total, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(1, total + 1, 4, 8, generator=g, dtype=torch.float64)
    owner = torch.randint(0, n, (past,), generator=g)  # cached slots scattered over the ranks
    layout = Zigzag()
    t_pad = -(-(total - past) // (2 * n)) * 2 * n
    members = [[past + i for i in layout.positions(t_pad, n, m)] for m in range(n)]
    mine = sorted([p for p in range(past) if owner[p] == rank] + [p for p in members[rank] if p < total])
    pos = torch.tensor(mine, dtype=torch.int64)
    qrows = [min(p, total) for p in members[rank]]  # padding rows: any query, never checked
    ql = q[:, qrows]
    ref, ref_lse = _dense(ql, members[rank], k, v, torch.arange(total), window)
    real = [i for i, p in enumerate(members[rank]) if p < total]
    errors = {}
    for name, fn, runs in (("pass_q", pass_q, [query_runs(m) for m in members]),
                           ("pass_kv", pass_kv, query_runs(members[rank]))):
        out, lse = fn(info, ql, runs, k[:, pos], v[:, pos], pos, scale=0.3, window=window)
        errors[name] = max((out[:, real] - ref[:, real]).abs().max().item(),
                           (lse[..., real] - ref_lse[..., real]).abs().max().item())
    dq = q[:, total:]  # a decode query at position `total` (every rank the same) over the cached slots
    ref, ref_lse = _dense(dq, [total], k, v, torch.arange(total), window)
    for mode in ("allgather", "tree"):
        out, lse = combine_replicated(info, *local_partial(dq, [(0, 1, total)], k[:, pos], v[:, pos], pos, scale=0.3,
                                                           window=window), mode)
        errors[mode] = max((out - ref).abs().max().item(), (lse - ref_lse).abs().max().item())
    return errors


@pytest.mark.parametrize("n", [2, 3])
def test_spread_attention_matches_float64(n):
    # float64 throughout: only summation order differs from the dense reference (~1e-15)
    for window in (None, 4):
        for errors in run_distributed(_spread_float64, n, window, timeout=120):
            assert max(errors.values()) < 1e-12, (window, errors)
