"""Options of ``seqpar train``: the command line, one frozen :class:`TrainConfig`, and the checks that
run before any rank starts (so bad input fails once, fast, with the flag to change)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from seqpar.methods import ADAPTIVE_METHODS, METHODS

from . import rope_flags
from .data import VOCAB_SIZE, PackedSequences, TextFiles, default_data_dir

CHECKPOINTING = ("none", "layer", "attention")
DTYPES = ("float32", "bfloat16", "float16")

# Default model: a Llama with GQA (8 query heads, 2 KV heads) small enough that a step of 2048
# tokens takes about a second on 2 CPU cores, large enough that its loss visibly falls in 50 steps.
DEFAULT_MODEL = dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=688,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     attention_dropout=0.0, bos_token_id=256, eos_token_id=257, pad_token_id=258)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a rank needs to train; built once from the command line and sent to every rank."""

    model_config: str | None = None
    model: str | None = None
    trust_pickle: bool = False
    data: str | None = None
    data_glob: str | None = None
    seq_len: int = 2048
    batch_size: int | None = None  # global sequences per step; None = one per data-parallel rank
    context_parallel: int = 1
    cp_method: str = "zigzag_ring"
    adaptive: bool = False
    calibration: str | None = None
    checkpointing: str = "none"
    dtype: str = "float32"
    steps: int = 50
    lr: float = 1e-3
    warmup: int | None = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    save: str | None = None
    save_every: int = 0
    resume: str | None = None  # "" = latest under --save
    nproc: int = 1
    threads: int | None = None
    plot: str | None = None
    json: str | None = None
    log_every: int = 1
    progress: bool = True
    timeout: float = 86400.0
    crash_at_step: int | None = None
    export_hf: str | None = None
    compile: bool = False
    loss_chunk: int | None = None  # tokens per loss chunk; None = 256 MiB of fp32 logits; 0 = unchunked
    replicas: int = 1  # HSDP: FSDP2 shards within groups of W / replicas ranks, replicated across them
    loss_scale_init: float | None = None  # --dtype float16: the first loss scale (None = torch's 2**16)
    loss_scale_growth_interval: int | None = None  # clean steps before the scale doubles (None = 2000)
    loss_scale_min: float | None = None  # the run stops when the scale falls below it (None = 1.0)
    eval_data: str | None = None  # held-out documents (same formats as --data); None = no evaluation
    eval_every: int | None = None  # steps between evaluations (None or 0 = only after the last step)
    eval_batches: int | None = None  # sequences evaluated (None = 32, capped at what the data holds)
    rope_theta: float | None = None  # the RoPE flags (rope_flags.py): applied to the model's config
    rope_scaling: str | None = None  # a JSON object of RoPE parameters, as given
    max_position_embeddings: int | None = None

    @property
    def data_dir(self) -> str:
        return self.data or default_data_dir()

    @property
    def glob(self) -> str:
        return self.data_glob or ("*.py" if self.data is None else "*")

    def to_dict(self) -> dict:
        return asdict(self)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="seqpar train",
        description="Train a transformers decoder (a local model folder, or random weights from a config) on "
                    "packed documents with context parallelism; parameters, gradients and optimizer state are "
                    "sharded (FSDP2) over all ranks. Local CPU ranks: --nproc N; GPUs or several nodes: "
                    "torchrun ... -m seqpar.train.")
    a = p.add_argument
    a("--model", metavar="DIR", help="local transformers model folder (config.json, safetensors weights, "
      "tokenizer): its weights are read straight into each rank's shards; data is tokenized with its tokenizer")
    a("--trust-pickle", action="store_true", help="with --model: allow a pickled pytorch_model.bin (it can run "
      "code when loaded; prefer safetensors)")
    a("--model-config", metavar="PATH", help="random weights from a JSON config or a folder's config.json "
      "(default: a small Llama with GQA; initialised from --seed, the same at any world size; byte-level tokens)")
    a("--data", metavar="PATH", help="folder of text files (one document each); with --model also JSONL with a "
      "'text' field or parquet/arrow files (default: the Python standard library's source files)")
    a("--data-glob", metavar="PATTERN", help="file names to use in --data and --eval-data folders (default "
      "'*.py' for the default data, else '*')")
    a("--seq-len", type=int, default=2048, help="tokens per packed sequence (global, before sharding)")
    a("--batch-size", type=int, help="global sequences per step (default: one per data-parallel rank)")
    a("--context-parallel", "--cp", type=int, default=1, metavar="N",
      help="ranks that share one sequence; the rest of the world is data parallel")
    a("--cp-method", default="zigzag_ring", choices=METHODS)
    a("--adaptive", action="store_true", help="plan context-parallel groups and methods per batch with "
      "the adaptive scheduler (seqpar.schedulers) instead of a fixed --context-parallel")
    a("--calibration", metavar="JSON", help="with --adaptive: plan with this 'seqpar calibrate' file's measured "
      "cost model and machine (default: the scheduler's GPU defaults, world = these ranks)")
    a("--checkpointing", default="none", choices=CHECKPOINTING, help="activation checkpointing: per decoder "
      "layer, or 'attention' (seqpar's rematerialisation-aware mode)")
    a("--dtype", default="float32", choices=DTYPES, help="compute dtype (FSDP2 mixed precision: "
      "computed in it, gradients reduced in fp32, fp32 master weights and optimizer state; one process: autocast; "
      "float16 adds dynamic loss scaling: a step whose gradients overflow is skipped on every rank)")
    a("--loss-scale-init", type=float, metavar="S", help="with --dtype float16: the initial loss scale "
      "(default 65536, torch's GradScaler's; halved after each overflow; a resumed run continues at its "
      "checkpoint's scale)")
    a("--loss-scale-growth-interval", type=int, metavar="N", help="with --dtype float16: clean steps before the "
      "loss scale doubles (default 2000)")
    a("--loss-scale-min", type=float, metavar="S", help="with --dtype float16: stop with an error when the loss "
      "scale falls below S (default 1, or --loss-scale-init when lower; the loss or gradients then overflow at "
      "nearly every step, and a scale halved on to 0 would silently stop all updates)")
    a("--steps", type=int, default=50)
    a("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, linear warmup, cosine to 10%%)")
    a("--warmup", type=int, help="warmup steps (default: min(10, steps / 10))")
    a("--weight-decay", type=float, default=0.0)
    a("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
    a("--seed", type=int, default=0, help="weights and data order")
    a("--eval-data", metavar="PATH", help="held-out documents (the formats of --data, packed the same way): "
      "evaluate the loss on the same sequences after every --eval-every steps and at the end")
    a("--eval-every", type=int, metavar="N", help="with --eval-data: evaluate every N steps (default 0: only "
      "after the last step)")
    a("--eval-batches", type=int, metavar="K", help="with --eval-data: sequences of --seq-len tokens evaluated "
      "(default 32, or all the data holds if fewer; the same ones at every evaluation, world size and cp)")
    a("--save", metavar="DIR", help="checkpoint folder (DCP; resumable with another --context-parallel)")
    a("--save-every", type=int, default=0, metavar="N", help="also save every N steps (default: only at the end)")
    a("--resume", nargs="?", const="", metavar="PATH", help="resume from PATH, or without a value from "
      "the latest complete checkpoint under --save (a fresh start if there is none yet)")
    a("--nproc", type=int, default=1, metavar="N", help="local CPU ranks to spawn (gloo); ignored under torchrun")
    a("--threads", type=int, help="torch threads per rank (default: CPU cores / ranks, at least 1)")
    a("--plot", nargs="?", const="loss.png", metavar="PNG", help="save the loss curve (default loss.png)")
    a("--json", metavar="PATH", help="append one JSON line per step (and start/end records) to PATH; '-' = stdout")
    a("--log-every", type=int, default=1, metavar="N")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--timeout", type=float, default=86400.0, help="seconds before spawned local ranks are killed")
    a("--export-hf", metavar="DIR", help="at the end, write the trained model as a transformers folder "
      "(safetensors, config, tokenizer) gathered from the shards; DIR must not exist or be empty")
    a("--compile", action="store_true", help="torch.compile each decoder layer")
    a("--replicas", type=int, default=1, metavar="R", help="HSDP for large worlds: shard parameters within "
      "W / R ranks (e.g. a node), replicate them across the R groups (gradients all-reduced across; default 1: "
      "shard over all ranks)")
    a("--loss-chunk", type=int, metavar="TOKENS", help="tokens per chunk of the loss (linear + cross entropy "
      "chunk by chunk, exact; default: 256 MiB of fp32 logits per chunk; 0 = the model's full logits at once)")
    rope_flags.add_arguments(p)
    a("--crash-at-step", type=int, metavar="K", help=argparse.SUPPRESS)  # fault injection for tests
    return p


def parse_args(argv: list[str] | None) -> TrainConfig:
    ns = build_parser().parse_args(argv)
    return TrainConfig(
        model_config=ns.model_config, data=ns.data, data_glob=ns.data_glob, seq_len=ns.seq_len,
        batch_size=ns.batch_size, context_parallel=ns.context_parallel, cp_method=ns.cp_method,
        adaptive=ns.adaptive, calibration=ns.calibration, checkpointing=ns.checkpointing, dtype=ns.dtype, steps=ns.steps, lr=ns.lr,
        warmup=ns.warmup, weight_decay=ns.weight_decay, grad_clip=ns.grad_clip, seed=ns.seed, save=ns.save,
        save_every=ns.save_every, resume=ns.resume, nproc=ns.nproc, threads=ns.threads, plot=ns.plot,
        json=ns.json, log_every=ns.log_every, progress=not ns.no_progress, timeout=ns.timeout,
        crash_at_step=ns.crash_at_step, model=ns.model, trust_pickle=ns.trust_pickle, export_hf=ns.export_hf,
        compile=ns.compile, loss_chunk=ns.loss_chunk, replicas=ns.replicas, loss_scale_init=ns.loss_scale_init,
        loss_scale_growth_interval=ns.loss_scale_growth_interval, loss_scale_min=ns.loss_scale_min,
        eval_data=ns.eval_data, eval_every=ns.eval_every, eval_batches=ns.eval_batches, rope_theta=ns.rope_theta,
        rope_scaling=ns.rope_scaling, max_position_embeddings=ns.max_position_embeddings)


# ----------------------------------------------------------------------------- model config


def load_model_config(path: str | None):
    """A transformers config: the default Llama, a JSON file, or a local folder's config.json."""
    from transformers import AutoConfig, LlamaConfig

    if path is None:
        values = dict(DEFAULT_MODEL)
        values.pop("model_type")
        return LlamaConfig(**values)
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"--model-config: folder {path} has no config.json")
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"--model-config: {path} is neither a JSON file nor a model folder")
    try:
        values = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model-config: {p} is not valid JSON ({exc})") from exc
    model_type = values.pop("model_type", "llama")
    try:
        config = AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"--model-config: {p}: {exc}") from exc
    if config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"--model-config: vocab_size {config.vocab_size} is smaller than the byte-level "
                         f"vocabulary ({VOCAB_SIZE}: 256 bytes + BOS, EOS, PAD)")
    return config


def run_model_config(cfg: TrainConfig):
    """The ``--model-config`` (or default) config with the RoPE flags applied (``--model``'s: the folder's)."""
    return rope_flags.apply(load_model_config(cfg.model_config), cfg)


# ----------------------------------------------------------------------------- checks


def world_size_of(cfg: TrainConfig) -> int:
    """Ranks of the run: torchrun's WORLD_SIZE when launched by it, else ``--nproc``."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else cfg.nproc




def global_batch(cfg: TrainConfig, world: int) -> int:
    return cfg.batch_size if cfg.batch_size is not None else world // cfg.context_parallel


def adaptive_models(cfg: TrainConfig, world: int, model_config):
    """(ClusterSpec, CostModel) for ``--adaptive`` (``(None, None)``: the scheduler's defaults).

    With ``--calibration``: the file's measured machine at this run's world size and its cost model
    moved to the model's attention shape (``rescale_cost_model``: heads, KV heads, head dim, layers),
    keeping the methods the adaptive trainer can use. ValueError naming the file when it is unusable.
    """
    if cfg.calibration is None:
        return None, None
    from seqpar.schedulers.calibration import load_calibration, rescale_cost_model

    cluster, cost = load_calibration(cfg.calibration)
    usable = [m for m in cost.method_names if m in ADAPTIVE_METHODS]
    if not usable:
        raise ValueError(f"--calibration {cfg.calibration}: calibrates {', '.join(cost.method_names)}, none of the "
                         f"methods --adaptive runs ({', '.join(ADAPTIVE_METHODS)}); calibrate with --methods "
                         f"{','.join(ADAPTIVE_METHODS)}")
    c = model_config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    cost = rescale_cost_model(cost.with_methods(usable), heads, kv, head_dim, c.num_hidden_layers)
    return cluster.with_world_size(world), cost


def initial_loss_scale(cfg: TrainConfig) -> float:
    """``--loss-scale-init``, or torch's GradScaler default (2**16)."""
    return 2.0**16 if cfg.loss_scale_init is None else cfg.loss_scale_init


def validate(cfg: TrainConfig, world: int):
    """Every check that needs no process group; raises ValueError naming the flag. Returns the packed data.

    Any ``--seq-len`` fits: sequences are packed documents, which seqpar pads to the layout itself.
    """
    positive = {"--seq-len": cfg.seq_len, "--context-parallel": cfg.context_parallel, "--steps": cfg.steps,
                "--nproc": cfg.nproc, "--log-every": cfg.log_every}
    for flag, value in positive.items():
        if value < 1:
            raise ValueError(f"{flag}: expected a positive integer, got {value}")
    if not 0 < cfg.lr < float("inf"):  # inf: NaN weights after the first step (and no strict JSON checkpoint)
        raise ValueError(f"--lr: expected a positive finite learning rate (e.g. 1e-3), got {cfg.lr}")
    # values that would otherwise be read as something else: a negative clip as "off", a negative
    # warmup as "no warmup" with the cosine past its end; an infinite weight decay as NaN weights
    for flag, value in (("--grad-clip", cfg.grad_clip), ("--weight-decay", cfg.weight_decay),
                        ("--warmup", cfg.warmup)):
        if value is not None and not (value >= 0 and (flag == "--grad-clip" or value < float("inf"))):
            raise ValueError(f"{flag}: expected a non-negative {'' if flag == '--grad-clip' else 'finite '}number, "
                             f"got {value}")
    if not cfg.timeout > 0:
        raise ValueError(f"--timeout: expected a positive number of seconds, got {cfg.timeout}")
    if cfg.save_every < 0 or (cfg.save_every and not cfg.save):
        raise ValueError("--save-every: needs --save DIR and a non-negative number of steps")
    if cfg.loss_chunk is not None and cfg.loss_chunk < 0:
        raise ValueError(f"--loss-chunk: expected tokens per chunk >= 1, or 0 for the unchunked loss; got "
                         f"{cfg.loss_chunk}")
    _validate_loss_scale(cfg)
    _validate_eval(cfg)
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads: expected a positive integer, got {cfg.threads}")
    cp = cfg.context_parallel
    if world % cp:
        raise ValueError(f"--context-parallel {cp} does not divide the {world} ranks; the world is split into "
                         f"groups of {cp} context-parallel ranks (use a divisor of {world})")
    dp = world // cp
    batch = global_batch(cfg, world)
    if batch < 1 or (batch % dp and not cfg.adaptive):  # adaptive plans its own groups
        raise ValueError(f"--batch-size {batch}: must be a positive multiple of the {dp} data-parallel groups")
    if cfg.replicas < 1 or dp % cfg.replicas or (cfg.adaptive and cfg.replicas > 1):
        raise ValueError(f"--replicas {cfg.replicas}: must be a positive divisor of the {dp} data-parallel groups "
                         "(the replicas split dp; each holds whole context-parallel groups), and 1 with --adaptive")
    if cfg.adaptive and world & (world - 1):
        raise ValueError(f"--adaptive: the scheduler tiles the ranks with power-of-two groups; {world} ranks "
                         "is not a power of two")
    if cfg.calibration is not None:
        if not cfg.adaptive:
            raise ValueError("--calibration: only the adaptive scheduler plans with a cost model; add --adaptive "
                             "(or drop --calibration)")
        adaptive_models(cfg, world, run_model_config(cfg))  # a bad file fails here, once
    if cfg.crash_at_step is not None and not cfg.crash_at_step >= 1:
        raise ValueError("--crash-at-step: expected a step >= 1")
    if cfg.export_hf is not None:
        out = Path(cfg.export_hf)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--export-hf: {out} exists and is not an empty folder; choose a new path (the "
                             "export never overwrites)")
        if not out.resolve().parent.is_dir():
            raise ValueError(f"--export-hf: the parent folder of {out} does not exist; create it first")
    folder = model_folder(cfg)
    if cfg.adaptive:  # one forward per group's stream of several sequences: one choice of frequencies for all
        from ..hf.rope import length_dependent_types

        kinds = length_dependent_types(folder.config if folder is not None else run_model_config(cfg))
        if kinds:
            raise ValueError(f"--adaptive: the model's RoPE ({', '.join(kinds)}) takes its frequencies from the "
                             "longest document of each forward, and --adaptive runs several sequences in one "
                             "forward, so the loss would depend on the plan; use --context-parallel N instead")
    open_eval_data(cfg, folder)  # a bad --eval-data fails here, once
    return open_data(cfg, folder)


def _validate_eval(cfg: TrainConfig) -> None:
    for flag, value in (("--eval-every", cfg.eval_every), ("--eval-batches", cfg.eval_batches)):
        if value is not None and cfg.eval_data is None:
            raise ValueError(f"{flag}: evaluation needs held-out data; add --eval-data PATH (or drop {flag})")
    if cfg.eval_every is not None and cfg.eval_every < 0:
        raise ValueError(f"--eval-every: expected a number of steps >= 0 (0 = only after the last step), got "
                         f"{cfg.eval_every}")
    if cfg.eval_batches is not None and cfg.eval_batches < 1:
        raise ValueError(f"--eval-batches: expected a positive number of sequences (default 32), got "
                         f"{cfg.eval_batches}")


def _validate_loss_scale(cfg: TrainConfig) -> None:
    import math

    for flag, value in (("--loss-scale-init", cfg.loss_scale_init),
                        ("--loss-scale-growth-interval", cfg.loss_scale_growth_interval),
                        ("--loss-scale-min", cfg.loss_scale_min)):
        if value is not None and cfg.dtype != "float16":
            raise ValueError(f"{flag}: only --dtype float16 scales the loss (this run is {cfg.dtype}); drop {flag} "
                             "or add --dtype float16")
    if cfg.loss_scale_init is not None and not (math.isfinite(cfg.loss_scale_init) and cfg.loss_scale_init > 0):
        raise ValueError(f"--loss-scale-init: expected a positive finite scale (e.g. 65536), got {cfg.loss_scale_init}")
    # the scaler holds its scale in fp32: above fp32's largest value it cannot be stored (torch raises at
    # the first step); below its smallest normal one the scale's inverse overflows (or the scale rounds
    # to 0), which makes the gradients inf/NaN after the inf check has passed them: NaN weights, no skip
    low, high = 2.0**-126, (2 - 2.0**-23) * 2.0**127
    if cfg.loss_scale_init is not None and not low <= cfg.loss_scale_init <= high:
        raise ValueError(f"--loss-scale-init: the scale is held in float32, so it must lie in [{low:.3g}, {high:.3g}] "
                         f"(e.g. 65536); got {cfg.loss_scale_init}")
    init = initial_loss_scale(cfg)
    if cfg.loss_scale_min is not None and not low <= cfg.loss_scale_min <= init:
        raise ValueError(f"--loss-scale-min: expected a scale in [{low:.3g}, --loss-scale-init {init:g}] (default 1), "
                         f"got {cfg.loss_scale_min}; lower it or raise --loss-scale-init")
    # the scaler counts clean steps in an int32 tensor
    if cfg.loss_scale_growth_interval is not None and not 1 <= cfg.loss_scale_growth_interval < 2**31:
        raise ValueError(f"--loss-scale-growth-interval: expected a positive number of steps below 2**31, got "
                         f"{cfg.loss_scale_growth_interval}")


def model_folder(cfg: TrainConfig):
    """The validated ``--model`` folder (:class:`.model_io.ModelFolder`; its config with the RoPE flags
    applied), or None for ``--model-config`` (whose config is checked here)."""
    if cfg.model is not None and cfg.model_config is not None:
        raise ValueError("--model: takes the config from the folder; drop --model-config (random weights) or --model")
    if cfg.trust_pickle and cfg.model is None:
        raise ValueError("--trust-pickle: only applies to --model DIR")
    if cfg.model is None:
        run_model_config(cfg)  # a bad config or RoPE flag fails here, once
        return None
    from .model_io import load_folder

    folder = load_folder(cfg.model, trust_pickle=cfg.trust_pickle, argument="--model")
    if folder.tokenizer is None:
        raise ValueError(f"--model: {cfg.model} has no tokenizer (tokenizer.json / tokenizer_config.json); save the "
                         "model's tokenizer into the folder with tokenizer.save_pretrained")
    return replace(folder, config=rope_flags.apply(folder.config, cfg))


def open_data(cfg: TrainConfig, folder):
    """The packed sequences of the run: byte-level text files, or with ``--model`` documents tokenized by
    its tokenizer (:func:`.tokens.open_token_data`). ValueError naming ``--data`` when there is too little."""
    if folder is not None:
        from .tokens import open_token_data

        return open_token_data(cfg.data_dir, folder.tokenizer, cfg.seq_len, cfg.seed, pattern=cfg.glob)
    files = TextFiles.scan(cfg.data_dir, cfg.glob)
    if files.num_tokens < cfg.seq_len:
        raise ValueError(f"--data: {cfg.data_dir} holds {files.num_tokens} tokens, fewer than one sequence of "
                         f"--seq-len {cfg.seq_len}; add text or lower --seq-len")
    return PackedSequences(files, cfg.seq_len, cfg.seed)


# ----------------------------------------------------------------------------- evaluation data (--eval-data)

EVAL_SEED = 0  # the evaluation set's shuffle: fixed, so runs with different --seed see the same sequences
DEFAULT_EVAL_BATCHES = 32


@dataclass(frozen=True)
class EvalSet:
    """The sequences evaluated: ``data.sequence(i)`` for ``i < count`` (``requested``: ``--eval-batches``)."""

    data: object  # PackedSequences (bytes) or PackedTokenSequences (--model's tokenizer)
    count: int
    requested: int


def open_eval_data(cfg, folder) -> EvalSet | None:
    """The evaluation set of ``cfg`` (None without ``--eval-data``); ValueError naming ``--eval-data``
    when it is missing, empty, or holds less than one ``--seq-len`` sequence."""
    if cfg.eval_data is None:
        return None
    requested = DEFAULT_EVAL_BATCHES if cfg.eval_batches is None else cfg.eval_batches
    pattern = cfg.data_glob or "*"
    if folder is not None:
        from .tokens import open_token_data

        data = open_token_data(cfg.eval_data, folder.tokenizer, cfg.seq_len, EVAL_SEED, pattern=pattern,
                               argument="--eval-data")
    else:
        files = TextFiles.scan(cfg.eval_data, pattern, argument="--eval-data")
        if files.num_tokens < cfg.seq_len:
            raise ValueError(f"--eval-data: {cfg.eval_data} holds {files.num_tokens} tokens, fewer than one "
                             f"sequence of --seq-len {cfg.seq_len}; add text or lower --seq-len")
        data = PackedSequences(files, cfg.seq_len, EVAL_SEED)
    return EvalSet(data, min(requested, data.per_epoch), requested)
