"""The benchmark matrix: flags or a suite file -> validated :class:`~seqpar.bench.core.BenchCase` s.

**Suite file schema** (JSON always; YAML when PyYAML is importable; one object; every key
optional; a list on a matrix axis means "each of these", a scalar means that one value)::

    {
      "name": "cpu_quick",             # free text, echoed in the output
      "description": "...",            # free text
      "methods": "all",                # list of names, or "all" | "softmax" | "linear"
      "seq_lens": [2048, "8k"],        # global tokens per sequence ("k" = 1024)
      "world_sizes": [2, 4],           # N ranks (spawned locally; must equal WORLD_SIZE under torchrun)
      "causal": "both",                # true | false | "both" | [true, false]
      "heads": 8,                      # query heads Hq (int or list)
      "kv_heads": [8, 2],              # K,V heads (int or list; default = heads; Hq % Hkv == 0)
      "head_dim": 64,                  # D (int or list)
      "batch": 1,                      # B (int or list)
      "dtypes": ["float32"],           # float32 | bfloat16 | float16 | float64 (alias "dtype")
      "repeats": 3, "warmup": 1,       # timed repeats (median) after warm-up calls
      "threads": 1,                    # torch threads per rank (and for the 1-rank baseline)
      "packed": false, "seed": 0,      # one packed batch of stdlib document lengths per length
      "emulate": null                  # an int N: emulate N ranks on one device instead (--emulate)
    }

Matrix order: world size, length, dtype, causal, head shape, then methods. Linear methods
(``zeco``, ``lasp2``, ``lasp1``) are causal and MHA only: in a matrix they get one row per
(N, T, dtype, heads, head_dim, batch) with ``causal=True`` and ``kv_heads=heads``; asking for
them with only non-causal rows is an error. Every case is validated (:func:`validate_case`)
before anything runs: a ValueError names the field and says how to fix it.
"""

from __future__ import annotations

import json
import os

from seqpar.comm.usp_groups import default_ulysses_degree
from seqpar.layouts import USPLayout, layout_named
from seqpar.methods import ALL_METHODS, DEFAULT_RING_METHOD, LINEAR_METHODS, METHODS
from seqpar.methods import method as declared
from seqpar.schedulers.data import parse_length

from .core import BenchCase, launched, run_cases

AXES = ("methods", "seq_lens", "world_sizes", "causal", "heads", "kv_heads", "head_dim", "batch", "dtypes")
SCALARS = ("repeats", "warmup", "threads", "packed", "seed", "emulate", "name", "description")
SUITE_KEYS = AXES + SCALARS + ("dtype",)
DTYPES = ("float32", "bfloat16", "float16", "float64")
METHOD_GROUPS = {"all": METHODS + LINEAR_METHODS, "softmax": METHODS, "linear": LINEAR_METHODS}
#: spawning more local ranks than this per CPU core is refused (each rank is a process with its own torch)
RANKS_PER_CORE = 8


def parse_methods(spec, field: str = "methods") -> list[str]:
    """A list of names or a group (``all``, ``softmax``, ``linear``); unknown names raise."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in (str(i).strip() for i in items):
        if item in METHOD_GROUPS:
            out += [m for m in METHOD_GROUPS[item] if m not in out]
        elif item in ALL_METHODS:
            out += [item] if item not in out else []
        elif item:
            raise ValueError(f"{field}: unknown method {item!r}; choose from {', '.join(ALL_METHODS)} "
                             f"or a group: {', '.join(METHOD_GROUPS)}")
    if not out:
        raise ValueError(f"{field}: no method given")
    return out


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _causal_list(value, field: str = "causal") -> list[bool]:
    if value == "both":
        return [True, False]
    out = []
    for v in _as_list(value):
        if isinstance(v, bool):
            out.append(v)
        elif str(v).lower() in ("yes", "true"):
            out.append(True)
        elif str(v).lower() in ("no", "false"):
            out.append(False)
        else:
            raise ValueError(f"{field}: {v!r} is not true, false or 'both'")
    if len(set(out)) < len(out):
        raise ValueError(f"{field}: {value!r} lists a value twice; list each once, or 'both'")
    return out


def _ints(value, field: str, minimum: int = 1) -> list[int]:
    out = []
    for v in _as_list(value):
        x = parse_length(v, field) if isinstance(v, str) else v
        if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
            raise ValueError(f"{field}: expected integers >= {minimum}, got {v!r}")
        if x in out:  # a row asked for twice would be dropped: say so instead
            raise ValueError(f"{field}: {v!r} is listed twice (= {x}); list each value once")
        out.append(x)
    return out


def _scalar(config: dict, key: str, default, minimum: int = 1) -> int:
    """One integer setting (repeats, warmup, threads, seed): a list or a float is refused, not cut."""
    value = config.get(key, default)
    if isinstance(value, (list, tuple)):
        raise ValueError(f"{key}: expected one integer, got a list {value!r}")
    return _ints(value, key, minimum)[0]


def _flag(config: dict, key: str) -> bool:
    """A boolean setting: true/false (or yes/no); any other value (e.g. the string "false", which
    ``bool()`` would read as true) is refused."""
    value = config.get(key, False)
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "yes", "false", "no"):
        return str(value).lower() in ("true", "yes")
    raise ValueError(f"{key}: expected true or false, got {value!r}")


def load_suite(path: str) -> dict:
    """Read a suite file (``.json``; ``.yaml``/``.yml`` when PyYAML is importable) into a config dict.
    Unknown keys raise a ValueError naming them (before anything runs)."""
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"--suite {path}: reading YAML needs PyYAML (pip install pyyaml); "
                             "or write the suite as JSON") from None
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--suite {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--suite {path}: expected one object of keys {', '.join(SUITE_KEYS)}")
    unknown = sorted(set(data) - set(SUITE_KEYS))
    if unknown:
        raise ValueError(f"--suite {path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SUITE_KEYS)}")
    return data


def expand_matrix(config: dict) -> list[BenchCase]:
    """All cases of a config (suite file or flags), validated; see the module docstring."""
    unknown = sorted(set(config) - set(SUITE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SUITE_KEYS)}")
    methods = parse_methods(config.get("methods", "all"))
    lens = _ints(config.get("seq_lens", [2048]), "seq_lens")
    emulate = config.get("emulate")
    if emulate is not None:
        if "world_sizes" in config:  # one of the two would be ignored
            raise ValueError(f"emulate: give world_sizes (real ranks) or emulate (ranks emulated on one device), "
                             f"not both (got world_sizes={config['world_sizes']!r}, emulate={emulate!r})")
        sizes = _ints(emulate, "emulate")
    else:
        sizes = _ints(config.get("world_sizes", [2]), "world_sizes")
    causal = _causal_list(config.get("causal", True))
    heads = _ints(config.get("heads", 8), "heads")
    kv_given = config.get("kv_heads")
    head_dims = _ints(config.get("head_dim", 64), "head_dim")
    batches = _ints(config.get("batch", 1), "batch")
    if "dtypes" in config and "dtype" in config:
        raise ValueError("dtype: give dtypes or its alias dtype, not both (one would be ignored)")
    dtypes = [str(d) for d in _as_list(config.get("dtypes", config.get("dtype", "float32")))]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtypes: {d!r} is not one of {', '.join(DTYPES)}")
        if dtypes.count(d) > 1:
            raise ValueError(f"dtypes: {d!r} is listed twice; list each value once")
    repeats, warmup, threads = (_scalar(config, "repeats", 3), _scalar(config, "warmup", 1, 0),
                                _scalar(config, "threads", 1))
    packed = _flag(config, "packed")
    seed = _scalar(config, "seed", 0, 0)
    linear = [m for m in methods if m in LINEAR_METHODS]
    if linear and True not in causal:
        raise ValueError(f"causal: {', '.join(linear)} are causal linear attention; ask for causal rows "
                         "(causal: true or 'both') or drop them from methods")
    cases: list[BenchCase] = []
    for n in sizes:
        for t in lens:
            for dt in dtypes:
                for c in causal:
                    for h in heads:
                        for hk in (_ints(kv_given, "kv_heads") if kv_given is not None else [h]):
                            for d in head_dims:
                                for b in batches:
                                    for m in methods:
                                        lin = m in LINEAR_METHODS
                                        if lin and not c:
                                            continue  # linear rows: causal MHA only (module docstring)
                                        cases.append(BenchCase(m, t, n, c, b, h, h if lin else hk, d, dt, repeats,
                                                               warmup, threads, seed if packed else None))
    # a linear row must not appear twice when the kv_heads axis has several values
    cases = list(dict.fromkeys(cases))
    for case in cases:
        validate_case(case, emulated=emulate is not None)
    return cases


def validate_case(case: BenchCase, *, emulated: bool = False) -> None:
    """ValueError naming the field when a case cannot run: unknown method, impossible shapes for the
    method, or more ranks than can be had. Host-only, before anything runs."""
    where = f"{case.method} T={case.seq_len} N={case.world_size}"
    if case.method not in ALL_METHODS:
        raise ValueError(f"methods: unknown method {case.method!r}; choose from {', '.join(ALL_METHODS)}")
    n = case.world_size
    if not emulated:
        if launched():
            ws = int(os.environ["WORLD_SIZE"])
            if n != ws:
                raise ValueError(f"world_sizes: {where} asks for {n} ranks but torchrun launched WORLD_SIZE={ws}; "
                                 f"launch with --nproc-per-node {n} (or more nodes), or use --nproc {ws}")
        elif n > RANKS_PER_CORE * (os.cpu_count() or 1):
            raise ValueError(f"world_sizes: {where}: {n} local ranks on {os.cpu_count()} CPU cores is more than "
                             f"{RANKS_PER_CORE} per core; use fewer ranks, torchrun on more machines, or --emulate {n}")
    if case.heads % case.kv_heads:
        raise ValueError(f"kv_heads: {where}: heads={case.heads} is not divisible by kv_heads={case.kv_heads} "
                         "(GQA needs Hq % Hkv == 0)")
    if case.family == "linear":
        if case.kv_heads != case.heads:
            raise ValueError(f"kv_heads: {where}: linear attention has no GQA; use kv_heads = heads")
        if not case.causal:
            raise ValueError(f"causal: {where}: linear attention is causal only")
        if case.packed_seed is not None:
            raise ValueError(f"packed: {where}: --packed covers the softmax methods only")
        if case.seq_len % n:
            raise ValueError(f"seq_lens: {where}: {case.method} shards contiguously and needs a length that is "
                             f"a multiple of N={n}; use {-(-case.seq_len // n) * n}")
        return
    if case.packed_seed is not None:
        return  # packed batches are padded per document: any total length fits
    if case.method == "ulysses":
        layout_named("contiguous").check_length(case.seq_len, n, method="ulysses", argument="seq_lens")
        if case.heads < n:
            raise ValueError(f"heads: {where}: ulysses gives every rank at least one query head; heads={case.heads} "
                             f"is fewer than N={n} (use usp with a smaller ulysses_degree, or a ring-family method)")
    elif case.method == "usp":
        u = default_ulysses_degree(n)
        r = n // u
        mult = USPLayout(layout_named(declared(DEFAULT_RING_METHOD).layout), u, r).multiple(n)
        if case.seq_len % mult:
            raise ValueError(f"seq_lens: {where}: usp with ulysses_degree={u} x {r} ring ranks of "
                             f"{DEFAULT_RING_METHOD} needs a multiple of R*lcm(2, U) = {mult}; "
                             f"use {-(-case.seq_len // mult) * mult}")
        if case.heads < u:
            raise ValueError(f"heads: {where}: usp gives every rank of its Ulysses axis at least one query head; "
                             f"heads={case.heads} is fewer than ulysses_degree U={u}")
    else:
        layout_named(declared(case.method).layout).check_length(case.seq_len, n, method=case.method,
                                                                 argument="seq_lens")


def run_linear_cases(methods, seq_lens, sizes, *, heads=4, key_dim=64, value_dim=64, repeats=3,
                     threads=1) -> list[dict]:
    """Linear-attention rows (each method at each length on each N), through the common runner;
    ``value_dim`` must equal ``key_dim`` (one head dim)."""
    if value_dim != key_dim:
        raise ValueError(f"value_dim: the benchmark uses one head dim, got key_dim={key_dim}, value_dim={value_dim}")
    cases = expand_matrix({"methods": list(methods), "seq_lens": list(seq_lens), "world_sizes": list(sizes),
                           "heads": heads, "head_dim": key_dim, "repeats": repeats, "threads": threads})
    return run_cases(cases, progress=False)
