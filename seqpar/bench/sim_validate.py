"""``seqpar simulate --validate``: the simulator's step times against real runs on local CPU ranks.

For each world size N (default 2, 4, 8) and method, N single-thread gloo ranks (the persistent pools
of :class:`seqpar.comm.pool.LocalRanks`) run one causal attention forward+backward of a ``[1, T, H, D]`` fp32
sequence sharded with the method's layout; the row's measured step is the median over repeats
(after one warm-up) of the slowest rank's forward+backward. The prediction is
``CostModel.time(method, N, [T], cluster.with_world_size(N))`` from a CPU calibration measured
first (or ``--calibration PATH``) at the same shape. The relative error is
``(predicted - measured) / measured``.

The CPU model is only meaningful because it models the machine: N ranks on C cores share them, so
each rank's compute is slower by the measured factor ``cluster.compute_slowdown(N)`` (about N/C when
N > C), gloo's measured point-to-point / all-to-all / all-gather bandwidth and latency per group
size replace NVLink/IB numbers, and the measured overlap factor says how much of the ring family's
communication really hides under compute when the cores are shared.

The formula composes those single measurements; what only a real group shows (one big Ulysses
kernel over fewer heads, LightSeq's helper traffic, gloo's progress while the cores are shared) it
can miss. ``group_scales=True`` (``--group-scales``) therefore first times each method's real step
on N ranks at **other, shorter lengths** (T/8, T/4, T/2) and fits two factors per (method, N)
there, one on the model's attention part and one on the rest (:func:`.calibrate.fit_group_scale`,
as ``seqpar calibrate`` does for the scheduler); the validated length T itself is never timed
before its prediction is made (held out). Rows keep the formula's own prediction and error too
(``formula_ms``, ``formula_error``). Measured on a shared 2-core machine, the correction did not
reduce the error reliably (benchmarks/results/README.md): two identical runs' measured step times
differ by 18% (median) and up to 46%, as much as the model's error.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Sequence

from seqpar.comm import CommStats, TokenRingGroups
from seqpar.comm.launch import progress_track
from seqpar.comm.pool import LocalRanks
from seqpar.layouts import shard
from seqpar.methods import METHODS
from seqpar.schedulers.calibration import load_calibration, rescale_cost_model
from seqpar.schedulers.cluster import ClusterSpec
from seqpar.schedulers.cost import SOFTMAX_METHODS, CostModel
from seqpar.softmax import attention

_TWO_WAY = ("token_ring", "lightseq")  # their two traffic directions get their own communicators


def measure_step(method: str, seq_len: int, shape: tuple[int, int, int], repeats: int, warmup: int,
                 probe_len: int | None = None) -> dict:
    """On every rank of the default group: time causal fwd+bwd of ``method``; returns the median
    slowest-rank step (seconds), every repeat, and the bytes the busiest rank sent in one step.

    ``probe_len``: before every timed repeat, every rank also times a single-rank causal fwd+bwd of
    ``probe_len`` tokens on its own (no communication, all ranks at once); ``probe_s`` is the median
    of the slowest rank's probe: the machine's speed at the moment of this case."""
    import torch
    import torch.distributed as dist

    from .measure import _attention_seconds, _solo_group

    torch.set_num_threads(1)
    group = dist.group.WORLD
    solo = _solo_group() if probe_len else None
    probes = []
    h, hk, d = shape
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq_len, n, d, generator=gen) for n in (h, hk, hk, h)]
    q, k, v, dout = (shard(t, method=method, group=group) for t in full)
    comm = TokenRingGroups(group) if method in _TWO_WAY else None
    stats, steps = CommStats(), []
    for i in range(warmup + repeats):
        if probe_len and i >= warmup:
            dist.barrier()
            p = torch.tensor([_attention_seconds(method, probe_len, shape, solo, torch.device("cpu"), 1, warmup=0)],
                             dtype=torch.float64)
            dist.all_reduce(p, op=dist.ReduceOp.MAX)
            probes.append(float(p))
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        dist.barrier()
        if i == warmup:
            start = cpu_sample(), time.perf_counter()
        t0 = time.perf_counter()
        out = attention(qq, kk, vv, method=method, causal=True, group=comm or group,
                               stats=stats if i == 0 else None)
        out.backward(dout)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= warmup:
            steps.append(float(t))
    (busy0, own0), w0 = start
    busy1, own1 = cpu_sample()
    wall = time.perf_counter() - w0
    own = torch.tensor([float(own1 - own0)], dtype=torch.float64)
    dist.all_reduce(own)  # CPU seconds of all our ranks (every thread) during the timed repeats
    if comm is not None:
        comm.destroy()
    busiest = torch.tensor([stats.total()], dtype=torch.float64)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    outside = max(0.0, (busy1 - busy0) - float(own)) / wall  # cores other processes kept busy
    return {"step_s": statistics.median(steps), "steps_s": steps, "bytes": int(busiest), "outside_cores": outside,
            "probe_s": statistics.median(probes) if probes else None}


def cpu_sample() -> tuple[float, float]:
    """(CPU seconds the whole machine spent busy, CPU seconds of this process) from /proc (Linux);
    (0, 0) elsewhere."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as fh:
            vals = [int(x) for x in fh.readline().split()[1:9]]
        busy = sum(vals) - vals[3] - vals[4]  # all but idle and iowait
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        own = int(fields[11]) + int(fields[12])  # utime + stime of every thread
        return busy / tick, own / tick
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def validate(*, world_sizes: Sequence[int] = (2, 4, 8), seq_len: int = 8192, heads: int = 8,
             kv_heads: int | None = None, head_dim: int = 32, methods: Sequence[str] | None = None,
             calibration: tuple[ClusterSpec, CostModel] | None = None, calibration_out: str | None = None,
             repeats: int = 3, warmup: int = 1, progress: bool = True, track_load: bool = True,
             group_scales: bool = False, probe: bool = True) -> list[dict]:
    """Measured vs predicted step time per (method, N); calibrates first unless ``calibration`` is given.

    Row keys: method, world_size, seq_len, measured_ms, predicted_ms, rel_error, measured_bytes,
    predicted_bytes, predicted_efficiency, measured_efficiency (the single-rank time from the
    calibration's fit at T, over N·measured), error (a failed run; no numbers then).

    ``track_load``: a shared machine's outside load changes between the calibration and the run.
    During each case's timed repeats, /proc/stat gives the CPU time other processes used (machine
    busy time minus our ranks' own); the row then also gets ``tracked_ms`` / ``tracked_error``: the
    same model with ``cores`` = the cores left free (``free_cores``) and core sharing
    ``max(1, N / free_cores)`` instead of the calibrated table. Nothing of the method's own timing
    at length T enters any prediction.

    ``group_scales``: first time every method on N ranks at T/8, T/4 and T/2 (held-out lengths) and
    fit the model's two factors per (method, N) there (see the module docstring).

    ``probe``: the speed of a shared machine also drifts within seconds (two identical runs here
    differ by 18% median per row, consistently over a row's repeats). Before each timed repeat
    every rank times a single-rank kernel of T/4 tokens alone (:func:`measure_step`), and the row
    gets ``probe_ms`` / ``probe_error``: the formula's prediction times (probe measured / probe
    modelled). The probe is the same kernel for every method and carries no communication.
    """
    from .calibrate import calibrate

    kv_heads = heads if kv_heads is None else kv_heads
    methods = list(methods) if methods else [m for m in METHODS if m in SOFTMAX_METHODS]
    sizes = sorted(set(world_sizes))
    if not sizes or any(n < 2 or n & (n - 1) for n in sizes):
        raise ValueError(f"world_sizes: expected powers of two >= 2, got {list(world_sizes)}")
    if calibration is None:
        lens = sorted({max(64, seq_len // 8), max(128, seq_len // 4), max(256, seq_len // 2), seq_len})
        cluster, cost = calibrate(nproc=max(sizes), methods=methods, seq_lens=lens, heads=heads, kv_heads=kv_heads,
                                  head_dim=head_dim, layers=1, repeats=3, out=calibration_out, progress=progress,
                                  share_compute=True, groups=False)  # scaled per N below instead
    else:
        cluster, cost = calibration
    shape = (heads, kv_heads, head_dim)
    if (cost.hidden, cost.kv_hidden, cost.n_heads, cost.layers) != (heads * head_dim, kv_heads * head_dim, heads, 1):
        cost = rescale_cost_model(cost, heads, kv_heads, head_dim, 1)
    formula = cost.without_group_scales()
    probe_len = max(64, seq_len // 4)
    if group_scales:
        cost = formula.with_group_scales(held_out_scales(cluster, formula, methods, sizes, seq_len, shape, repeats))
    cases = [(n, m) for n in sizes for m in methods]
    rows = []
    with LocalRanks() as ranks:
        for n, m in progress_track(cases, "validate", progress):
            try:
                res = ranks.run(measure_step, n, m, seq_len, shape, repeats, warmup, probe_len if probe else None,
                                timeout=1800)[0]
                rows.append(_row(m, n, seq_len, res, cluster, cost, formula, probe_len, track_load))
            except Exception as exc:  # a failing row is reported; the others go on
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                rows.append({"method": m, "world_size": n, "seq_len": seq_len, "error": error})
    return rows


def _row(m: str, n: int, seq_len: int, res: dict, cluster: ClusterSpec, cost: CostModel, formula: CostModel,
         probe_len: int, track_load: bool) -> dict:
    """One validation row: the measured step ``res`` of ``m`` on ``n`` ranks against the models."""
    row = {"method": m, "world_size": n, "seq_len": seq_len, "error": ""}
    cl = cluster.with_world_size(n)
    pred = cost.time(m, n, [seq_len], cl)
    t1 = cost.time(m, 1, [seq_len], cluster.with_world_size(1))
    raw = formula.time(m, n, [seq_len], cl)
    row.update(measured_ms=res["step_s"] * 1e3, predicted_ms=pred * 1e3,
               rel_error=(pred - res["step_s"]) / res["step_s"], formula_ms=raw * 1e3,
               formula_error=(raw - res["step_s"]) / res["step_s"],
               group_scale=list(cost.coeffs(m).scale(n)),
               measured_bytes=res["bytes"],
               predicted_bytes=cost.comm_bytes(m, n, seq_len, cl), predicted_efficiency=t1 / (n * pred),
               measured_efficiency=t1 / (n * res["step_s"]), repeats_ms=[t * 1e3 for t in res["steps_s"]])
    if res["probe_s"]:
        # the machine's speed now against the calibration's: the probe's measured time over
        # what the same model says for it (single-rank kernel, n ranks busy at once)
        ratio = res["probe_s"] / formula.time(m, 1, [probe_len], cl)
        row.update(probe_ratio=ratio, probe_ms=raw * ratio * 1e3,
                   probe_error=(raw * ratio - res["step_s"]) / res["step_s"])
    if track_load and cl.cores:
        # the cores outside processes left us during this very run (measured from /proc/stat)
        free = max(0.25, cl.cores - res["outside_cores"])
        cl_now = replace(cl, cores=free, compute_slowdown_by_ranks=())
        pred_now = cost.time(m, n, [seq_len], cl_now)
        row.update(outside_cores=res["outside_cores"], free_cores=free,
                   slowdown_calibrated=cl.compute_slowdown(), slowdown_now=cl_now.compute_slowdown(),
                   tracked_ms=pred_now * 1e3, tracked_error=(pred_now - res["step_s"]) / res["step_s"])
    return row


def held_out_scales(cluster: ClusterSpec, cost: CostModel, methods: Sequence[str], sizes: Sequence[int],
                    seq_len: int, shape: tuple[int, int, int], repeats: int) -> dict:
    """``{method: {N: (k_attn, k_rest)}}`` fitted to every method's real step on N ranks (a pool of N,
    the setting of the validation) for one sequence of T/8, T/4 and T/2 tokens, never T itself."""
    from .calibrate import measure_group_scales

    scales: dict = {}
    with LocalRanks() as ranks:
        for n in sizes:
            lens = sorted({max(2 * n, seq_len // k // (2 * n) * (2 * n)) for k in (8, 4, 2)})
            run = (lambda n: lambda fn, *args: ranks.run(fn, n, *args, timeout=1800)[0])(n)
            got, _ = measure_group_scales(run, cluster.with_world_size(n), cost, methods,
                                          [(n, [s]) for s in lens], shape, repeats)
            for m, by in got.items():
                scales.setdefault(m, {}).update(by)
    return scales


def summary(rows: list[dict]) -> dict:
    """Max and median |relative error| over the rows that ran (and of the load-tracked prediction)."""
    ok = [r for r in rows if not r["error"]]
    out = {"rows": len(ok), "failed": len(rows) - len(ok)}
    for key, name in (("rel_error", ""), ("tracked_error", "tracked_"), ("formula_error", "formula_"),
                      ("probe_error", "probe_")):
        errs = [abs(r[key]) for r in ok if key in r]
        if errs:
            out[f"{name}max_abs_error"] = max(errs)
            out[f"{name}median_abs_error"] = statistics.median(errs)
            out[f"{name}within_20pct"] = sum(e <= 0.2 for e in errs)
    out.setdefault("max_abs_error", float("nan"))
    out.setdefault("median_abs_error", float("nan"))
    return out


def print_validation(rows: list[dict], title: str) -> None:
    """Per row measured vs predicted (rich table), then the max / median error."""
    s = summary(rows)
    tracked = any("tracked_ms" in r for r in rows)
    cols = ["method", "N", "meas ms", "pred ms", "error", "k attn/rest", "formula err", "probe err",
            "MB/rank meas/pred", "eff meas", "eff pred"]
    cols += ["tracked ms", "tracked err", "free cores", "slowdown cal/now"] if tracked else []
    lines = []
    for r in rows:
        if r["error"]:
            lines.append([r["method"], str(r["world_size"]), "failed", "", r["error"][:60]] + [""] * (len(cols) - 5))
            continue
        line = [r["method"], str(r["world_size"]), f"{r['measured_ms']:.0f}", f"{r['predicted_ms']:.0f}",
                f"{r['rel_error']:+.1%}", "{:.2f}/{:.2f}".format(*r["group_scale"]), f"{r['formula_error']:+.1%}",
                f"{r['probe_error']:+.1%}" if "probe_error" in r else "-",
                f"{r['measured_bytes'] / 1e6:.1f} / {r['predicted_bytes'] / 1e6:.1f}",
                f"{r['measured_efficiency']:.2f}", f"{r['predicted_efficiency']:.2f}"]
        if tracked:
            line += [f"{r['tracked_ms']:.0f}", f"{r['tracked_error']:+.1%}", f"{r['free_cores']:.2f}",
                     f"{r['slowdown_calibrated']:.2f} / {r['slowdown_now']:.2f}"]
        lines.append(line)
    foot = (f"{s['rows']} rows: max |error| {s['max_abs_error']:.1%}, median |error| {s['median_abs_error']:.1%}, "
            f"{s.get('within_20pct', 0)} within 20%" + (f"; {s['failed']} failed" if s["failed"] else ""))
    if "formula_max_abs_error" in s:
        foot += (f"\nformula alone (no group scale): max |error| {s['formula_max_abs_error']:.1%}, median "
                 f"{s['formula_median_abs_error']:.1%}, {s['formula_within_20pct']} within 20%")
    if "probe_max_abs_error" in s:
        foot += (f"\nspeed-probed (formula x probe measured / modelled): max |error| {s['probe_max_abs_error']:.1%}, "
                 f"median {s['probe_median_abs_error']:.1%}, {s['probe_within_20pct']} within 20%")
    if tracked:
        foot += (f"\nload-tracked: max |error| {s['tracked_max_abs_error']:.1%}, median "
                 f"{s['tracked_median_abs_error']:.1%}, {s['tracked_within_20pct']} within 20%")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title, *("  ".join(x) for x in [cols] + lines), foot, sep="\n")
        return
    table = Table(title=title, caption=foot)
    for c in cols:
        table.add_column(c, justify="left" if c == "method" else "right", no_wrap=True)
    for x in lines:
        table.add_row(*x)
    Console(width=190).print(table)


def plot_validation(rows: list[dict], path: str, title: str) -> None:
    """Predicted vs measured step time (log-log), one marker per method, with the y = x line and ±20%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r["error"]]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for m in dict.fromkeys(r["method"] for r in ok):
        pts = [(r["measured_ms"], r["predicted_ms"]) for r in ok if r["method"] == m]
        ax.scatter(*zip(*pts), label=m, s=22)
    if ok:
        lo = min(min(r["measured_ms"], r["predicted_ms"]) for r in ok) * 0.8
        hi = max(max(r["measured_ms"], r["predicted_ms"]) for r in ok) * 1.25
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        for f in (0.8, 1.2):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step ms (CPU gloo)")
    ax.set_ylabel("predicted step ms (calibrated model)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def validate_main(args) -> int:
    """``seqpar simulate --validate`` with the parsed arguments of :mod:`.simulate`."""
    import json
    from pathlib import Path

    from seqpar.schedulers.data import parse_lengths

    from .report import write_rows

    (seq_len,) = parse_lengths(args.seq_len or "8k", "--seq-len")
    sizes = parse_lengths(args.world_sizes or "2,4,8", "--world-sizes")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    heads, hd = args.heads or 8, args.head_dim or 32
    calibration = None
    if args.calibration:

        calibration = load_calibration(args.calibration)
    rows = validate(world_sizes=sizes, seq_len=seq_len, heads=heads, kv_heads=args.kv_heads, head_dim=hd,
                    methods=methods, calibration=calibration, calibration_out=args.calibration_out,
                    repeats=args.repeats, progress=not args.no_progress, track_load=not args.no_track_load,
                    group_scales=args.group_scales, probe=not args.no_probe)
    title = (f"seqpar simulate --validate: CPU gloo, T={seq_len}, H={heads}, Hkv={args.kv_heads or heads}, D={hd}, "
             f"causal fp32, step = slowest rank fwd+bwd, median of {args.repeats}")
    print_validation(rows, title)
    meta = {"command": " ".join(["seqpar", "simulate"] + sys.argv[2:]), "summary": summary(rows),
            "calibration": args.calibration or args.calibration_out}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.csv:
        write_rows([{k: v for k, v in r.items() if k != "repeats_ms"} for r in rows], args.csv, meta, "csv")
        print(f"wrote {args.csv}")
    if args.plot:
        plot_validation(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return 1 if summary(rows)["failed"] else 0
