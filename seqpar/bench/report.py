"""Output of ``seqpar bench``: a rich table, CSV and JSON rows with machine, versions and command.

Every row is a flat dict (:meth:`~seqpar.bench.core.BenchRow.as_dict`, or an emulation row of
:mod:`.emulate`) with ``mode`` = ``"dist"`` (N real ranks) or ``"emulate"`` (N ranks emulated on
one device); the table prints one section per mode.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

from seqpar._version import __version__

NOTE_DIST = ("efficiency = single-rank time (same threads per rank) / (N x step time on N ranks); "
             "TFLOP/s: attention fwd 4·B·T²·Hq·D (x0.5 causal), bwd 2.5x fwd; linear fwd B·T·H·(2C(K+V)+4KV), "
             "bwd 2x; MB sent: the most any rank sent (fwd+bwd); link MB: most bytes one rank sent to one peer; "
             "peak MB: most bytes any rank allocated during one fwd+bwd (seqpar.bench.memory); Hq/Hkv xF: uneven "
             "query-head shards (ulysses, usp), F = most heads on a rank / mean")
NOTE_EMULATE = ("compute eff = single-device fwd+bwd / (N x slowest rank's kernels); bound = the schedule's "
                "(visible pairs of all ranks / (N x the busiest rank's)); step-sync: each step waits for its "
                "slowest rank; imbalance = max over steps of max/mean rank time in that step")


def environment() -> dict:
    """Machine, versions and the command line, recorded with every output."""
    env = {
        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "seqpar": __version__, "platform": platform.platform(),
        "command": " ".join(["seqpar"] + sys.argv[1:]) if sys.argv and "seqpar" in sys.argv[0]
        else " ".join(sys.argv),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    try:
        with open("/proc/loadavg") as f:
            env["loadavg"] = f.read().split()[:3]
    except OSError:
        pass
    return env


def _f(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _heads(r: dict) -> str:
    """``Hq/Hkv`` (linear: ``H``), with ``x<max/mean heads per rank>`` when head shards are uneven."""
    if r.get("family") == "linear":
        return f"{r['heads']}"
    imbalance = r.get("head_imbalance", 1.0)
    return f"{r['heads']}/{r['kv_heads']}" + ("" if imbalance == 1.0 else f" x{_f(imbalance, '.3f')}")


def _dist_columns(rows: list[dict]):
    cols = [
        ("method", lambda r: r["method"]), ("N", lambda r: str(r["world_size"])), ("T", lambda r: str(r["seq_len"])),
        ("causal", lambda r: "y" if r["causal"] else "n"), ("Hq/Hkv", _heads), ("dtype", lambda r: r["dtype"]),
        ("fwd ms", lambda r: _f(r["fwd_ms"], ".1f")), ("bwd ms", lambda r: _f(r["bwd_ms"], ".1f")),
        ("step ms", lambda r: _f(r["step_ms"], ".1f")),
        ("1-rank ms", lambda r: _f(r["fwd_ms_1"] + r["bwd_ms_1"], ".1f")),
        ("efficiency", lambda r: _f(r["efficiency"], ".3f")),
        ("tok/s", lambda r: _f(r["tokens_per_s"], ".3g")), ("TFLOP/s", lambda r: _f(r["tflops"], ".3g")),
        ("MB sent/rank", lambda r: f"{(r['bytes_fwd'] + r['bytes_bwd']) / 1e6:.2f}"),
        ("link MB", lambda r: f"{r['busiest_link'] / 1e6:.2f}"),
        ("peak MB/rank", lambda r: f"{r['peak_mem'] / 1e6:.1f}" if r.get("peak_mem") else "-"),
        ("max err", lambda r: _f(r["max_error"], ".1e")), ("error", lambda r: r["error"]),
    ]
    if any("balance" in r.get("extra", {}) for r in rows):  # --packed: docs and max/mean work per rank
        x = lambda r: r.get("extra", {})  # noqa: E731
        cols[4:4] = [("docs", lambda r: f"{x(r)['docs']} (max {x(r)['max_doc']})" if "docs" in x(r) else "-"),
                     ("pad %", lambda r: f"{100 * x(r)['padding']:.2f}" if "padding" in x(r) else "-"),
                     ("max/mean work", lambda r: f"{x(r)['balance']:.3f}" if "balance" in x(r) else "-")]
    return cols


def _emulate_columns():
    return [
        ("method", lambda r: r["method"]), ("N", lambda r: str(r["world_size"])), ("T", lambda r: str(r["seq_len"])),
        ("causal", lambda r: "y" if r["causal"] else "n"), ("Hq/Hkv", _heads), ("dtype", lambda r: r["dtype"]),
        ("1-device ms", lambda r: _f(r["single_ms"], ".1f")), ("slowest rank ms", lambda r: _f(r["slowest_ms"], ".1f")),
        ("compute eff", lambda r: _f(r["efficiency"], ".3f")), ("bound", lambda r: _f(r["bound"], ".3f")),
        ("step-sync eff", lambda r: _f(r["step_efficiency"], ".3f")),
        ("step bound", lambda r: _f(r["step_bound"], ".3f")), ("imbalance", lambda r: _f(r["imbalance"], ".3f")),
        ("calls/rank", lambda r: r.get("calls", "-")), ("error", lambda r: r["error"]),
    ]


def _print(title: str, cols, rows: list[dict], note: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is an optional extra
        print(title)
        print(" | ".join(label for label, _ in cols))
        for r in rows:
            print(" | ".join(str(fn(r)) for _, fn in cols))
    else:
        table = Table(title=title)
        for label, _ in cols:
            table.add_column(label, overflow="fold")
        for r in rows:
            table.add_row(*[str(fn(r)) for _, fn in cols], style="red" if r.get("error") else None)
        Console(width=max(200, Console().width)).print(table)
    print(note)


def print_table(rows: list[dict], title: str = "seqpar bench") -> None:
    """One table for the N-rank rows and one for the emulated rows (whichever exist)."""
    dist_rows = [r for r in rows if r.get("mode", "dist") == "dist"]
    emu_rows = [r for r in rows if r.get("mode") == "emulate"]
    if dist_rows:
        _print(title, _dist_columns(dist_rows), dist_rows, NOTE_DIST)
    if emu_rows:
        _print(f"{title} --emulate", _emulate_columns(), emu_rows, NOTE_EMULATE)


def print_linear_table(rows: list[dict]) -> None:
    """The linear rows (kept for callers of the former ``--linear`` section): the common table."""
    print_table(rows, title="seqpar bench (linear attention)")


def _flat(row: dict) -> dict:
    out = {k: v for k, v in row.items() if not isinstance(v, (dict, list))}
    for k, v in row.get("extra", {}).items():
        out[f"extra.{k}"] = v
    for k, v in row.items():
        if isinstance(v, list):
            out[k] = json.dumps(v)
    return out


def write_csv(rows: list[dict], path: str) -> None:
    """Tidy CSV: one line per row, the environment (machine, versions, command) repeated on each."""
    env = {f"env.{k}": (" ".join(v) if isinstance(v, list) else v) for k, v in environment().items()}
    flat = [{**_flat(r), **env} for r in rows]
    keys: list[str] = []
    for r in flat:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(flat)


def write_json(rows: list[dict], path: str) -> None:
    """``{"environment": {...}, "rows": [...]}``."""
    with open(path, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)


def write_rows(rows: list[dict], path: str, meta: dict, fmt: str = "json") -> None:
    """``fmt="csv"``: one line per row; ``"json"``: ``{"meta": ..., "rows": [...]}``."""
    if fmt == "csv":
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
