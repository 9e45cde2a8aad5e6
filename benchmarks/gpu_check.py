"""One command for a lent GPU: the GPU tests, the static GPU suite and the kernel benchmark.

    python benchmarks/gpu_check.py                 # everything this machine can run
    python benchmarks/gpu_check.py --full          # + the opt-in static matrix (SEQPAR_GPU_STATIC_FULL=1)
    python benchmarks/gpu_check.py --bench-seqlens 4096,8192   # a shorter benchmark
    python benchmarks/gpu_check.py --skip static   # on a short GPU lease: CI already runs step 1

Steps, each a subprocess (a crash in one does not stop the others):

1. ``static``: ``pytest tests/test_gpu_static_*.py`` (AOT Triton compilation, fake CUDA tensors,
   flash-attn's interface, fake NCCL groups); runs on any machine.
2. ``gpu``: ``pytest -m gpu`` (kernels and methods on the real device); GPU only.
3. ``bench``: ``benchmarks/bench_kernels.py`` (Triton vs torch SDPA vs flash-attn); GPU only.

Writes ``benchmarks/results/gpu_check/<label>/summary.md`` (label: the GPU's name, or
``no-gpu``) with the machine, versions, commit, and per step its command, duration, pass / fail /
skip counts and the failed tests; the benchmark's CSV and plot land in the same folder. Without a
GPU, steps 2 and 3 are recorded as skipped. Exit status: 1 if any step that ran failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PROGRESS = re.compile(r"^[.sxXFE]+\s*(\[\s*\d+%\])?$")  # pytest's progress lines


def _shown(command: list[str]) -> str:
    """The command as a reader would type it: ``python``, no temporary report path."""
    return " ".join(["python" if c == sys.executable else c for c in command if not c.startswith("--junitxml")])


@dataclasses.dataclass
class Step:
    name: str
    command: list[str]
    ran: bool = False
    why_not: str = ""
    returncode: int = 0
    seconds: float = 0.0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    failed: list[str] = dataclasses.field(default_factory=list)
    tail: str = ""


def _probe() -> dict[str, str]:
    """Machine and versions, asked of a fresh interpreter (this script imports no torch)."""
    code = (
        "import json, torch\n"
        "info = {'torch': torch.__version__, 'cuda': str(torch.version.cuda), 'gpu': ''}\n"
        "if torch.cuda.is_available():\n"
        "    cap = torch.cuda.get_device_capability()\n"
        "    info['gpu'] = f'{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})'\n"
        "for mod in ('triton', 'flash_attn'):\n"
        "    try:\n"
        "        info[mod] = __import__(mod).__version__\n"
        "    except Exception as exc:\n"
        "        info[mod] = f'not installed ({type(exc).__name__})'\n"
        "print(json.dumps(info))\n"
    )
    import json

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    info.update(python=platform.python_version(), host=platform.node(), commit=commit.stdout.strip() or "?")
    return info


def _junit(path: Path) -> tuple[dict[str, int], list[str]]:
    """Counts and failed test ids of a pytest JUnit report."""
    if not path.exists():
        return {}, []
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return counts, failed


def _run(step: Step, env: dict[str, str], report: Path | None) -> None:
    print(f"== {step.name}: {_shown(step.command)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(step.command, cwd=ROOT, env=env, capture_output=True, text=True)
    step.ran, step.returncode, step.seconds = True, proc.returncode, time.perf_counter() - t0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and not _PROGRESS.match(ln)]
    step.tail = "\n".join(lines[-15:])
    if report is not None:
        step.counts, step.failed = _junit(report)
    print(step.tail, flush=True)


def _summary(steps: list[Step], info: dict[str, str], args: argparse.Namespace) -> str:
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# GPU check: {info['gpu'] or 'no GPU'} ({when})", "",
        f"Command: `{' '.join(['python benchmarks/gpu_check.py', *args.argv])}`  ",
        f"Machine: {info['host']}, Python {info['python']}, torch {info['torch']} (CUDA {info['cuda']}), "
        f"triton {info['triton']}, flash-attn {info['flash_attn']}, seqpar commit {info['commit']}.", "",
        "| step | ran | seconds | passed | failed | errors | skipped | exit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in steps:
        c = s.counts
        if s.ran:
            lines.append(f"| {s.name} | yes | {s.seconds:.0f} | {c.get('passed', '-')} | {c.get('failures', '-')} | "
                         f"{c.get('errors', '-')} | {c.get('skipped', '-')} | {s.returncode} |")
        else:
            lines.append(f"| {s.name} | no: {s.why_not} | | | | | | |")
    for s in steps:
        if s.ran:
            lines += ["", f"## {s.name}", "", f"`{_shown(s.command)}`", ""]
            if s.failed:
                lines += ["Failed:", *[f"- `{f}`" for f in s.failed], ""]
            lines += ["```", s.tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="also the opt-in static matrix (SEQPAR_GPU_STATIC_FULL=1)")
    p.add_argument("--bench-seqlens", default=None, help="passed to bench_kernels.py --seqlens")
    p.add_argument("--skip", default="", help="comma-separated steps not to run (static, gpu, bench)")
    p.add_argument("--out-root", default=str(ROOT / "benchmarks" / "results" / "gpu_check"))
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    info = _probe()
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", info["gpu"].split(" (")[0]).strip("_") or "no-gpu"
    out = Path(args.out_root) / label
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.full:
        env["SEQPAR_GPU_STATIC_FULL"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="seqpar_gpu_check_"))
    py, static_tests = sys.executable, sorted(str(t.relative_to(ROOT)) for t in (ROOT / "tests").glob("test_gpu_static_*.py"))
    bench = [py, "benchmarks/bench_kernels.py", "--out-dir", str(out)]
    if args.bench_seqlens:
        bench += ["--seqlens", args.bench_seqlens]
    steps = [
        (Step("static", [py, "-m", "pytest", "-q", *static_tests, f"--junitxml={tmp / 'static.xml'}"]), tmp / "static.xml"),
        (Step("gpu", [py, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={tmp / 'gpu.xml'}"]), tmp / "gpu.xml"),
        (Step("bench", bench), None),
    ]
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    unknown = skip - {s.name for s, _ in steps}
    if unknown:
        p.error(f"--skip {args.skip}: unknown step(s) {sorted(unknown)}; steps are static, gpu, bench")
    for step, report in steps:
        if step.name in skip:
            step.why_not = "skipped (--skip)"
            continue
        if step.name != "static" and not info["gpu"]:
            step.why_not = "no CUDA device"
            continue
        _run(step, env, report)
    text = _summary([s for s, _ in steps], info, args)
    (out / "summary.md").write_text(text)
    print(f"wrote {out / 'summary.md'}")
    return int(any(s.ran and s.returncode != 0 for s, _ in steps))


if __name__ == "__main__":
    sys.exit(main())
