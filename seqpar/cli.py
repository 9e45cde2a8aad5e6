"""The ``seqpar`` command: ``bench``, ``plan`` (and, as they land, ``train``, ``calibrate``)."""

from __future__ import annotations

import argparse
import sys


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        out.append(int(part) * mult)
    return out


def bench_main(argv: list[str]) -> int:
    from seqpar import METHODS
    from seqpar.bench import BenchCase, print_table, run_cases, write_json

    p = argparse.ArgumentParser(prog="seqpar bench", description="Time sequence-parallel attention methods "
                                "forward+backward against the ideal (single-rank time / N).")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--seq-lens", default="2k,4k", help="global sequence lengths, e.g. 2k,8192")
    p.add_argument("--nproc", "-n", default="4", help="world sizes to spawn locally (comma-separated); "
                   "ignored under torchrun")
    p.add_argument("--causal", choices=["yes", "no", "both"], default="yes")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="defaults to --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (and for the 1-rank baseline)")
    p.add_argument("--json", metavar="PATH", help="write the rows with machine and versions as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--linear", action="store_true", help="benchmark the linear-attention methods (zeco, lasp2, "
                   "lasp1) instead, with --heads H and --head-dim K=V")
    p.add_argument("--packed", action="store_true", help="one packed batch per --seq-lens total (e.g. 64k) of "
                   "documents with the Python stdlib's .py file sizes / 4 as lengths (long-tailed, offline); "
                   "reports max/mean work per rank")
    p.add_argument("--seed", type=int, default=0, help="--packed: seed of the document sampling")
    args = p.parse_args(argv)

    import os

    if args.linear:
        return _bench_linear(args, p)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(METHODS)}")
    if "WORLD_SIZE" in os.environ:
        sizes = [int(os.environ["WORLD_SIZE"])]
    else:
        sizes = _int_list(args.nproc)
    causal = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    cases = [BenchCase(method=m, seq_len=t, world_size=n, causal=c, batch=args.batch, heads=args.heads,
                       kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, dtype=args.dtype,
                       repeats=args.repeats, warmup=args.warmup, threads=args.threads,
                       packed_seed=args.seed if args.packed else None)
             for n in sizes for t in _int_list(args.seq_lens) for c in causal for m in methods]
    rows = run_cases(cases, progress=not args.no_progress)
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0:
        print_table(rows, title="seqpar bench --packed" if args.packed else "seqpar bench")
        if args.json:
            write_json(rows, args.json)
            print(f"wrote {args.json}")
    return 1 if any(r["error"] for r in rows) else 0


def _bench_linear(args, parser) -> int:
    from seqpar.bench import print_linear_table, run_linear_cases, write_json
    from seqpar.linear import LINEAR_METHODS

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if set(methods) == set(__import__("seqpar").METHODS):
        methods = list(LINEAR_METHODS)
    bad = [m for m in methods if m not in LINEAR_METHODS]
    if bad:
        parser.error(f"--methods: unknown linear method {', '.join(bad)}; choose from {', '.join(LINEAR_METHODS)}")
    rows = run_linear_cases(methods, _int_list(args.seq_lens), _int_list(args.nproc), heads=args.heads,
                            key_dim=args.head_dim, value_dim=args.head_dim, repeats=args.repeats,
                            threads=args.threads)
    print_linear_table(rows)
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {args.json}")
    return 1 if any(r["error"] for r in rows) else 0


def plan_main(argv: list[str]) -> int:
    from seqpar.schedulers.cli import plan_main as run

    return run(argv)


def train_main(argv: list[str]) -> int:
    from seqpar.integrations.trainer import main as run

    return run(argv)


COMMANDS = {"bench": bench_main, "plan": plan_main, "train": train_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: seqpar {" + ",".join(COMMANDS) + "} [options]\n"
              "  bench      time every method against the ideal (default: 4 local CPU ranks)\n"
              "  plan       plan SP groups for a batch of sequence lengths (adaptive scheduler)\n"
              "  train      train a transformers Llama with --context-parallel N on packed text\n"
              "run 'seqpar COMMAND --help' for the options of a command")
        return 0 if argv and argv[0] in ("-h", "--help") else (2 if argv else 0)
    return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
