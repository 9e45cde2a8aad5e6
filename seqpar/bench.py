"""``seqpar bench``: time every method forward and backward against the ideal (single-rank time / N).

Each row runs one method at one global length on N ranks: forward and backward times are the
median over repeats (after warm-up) of the slowest rank; efficiency is ``t_1 / (N · t_N)`` where
``t_1`` is the same computation on one rank with the same threads per rank; bytes are what each
rank sent (``seqpar.comm.CommStats``); the error is against that single-rank run.

By default N local CPU ranks are spawned (gloo, one thread each, through the persistent pool of
``seqpar.testing``); under ``torchrun`` the launched ranks are used.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import seqpar
from seqpar.attention.registry import method_spec


@dataclass(frozen=True)
class BenchCase:
    method: str
    seq_len: int
    world_size: int
    causal: bool = True
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    repeats: int = 3
    warmup: int = 1
    threads: int = 1
    packed_seed: int | None = None  # packed batch of stdlib document lengths (``--packed``), else dense


def stdlib_doc_lengths(total: int, seed: int = 0) -> list[int]:
    """A packed batch of ``total`` tokens drawn from a long-tailed real length distribution available
    offline: the byte sizes of the Python standard library's ``.py`` files / 4 (a token estimate,
    :func:`seqpar.schedulers.data.stdlib_lengths`), sampled with ``seed`` until the total is reached
    (the last document is cut to fit)."""
    import random

    from seqpar.schedulers.data import stdlib_lengths

    sizes = [int(x) for x in stdlib_lengths()]
    rng, lens = random.Random(seed), []
    while sum(lens) < total:
        lens.append(min(rng.choice(sizes), total - sum(lens)))
    return lens


@dataclass
class BenchRow:
    case: BenchCase
    fwd_ms: float = float("nan")
    bwd_ms: float = float("nan")
    fwd_ms_1: float = float("nan")
    bwd_ms_1: float = float("nan")
    efficiency: float = float("nan")
    step_ms: float = float("nan")  # forward+backward of the slowest rank (what a training step waits for)
    bytes_fwd: int = 0
    bytes_bwd: int = 0
    busiest_link: int = 0
    busiest_link_step: int = 0  # forward: most bytes sent to one peer within one step
    max_error: float = float("nan")
    error: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self.case)
        d.update({k: v for k, v in asdict(self).items() if k != "case"})
        return d


def _inputs(case: BenchCase, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    B, T, H, Hk, D = case.batch, case.seq_len, case.heads, case.kv_heads, case.head_dim
    if case.packed_seed is not None:
        B = 1  # one packed stream
    shapes = [(B, T, H, D), (B, T, Hk, D), (B, T, Hk, D), (B, T, H, D)]
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def _time_once(method, causal, q, k, v, dout, group, stats=None, comm=None, cu_seqlens=None):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if group is not None:
        dist.barrier(group)
    t0 = time.perf_counter()
    out = seqpar.attention(q, k, v, method=method, causal=causal, group=comm or group, stats=stats,
                           cu_seqlens=cu_seqlens)
    t1 = time.perf_counter()
    out.backward(dout)
    t2 = time.perf_counter()
    return out.detach(), (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _max_over_ranks(x: float, group) -> float:
    if group is None:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


_TWO_WAY = ("token_ring", "lightseq")


def run_case_on_rank(case: BenchCase) -> dict:
    """Run one case on this rank (all ranks of the default group call it). Returns the row as a dict."""
    torch.set_num_threads(case.threads)
    n = dist.get_world_size() if dist.is_initialized() else 1
    group = dist.group.WORLD if dist.is_initialized() else None
    row = BenchRow(case)
    try:
        if n != case.world_size:
            raise ValueError(f"world_size: the case asks for {case.world_size} ranks but {n} are running")
        method_spec(case.method, softmax_only=True)
        q, k, v, dout = _inputs(case)
        pl = pl1 = None
        if case.packed_seed is not None:  # one packed stream; geometry built once, reused by every repeat
            lens = stdlib_doc_lengths(case.seq_len, case.packed_seed)
            cu = [0] + [sum(lens[:i + 1]) for i in range(len(lens))]
            pl = seqpar.packed_layout(cu, method=case.method, group=group)
            if case.method not in ("usp",):
                w = [pl.work(r, case.causal) for r in range(pl.n)] if pl.n > 1 else [1]
                row.extra.update(docs=len(lens), max_doc=max(lens), balance=max(w) * len(w) / sum(w),
                                 padding=pl.num_padding / pl.total_tokens)
        local = [seqpar.shard(t, method=case.method, group=group, cu_seqlens=pl) for t in (q, k, v, dout)]
        stats = seqpar.CommStats()
        fwd, bwd, step = [], [], []
        out = None
        # methods whose two traffic directions get their own communicators (created once, collectively)
        comm = seqpar.TokenRingGroups(group) if group is not None and case.method in _TWO_WAY else None
        for i in range(case.warmup + case.repeats):
            s = stats if i == 0 else None
            out, tf, tb = _time_once(case.method, case.causal, *local, group, stats=s, comm=comm, cu_seqlens=pl)
            if i >= case.warmup:
                fwd.append(_max_over_ranks(tf, group))
                bwd.append(_max_over_ranks(tb, group))
                # the slowest rank's whole step: max(fwd) + max(bwd) would count a rank that finished
                # its forward early and then waits in backward for the others twice
                step.append(_max_over_ranks(tf + tb, group))
        if comm is not None:
            comm.destroy()
        row.fwd_ms, row.bwd_ms = statistics.median(fwd), statistics.median(bwd)
        row.step_ms = statistics.median(step)
        row.bytes_fwd, row.bytes_bwd = stats.total("fwd"), stats.total("bwd")
        row.busiest_link = stats.busiest_link("fwd")
        row.busiest_link_step = stats.busiest_link_per_step("fwd")
        full = seqpar.unshard(out, method=case.method, group=group, cu_seqlens=pl)
        # single-rank baseline with the same threads: the same method on a group of one rank
        solo = None
        if dist.is_initialized():
            solo = [dist.new_group([r]) for r in range(n)][dist.get_rank()]  # every rank creates every group
        if not dist.is_initialized() or dist.get_rank() == 0:
            f1, b1 = [], []
            out1 = None
            if pl is not None:  # the same packed batch on one rank (its own, one-rank layout)
                pl1 = seqpar.packed_layout(pl.cu_seqlens, method=case.method, group=solo)
            one = [q, k, v, dout] if pl1 is None else [seqpar.shard(t, method=case.method, cu_seqlens=pl1,
                                                                    group=solo) for t in (q, k, v, dout)]
            for i in range(case.warmup + case.repeats):
                out1, tf, tb = _time_once(case.method, case.causal, *one, solo, cu_seqlens=pl1)
                if i >= case.warmup:
                    f1.append(tf)
                    b1.append(tb)
            row.fwd_ms_1, row.bwd_ms_1 = statistics.median(f1), statistics.median(b1)
            if pl1 is not None:
                out1 = seqpar.unshard(out1, method=case.method, cu_seqlens=pl1, group=solo)
            row.max_error = float((full.double() - out1.double()).abs().max() / out1.double().abs().max())
            row.efficiency = (row.fwd_ms_1 + row.bwd_ms_1) / (n * row.step_ms)
    except Exception as exc:  # a failing row is reported, the others go on
        row.error = f"{type(exc).__name__}: {exc}"
    return row.as_dict()


def _single_thread_group_baseline_note() -> str:
    return ("efficiency = single-rank time (same threads per rank) / (N x time on N ranks); "
            "link/step = forward bytes sent to the busiest peer within one step")


def environment() -> dict:
    return {
        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "seqpar": seqpar.__version__, "platform": platform.platform(),
        "command": " ".join(["seqpar"] + sys.argv[1:]),
    }


def run_cases(cases: list[BenchCase], *, progress: bool = True) -> list[dict]:
    """Run cases on local ranks (spawned) or, under torchrun, on the launched ranks."""
    rows = []
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    iterator = cases
    bar = None
    if progress and (not launched or os.environ.get("RANK") == "0"):
        try:
            from rich.progress import track

            iterator = track(cases, description="benchmarking", transient=True)
        except ImportError:  # rich is an optional extra
            bar = None
    for case in iterator:
        if launched:
            if not dist.is_initialized():
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            rows.append(run_case_on_rank(case))
        else:
            from seqpar.testing import run_distributed

            try:
                res = run_distributed(run_case_on_rank, case.world_size, case, timeout=3600)
                rows.append(res[0])
            except Exception as exc:
                r = BenchRow(case, error=f"{type(exc).__name__}: {exc}").as_dict()
                rows.append(r)
    del bar
    return rows


def print_table(rows: list[dict], title: str = "seqpar bench") -> None:
    cols = [("method", "method"), ("N", "world_size"), ("T", "seq_len"), ("causal", "causal"),
            ("fwd ms", "fwd_ms"), ("bwd ms", "bwd_ms"), ("step ms", "step_ms"), ("1-rank ms", None), ("efficiency", "efficiency"),
            ("MB sent/rank", None), ("link/step KB", None), ("max err", "max_error"), ("error", "error")]
    if any("balance" in r.get("extra", {}) for r in rows):  # --packed: docs and max/mean work per rank
        cols[3:3] = [("docs", None), ("pad %", None), ("max/mean work", None)]

    def cell(r, key, label):
        x = r.get("extra", {})
        if label == "docs":
            return f"{x['docs']} (max {x['max_doc']})" if "docs" in x else "-"
        if label == "pad %":
            return f"{100 * x['padding']:.2f}" if "padding" in x else "-"
        if label == "max/mean work":
            return f"{x['balance']:.3f}" if "balance" in x else "-"
        if label == "1-rank ms":
            return f"{r['fwd_ms_1'] + r['bwd_ms_1']:.1f}"
        if label == "MB sent/rank":
            return f"{(r['bytes_fwd'] + r['bytes_bwd']) / 1e6:.2f}"
        if label == "link/step KB":  # forward: most bytes to one peer in one step (CommStats)
            return f"{r.get('busiest_link_step', 0) / 1e3:.0f}"
        val = r[key]
        if isinstance(val, float):
            return f"{val:.3f}" if key == "efficiency" else (f"{val:.1e}" if key == "max_error" else f"{val:.1f}")
        return str(val)

    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for label, _ in cols:
            table.add_column(label)
        for r in rows:
            table.add_row(*[cell(r, k, label) for label, k in cols])
        Console(width=max(160, Console().width)).print(table)
    except ImportError:
        print(title)
        print(" | ".join(label for label, _ in cols))
        for r in rows:
            print(" | ".join(cell(r, k, label) for label, k in cols))
    print(_single_thread_group_baseline_note())


def write_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)


def _linear_rank(method, T, H, K, V, repeats, threads):
    from seqpar.linear.bench import bench_linear

    torch.set_num_threads(threads)
    return bench_linear(method, T, H, K, V, repeats)


def run_linear_cases(methods, seq_lens, sizes, *, heads=4, key_dim=64, value_dim=64, repeats=3,
                     threads=1) -> list[dict]:
    """Linear-attention rows: each method at each length on each N, with efficiency against the
    single-rank time of the same method (``--linear`` section of ``seqpar bench``)."""
    from seqpar.testing import run_distributed

    rows = []
    for T in seq_lens:
        for method in methods:
            base = None
            for n in sorted(set([1] + list(sizes))):
                row = {"method": method, "world_size": n, "seq_len": T, "heads": heads, "key_dim": key_dim,
                       "value_dim": value_dim, "error": ""}
                try:
                    res = run_distributed(_linear_rank, n, method, T, heads, key_dim, value_dim, repeats, threads,
                                          timeout=3600)
                    r0 = res[0]
                    row.update(fwd_ms=1e3 * r0["fwd_s_max"], bwd_ms=1e3 * r0["bwd_s_max"],
                               bytes_fwd=max(r["bytes_fwd"] for r in res), bytes_bwd=max(r["bytes_bwd"] for r in res))
                    total = r0["total_s_max"]
                    if n == 1:
                        base = total
                    row["efficiency"] = base / (n * total) if base else float("nan")
                except Exception as exc:  # a failing row is reported, the others go on
                    row["error"] = f"{type(exc).__name__}: {exc}"
                if n in sizes:
                    rows.append(row)
    return rows


def print_linear_table(rows: list[dict]) -> None:
    header = ["method", "N", "T", "fwd ms", "bwd ms", "efficiency", "bytes fwd/rank", "bytes bwd/rank", "error"]
    lines = [header]
    for r in rows:
        lines.append([r["method"], str(r["world_size"]), str(r["seq_len"]), f"{r.get('fwd_ms', float('nan')):.1f}",
                      f"{r.get('bwd_ms', float('nan')):.1f}", f"{r.get('efficiency', float('nan')):.3f}",
                      str(r.get("bytes_fwd", "")), str(r.get("bytes_bwd", "")), r["error"]])
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="seqpar bench --linear")
        for h in header:
            table.add_column(h)
        for line in lines[1:]:
            table.add_row(*line)
        Console(width=max(160, Console().width)).print(table)
    except ImportError:
        for line in lines:
            print(" | ".join(line))
    print(_single_thread_group_baseline_note())
