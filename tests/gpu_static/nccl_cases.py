"""The fake-NCCL matrix: every communicating method and entry point of seqpar as one :class:`Case`,
driven through the public API on fake CUDA tensors, rank by rank (:func:`.fake_nccl.run_ranks`).

A case's ``drive(run)`` runs one rank and marks its phases (``run.phase``: ``"fwd"``, ``"bwd"``,
then whatever follows); :func:`check` runs it on the 4 ranks and returns its :class:`Row`. Used by
tests/test_gpu_static_nccl.py (``ci`` rows in CI, the rest with ``SEQPAR_GPU_STATIC_FULL=1``) and by
benchmarks/gpu_static_nccl.py (every row, written to benchmarks/results/).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import seqpar
from seqpar.comm import TokenRingGroups

from .fake_nccl import WORLD, RankRun, run_ranks

T_DENSE, T_PACKED = 32, 30  # global tokens (T_DENSE: a multiple of 2N and of U·2R for usp 2x2)
CU_SEQLENS = [0, 5, 19, 30]  # three documents; a list, as from a data loader (host offsets)
HQ, HKV, D = 4, 2, 8
TINY_LLAMA = {"model_type": "llama", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Case:
    """One row: ``entry`` (a method or an entry point), ``layout`` (dense or packed), ``group``."""

    entry: str
    layout: str
    group: str
    drive: Callable[[RankRun], None] = field(compare=False, repr=False)
    ci: bool = True
    needs: tuple = ("fwd",)  # phases that must communicate (on every rank of a group of 2+)
    backend: str = "nccl"  # "gloo": a CPU job on the GPU machine (CPU tensors; no CUDA stream may appear)
    command: bool = False  # a seqpar command: it selects the rank's GPU itself (a library call's caller does)
    # phase -> most host reads of CUDA values per rank (each a device-to-host sync on a GPU); None: any
    host_reads: dict | None = None

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.layout}-{self.group}{'-gloo' if self.backend != 'nccl' else ''}".replace(" ", "_")


@dataclass
class Row:
    """What the 4 ranks of a case did: c10d ops per phase (summed over ranks), Functions whose
    backward ran, and the verdict (``"clean"`` or the first problem)."""

    case: Case
    ops: dict
    backward: list
    host_reads: dict  # "phase: what at site" -> count, over the ranks (each a device-to-host sync on a GPU)
    result: str = "clean"

    def as_dict(self) -> dict:
        return {"entry": self.case.entry, "layout": self.case.layout, "group": self.case.group,
                "backend": self.case.backend,
                "ci": self.case.ci, "ops": self.ops, "backward": self.backward, "host_reads": self.host_reads,
                "result": self.result}


def check(case: Case) -> Row:
    """Run ``case`` on every rank; raises AssertionError (violations, mismatches, a silent phase)."""
    runs = run_ranks(case.drive, backend=case.backend, set_device=not case.command)
    ops: dict = {}
    for run in runs:
        for op in run.comm:
            ops.setdefault(op.phase, Counter())[op.name] += 1
        for phase in case.needs:
            if not any(op.phase == phase for op in run.comm):
                raise AssertionError(f"{case.id}: rank {run.rank} did not communicate in phase {phase!r}")
        for phase, most in (case.host_reads or {}).items():
            reads = [f"{what} at {site}" for what, site, p in run.host_reads if p == phase]
            if len(reads) > most:
                raise AssertionError(f"{case.id}: rank {run.rank} read {len(reads)} CUDA value(s) on the host in "
                                     f"phase {phase!r} (at most {most}: each one stalls the GPU stream): {reads[:5]}")
    backward = sorted({name for run in runs for name, _ in run.backward_calls})
    reads = Counter(f"{phase}: {what} at {site}" for run in runs for what, site, phase in run.host_reads)
    return Row(case, {p: dict(c) for p, c in ops.items()}, backward, dict(reads))


# --------------------------------------------------------------------------------------------- inputs
def cuda(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _tensor(run: RankRun, *shape) -> torch.Tensor:
    """An input on the job's device: CUDA under NCCL, the CPU for a gloo job."""
    return torch.randn(*shape, device="cuda" if run.backend == "nccl" else "cpu")


def _group(run: RankRun, kind: str):
    """``world``; ``2 groups of 2`` (new_group, every rank builds both); ``TokenRingGroups``."""
    if kind == "world":
        return None
    if kind == "2 groups of 2":
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        return groups[run.rank // 2]
    if kind == "TokenRingGroups":
        return TokenRingGroups(None)
    raise ValueError(kind)


def _expect(t: torch.Tensor, shape, like: torch.Tensor | None = None) -> None:
    device = "cuda" if like is None else like.device.type
    assert tuple(t.shape) == tuple(shape) and t.device.type == device, (tuple(t.shape), t.device)


# ---------------------------------------------------------------------------------------- softmax
def softmax_drive(method: str, packed: bool, kind: str, check_ranks: bool = False, usp: str = "flat",
                  window: int | None = None, hq: int = HQ, sinks: bool = False, traced: bool = False,
                  lse: bool = False):
    """``window``: a sliding window; ``hq``: query heads (5: uneven Ulysses shards, uneven all-to-all
    splits); ``sinks``: a CUDA ``[hq]`` sink tensor that needs a gradient; ``traced``: forward and
    backward inside ``seqpar.trace`` (the recorder's hooks on the GPU path); ``lse``: ``return_lse=True``
    with the lse in rank 0's loss only (its gradient's paths; the other ranks' backward gets none)."""
    def drive(run: RankRun) -> None:
        run.phase = "shard"
        group = _group(run, kind)
        plain = group.group if isinstance(group, TokenRingGroups) else group
        opts = {}
        if method == "usp":
            opts = {"ulysses_degree": 2}
            if usp == "mesh":
                from torch.distributed.device_mesh import init_device_mesh

                plain = group = init_device_mesh("cuda", (2, 2), mesh_dim_names=("ring", "ulysses"))
                opts = {}
            elif usp == "make_usp_groups":
                from seqpar.comm.usp_groups import make_usp_groups

                plain = group = make_usp_groups(None, 2)
                opts = {}
        T = T_PACKED if packed else T_DENSE
        cu = seqpar.packed_layout(CU_SEQLENS, method=method, group=plain, **opts) if packed else None
        hkv = HKV if hq % HKV == 0 else 1
        q, k, v, dout = (seqpar.shard(_tensor(run, 1, T, h, D), method=method, group=plain, cu_seqlens=cu, **opts)
                         for h in (hq, hkv, hkv, hq))
        s = _tensor(run, hq).requires_grad_() if sinks else None
        run.phase = "fwd"
        recorder = seqpar.Trace() if traced else None
        with seqpar.trace(recorder) if traced else contextlib.nullcontext():
            out = seqpar.attention(q, k, v, method=method, causal=True, group=group, cu_seqlens=cu,
                                   check_ranks=check_ranks, window=window, sinks=s, return_lse=lse, **opts)
            out, rows_lse = out if lse else (out, None)
            _expect(out, q.shape, q)
            run.phase = "bwd"
            if rows_lse is not None and run.rank == 0:
                _expect(rows_lse, (1, hq, q.shape[1]), None)
                torch.autograd.backward((out, rows_lse), (dout, _tensor(run, *rows_lse.shape)))
            else:
                out.backward(dout)  # the tape checks every gradient (ds too) against its input's shape and device
        assert recorder is None or any(e["type"] == "compute" for e in recorder.events), "nothing was traced"
        run.phase = "unshard"
        _expect(seqpar.unshard(out, method=method, group=plain, cu_seqlens=cu, check_ranks=check_ranks, **opts),
                (1, T, hq, D), q)
        if isinstance(group, TokenRingGroups):
            group.destroy()

    return drive


# The attention step loops never wait for the host: no CUDA value is read back while they run.
_SOFTMAX = {"needs": ("fwd", "bwd"), "host_reads": {"shard": 0, "fwd": 0, "bwd": 0, "unshard": 0}}
# with return_lse=True a backward reads bools on the host (seqpar.softmax.lse): whether the dlse is zero
# (once; Ulysses once more on its head shards) and, per query bundle carrying delta, whether a row only delta
# can carry; at most 1 + N + 1 per rank (measured at N = 4: token_ring 1 + 4, ulysses and usp 3, the others 2)
READS_LSE = 6
_SOFTMAX_LSE = {"needs": ("fwd", "bwd"), "host_reads": {"shard": 0, "fwd": 0, "bwd": READS_LSE, "unshard": 0}}


# CI runs every method dense on the world; packed, and in subgroups, one method per communication
# pattern (ring, zigzag and striped share the executor and the ring transport: zigzag stands for them)
_CI_PACKED = ("zigzag_ring", "allgather_kv", "token_ring", "lightseq", "ulysses", "usp")
_CI_SUBGROUPS = ("zigzag_ring", "token_ring", "ulysses", "usp")
_CI_WINDOW = ("zigzag_ring", "token_ring", "lightseq")  # the K,V, query and helper pairings


def softmax_cases() -> list[Case]:
    cases = []
    for m in seqpar.METHODS:
        for packed in (False, True):
            lay = "packed" if packed else "dense"
            cases.append(Case(m, lay, "world", softmax_drive(m, packed, "world"), ci=not packed or m in _CI_PACKED,
                              **_SOFTMAX))
            cases.append(Case(m, lay, "2 groups of 2", softmax_drive(m, packed, "2 groups of 2"),
                              ci=not packed and m in _CI_SUBGROUPS, **_SOFTMAX))
        cases.append(Case(m, "dense", "world, check_ranks", softmax_drive(m, False, "world", True),
                          ci=m == "zigzag_ring", **_SOFTMAX))
    for m in ("token_ring", "lightseq"):
        for packed in (False, True):
            cases.append(Case(m, "packed" if packed else "dense", "TokenRingGroups",
                              softmax_drive(m, packed, "TokenRingGroups"), ci=m == "token_ring" and not packed,
                              **_SOFTMAX))
    for m in ("zigzag_ring", "token_ring"):  # a CPU job on a GPU machine: no CUDA stream on its path
        cases.append(Case(m, "dense", "world", softmax_drive(m, False, "world"), ci=False, backend="gloo",
                          **_SOFTMAX))
    for m in seqpar.METHODS:  # sliding windows: direct sends to both sides, several row ranges per message
        window = 20 if m == "lightseq" else 6  # lightseq: far enough (3 shards of 8) for its helpers
        for packed in (False, True):
            cases.append(Case(m, "packed" if packed else "dense", f"world, window={window}",
                              softmax_drive(m, packed, "world", window=window),
                              ci=not packed and m in _CI_WINDOW, **_SOFTMAX))
    for how in ("mesh", "make_usp_groups"):
        cases.append(Case("usp", "dense", f"2x2 {how}", softmax_drive("usp", False, "world", usp=how),
                          ci=how == "mesh", **_SOFTMAX))
    # sinks (applied after the merge: no communication of their own) and uneven head shards (5 query
    # heads: 2+1+1+1 over 4 Ulysses ranks, 3+2 over usp's 2)
    for m in seqpar.METHODS:
        cases.append(Case(m, "dense", "world, sinks", softmax_drive(m, False, "world", sinks=True),
                          ci=m in ("zigzag_ring", "ulysses"), **_SOFTMAX))
    for m in ("ulysses", "usp"):
        for packed in (False, True):
            cases.append(Case(m, "packed" if packed else "dense", "world, 5 heads, sinks",
                              softmax_drive(m, packed, "world", hq=5, sinks=True), ci=not packed, **_SOFTMAX))
    for m in seqpar.METHODS:  # return_lse=True, the lse in rank 0's loss: delta' in the bundles, Ulysses' dlse
        cases.append(Case(m, "dense", "world, lse in rank 0's loss", softmax_drive(m, False, "world", lse=True),
                          ci=m in ("zigzag_ring", "ulysses", "usp"), **_SOFTMAX_LSE))
    for m in seqpar.METHODS:  # the trace recorder's hooks (compute spans, messages, collectives)
        cases.append(Case(m, "dense", "world, traced", softmax_drive(m, False, "world", traced=True),
                          ci=m in ("zigzag_ring", "ulysses"), **_SOFTMAX))
    return cases


# ----------------------------------------------------------------------------------------- linear
def linear_drive(method: str, packed: bool, kind: str, check_ranks: bool = False, final_state: bool = False,
                 traced: bool = False):
    def drive(run: RankRun) -> None:
        run.phase = "shard"
        group = _group(run, kind)
        T = 64
        q, k, v, dout = (seqpar.shard(_tensor(run, 1, T, 2, D), method=method, group=group) for _ in range(4))
        g = seqpar.shard(torch.nn.functional.logsigmoid(_tensor(run, 1, T, 2, D)), method=method, group=group)
        h0 = _tensor(run, 1, 2, D, D) if final_state else None
        run.phase = "fwd"
        recorder = seqpar.Trace() if traced else None
        with seqpar.trace(recorder) if traced else contextlib.nullcontext():
            out, state = seqpar.linear_attention(q, k, v, g, group=group, method=method, initial_state=h0,
                                                 output_final_state=final_state, check_ranks=check_ranks,
                                                 cu_seqlens=[0, 10, 37, 64] if packed else None)
            _expect(out, v.shape, v)
            run.phase = "bwd"
            out.backward(dout)
        assert recorder is None or any(e["type"] == "compute" for e in recorder.events), "nothing was traced"

    return drive


# One read per call, in forward: linear_attention checks on the host that the log-decay g <= 0
# (seqpar.linear.api._validate) before any communication; the scans themselves read nothing back.
_LINEAR = {"needs": ("fwd", "bwd"), "host_reads": {"shard": 0, "fwd": 1, "bwd": 0}}


def linear_cases() -> list[Case]:
    cases = []
    for m in seqpar.LINEAR_METHODS:
        for packed in (False, True):
            lay = "packed" if packed else "dense"
            cases.append(Case(m, lay, "world", linear_drive(m, packed, "world"), ci=not packed or m != "lasp1",
                              **_LINEAR))
            cases.append(Case(m, lay, "2 groups of 2", linear_drive(m, packed, "2 groups of 2"), ci=False, **_LINEAR))
        cases.append(Case(m, "dense", "world, check_ranks, states", linear_drive(m, False, "world", True, True),
                          ci=m == "zeco", **_LINEAR))
        cases.append(Case(m, "dense", "world", linear_drive(m, False, "world"), ci=m == "zeco", backend="gloo",
                          **_LINEAR))
        cases.append(Case(m, "dense", "world, traced", linear_drive(m, False, "world", traced=True), ci=m == "zeco",
                          **_LINEAR))
    return cases


# ------------------------------------------------------------------------------------ entry points
def shard_drive(on_cpu: bool):
    """``seqpar.shard``/``unshard`` with ``check_ranks``; ``on_cpu``: the global tensor on the host
    (sharding is local: only the agreement gather communicates, and it must use the group's device)."""
    def drive(run: RankRun) -> None:
        x = torch.randn(1, T_DENSE, HQ, D) if on_cpu else cuda(1, T_DENSE, HQ, D)
        for method in ("zigzag_ring", "striped_ring", "ulysses"):
            run.phase = "fwd"
            local = seqpar.shard(x, method=method, check_ranks=True)
            run.phase = "unshard"
            if not on_cpu:
                _expect(seqpar.unshard(local, method=method, check_ranks=True), x.shape)

    return drive


def check_same_drive(run: RankRun) -> None:
    """``seqpar.comm.agreement.check_same_on_ranks`` as its docstring shows it (no device given)."""
    from seqpar.comm.agreement import check_same_on_ranks

    run.phase = "fwd"
    check_same_on_ranks(tuple(CU_SEQLENS), None)


def bench_drive(argv: list[str]):
    """``seqpar bench ...`` on torchrun's ranks (the command makes and destroys the default group)."""
    def drive(run: RankRun) -> None:
        from seqpar.cli import main

        dist.destroy_process_group()
        run.phase = "fwd"
        assert main(["bench", "--heads", str(HQ), "--head-dim", str(D), "--repeats", "1", "--warmup", "0",
                     "--no-progress", *argv]) == 0

    return drive


def linear_bench_drive(device):
    def drive(run: RankRun) -> None:
        from seqpar.bench.linear import bench_linear

        run.phase = "fwd"
        res = bench_linear("zeco", 64, 2, D, D, repeats=1, warmup=0, device=device)
        assert math.isfinite(res["total_s_max"])

    return drive


def entry_cases() -> list[Case]:
    from . import nccl_entries

    return [
        Case("seqpar.shard/unshard", "dense", "world, check_ranks", shard_drive(False), needs=("fwd", "unshard")),
        Case("seqpar.shard (CPU tensor)", "dense", "world, check_ranks", shard_drive(True)),
        Case("packing.check_same_on_ranks", "packed", "world", check_same_drive),
        Case("seqpar bench", "dense", "world", bench_drive(["--methods", "zigzag_ring,lasp2", "--seq-lens", "64"]),
             command=True),
        Case("seqpar bench", "packed", "world", bench_drive(["--methods", "zigzag_ring", "--packed", "--seq-lens",
                                                              "256"]), ci=False, command=True),
        Case("seqpar bench --methods all", "dense", "world", bench_drive(["--methods", "all", "--seq-lens", "64"]),
             ci=False, command=True),
        Case("seqpar.bench.linear.bench_linear", "dense", "world", linear_bench_drive("cuda"), ci=False),
        Case("seqpar.bench.linear.bench_linear (default device)", "dense", "world", linear_bench_drive(None)),
        *nccl_entries.cases(),
    ]


def all_cases() -> list[Case]:
    return softmax_cases() + linear_cases() + entry_cases()


def write_results(rows: list[Row], path) -> None:
    with open(path, "w") as f:
        json.dump({"world_size": WORLD, "rows": [r.as_dict() for r in rows]}, f, indent=1)
