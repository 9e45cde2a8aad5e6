"""Peak memory and time of the language-model loss, forward + backward, unchunked vs chunked.

    python benchmarks/loss_memory.py [--tokens 2048 --vocab 32000 --hidden 256 --chunks 2048,512,128,32]
        [--device cpu] [--out benchmarks/results/loss_memory]

Unchunked: ``F.cross_entropy(hidden @ weight.T, labels, reduction="sum")`` (what a transformers
model's loss does: the whole [N, V] logits, their fp32 softmax and gradient). Chunked:
``seqpar.integrations.loss.chunked_cross_entropy`` at each chunk size (backend "torch"). Peak memory
is :class:`seqpar.bench.memory.PeakMemory` (CPU: torch's allocator events under the profiler;
CUDA: max_memory_allocated), relative to what was live before (the inputs). Also checked: every
chunked loss and gradient equals the unchunked one (relative error printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seqpar.bench.memory import PeakMemory  # noqa: E402
from seqpar.integrations.loss import chunked_cross_entropy  # noqa: E402


def _run(fn, h, w, y, device):
    """Peak bytes (one run under PeakMemory), the best of 3 plain timed runs, loss and gradients."""
    times = []
    for _ in range(3):
        h.grad = w.grad = None
        start = time.perf_counter()
        fn(h, w, y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    h.grad = w.grad = None
    with PeakMemory(device) as mem:
        loss = fn(h, w, y)
        loss.backward()
    return mem.peak, min(times), loss.detach(), h.grad.clone(), w.grad.clone()


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunks", default="2048,512,128,32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g).to(device).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, generator=g) / a.hidden**0.5).to(device).requires_grad_()
    y = torch.randint(0, a.vocab, (a.tokens,), generator=g).to(device)
    rows = []
    ref = _run(lambda h, w, y: F.cross_entropy(h @ w.t(), y, reduction="sum"), h, w, y, device)
    rows.append({"chunk_size": None, "peak_mib": ref[0] / 2**20, "seconds": ref[1]})
    for c in (int(x) for x in a.chunks.split(",")):
        got = _run(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk_size=c, backend="torch"), h, w, y, device)
        rows.append({"chunk_size": c, "peak_mib": got[0] / 2**20, "seconds": got[1],
                     "rel_err_loss": _rel(got[2], ref[2]), "rel_err_grad_hidden": _rel(got[3], ref[3]),
                     "rel_err_grad_weight": _rel(got[4], ref[4])})
    result = {"command": "python benchmarks/loss_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "tokens": a.tokens, "vocab": a.vocab, "hidden": a.hidden, "device": str(device),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "logits_fp32_mib": a.tokens * a.vocab * 4 / 2**20, "rows": rows}
    lines = [f"N={a.tokens} tokens, V={a.vocab}, d={a.hidden}, fp32, {device}; [N, V] fp32 logits = "
             f"{result['logits_fp32_mib']:.0f} MiB", "",
             "| chunk_size | peak MiB | seconds | rel err loss / grad h / grad W |", "|---|---|---|---|"]
    for r in rows:
        errs = ("-" if r["chunk_size"] is None else
                f"{r['rel_err_loss']:.1e} / {r['rel_err_grad_hidden']:.1e} / {r['rel_err_grad_weight']:.1e}")
        lines.append(f"| {r['chunk_size'] or 'unchunked'} | {r['peak_mib']:.1f} | {r['seconds']:.3f} | {errs} |")
    print("\n".join(lines))
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
        note = ("Peak: bytes allocated above the inputs during forward + backward (see the script's doc). "
                "The unchunked loss holds the [N, V] logits, their softmax and gradient (3 x the logits); a "
                "chunk holds its [C, V] logits and logsumexp's temporary of that size, over the hidden and "
                "weight gradients ([N, d] and [V, d] fp32). Seconds: best of 3 without the profiler, on "
                f"{torch.get_num_threads()} threads of a CPU shared with other jobs: indicative only.")
        Path(a.out + ".md").write_text(f"# Loss memory\n\n`{result['command']}`\n\n" + "\n".join(lines)
                                       + "\n\n" + note + "\n")
    return result


if __name__ == "__main__":
    main()
