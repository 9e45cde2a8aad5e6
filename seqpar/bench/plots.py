"""PNG plots of ``seqpar bench`` rows (matplotlib, Agg backend: no display needed).

- ``efficiency_vs_length.png``: efficiency against the ideal vs global length, one line per method,
  one panel per (N, causal) (N-rank rows);
- ``bytes_per_rank_vs_n.png``: MB sent by the busiest rank (fwd+bwd) vs N at the longest length;
- ``memory_per_rank_vs_n.png``: peak MB allocated per rank vs N at the longest length;
- ``emulate_efficiency.png``: compute efficiency of the ``--emulate`` rows per method (one panel per
  (N, T)), each method's schedule bound marked.

Rows with an error are left out. Returns the paths written.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict


def _ok(r: dict, key: str) -> bool:
    v = r.get(key)
    return not r.get("error") and isinstance(v, (int, float)) and not math.isnan(v)


def _label(r: dict) -> str:
    gqa = "" if r["heads"] == r["kv_heads"] else f" GQA {r['heads']}/{r['kv_heads']}"
    return f"{r['method']}{gqa} {r['dtype']}" if r["dtype"] != "float32" else f"{r['method']}{gqa}"


def _lines(ax, rows, x, y, scale=1.0):
    series = defaultdict(list)
    for r in rows:
        if _ok(r, y):
            series[_label(r)].append((r[x], r[y] * scale))
    import matplotlib

    colors = matplotlib.colormaps["tab20"].colors  # up to 20 distinct series (methods x MHA/GQA)
    for i, (name, pts) in enumerate(sorted(series.items())):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=colors[i % 20],
                ls="--" if "GQA" in name else "-")
    if x == "world_size" and series:
        ax.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
    return bool(series)


def write_plots(rows: list[dict], out_dir: str, title: str = "seqpar bench") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    dist_rows = [r for r in rows if r.get("mode", "dist") == "dist"]
    emu_rows = [r for r in rows if r.get("mode") == "emulate"]

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    if dist_rows:
        panels = sorted({(r["world_size"], r["causal"]) for r in dist_rows}, key=lambda p: (p[0], not p[1]))
        fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.6), squeeze=False)
        for ax, (n, causal) in zip(axes[0], panels):
            drawn = _lines(ax, [r for r in dist_rows if r["world_size"] == n and r["causal"] == causal],
                           "seq_len", "efficiency")
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
            ax.set(xscale="log", xlabel="global tokens T", ylabel="efficiency (t_1 / (N t_N))",
                   title=f"N={n}, {'causal' if causal else 'non-causal'}")
            if drawn:
                ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.suptitle(f"{title}: efficiency vs length")
        save(fig, "efficiency_vs_length.png")
        longest = max(r["seq_len"] for r in dist_rows)
        at = [dict(r, mb=(r["bytes_fwd"] + r["bytes_bwd"]) / 1e6, peak_mb=r.get("peak_mem", 0) / 1e6)
              for r in dist_rows if r["seq_len"] == longest]
        for key, name, ylabel in (("mb", "bytes_per_rank_vs_n.png", "MB sent by the busiest rank (fwd+bwd)"),
                                  ("peak_mb", "memory_per_rank_vs_n.png", "peak MB allocated per rank")):
            fig, axes = plt.subplots(1, 2, figsize=(14, 4.6), squeeze=False)
            for ax, causal in zip(axes[0], (True, False)):
                if _lines(ax, [r for r in at if r["causal"] == causal], "world_size", key):
                    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
                ax.set(xlabel="ranks N", ylabel=ylabel, title=f"T={longest}, {'causal' if causal else 'non-causal'}")
            fig.suptitle(f"{title}: {ylabel} vs N")
            save(fig, name)
    if emu_rows:
        panels = sorted({(r["world_size"], r["seq_len"]) for r in emu_rows})
        fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.5), squeeze=False)
        for ax, (n, t) in zip(axes[0], panels):
            sel = [r for r in emu_rows if (r["world_size"], r["seq_len"]) == (n, t) and _ok(r, "efficiency")]
            xs = range(len(sel))
            ax.bar(xs, [r["efficiency"] for r in sel], color="tab:blue", label="measured compute efficiency")
            ax.scatter(xs, [r["bound"] for r in sel], marker="_", s=400, color="black", label="schedule bound")
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
            ax.set_xticks(list(xs), [_label(r) + ("" if r["causal"] else " (nc)") for r in sel], rotation=45,
                          ha="right", fontsize=8)
            ax.set(ylabel="single device / (N x slowest rank)", title=f"--emulate {n}, T={t}")
            ax.legend(fontsize=7)
        fig.suptitle(f"{title}: emulated compute efficiency")
        save(fig, "emulate_efficiency.png")
    return paths
