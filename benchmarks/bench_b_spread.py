"""Where the run-to-run spread of validation (b) comes from (benchmarks/results/b_spread_*.md).

Validation (b) (``validate_replay.py``) replays each method at N = 8 on this machine's cores and asks
that its efficiency (replayed one-rank step / N / replayed N-rank step) move by at most 3% across 3
runs. This script runs the same cases as (b) did up to its eighth validation (``run_case``: the
ranks compute one at a time on one core; every N-rank step is followed by the one-rank step in rank
0's process; a case's repeats one after the other, where (b) now takes them in rounds over the
methods, ``round_robin``) and keeps every repeat's traces, so that the estimators can be compared on
the same data afterwards:

    python benchmarks/bench_b_spread.py collect --runs 3 --methods ring,allgather_kv --agreement on,off \
        --out /tmp/spread
    python benchmarks/bench_b_spread.py analyze /tmp/spread --out benchmarks/results/b_spread_agreement

``collect --agreement on,off`` alternates, case by case, the default rank agreement and
``SEQPAR_CHECK_RANKS=0`` (the controlled comparison for the agreement change of 3213cac). The replay
uses the link and collectives of ``--link`` (the committed validation's calibration), so only the
traced CPU times differ between cases. ``analyze`` writes, per method and agreement setting, the
efficiency of each run and its spread under each estimator of :data:`ESTIMATORS`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from seqpar import __version__
from seqpar.bench.core import BenchCase
from seqpar.bench.replay import replay
from seqpar.bench.local_cores import STEADY_MALLOC, MachineLock
from seqpar.bench.replay_validate import cpu_machine, floor_traces, kernel_class_traces, run_case
from seqpar.comm.pool import LocalRanks

RESULTS = Path(__file__).resolve().parent / "results"


def set_agreement(agree: bool) -> None:
    """On each rank process: the rank agreement on (the default) or off (``SEQPAR_CHECK_RANKS=0``,
    read by every call) for the cases that follow."""
    if agree:
        os.environ.pop("SEQPAR_CHECK_RANKS", None)
    else:
        os.environ["SEQPAR_CHECK_RANKS"] = "0"


def machine_from(path: Path, scale: float = 1.0):
    """The replay machine of a validation JSON (its link, collectives and transfer CPU); ``scale`` > 1
    makes every link that many times slower (bandwidth / scale, latency * scale)."""
    v = json.loads(Path(path).read_text())
    link = v["link"]
    colls = {k: (c["bandwidth"] / scale, c["latency"] * scale) for k, c in v["collectives"].items()}
    return cpu_machine(link["bandwidth"] / scale, link["latency"] * scale, collectives=colls,
                       transfer_cpu=link["transfer_cpu"])


def _file(out: Path, method: str, agree: bool, run: int) -> Path:
    return out / f"{method}_{'on' if agree else 'off'}_{run}.json.gz"


def collect(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(STEADY_MALLOC)  # read by the rank processes when they start
    lock = MachineLock(os.path.join(tempfile.mkdtemp(prefix="seqpar-spread-"), "compute.lock"))
    shape = {"seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.heads, "head_dim": args.head_dim}
    settings = [s == "on" for s in args.agreement.split(",")]
    meta = {"command": " ".join(["python", "benchmarks/bench_b_spread.py"] + sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "seqpar": __version__},
            "shape": shape, "world_size": args.world_size, "repeats": args.repeats, "warmup": args.warmup,
            "link": os.path.relpath(args.link, Path(__file__).resolve().parent.parent), "cases": []}
    with LocalRanks() as ranks:
        for run in range(args.runs):
            for method in args.methods.split(","):
                for agree in settings:
                    case = BenchCase(method, world_size=args.world_size, **shape)
                    ranks.run(set_agreement, args.world_size, agree)
                    _, traces, one = run_case(ranks, case, args.repeats, args.warmup, lock, paired=True)
                    with gzip.open(_file(out, method, agree, run), "wt") as fh:
                        json.dump({"traces": traces, "one": one}, fh)
                    meta["cases"].append({"run": run, "method": method, "agree": agree,
                                          "time": time.strftime("%Y-%m-%d %H:%M:%S"), "load": os.getloadavg()[0]})
                    print(json.dumps(meta["cases"][-1]), flush=True)
                    (out / "collect.json").write_text(json.dumps(meta, indent=1))  # analyzable if cut short
    return 0


def _quantile(p: float):
    return lambda xs: sorted(xs)[int(p * (len(xs) - 1))]


# name -> what it replays (every one is computed by _estimates)
ESTIMATORS = {
    "floor": "each segment's least time over the repeats (the target's estimator)",
    "floor_first_half": "the same over the first half of the repeats",
    "floor_second_half": "the same over the second half",
    "q25": "each segment's 25th percentile over the repeats",
    "class": "one median time per kernel class (kernel_class_traces)",
    "free_link": "floor, on a link 10^6 times faster: the spread of the traced compute alone (a transfer "
                 "still takes its CPU share while it flows, for next to no time)",
    "link_with_speed": "floor, every link slowed by the run's one-rank step over the mean of the runs'",
}


def _efficiency(traces, one, m, build=floor_traces) -> float:
    n = len(traces[0])
    return replay(build(one), m).step_s / n / replay(build(traces), m).step_s


def _estimates(data: list[dict], link: Path) -> dict:
    """Every estimator's efficiency per run (``data``: one dict of traces per run)."""
    m, half = machine_from(link), len(data[0]["traces"]) // 2
    est = {k: [] for k in ESTIMATORS}
    ones = [replay(floor_traces(d["one"]), m).step_s for d in data]
    ref = statistics.mean(ones)
    for d, one_s in zip(data, ones):
        tr, one = d["traces"], d["one"]
        est["floor"].append(_efficiency(tr, one, m))
        est["floor_first_half"].append(_efficiency(tr[:half], one[:half], m))
        est["floor_second_half"].append(_efficiency(tr[half:], one[half:], m))
        est["q25"].append(_efficiency(tr, one, m, lambda r: floor_traces(r, pick=_quantile(0.25))))
        est["class"].append(_efficiency(tr, one, m, kernel_class_traces))
        est["free_link"].append(_efficiency(tr, one, machine_from(link, 1e-6)))
        est["link_with_speed"].append(_efficiency(tr, one, machine_from(link, one_s / ref)))
    est["one_rank_s"] = ones
    return est


def _load(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def _spread(xs) -> float:
    return (max(xs) - min(xs)) / statistics.mean(xs)


def analyze(args) -> int:
    src = Path(args.dir)
    meta = json.loads((src / "collect.json").read_text())
    link = Path(args.link) if args.link else Path(__file__).resolve().parent.parent / meta["link"]
    order = list(dict.fromkeys(c["method"] for c in meta["cases"]))
    keys = sorted({(c["method"], c["agree"]) for c in meta["cases"]}, key=lambda k: (order.index(k[0]), not k[1]))
    rows = []
    for method, agree in keys:
        runs = sorted({c["run"] for c in meta["cases"] if c["method"] == method and c["agree"] == agree})
        data = [_load(_file(src, method, agree, r)) for r in runs]
        est = _estimates(data, link)
        rows.append({"method": method, "agreement": "on" if agree else "off", "runs": runs, **est,
                     "spread": {k: _spread(est[k]) for k in ESTIMATORS}})
        print(method, rows[-1]["agreement"], " ".join(f"{k} {v:.1%}" for k, v in rows[-1]["spread"].items()),
              flush=True)
    v = json.loads(link.read_text())
    result = {"collect": meta, "link": str(link), "link_values": {"link": v["link"], "collectives": v["collectives"]},
              "estimators": ESTIMATORS, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    Path(args.out + ".md").write_text(markdown(result))
    return 0


def markdown(result: dict) -> str:
    meta = result["collect"]
    head = (f"`{meta['command']}`, then `python benchmarks/bench_b_spread.py analyze <dir> --out <this file>`; "
            f"{meta['machine']['cpus']} cores, {meta['machine']['platform']}, torch {meta['versions']['torch']}, "
            f"seqpar {meta['versions']['seqpar']}. Shape {meta['shape']}, N = {meta['world_size']}, "
            f"{meta['repeats']} repeats after {meta['warmup']} untimed steps per case, as in (b). "
            f"Replayed on the link of {result['link']}.")
    lines = ["# Where the spread of validation (b) comes from", "", head, "", "Estimators:", ""]
    lines += [f"- `{k}`: {v}" for k, v in result["estimators"].items()]
    lines += ["", "Efficiency per run, then its spread = (max - min) / mean (target of (b): 3%).", "",
              "| method | agreement | " + " | ".join(result["estimators"]) + " | one-rank step (ms) |",
              "|---|---|" + "---|" * (len(result["estimators"]) + 1)]
    for row in result["rows"]:
        cells = [" / ".join(f"{x:.3f}" for x in row[k]) + f" ({row['spread'][k]:.1%})" for k in result["estimators"]]
        ones = " / ".join(f"{x * 1e3:.0f}" for x in row["one_rank_s"])
        lines.append(f"| {row['method']} | {row['agreement']} | " + " | ".join(cells) + f" | {ones} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="run the cases of (b) and keep every repeat's traces")
    c.add_argument("--runs", type=int, default=3)
    c.add_argument("--methods", default="ring,allgather_kv")
    c.add_argument("--world-size", type=int, default=8)
    c.add_argument("--repeats", type=int, default=12)
    c.add_argument("--warmup", type=int, default=3)
    c.add_argument("--seq-len", type=int, default=4096)
    c.add_argument("--heads", type=int, default=8)
    c.add_argument("--head-dim", type=int, default=64)
    c.add_argument("--agreement", default="on,off", help="on, off or on,off (alternated case by case)")
    c.add_argument("--link", default=str(RESULTS / "replay_validation.json"))
    c.add_argument("--out", required=True, help="directory for the traces (a few MB: not committed)")
    a = sub.add_parser("analyze", help="every estimator's efficiency per run and spread")
    a.add_argument("dir", help="collect's --out")
    a.add_argument("--link", default=None, help="the validation JSON whose link to replay on (default: collect's)")
    a.add_argument("--out", default=str(RESULTS / "b_spread"), help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    return collect(args) if args.cmd == "collect" else analyze(args)


if __name__ == "__main__":
    sys.exit(main())
