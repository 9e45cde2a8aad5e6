"""Built-in length distributions for planning demos and benchmarks (offline, deterministic).

``stdlib``: the byte sizes of the Python standard library's ``.py`` files (the directory of
``sysconfig.get_paths()["stdlib"]``, without ``site-packages``/``dist-packages`` and without empty
files) divided by 4 as a token estimate: a real long-tailed document-length distribution (on
CPython 3.11: 1762 files, median ~1.7K tokens, p99 ~41K, max ~189K).

``stdlib-dirs``: repository-level documents: the ``.py`` files of each stdlib directory (each
package, non-recursive) concatenated into one document, as code corpora build repository-level
samples, cut into pieces of at most ``max_len`` tokens (a context window, default 131072) like any
document longer than the window (CPython 3.11: 113 directories, 7.9M tokens, median ~11.6K, the
largest ``test`` with 3.5M tokens -> 27 full windows).

``stdlib-mix``: the union of ``stdlib`` (file-level) and ``stdlib-dirs`` (repository-level)
documents: a long-context mixture where most documents are short and a few fill the window.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Sequence

import numpy as np

from .cluster import ClusterSpec
from .cost import CostModel

DISTRIBUTIONS = ("stdlib", "stdlib-dirs", "stdlib-mix")
_SUFFIXES = {"k": 1024, "m": 1024 * 1024}
DEFAULT_WINDOW = 131072


def parse_length(x, field: str = "seq_lens") -> int:
    """``8192``, ``"8192"``, ``"8k"`` (k = 1024) or ``"1m"`` (m = 1024²) -> int; ValueError naming
    ``field`` otherwise (the command lines' token counts)."""
    text = str(x).strip().lower()
    mult = _SUFFIXES.get(text[-1:], 1)
    try:
        value = int(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{field}: {x!r} is not a length (a non-negative integer, or e.g. '8k' for 8192)")
    return value


def parse_lengths(text: str, field: str = "seq_lens") -> list[int]:
    """Comma-separated positive :func:`parse_length` values: ``"2k,4k,8192"``."""
    out = [parse_length(part, field) for part in str(text).split(",")]
    if 0 in out:
        raise ValueError(f"{field}: {text!r}: every entry must be positive")
    return out


def stdlib_lengths(bytes_per_token: int = 4) -> np.ndarray:
    """Token estimates (bytes // bytes_per_token, at least 1) of every non-empty stdlib .py file,
    in path order (so a seeded sample is reproducible on the same Python)."""
    root = sysconfig.get_paths()["stdlib"]
    sizes = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                size = os.path.getsize(os.path.join(dirpath, name))
                if size > 0:
                    sizes.append(max(1, size // bytes_per_token))
    if not sizes:
        raise ValueError(f"dist='stdlib': no .py files found under {root}")
    return np.array(sizes, dtype=np.int64)


def stdlib_dir_lengths(bytes_per_token: int = 4, max_len: int = DEFAULT_WINDOW) -> np.ndarray:
    """Repository-level documents: per stdlib directory, the concatenated ``.py`` bytes //
    ``bytes_per_token``, cut into pieces of at most ``max_len`` tokens (full windows, then the rest),
    in path order."""
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len={max_len!r}: expected a positive number of tokens")
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        size = sum(os.path.getsize(os.path.join(dirpath, n)) for n in sorted(filenames) if n.endswith(".py"))
        tokens = size // bytes_per_token
        while tokens > 0:
            out.append(min(tokens, max_len))
            tokens -= max_len
    if not out:
        raise ValueError(f"dist='stdlib-dirs': no .py files found under {root}")
    return np.array(out, dtype=np.int64)


def _pool(dist: str, max_len: int) -> np.ndarray:
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist={dist!r}: choose one of {', '.join(DISTRIBUTIONS)}")
    if dist == "stdlib":
        return stdlib_lengths()
    if dist == "stdlib-dirs":
        return stdlib_dir_lengths(max_len=max_len)
    return np.concatenate([np.minimum(stdlib_lengths(), max_len), stdlib_dir_lengths(max_len=max_len)])


def sample_lengths(num_seqs: int, seed: int = 0, dist: str = "stdlib", max_len: int = DEFAULT_WINDOW) -> np.ndarray:
    """``num_seqs`` lengths drawn with replacement from the distribution ``dist`` (``max_len``: the
    window of ``stdlib-dirs`` / ``stdlib-mix``; ``stdlib`` is never cut)."""
    if not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs={num_seqs!r}: expected a positive integer")
    pool = _pool(dist, max_len)
    return np.random.default_rng(seed).choice(pool, size=num_seqs, replace=True)


def sample_tokens(total_tokens: int, seed: int = 0, dist: str = "stdlib-mix",
                  max_len: int = DEFAULT_WINDOW) -> np.ndarray:
    """Real (unscaled) lengths drawn with replacement from ``dist`` until they hold at least
    ``total_tokens`` tokens (a token-budget batch, as long-context trainers build them)."""
    if not isinstance(total_tokens, (int, np.integer)) or total_tokens < 1:
        raise ValueError(f"total_tokens={total_tokens!r}: expected a positive integer")
    pool = _pool(dist, max_len)
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < total_tokens:
        x = int(rng.choice(pool))
        out.append(x)
        total += x
    return np.array(out, dtype=np.int64)


def max_fitting_length(cluster: ClusterSpec, cost_model: CostModel, methods: Sequence[str] | None = None) -> int:
    """Longest sequence that fits memory on some group of the cluster (every group size it allows)
    with the best of ``methods``: 0 when none fits even one token, ``sys.maxsize`` when a method's
    memory does not grow with the length. (Only the largest group used to be looked at, where
    Ulysses cannot run when the group is larger than its heads: every length then became 1.)"""
    methods = cost_model.default_methods() if methods is None else methods
    best = 0.0
    for d in cluster.group_sizes():
        for m in methods:
            if not cost_model.supports(m, d):
                continue
            c = cost_model.group_coeffs(m, d, cluster)
            room = cluster.memory_per_rank - c.mem_const
            if room > 0:
                best = max(best, room / c.mem_lin if c.mem_lin > 0 else float(sys.maxsize))
    return int(min(best, sys.maxsize))


def fit_to_cluster(lens: Sequence[int], cluster: ClusterSpec, cost_model: CostModel,
                   tokens_per_rank: float | None = None, methods: Sequence[str] | None = None) -> np.ndarray:
    """Scale lengths so the batch holds ``tokens_per_rank · world_size`` tokens (keeping the shape of
    the distribution; each scaled length is rounded to whole tokens, at least 1), and check that
    every one fits memory on some group with ``methods`` (:func:`max_fitting_length`).
    ``tokens_per_rank=None`` only checks. Nothing is cut: a length that does not fit raises a
    ``ValueError`` naming the longest length that would."""
    out = np.asarray(lens, dtype=np.float64)
    if tokens_per_rank is not None:
        if not tokens_per_rank > 0:
            raise ValueError(f"tokens_per_rank={tokens_per_rank!r}: expected a positive number")
        out = out * (tokens_per_rank * cluster.world_size / out.sum())
    out = np.maximum(1, np.round(out)).astype(np.int64)
    fit = max_fitting_length(cluster, cost_model, methods)
    chosen = ", ".join(cost_model.default_methods() if methods is None else methods)
    if fit < 1:
        raise ValueError(f"methods: no group of {cluster.world_size} ranks ({cluster.memory_per_rank / 1e9:g} GB "
                         f"per rank) can hold even one token with {chosen}; allow other methods or add memory")
    too_long = int((out > fit).sum())
    if too_long:
        scaled = f" after scaling to tokens_per_rank={tokens_per_rank:g}" if tokens_per_rank is not None else ""
        raise ValueError(f"seq_lens: {too_long} of {len(out)} sequences{scaled} are longer than {fit:,} tokens, the "
                         f"longest that fits memory on a group of this cluster with {chosen} (the longest is "
                         f"{int(out.max()):,}); lower the lengths (or tokens_per_rank), allow other methods, or add "
                         "memory or ranks")
    return out
