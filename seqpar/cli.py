"""The ``seqpar`` command: ``bench``, ``plan``, ``train``, ``calibrate``, ``simulate``, ``memory``."""

from __future__ import annotations

import sys


def bench_main(argv: list[str]) -> int:
    """``seqpar bench``: the argument parsing and the runs live in :mod:`seqpar.bench.cli`."""
    from seqpar.bench.cli import main as run

    return run(argv)


def plan_main(argv: list[str]) -> int:
    from seqpar.schedulers.cli import plan_main as run

    return run(argv)


def calibrate_main(argv: list[str]) -> int:
    from seqpar.bench.calibrate_cli import calibrate_main as run

    return run(argv)


def simulate_main(argv: list[str]) -> int:
    from seqpar.bench.simulate_cli import main as run

    return run(argv)


def memory_main(argv: list[str]) -> int:
    from seqpar.bench.memory_cli import main as run

    return run(argv)


def train_main(argv: list[str]) -> int:
    from seqpar.integrations.train import main as run

    return run(argv)


def generate_main(argv: list[str]) -> int:
    from seqpar.integrations.generate import generate_main as run

    return run(argv)


COMMANDS = {"bench": bench_main, "plan": plan_main, "train": train_main, "calibrate": calibrate_main,
            "simulate": simulate_main, "memory": memory_main,
            "generate": generate_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: seqpar {" + ",".join(COMMANDS) + "} [options]\n"
              "  bench      time every method against the ideal (default: a local CPU rank per core, 2-8)\n"
              "  plan       plan SP groups for a batch of sequence lengths (adaptive scheduler)\n"
              "  train      train a transformers Llama with --context-parallel N on packed text\n"
              "  generate   generate from a long prompt: context-parallel prefill, decoding over a sharded KV cache\n"
              "  calibrate  measure the cost model on this machine (CPU ranks or torchrun GPUs) to JSON\n"
              "  simulate   replay every method's traced schedule on a machine model (8..1024 GPUs)\n"
              "  memory     predict each rank's peak memory for training; what fits a device\n"
              "run 'seqpar COMMAND --help' for the options of a command")
        return 0 if argv and argv[0] in ("-h", "--help") else (2 if argv else 0)
    return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
