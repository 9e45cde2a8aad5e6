"""Argument parsing of ``seqpar bench`` (``seqpar.cli.bench_main`` delegates here).

The flags and a suite file (``--suite``) build the same config dict (schema:
:mod:`seqpar.bench.suite`); flags given explicitly override the suite's keys. Everything is
validated before the first case runs.
"""

from __future__ import annotations

import argparse
import os
import sys

_FLAG_KEYS = {  # argparse dest -> suite key
    "methods": "methods", "seq_lens": "seq_lens", "nproc": "world_sizes", "causal": "causal", "heads": "heads",
    "kv_heads": "kv_heads", "head_dim": "head_dim", "batch": "batch", "dtype": "dtypes", "repeats": "repeats",
    "warmup": "warmup", "threads": "threads", "seed": "seed", "emulate": "emulate",
}
_DEFAULTS = {"methods": "softmax", "seq_lens": "2k,4k", "causal": "yes", "heads": "8",
             "head_dim": "64", "batch": "1", "dtypes": "float32", "repeats": 3, "warmup": 1, "threads": 1, "seed": 0}


MAX_DEFAULT_RANKS = 8  # more local ranks than this only add start-up time to a first look


def default_world_size(threads: int = 1) -> int:
    """The ranks ``seqpar bench`` spawns without ``--nproc``: as many as this machine runs side by side
    (one per ``threads`` usable cores), at least 2 (a sequence-parallel run needs two ranks) and at
    most :data:`MAX_DEFAULT_RANKS`."""
    from seqpar.comm.launch import usable_cores

    return max(2, min(MAX_DEFAULT_RANKS, usable_cores() // max(threads, 1)))


def core_sharing_note(rows: list[dict], threads: int) -> str | None:
    """A note when the ranks of a row had to share cores (None when every rank had its own): the
    one-rank baseline runs alone, so the efficiency column then reads low by about the sharing factor."""
    from seqpar.comm.launch import launched_by_torchrun, usable_cores

    if launched_by_torchrun():
        return None  # torchrun's ranks may be on other machines: their cores are not counted here
    cores = usable_cores()
    crowded = sorted({r["world_size"] for r in rows if r.get("world_size", 0) * threads > cores})
    if not crowded:
        return None
    worst = max(crowded) * threads / cores
    return (f"note: {', '.join(map(str, crowded))} ranks x {threads} thread(s) share {cores} usable core(s), while the "
            f"1-rank baseline had its cores to itself; each rank ran at about 1/{worst:.3g} of the baseline's speed, "
            f"so the efficiency column reads low by up to {worst:.3g}x. For efficiencies that mean something, use "
            f"--nproc {max(2, cores // max(threads, 1))} or fewer here, or torchrun on machines with a core per rank.")


def busy_machine_note(load_before: float | None, cores: int) -> str | None:
    """A note when other processes kept the cores busy as the run started (``load_before``: the
    1-minute load average then; None where the platform has none): every timing, the 1-rank
    baseline's included, then waited for the cores, and the efficiency column means little."""
    if load_before is None or load_before < 0.5 * cores:
        return None
    return (f"note: the machine was busy before the run started (load average {load_before:.1f} on {cores} usable "
            f"core(s)): other processes shared the cores with the ranks and with the 1-rank baseline, so the timings "
            f"and the efficiency column vary with their load; rerun on an idle machine for numbers that mean something.")


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def _csv(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="seqpar bench",
        description="Time sequence-parallel attention methods forward+backward against the ideal "
                    "(single-rank time / N) on N local CPU ranks (default) or the ranks of torchrun; "
                    "or emulate N ranks on one device (--emulate N). Lists are comma-separated; "
                    "every list is a matrix axis.")
    p.add_argument("--suite", metavar="FILE", help="a JSON (or YAML, with PyYAML) suite file; schema in "
                   "seqpar/bench/suite.py, examples in benchmarks/suites/. Flags given too override its keys")
    p.add_argument("--methods", help="names, or all | softmax | linear (default: softmax)")
    p.add_argument("--seq-lens", help="global lengths, e.g. 2k,8192 (default 2k,4k)")
    p.add_argument("--nproc", "-n", help="world sizes N to spawn locally (default: as many as the usable cores "
                   "run side by side, 2 to 8; WORLD_SIZE under torchrun)")
    p.add_argument("--causal", choices=["yes", "no", "both"])
    p.add_argument("--heads", help="query heads Hq (list allowed; default 8)")
    p.add_argument("--kv-heads", help="K,V heads, e.g. 8,2 for MHA and GQA (default: = heads)")
    p.add_argument("--head-dim", help="head dim D (default 64)")
    p.add_argument("--batch", help="batch B (default 1)")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 | float64 (list allowed)")
    p.add_argument("--repeats", type=int, help="timed repeats, median reported (default 3)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 1)")
    p.add_argument("--threads", type=int, help="torch threads per rank and for the 1-rank baseline (default 1)")
    p.add_argument("--emulate", type=int, metavar="N", help="emulate N ranks on one device (CUDA when "
                   "available, else CPU): each rank's per-step kernels back to back; compute efficiency, "
                   "imbalance and the schedule bound")
    p.add_argument("--device", help="--emulate: the device (default cuda if available, else cpu)")
    p.add_argument("--packed", action="store_true", help="one packed batch per length of documents with the "
                   "Python stdlib's .py file sizes / 4 as lengths; reports max/mean work per rank")
    p.add_argument("--seed", type=int, help="--packed: seed of the document sampling")
    p.add_argument("--linear", action="store_true", help="shorthand for --methods linear")
    p.add_argument("--json", metavar="PATH", help="write rows + machine, versions and command as JSON")
    p.add_argument("--csv", metavar="PATH", help="write tidy CSV rows (machine, versions, command on each)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots (matplotlib) into DIR")
    p.add_argument("--trace", metavar="DIR", help="also record one step of every case on every rank and write "
                   "the per-rank traces (seqpar.tracing) into DIR, for 'seqpar simulate --traces DIR'")
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(args, parser) -> dict:
    """The suite config: the suite file (if any), then defaults for missing keys, then explicit flags."""
    from .suite import load_suite

    config: dict = {}
    if args.suite:
        try:
            config = load_suite(args.suite)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    for dest, key in _FLAG_KEYS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if dest == "causal":
            value = "both" if value == "both" else value == "yes"
        elif dest in ("methods", "seq_lens", "nproc", "heads", "kv_heads", "head_dim", "batch", "dtype"):
            value = _csv(value)
        config[key] = value
    if args.linear:
        config["methods"] = "linear"
    if args.packed:
        config["packed"] = True
    for key, value in _DEFAULTS.items():
        if key not in config and not (key == "world_sizes" and "emulate" in config):
            config[key] = _csv(value) if isinstance(value, str) else value
    from seqpar.comm.launch import launched_by_torchrun

    if "world_sizes" not in config and "emulate" not in config:
        threads = config.get("threads", 1)
        config["world_sizes"] = [default_world_size(threads if isinstance(threads, int) else 1)]
    if launched_by_torchrun() and args.nproc is None and not args.suite:
        config["world_sizes"] = [int(os.environ["WORLD_SIZE"])]
    return config


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args, parser)
    from .suite import expand_matrix

    try:
        cases = expand_matrix(config)
    except ValueError as exc:
        parser.error(f"{args.suite + ': ' if args.suite else ''}{exc}")
    progress = not args.no_progress
    load_before = _load_average()
    if config.get("emulate") is not None:
        if args.packed:
            parser.error("--packed: --emulate runs dense problems only")
        if args.trace:
            parser.error("--trace: records real runs on N ranks; --emulate runs none")
        from .emulate import emulate_cases

        rows = emulate_cases(cases, progress=progress, device=args.device)
    else:
        from .core import run_cases

        rows = run_cases(cases, progress=progress, trace_dir=args.trace)
    if os.environ.get("RANK", "0") != "0":
        return 1 if any(r["error"] for r in rows) else 0
    from .report import print_table, write_csv, write_json

    title = f"seqpar bench{' ' + str(config['name']) if config.get('name') else ''}"
    print_table(rows, title=title + (" --packed" if config.get("packed") else ""))
    if config.get("emulate") is None:
        from seqpar.comm.launch import launched_by_torchrun, usable_cores

        notes = [core_sharing_note(rows, config.get("threads", 1)),
                 None if launched_by_torchrun() else busy_machine_note(load_before, usable_cores())]
        for note in filter(None, notes):
            print(note)
    for path, write in ((args.json, write_json), (args.csv, write_csv)):
        if path:
            write(rows, path)
            print(f"wrote {path}")
    if args.plots:
        try:
            import matplotlib  # noqa: F401  (an optional extra)
        except ImportError:
            print("--plots needs matplotlib (pip install 'seqpar[bench]'); no plots written", file=sys.stderr)
        else:
            from .plots import write_plots

            for path in write_plots(rows, args.plots, title=title):
                print(f"wrote {path}")
    return 1 if any(r["error"] for r in rows) else 0
