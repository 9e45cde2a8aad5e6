"""The results page of benchmarks/gpu_overlap.py runs (any machine):

    python benchmarks/gpu_overlap_report.py DIR1/gpu_overlap.json DIR2/gpu_overlap.json

prints one section per run (results/gpu_real/gpu_overlap.md: a written introduction, then these).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOKENS = 8192  # gpu_overlap.TOKENS (not imported: that module needs torch)


def markdown(doc: dict) -> str:
    """The results page of one run (see the module docstring for what each part measures)."""
    m, ideal = doc["machine"], doc["ideal_ms"]
    lines = [f"`{doc['command']}`: {m['gpu']} ({m['sms']} SMs), torch {m['torch']}, CUDA {m['cuda']}, CuPy "
             f"{m['cupy']}; nvidia-smi before: {m['nvidia_smi']}, after: {doc.get('after', '-')}.", "",
             f"Ideal (the causal {TOKENS}-token call, 10 back to back): forward {ideal[0]:.3f} ms, backward "
             f"{ideal[1]:.3f} ms. Blocks per call, forward / backward: " + ", ".join(
                 f"{k} {v[0]:.3f} / {v[1]:.3f}" for k, v in doc["block_ms"].items()) + " ms. TorchScript fused the "
             f"scripted merge: {'yes' if doc['scripted_merge_fused'] else 'no'}.", "",
             "### A block beside a transfer", "",
             "| pass | stand-in | block alone ms | beside ms | slowdown | transfer alone ms | transfer ends ms |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["beside"]:
        rate = f"{r['rate_gbs']} GB/s" if r["rate_gbs"] else "full speed"
        label = f"{r['ctas']} blocks, {rate}, {'exclusive' if r['exclusive'] else 'shared'}"
        for first in ("transfer", "block"):
            got = r.get(f"{first}_first")
            if got:
                lines.append(f"| {r['pass']} | {label}, {first} launched first | {r['block_alone_ms']:.3f} | "
                             f"{got['block_ms']:.3f} | {got['block_ms'] / r['block_alone_ms'] - 1:+.1%} | "
                             f"{r['transfer_alone_ms']:.3f} | {got['transfer_end_ms']:.3f} |")
    lines += ["", "### One rank's zigzag step (the busiest of the 8 played ranks; the most any rank's blocks take "
              f"timed alone back to back, forward+backward: {max(sum(r) for r in doc['kernels_sum_ms']):.2f} ms)", "",
              "| variant | forward ms | efficiency | forward+backward ms | efficiency |", "|---|---|---|---|---|"]
    for r in doc.get("steps", []):
        lines.append(f"| {r['variant']} | {r['fwd_ms']:.2f} | {r['efficiency_fwd']:.1%} | {r['fwd_bwd_ms']:.2f} | "
                     f"{r['efficiency_fwd_bwd']:.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise ValueError("give one or more gpu_overlap.json files")
    for path in paths:
        print(f"## {Path(path).name}\n\n" + markdown(json.loads(Path(path).read_text())) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
