"""``seqpar train --model`` on a model whose RoPE depends on the sequence length (Phi-3's "longrope").

A tiny Phi-3 folder (tests/model_folders.py's tokenizer) with ``original_max_position_embeddings`` 16:
a packed sequence whose longest document piece passes 16 positions takes the long factors, one whose
pieces are all shorter the short ones. The model is built on the meta device, where the check forward
of ``apply_context_parallel`` caches longrope's long factors as a plain attribute that ``to_empty`` does
not move: every forward then failed ('Cannot copy out of meta tensor'). The run's weights are left as
read (lr 1e-30), so its evaluation equals the plain transformers model's float64 loss on the same
packed sequences (position ids restarting at each document, the whole sequence in one forward: the
factors of its longest document), in one process and at cp 2.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from model_folders import _save, spread_weights, text_documents, tiny_tokenizer  # noqa: E402

from seqpar.integrations.train import train  # noqa: E402
from seqpar.testing import run_distributed  # noqa: E402
from test_train_eval import _run  # noqa: E402

SEQ_LEN, K, HEAD_DIM = 64, 4, 8
# fp32 forward against float64 on the same weights: ~1e-7 relative per operation, averaging out over
# ~250 labels (measured ~1e-8); the long and short factors' losses differ by ~1e-2
REF_RTOL = 1e-6


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import Phi3Config, Phi3ForCausalLM

    tmp = tmp_path_factory.mktemp("longrope")
    tok = tiny_tokenizer()
    config = Phi3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=16,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                         "short_factor": [1.0] * (HEAD_DIM // 2),
                         "long_factor": [1.0 + 3 * i for i in range(HEAD_DIM // 2)]})
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config)
    spread_weights(model)  # larger weights than the init's 0.02: the factors change the loss visibly
    _save(model, tmp / "model", tok, False)
    held = tmp / "held.jsonl"
    # 36 documents of 2 words and 4 of 30: of the first 4 sequences two hold pieces of at most 16 tokens
    # (the short factors: longest 14 and 9 tokens), two longer ones (64 and 27 tokens: the long factors)
    docs = text_documents(40, seed=1)
    docs = [" ".join(d.split()[:2]) for d in docs[:36]] + [" ".join(d.split()[:30]) for d in docs[36:]]
    held.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return tmp, tmp / "model", held


def _args(folders, *extra):
    _, model, held = folders
    return [str(a) for a in ("--model", model, "--data", held, "--seq-len", SEQ_LEN, "--steps", 1, "--lr", 1e-30,
                             "--no-progress", "--eval-data", held, "--eval-batches", K, *extra)]


def _reference(model_dir, held) -> tuple[float, int]:
    """The float64 plain transformers model on the first K evaluation sequences, each in one forward with
    its documents' restarting position ids (transformers' packed form: no mask, the documents apart)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqpar.integrations.hf import IGNORE_INDEX, shift_labels
    from seqpar.integrations.train.evaluate import EVAL_SEED
    from seqpar.integrations.train.tokens import open_token_data

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).double().eval()
    data = open_token_data(str(held), AutoTokenizer.from_pretrained(str(model_dir)), SEQ_LEN, EVAL_SEED)
    total, labels, kinds = 0.0, 0, set()
    with torch.no_grad():
        for i in range(K):
            tokens, cu = data.sequence(i)
            positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
            kinds.add(int(positions.max()) + 1 > 16)  # the long factors, or the short ones
            targets = shift_labels(tokens[None], torch.tensor(cu))
            logits = model(input_ids=tokens[None], position_ids=positions, use_cache=False).logits
            total += float(F.cross_entropy(logits[0], targets[0], ignore_index=IGNORE_INDEX, reduction="sum"))
            labels += int((targets != IGNORE_INDEX).sum())
    return total / labels, labels, kinds


def test_longrope_model_trains_and_evaluates_as_transformers(folders):
    want, labels, kinds = _reference(folders[1], folders[2])
    one = train(_args(folders)).evals[-1]
    cp2 = run_distributed(_run, 2, _args(folders, "--context-parallel", 2), timeout=300)[0][1][-1]
    print(f"eval loss one {one['eval_loss']!r}, cp 2 {cp2['eval_loss']!r}, float64 {want!r}, long factors {kinds}")
    assert kinds == {False, True}  # both factor sets are in use
    for got in (one, cp2):
        assert got["eval_tokens"] == labels and abs(got["eval_loss"] - want) <= REF_RTOL * want


def test_adaptive_is_refused_for_a_length_dependent_rope(folders):
    """--adaptive runs a group's several sequences in one forward, whose longest document would choose the
    factors for all of them (measured: the --batch-size 4 evaluation 1.3e-4 off one process, every
    sequence with the long factors); refused before any rank starts, naming the flag and the way out."""
    with pytest.raises(ValueError, match=r"--adaptive: the model's RoPE \(longrope\).*--context-parallel N"):
        train(_args(folders, "--adaptive", "--nproc", 2, "--batch-size", 4))
