"""The plot of ``seqpar memory --plot``: the peak's components as stacked bars, one bar per checkpointing
mode, and the peak against the sequence length for each cp that divides the world."""

from __future__ import annotations

from dataclasses import replace

from .memory_plan import CHECKPOINTING, ModelShape, Setup, plan
from .memory_search import divisors, human_tokens, seq_unit

COMPONENTS = ("parameters", "optimizer", "gradients", "fsdp", "activations", "layer", "attention", "loss")


def _bars(ax, model: ModelShape, setup: Setup, limit: int | None) -> None:
    gib = 2**30
    plans = [plan(model, replace(setup, checkpointing=ck)) for ck in CHECKPOINTING]
    bottoms = [0.0] * len(plans)
    for comp in COMPONENTS:
        values = [p.components().get(comp, 0) / gib for p in plans]
        ax.bar(list(CHECKPOINTING), values, bottom=bottoms, label=comp)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if limit is not None:
        ax.axhline(limit / gib, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_ylabel("GiB per rank at the peak")
    ax.set_xlabel("checkpointing")
    ax.set_title(f"{human_tokens(setup.seq)} tokens, cp {setup.cp}, {setup.method}", fontsize=9)
    ax.legend(fontsize=7)


def _lines(ax, model: ModelShape, setup: Setup, limit: int | None) -> None:
    gib = 2**30
    for cp in divisors(setup.world):
        try:
            base = replace(setup, cp=cp, seq=seq_unit(replace(setup, cp=cp)))
        except ValueError:
            continue
        unit = seq_unit(base)
        seqs = [2**k for k in range(12, 23) if 2**k % unit == 0]  # 4K .. 4M tokens
        xs, ys = [], []
        for seq in seqs:
            try:
                ys.append(plan(model, replace(base, seq=seq)).peak / gib)
            except ValueError:
                continue
            xs.append(seq)
        ax.plot(xs, ys, marker=".", label=f"cp {cp}")
    if limit is not None:
        ax.axhline(limit / gib, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak GiB per rank")
    ax.set_title(f"world {setup.world}, {setup.method}, checkpointing {setup.checkpointing}", fontsize=9)
    ax.legend(fontsize=7)


def plot_memory(model: ModelShape, setup: Setup, path: str, limit: int | None = None) -> None:
    """Write the two panels to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    _bars(left, model, setup, limit)
    _lines(right, model, setup, limit)
    fig.suptitle(f"seqpar memory: {model.name}, {setup.dtype}, micro-batch {setup.micro_batch}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
