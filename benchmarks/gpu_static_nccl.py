"""Every method and entry point on a fake NCCL group of 4 ranks, without a GPU: one row per case.

Runs the whole matrix of tests/gpu_static/nccl_cases.py (the CI rows and the ``gpu_static_full``
ones) with the machinery of tests/gpu_static/fake_nccl.py and writes, per (method or entry point) x
(dense or packed) x group, the c10d operations of every phase summed over the 4 ranks, the
autograd Functions whose backward ran, the host reads of CUDA values, and the verdict ("clean", or
the first violation, cross-rank mismatch or error).

    python benchmarks/gpu_static_nccl.py            # benchmarks/results/gpu_static_nccl.{json,md}
    python benchmarks/gpu_static_nccl.py --ci       # the CI rows only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import transformers.models.llama.modeling_llama  # noqa: E402,F401  (imported before torch.cuda is patched)

from tests.gpu_static import nccl_cases  # noqa: E402


def _ops(ops: dict) -> str:
    return "; ".join(f"{phase}: " + ", ".join(f"{n} {name}" for name, n in sorted(c.items()))
                     for phase, c in ops.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ci", action="store_true", help="only the rows CI runs")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the results")
    args = p.parse_args(argv)
    rows, t0 = [], time.perf_counter()
    for case in nccl_cases.all_cases():
        if args.ci and not case.ci:
            continue
        try:
            row = nccl_cases.check(case)
        except Exception as exc:  # a row that fails is reported, the others go on
            row = nccl_cases.Row(case, {}, [], {}, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        rows.append(row)
        print(f"{case.id}: {row.result}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nccl_cases.write_results(rows, out / "gpu_static_nccl.json")
    lines = ["# Fake NCCL, 4 ranks: every method and entry point", "",
             f"`python benchmarks/gpu_static_nccl.py` ({len(rows)} rows, {time.perf_counter() - t0:.0f} s). "
             "A row is clean when no NCCL op got a CPU tensor or a tensor off the rank's GPU, the ranks' "
             "collectives and send/receive pairs match, no CUDA stream/event/sync sits on a CPU path, every "
             "backward returned gradients like its inputs, the phases that must communicate did, no CUDA "
             "value was read on the host where none may be, and no clock read of seqpar's timing code closed an "
             "interval with GPU work still in flight. Ops are summed over the 4 ranks.", "",
             "| method / entry point | layout | group | CI | result | c10d ops by phase | backward | host reads |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.case
        group = c.group + (" (gloo job on a GPU machine)" if c.backend != "nccl" else "")
        lines.append(f"| {c.entry} | {c.layout} | {group} | {'yes' if c.ci else 'full'} | {r.result} | "
                     f"{_ops(r.ops)} | {', '.join(r.backward)} | {sum(r.host_reads.values())} |")
    (out / "gpu_static_nccl.md").write_text("\n".join(lines) + "\n")
    bad = [r for r in rows if r.result != "clean"]
    print(f"{len(rows) - len(bad)} clean, {len(bad)} not; wrote {out / 'gpu_static_nccl.md'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
