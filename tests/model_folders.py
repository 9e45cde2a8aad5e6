"""Real-format model folders for tests, built in-process (no downloads).

Everything here is deterministic: the tokenizer is trained on a fixed text, models are initialised
from a fixed seed, documents come from a seeded generator. Each folder takes well under a second.

- :func:`tiny_tokenizer` a ``transformers.PreTrainedTokenizerFast`` (byte-level BPE trained with the
  ``tokenizers`` library) with ``<bos>``, ``<eos>``, ``<pad>``, ``<unk>`` specials;
- :func:`llama_folder` a tiny ``LlamaForCausalLM`` (GQA, tied or untied) saved with
  ``save_pretrained`` (safetensors, optionally sharded with an index) plus the tokenizer;
- :func:`windowed_folder` a tiny ``GptOssForCausalLM`` (sliding-window layers alternating with full
  layers, attention sinks, a 2-expert MoE) plus the tokenizer;
- :func:`text_documents` real-ish English documents of awkward lengths (1 word to a few hundred).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

_WORDS = (
    "the of and to in is was that for on with as by at from his her they this which be are it an "
    "or had not were but have all their one been has more when who will would there she can its "
    "into about out then them these so some time only could other new two first may after over "
    "river mountain window garden letter morning evening station market winter summer harbour "
    "engine signal pattern number question answer teacher student village forest bridge journey "
    "quiet bright heavy narrow ancient careful sudden gentle distant curious simple strange "
    "walked carried opened wrote found turned watched listened remembered followed explained"
).split()

_SEED_TEXT = (
    "The river ran past the old station, and the morning train carried letters to the village. "
    "A curious student walked across the narrow bridge; the teacher explained the pattern again. "
    "In winter the harbour was quiet, in summer the market opened early and closed late. "
    "Numbers, questions and answers: 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > ! ? ' \" : ; , . "
)


def tiny_tokenizer(directory: str | Path | None = None, *, vocab_size: int = 320):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained in-process on a fixed text.

    Specials: ``<unk>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<pad>`` 3; the 256 byte symbols follow, then
    merges, up to ``vocab_size`` entries (the trainer may stop earlier when the text has no more
    pairs; ``len(tokenizer)`` is the real size). Any text encodes (byte fallback). Saved with
    ``save_pretrained`` into ``directory`` when one is given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<bos>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [_SEED_TEXT] + [" ".join(_WORDS[i:i + 12]) for i in range(0, len(_WORDS), 6)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(directory))
    return fast


def spread_weights(model, std: float = 0.2) -> None:
    """Redraw every weight of two or more dimensions (matrices, stacked experts) of ``model`` from
    N(0, std^2), norms and biases kept: the initializer's 0.02 gives near-uniform logits, larger
    weights sharper ones, so that a wrong position, RoPE or mask moves the comparison visibly. Draws
    from torch's global generator (seed it first)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)


def _save(model, path: Path, tokenizer, sharded: bool) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    # A shard limit well below the model's size forces several files and model.safetensors.index.json.
    model.save_pretrained(str(path), max_shard_size="20KB" if sharded else "10GB")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def llama_folder(path: str | Path, *, tied: bool = True, hidden: int = 32, layers: int = 2,
                 heads: int = 4, kv_heads: int = 2, intermediate: int = 64, seed: int = 0,
                 sharded: bool = False, dtype: torch.dtype = torch.float32, vocab_size: int | None = None,
                 tokenizer: bool = True, max_positions: int = 4096) -> Path:
    """Save a tiny ``LlamaForCausalLM`` (GQA: ``heads`` query heads over ``kv_heads`` KV heads) and
    its tokenizer into ``path``; returns ``path``.

    ``vocab_size`` defaults to the tokenizer's ``len``; pass a smaller one to build the "tokenizer
    larger than the embedding" mistake. ``tied`` ties ``lm_head`` to the input embedding (the
    file then holds no ``lm_head.weight``). ``sharded=True`` writes several safetensors files and
    ``model.safetensors.index.json``. ``tokenizer=False`` leaves the tokenizer out.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab_size if vocab_size is not None else len(tok), hidden_size=hidden,
        intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, rms_norm_eps=1e-5, dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    return _save(model, path, tok if tokenizer else None, sharded)


def windowed_folder(path: str | Path, *, window: int = 8, hidden: int = 32, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, seed: int = 0, sharded: bool = False,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Save a tiny gpt-oss-style model (``GptOssForCausalLM``) and its tokenizer into ``path``.

    Layers alternate ``sliding_attention`` (window ``window``) and ``full_attention``; every
    attention has learned sinks (``self_attn.sinks``, one logit per head). A 2-expert MoE with one
    expert per token keeps it tiny. Plain default RoPE (no YaRN) so short-sequence tests stay
    simple. Returns ``path``.
    """
    from transformers import GptOssConfig, GptOssForCausalLM

    path = Path(path)
    tok = tiny_tokenizer()
    config = GptOssConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, num_local_experts=2, num_experts_per_tok=1, sliding_window=window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, dtype=dtype)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).to(dtype)
    with torch.no_grad():  # sinks start at zero in some versions: make them matter in tests
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return _save(model, path, tok, sharded)


def text_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic English-like documents of awkward lengths (1 to ~400 words; some with
    newlines, digits and punctuation). Same ``(n, seed)`` -> same list."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 7, 13, 31, 64, 127, 257, 399]
    docs = []
    for i in range(n):
        count = lengths[i % len(lengths)] if i < len(lengths) else rng.randint(1, 300)
        words = []
        for j in range(count):
            w = rng.choice(_WORDS)
            if j == 0:
                w = w.capitalize()
            if rng.random() < 0.06:
                w += rng.choice([",", ".", ";", "!", "?"])
            if rng.random() < 0.03:
                w = str(rng.randint(0, 9999))
            words.append(w)
            if rng.random() < 0.02:
                words.append("\n")
        docs.append(" ".join(words).replace(" \n ", "\n") + ".")
    return docs
