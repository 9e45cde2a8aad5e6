"""The ``seqpar generate`` command: flags, the local CPU ranks or torchrun's, one rank's run.

Launch: ``--nproc N`` spawns N local CPU ranks (gloo, :class:`seqpar.comm.pool.WorkerPool`); under
``torchrun`` the launched ranks are used; ``--nproc 1`` runs in this process. Sampling draws the same
tokens on every rank because every rank seeds torch with ``--seed`` (the cache checks it). Several
prompts (``--prompt`` or ``--prompt-file`` given more than once) are generated as one batch padded
on the left (:func:`pad_id`), as ``ShardedCache`` takes prompts of different lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...comm import CommStats, group_info
from ...comm.launch import launched_by_torchrun, launched_process_group, usable_cores
from ...comm.pool import WorkerPool
from ...methods import METHODS
from ..hf import ShardedCache, apply_context_parallel
from ..hf.cache import COMBINE_MODES, PREFILL_MODES

__all__ = ["GenerateConfig", "GenerateResult", "generate_main", "parse_args", "pad_id", "prompt_batch", "prompt_ids",
           "run"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """``prompt_file`` / ``prompt``: one or several (a str or a tuple); several run as one batch."""

    model: str
    prompt_file: tuple[str, ...] | str | None = None
    prompt: tuple[str, ...] | str | None = None
    chat: bool = False
    system: str | None = None
    nproc: int = 1
    method: str = "zigzag_ring"
    max_new_tokens: int = 64
    sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    prefill: str = "auto"
    decode_combine: str = "auto"
    dtype: str = "float32"
    threads: int = 0
    timeout: float = 3600.0
    json: str | None = None
    progress: bool = True

    def __post_init__(self):
        for name in ("prompt_file", "prompt"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value or ()))
        if bool(self.prompt) == bool(self.prompt_file):
            raise ValueError(f"prompt / prompt_file: give the prompts one way, as text (prompt) or as files "
                             f"(prompt_file), one or several; got {len(self.prompt)} and {len(self.prompt_file)}")


@dataclasses.dataclass
class GenerateResult:
    """What rank 0 reports: the generated text and token ids, the timings and the sizes per rank.
    ``text``, ``new_tokens`` and ``prompt_tokens`` are the first prompt's; ``outputs`` holds them for
    every prompt, in order (several prompts: one batch). ``decode_tokens_per_s`` counts every row's
    tokens."""

    text: str
    new_tokens: list[int]
    prompt_tokens: int
    ranks: int
    method: str
    prefill_s: float
    decode_tokens_per_s: float
    kv_bytes_per_rank: list[int]
    prefill_comm_bytes: int
    decode_comm_bytes_per_token: float
    choices: list[dict]
    decode_combine: list[str] = dataclasses.field(default_factory=list)
    outputs: list[dict] = dataclasses.field(default_factory=list)


def parse_args(argv: list[str]) -> GenerateConfig:
    p = argparse.ArgumentParser(prog="seqpar generate", description=(
        "Generate from a long prompt with context-parallel prefill and decoding over a sharded KV cache "
        "(seqpar.integrations.hf.ShardedCache inside transformers' generate())."))
    p.add_argument("--model", required=True, help="local transformers folder (config.json, safetensors, tokenizer)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt-file", action="append", help="text file holding the prompt; give it again for "
                       "more prompts, generated as one batch padded on the left")
    given.add_argument("--prompt", action="append", help="the prompt itself (short prompts; long ones: "
                       "--prompt-file); give it again for more prompts, generated as one batch padded on the left")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the tokenizer's "
                   "chat template, with the assistant's turn opened (instruction-tuned models)")
    p.add_argument("--system", help="with --chat: a system message before the user's")
    p.add_argument("--nproc", type=int, default=1, help="local CPU ranks (gloo); ignored under torchrun")
    p.add_argument("--method", default="zigzag_ring", choices=list(METHODS),
                   help="context-parallel attention method of the prefill")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="torch seed of every rank (sampling)")
    p.add_argument("--prefill", default="auto", choices=PREFILL_MODES,
                   help="prefill over a cached prefix (and of a batch of several prompts, padded on the left)")
    p.add_argument("--decode-combine", default="auto", choices=COMBINE_MODES)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before local ranks are stopped")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a = p.parse_args(argv)
    if a.nproc < 1:
        p.error(f"--nproc {a.nproc}: pass 1 or more ranks")
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens {a.max_new_tokens}: pass 1 or more")
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model}: no config.json there; pass a local transformers model folder "
                "(config.json, weights, tokenizer files)")
    for name in a.prompt_file or ():
        if not Path(name).is_file():
            p.error(f"--prompt-file {name}: no such file; pass a text file holding the prompt")
    if a.system is not None and not a.chat:
        p.error("--system: a system message needs --chat (the chat template places it)")
    return GenerateConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(GenerateConfig)})


def generate_main(argv: list[str] | None = None) -> int:
    cfg = parse_args(list(argv or []))
    try:
        result = run(cfg)
    except ValueError as exc:  # bad input found by the ranks (e.g. --chat without a template): one line
        print(f"seqpar generate: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    if result is not None:
        _print(result)
        if cfg.json:
            Path(cfg.json).write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n")
    return 0


def run(cfg: GenerateConfig) -> GenerateResult | None:
    """Run on torchrun's ranks, on ``cfg.nproc`` local ranks, or here; rank 0's result (None elsewhere)."""
    if launched_by_torchrun():
        with launched_process_group():
            return _rank_main(cfg)
    if cfg.nproc > 1:
        threads = cfg.threads or max(1, usable_cores() // cfg.nproc)
        with contextlib.closing(WorkerPool(cfg.nproc, threads_per_rank=threads)) as pool:
            return pool.run(_rank_main, (cfg,), {}, timeout=cfg.timeout)[0]
    previous = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or usable_cores())
    try:
        return _rank_main(cfg)
    finally:
        torch.set_num_threads(previous)


class _Progress:
    """A transformers streamer that advances a rich progress bar by one per generated token and
    notes when the first token (the end of the prefill) arrives."""

    def __init__(self, total: int, enabled: bool):
        self.calls, self.first, self.bar, self.task = 0, None, None, None
        if enabled:
            with contextlib.suppress(ImportError):
                from rich.progress import Progress

                self.bar = Progress(transient=True)
                self.task = self.bar.add_task("decoding", total=total)
                self.bar.start()

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first put is the prompt, the second the first new token
            self.first = time.perf_counter()
        if self.calls >= 2 and self.bar is not None:
            self.bar.advance(self.task)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def prompt_ids(cfg: GenerateConfig, tok) -> list[list[int]]:
    """Each prompt's token ids: the text of ``--prompt`` / ``--prompt-file`` (in order), tokenized as
    it is or, with ``--chat``, as a user message (after ``--system``'s) in the tokenizer's chat
    template with the assistant's turn opened."""
    texts = list(cfg.prompt) or [Path(name).read_text() for name in cfg.prompt_file]
    if not cfg.chat:
        return [tok(text).input_ids for text in texts]
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"--chat: the tokenizer in {cfg.model} has no chat template (tokenizer_config.json's "
                         "'chat_template' or chat_template.jinja); drop --chat to use the text as it is")
    system = [{"role": "system", "content": cfg.system}] if cfg.system is not None else []
    return [torch.as_tensor(tok.apply_chat_template(system + [{"role": "user", "content": text}],
                                                    add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]).flatten().tolist()
            for text in texts]


def pad_id(tok) -> int:
    """The id that fills the pads and finished rows: the tokenizer's pad token, else its end of sequence
    (many base models' tokenizers have no pad token; a pad's id never reaches the attention), else 0."""
    for candidate in (tok.pad_token_id, tok.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)


def prompt_batch(cfg: GenerateConfig, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, T]``, one row per prompt, padded on the left to the
    longest with :func:`pad_id` (the mask's zeros mark the pads)."""
    rows = prompt_ids(cfg, tok)
    width, pad = max(map(len, rows)), pad_id(tok)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def _new_tokens(row: list[int], eos) -> list[int]:
    """A row's generated ids up to its first end-of-sequence token (generate() pads finished rows)."""
    stops = set([eos] if isinstance(eos, int) else eos or [])
    ends = [i for i, t in enumerate(row) if t in stops]
    return row[:ends[0] + 1] if ends else row


@contextlib.contextmanager
def _quiet_loading(quiet: bool):
    """transformers' progress bars off while loading (``quiet``), restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was:
            hf_logging.enable_progress_bar()


def _rank_main(cfg: GenerateConfig) -> GenerateResult | None:
    from transformers import AutoModelForCausalLM

    from ..train.model_io import load_folder

    folder = load_folder(cfg.model)
    if folder.tokenizer is None:
        raise ValueError(f"--model: {cfg.model} has no tokenizer files; save the tokenizer into the folder")
    group = dist.group.WORLD if dist.is_initialized() else None
    info = group_info(group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and dist.is_initialized() \
        and dist.get_backend() != "gloo" else torch.device("cpu")
    with _quiet_loading(not cfg.progress or info.rank != 0):  # one "Loading weights" bar, not one per rank
        model = AutoModelForCausalLM.from_pretrained(folder.path, dtype=DTYPES[cfg.dtype]).to(device).eval()
    apply_context_parallel(model, group=group, method=cfg.method)
    tok = folder.tokenizer
    ids, mask = (t.to(device) for t in prompt_batch(cfg, tok))
    cache = ShardedCache(group=group, prefill=cfg.prefill, decode_combine=cfg.decode_combine, stats=CommStats())
    kw = dict(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.sample, pad_token_id=pad_id(tok))
    if cfg.sample:
        kw.update(temperature=cfg.temperature, top_p=cfg.top_p)
    torch.manual_seed(cfg.seed)
    progress = _Progress(cfg.max_new_tokens, cfg.progress and info.rank == 0)
    start = time.perf_counter()
    try:
        out = model.generate(ids, attention_mask=mask, cache=cache, streamer=progress, **kw)
    finally:
        progress.end()
    end = time.perf_counter()
    first = progress.first or end
    eos = model.generation_config.eos_token_id
    outputs = [{"prompt_tokens": int(m.sum()), "new_tokens": _new_tokens(row[ids.shape[1]:].tolist(), eos)}
               for row, m in zip(out, mask)]
    for o in outputs:
        o["text"] = tok.decode(o["new_tokens"], skip_special_tokens=True)
    steps, new = out.shape[1] - ids.shape[1], outputs[0]["new_tokens"]
    sizes = torch.tensor([cache.kv_bytes()], dtype=torch.int64)
    if info.size > 1:
        sizes = torch.zeros(info.size, dtype=torch.int64)
        sizes[info.rank] = cache.kv_bytes()
        dist.all_reduce(sizes, group=info.group)
    comm = cache.comm_summary()
    if info.rank != 0:
        return None
    return GenerateResult(
        text=outputs[0]["text"], new_tokens=new, prompt_tokens=outputs[0]["prompt_tokens"],
        ranks=info.size, method=cfg.method, prefill_s=first - start,
        decode_tokens_per_s=ids.shape[0] * (steps - 1) / (end - first) if steps > 1 and end > first else 0.0,
        kv_bytes_per_rank=sizes.tolist(), prefill_comm_bytes=comm["prefill_bytes"],
        decode_comm_bytes_per_token=comm["decode_bytes_per_token"],
        choices=[{k: v for k, v in h.items() if v is not None} for h in cache.history if h["phase"] == "prefill"],
        decode_combine=sorted({h["combine"] for h in cache.history if h["combine"]}), outputs=outputs)


def _print(r: GenerateResult) -> None:
    if len(r.outputs) > 1:
        for i, o in enumerate(r.outputs):
            print(f"--- prompt {i + 1} of {len(r.outputs)}: {o['prompt_tokens']} tokens, {len(o['new_tokens'])} new")
            print(o["text"])
        print(f"--- {len(r.outputs)} prompts in one batch (padded on the left), {r.ranks} rank(s), method {r.method}")
    else:
        print(r.text)
        print(f"--- {r.prompt_tokens} prompt tokens, {len(r.new_tokens)} new, {r.ranks} rank(s), method {r.method}")
    print(f"prefill {r.prefill_s:.3f} s; decode {r.decode_tokens_per_s:.2f} tokens/s")
    print("KV bytes per rank: " + ", ".join(f"{b:,}" for b in r.kv_bytes_per_rank)
          + f" (total {sum(r.kv_bytes_per_rank):,})")
    print(f"sent per rank: {r.prefill_comm_bytes:,} B in the prefill, "
          f"{r.decode_comm_bytes_per_token:,.0f} B per decoded token (combine: {', '.join(r.decode_combine) or '-'})")
