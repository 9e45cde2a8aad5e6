"""Command line of ``seqpar memory`` (:mod:`.memory_plan`, :mod:`.memory_search`): each rank's
predicted peak memory for one training step, whether it fits a device, the longest sequence that
fits, and (``--search``) the cp, method and checkpointing that fit.

    seqpar memory --model llama3-8b --seq 128k --world 8 --cp 8 --checkpointing layer
    seqpar memory --model llama3-8b --seq 128k --world 8 --cp 8 --device-memory 80GB   # fits? longest?
    seqpar memory --model path/to/model --seq 1m --world 64 --device-memory 80GB --search --json
"""

from __future__ import annotations

import argparse
import json
import sys

from seqpar.methods import METHODS
from seqpar.schedulers.data import parse_length

from .memory_plan import CHECKPOINTING, DTYPES, Setup, plan
from .memory_search import KNOWN_MODELS, budget, human, human_tokens, load_model, longest_fit, parse_bytes, search


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqpar memory", description="Predict each rank's peak memory for one "
                                "FSDP2 + context-parallel training step (parameters, gradients, AdamW state, "
                                "activations, attention buffers, loss, FSDP buffers), and what fits a device.")
    a = p.add_argument
    a("--model", required=True, help=f"a known name ({', '.join(KNOWN_MODELS)}), a config.json or a model folder")
    a("--seq", "--seq-len", dest="seq", default=None,  # --seq-len: seqpar train's spelling
      help="tokens per sequence, e.g. 131072, 128k, 1m (k = 1024)")
    a("--world", type=int, default=8, help="ranks (GPUs) in all: dp x cp (default 8)")
    a("--cp", type=int, default=None, help="context-parallel ranks per sequence (default: --world)")
    a("--method", default="zigzag_ring", help=f"attention method ({', '.join(METHODS)})")
    a("--ulysses-degree", type=int, default=None, help="usp: ranks of the Ulysses axis (default gcd(cp, 8))")
    a("--checkpointing", default="none", help=f"{' | '.join(CHECKPOINTING)} (as seqpar train)")
    a("--dtype", default="bfloat16", help=f"compute dtype: {', '.join(DTYPES)} (fp32 master weights either way)")
    a("--micro-batch", type=int, default=1, help="sequences per rank and step (default 1)")
    a("--loss-chunk", type=int, default=None, help="tokens per chunk of the chunked loss (default: 256 MiB of fp32 "
      "logits, as seqpar.integrations.loss; 0: the full logits)")
    a("--device", default="cuda", help="cuda (FSDP2 prefetches in forward) or cpu")
    a("--device-memory", default=None, help="per-device memory, e.g. 80GB, 80GiB: fits? the longest --seq that fits")
    a("--headroom", type=float, default=0.10, help="fraction of --device-memory left for what the plan does not "
      "count: CUDA context, NCCL, fragmentation (default 0.10)")
    a("--search", action="store_true", help="with --seq and --device-memory: every cp, method and checkpointing")
    a("--json", action="store_true", help="print JSON instead of the table")
    a("--plot", metavar="PNG", help="stacked bars per component by checkpointing, and peak against length per cp")
    return p


def _setup(args, seq: int) -> Setup:
    cp = args.world if args.cp is None else args.cp
    return Setup(seq=seq, world=args.world, cp=cp, method=args.method, checkpointing=args.checkpointing,
                 dtype=args.dtype, micro_batch=args.micro_batch, loss_chunk=args.loss_chunk,
                 device=args.device, ulysses_degree=args.ulysses_degree)


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, compute, and return the report as a dict (ValueError naming the flag on bad input)."""
    return _run(_parser().parse_args(argv), argv)


def _run(args, argv) -> dict:
    model = load_model(args.model)
    limit = None
    if args.device_memory is not None:
        limit = budget(parse_bytes(args.device_memory), args.headroom)
    if args.seq is None and limit is None:
        raise ValueError("--seq: give a sequence length, or --device-memory to find the longest that fits")
    seq = parse_length(args.seq, "--seq") if args.seq is not None else None
    if seq == 0:
        raise ValueError("--seq: must be positive")
    if args.search and (seq is None or limit is None):
        raise ValueError("--search: needs --seq and --device-memory")
    report = {"command": "seqpar memory " + " ".join(sys.argv[2:] if argv is None else argv),
              "model": model.name, "params": model.params, "limit_bytes": limit}
    unit_setup = _setup(args, seq if seq is not None else (args.cp or args.world) * 2)
    if seq is not None:
        report["plan"] = plan(model, unit_setup).to_dict()
    if limit is not None:
        report["fits"] = None if seq is None else report["plan"]["peak_bytes"] <= limit
        report["longest_seq"] = longest_fit(model, unit_setup, limit)
    if args.search:
        found = search(model, seq, args.world, unit_setup, limit)
        report["search"] = {"best": found["best"] and found["best"].to_dict(),
                            "no_checkpointing": found["no_checkpointing"] and found["no_checkpointing"].to_dict(),
                            "by_cp": {str(cp): p and p.to_dict() for cp, p in found["by_cp"].items()}}
    if args.plot:
        from .memory_plots import plot_memory

        plot_memory(model, unit_setup, args.plot, limit)
        report["plot"] = args.plot
    return report


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if "plan" in report:
        p = report["plan"]
        s = p["setup"]
        n = report["params"]
        count = f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M" if n >= 1e5 else f"{n:,}"
        # the header above the table, not its title: rich wraps a title to the (narrow) table's width
        console.print(f"seqpar memory: {report['model']} ({count} params), {human_tokens(s['seq'])} tokens x "
                      f"{s['micro_batch']}, world {s['world']} = dp {p['dp']} x cp {s['cp']}, {s['method']}, "
                      f"checkpointing {s['checkpointing']}, {s['dtype']}; per rank, at the peak ({p['peak_phase']})")
        t = Table()
        t.add_column("component")
        t.add_column("bytes", justify="right")
        t.add_column("share", justify="right")
        for name, b in sorted(p["components"].items(), key=lambda kv: -kv[1]):
            t.add_row(name, human(b), f"{100 * b / p['peak_bytes']:.1f}%")
        t.add_row("[bold]peak[/bold]", f"[bold]{human(p['peak_bytes'])}[/bold]", "")
        console.print(t)
    if report.get("limit_bytes") is not None:
        fits = report.get("fits")
        verdict = "" if fits is None else ("fits" if fits else "does not fit") + "; "
        console.print(f"{verdict}budget {human(report['limit_bytes'])} per device; longest sequence that fits "
                      f"this setup: {human_tokens(report['longest_seq']) if report['longest_seq'] else 'none'}")
    if "search" in report:
        _print_search(console, report["search"])


def _print_search(console, found: dict) -> None:
    from rich.table import Table

    t = Table(title="the lightest setup that fits, per cp (smallest cp first)")
    for col in ("cp", "dp", "method", "checkpointing", "peak"):
        t.add_column(col, justify="right" if col in ("cp", "dp", "peak") else "left")
    for cp, p in found["by_cp"].items():
        if p is None:
            t.add_row(cp, "", "does not fit", "", "")
        else:
            t.add_row(cp, str(p["dp"]), p["setup"]["method"], p["setup"]["checkpointing"], human(p["peak_bytes"]))
    console.print(t)
    best = found["best"]
    console.print("best: " + ("nothing fits" if best is None else f"cp {best['setup']['cp']}, "
                  f"{best['setup']['method']}, checkpointing {best['setup']['checkpointing']} "
                  f"({human(best['peak_bytes'])})"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``seqpar memory``; returns the exit status (2 for bad arguments)."""
    args = _parser().parse_args(argv)
    try:
        report = _run(args, argv)
    except ValueError as exc:
        print(f"seqpar memory: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    _print_table(report)
    if args.plot:
        print(f"wrote {args.plot}")
    return 0
