"""Exports of a replay (:mod:`.replay`): Chrome / Perfetto trace JSON and a PNG timeline.

The JSON is the Trace Event Format (open it in ``ui.perfetto.dev`` or ``chrome://tracing``): one
process per rank, a ``compute`` track (kernels and host work), a ``blocked`` track (waits and
collectives: the exposed communication) and a ``network`` track with every message while it
flows (sender's side), times in microseconds of the replayed step.
"""

from __future__ import annotations

import json
from pathlib import Path

from .replay import ReplayResult

_TRACKS = {"compute": 1, "host": 1, "wait": 2, "coll": 2}


def chrome_trace(result: ReplayResult, *, title: str = "seqpar replay") -> dict:
    """The replay as a Trace Event Format object (``{"traceEvents": [...], ...}``)."""
    events = []
    for rr in result.ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rr.rank, "args": {"name": f"rank {rr.rank}"}})
        for tid, name in ((1, "compute"), (2, "blocked"), (3, "network")):
            events.append({"ph": "M", "name": "thread_name", "pid": rr.rank, "tid": tid, "args": {"name": name}})
        for start, end, kind, name in rr.timeline:
            events.append({"ph": "X", "pid": rr.rank, "tid": _TRACKS[kind], "name": name or kind, "cat": kind,
                           "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6})
    for src, dst, start, end, nbytes, chan in result.messages:
        events.append({"ph": "X", "pid": src, "tid": 3, "name": f"{chan} -> {dst}", "cat": "message",
                       "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6, "args": {"bytes": nbytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"title": title, "step_s": result.step_s, "machine": result.machine}}


def write_chrome_trace(result: ReplayResult, path: str | Path, *, title: str = "seqpar replay") -> None:
    Path(path).write_text(json.dumps(chrome_trace(result, title=title)) + "\n")


def write_timeline_png(result: ReplayResult, path: str | Path, *, title: str = "seqpar replay") -> None:
    """One row per rank: compute (blue), host work (grey), blocked on communication (red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"compute": "tab:blue", "host": "0.7", "wait": "tab:red", "coll": "tab:orange"}
    n = len(result.ranks)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.35 * min(n, 64)))
    scale, unit = (1e3, "ms") if result.step_s < 10 else (1.0, "s")
    labelled = set()
    for rr in result.ranks[:64]:
        for kind, color in colors.items():
            bars = [(s * scale, (e - s) * scale) for s, e, k, _ in rr.timeline if k == kind]
            if bars:
                ax.broken_barh(bars, (rr.rank - 0.4, 0.8), facecolors=color,
                               label=None if kind in labelled else kind)
                labelled.add(kind)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("rank")
    ax.set_ylim(min(n, 64) - 0.5, -0.5)
    ax.set_xlim(0, result.step_s * scale * 1.01 or 1)
    ax.set_title(title + (f" (first 64 of {n} ranks)" if n > 64 else ""), fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["chrome_trace", "write_chrome_trace", "write_timeline_png"]
