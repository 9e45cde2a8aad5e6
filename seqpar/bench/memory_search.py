"""Questions asked of the memory plan (:mod:`.memory_plan`): which model, how many bytes a device
has, the longest sequence that fits one setup, and the setups (cp, method, checkpointing) that fit.

A setup fits a device of ``M`` bytes when its predicted peak is at most ``M·(1 - headroom)``; the
headroom (default 10%) stands for what the plan does not count: the CUDA context (~0.5 GB), NCCL's
buffers, the allocator's fragmentation and kernels' workspaces.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from ..methods import BY_PREFERENCE, METHODS
from .memory_plan import CHECKPOINTING, ModelShape, Setup, plan

#: Known configurations (their config.json fields), for ``--model NAME``.
KNOWN_MODELS: dict[str, dict] = {
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                  "tie_word_embeddings": False},
    "llama3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                   "tie_word_embeddings": False},
    "llama3.1-405b": {"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                      "num_attention_heads": 128, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                      "tie_word_embeddings": False},
    "llama3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                    "tie_word_embeddings": True},
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def load_model(spec: str) -> ModelShape:
    """``spec``: a known name (:data:`KNOWN_MODELS`), a ``config.json`` path or a model folder holding one."""
    if spec in KNOWN_MODELS:
        return ModelShape.from_dict(KNOWN_MODELS[spec], name=spec)
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"--model={spec!r}: not a known name ({', '.join(KNOWN_MODELS)}), a config.json or a "
                         "folder with one")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model={spec!r}: cannot read {path}: {exc}") from exc
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg  # multimodal configs nest the decoder
    if not isinstance(cfg, dict):
        raise ValueError(f"--model={spec!r}: {path} is not a JSON object")
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "model"
    return ModelShape.from_dict(cfg, name=name)


def parse_bytes(text, flag: str = "--device-memory") -> int:
    """``"80GB"`` (10⁹), ``"80GiB"`` (2³⁰), ``"512MB"``, or a number of bytes -> int."""
    s = str(text).strip().lower().replace(" ", "")
    digits = s.rstrip("kmgtib")
    unit = s[len(digits):]
    try:
        value = float(digits) * _UNITS[unit]
    except (ValueError, KeyError):
        value = -1
    if not value > 0:
        raise ValueError(f"{flag}={text!r}: expected a size such as 80GB, 80GiB or 512MB")
    return int(value)


def budget(device_memory: int, headroom: float) -> int:
    if not 0 <= headroom < 1:
        raise ValueError(f"--headroom={headroom!r}: a fraction in [0, 1)")
    return int(device_memory * (1 - headroom))


def seq_unit(setup: Setup) -> int:
    """Sequence lengths the setup accepts are multiples of this."""
    from ..methods import method

    return setup.cp * method(setup.method).layout_multiple


def longest_fit(model: ModelShape, setup: Setup, limit: int, max_seq: int = 2**31) -> int:
    """The longest sequence (a multiple of :func:`seq_unit`) whose predicted peak is at most ``limit``
    bytes; 0 when not even one unit fits. The peak grows with the length, so a bisection finds it."""
    unit = seq_unit(setup)

    def fits(k: int) -> bool:
        return plan(model, replace(setup, seq=k * unit)).peak <= limit

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * unit <= max_seq and fits(hi):
        lo, hi = hi, hi * 2
    if hi * unit > max_seq:
        return lo * unit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def divisors(n: int) -> list[int]:
    """The cp degrees a world of ``n`` ranks allows."""
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelShape, seq: int, world: int, base: Setup, methods=None, cps=None):
    """Every valid (cp, checkpointing, method) setup of ``world`` ranks for ``seq`` tokens, in the order
    of preference: smallest cp (the most data parallelism, the least communication), then the least
    recomputation (none, attention, layer), then the methods' own preference (``Method.preference``)."""
    methods = [m for m in BY_PREFERENCE if m in (methods or METHODS)]
    out = []
    for cp in (cps or divisors(world)):
        for ck in CHECKPOINTING[:1] + ("attention", "layer"):
            for name in methods:
                try:
                    s = replace(base, seq=seq, world=world, cp=cp, method=name, checkpointing=ck)
                    p = plan(model, s)
                except ValueError:  # a length the layout cannot split, more Ulysses ranks than heads
                    continue
                out.append(p)
    return out


def search(model: ModelShape, seq: int, world: int, base: Setup, limit: int, methods=None, cps=None) -> dict:
    """The preferred setup that fits (``best``, a Plan or None), the smallest cp that fits without
    checkpointing, and for each cp its lightest fitting setup (``by_cp``: cp -> Plan or None)."""
    plans = candidates(model, seq, world, base, methods, cps)
    fitting = [p for p in plans if p.peak <= limit]
    by_cp: dict[int, object] = {}
    for p in plans:
        by_cp.setdefault(p.setup.cp, None)
        if p.peak <= limit and by_cp[p.setup.cp] is None:
            by_cp[p.setup.cp] = p
    smallest = min((p for p in plans), key=lambda p: p.peak, default=None)
    no_ckpt = next((p for p in fitting if p.setup.checkpointing == "none"), None)
    return {"best": fitting[0] if fitting else None, "no_checkpointing": no_ckpt, "by_cp": by_cp,
            "smallest": smallest, "limit": limit}


def human(n: float) -> str:
    """Bytes as GiB/MiB/KiB with 3 significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 1000 else f"{n / size:,.0f} {unit}"
    return f"{int(n)} B"


def human_tokens(n: int) -> str:
    """Tokens as 128K / 1M (K = 1024) when exact, else the integer."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"
