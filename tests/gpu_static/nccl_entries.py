"""Fake-NCCL cases of the scheduler, calibration, trainer and transformers entry points
(:mod:`.nccl_cases` holds the methods and the benchmarks).

Everything runs on torchrun's ranks as the commands do under NCCL: a command that makes its own
default group (``launched_process_group``) gets the fake one; a full transformers Llama (1 layer)
runs forward on fake CUDA tensors and its attention's backward through the recorded Functions.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import seqpar

from .fake_nccl import RankRun

# the internal modules these cases drive (the phases of ``seqpar calibrate``; torch checkpoint's
# context_fn of seqpar.checkpoint); the rest is public API
MEASURE = "seqpar.bench.measure"
CHECKPOINT = "seqpar.softmax.checkpoint"

SHAPE = (4, 2, 8)  # heads, kv heads, head dim of the calibration phases


def _module(name: str):
    import importlib

    return importlib.import_module(name)


def _plan(lens, group_size: int, method: str = "zigzag_ring"):
    """Groups of ``group_size`` tiling the 4 ranks, the sequences dealt round-robin (no solver)."""
    from seqpar.schedulers import GroupPlan, Plan

    n = 4 // group_size
    groups = [GroupPlan(start=i * group_size, size=group_size, method=method,
                        seqs=tuple(j for j in range(len(lens)) if j % n == i)) for i in range(n)]
    return Plan(world_size=4, groups=tuple(groups), estimated_time=0.0, solver="static")


# ------------------------------------------------------------------------------------- calibration
def phase_plans_drive(group_size: int):
    """``measure.phase_plans``: the last phase of ``seqpar calibrate`` (packed steps of a plan through
    ``execute.train_step`` with no parameters, then the slowest rank's times)."""
    def drive(run: RankRun) -> None:
        measure = _module(MEASURE)
        lens = [48, 24, 16, 8]
        run.phase = "fwd"
        res = measure.phase_plans([_plan(lens, group_size).to_json()], lens, SHAPE, 0, 0, 1)
        assert (res is None) == (run.rank != 0)

    return drive


def phase_links_drive(run: RankRun) -> None:
    measure = _module(MEASURE)
    run.phase = "fwd"
    out = measure.phase_links([4096], 1)
    assert set(out) == {2, 4}


def phase_overlap_drive(run: RankRun) -> None:
    measure = _module(MEASURE)
    run.phase = "fwd"
    assert "overlap" in measure.phase_overlap("zigzag_ring", 16, SHAPE, 4096, 1)


def calibrate_drive(run: RankRun) -> None:
    from seqpar.cli import main

    dist.destroy_process_group()
    run.phase = "fwd"
    with tempfile.TemporaryDirectory() as tmp:
        assert main(["calibrate", "--quick", "--methods", "zigzag_ring", "--heads", "4", "--head-dim", "8",
                     "--no-progress", "--out", str(Path(tmp) / "cal.json")]) == 0


# --------------------------------------------------------------------------------- plan execution
def execute_drive(with_params: bool):
    """``GroupCache``, ``rank_work``, ``execute_plan`` (``work.shard`` / ``attention`` / ``unshard``) and
    ``train_step`` with (a CUDA weight) or without parameters, on a plan of two groups of 2."""
    def drive(run: RankRun) -> None:
        import seqpar.schedulers as ex

        lens = [24, 16, 12, 8]
        plan = _plan(lens, 2)
        groups = ex.GroupCache()
        per_seq = [torch.randn(n, 4, 8, device="cuda") for n in lens]
        weight = torch.ones(8, device="cuda", requires_grad=True)

        def run_group(work):
            x = work.shard(work.pack(per_seq))
            out = work.attention(x, x, x, causal=True)
            return work.unshard(out)

        run.phase = "fwd"
        full = ex.execute_plan(plan, lens, run.rank, groups, run_group)
        assert full.shape[1] == sum(lens[i] for i in ex.rank_work(plan, lens, run.rank, groups).seqs)

        def loss_fn(work):
            x = work.shard(work.pack(per_seq))
            out = work.attention(x * weight, x, x, causal=True)
            return out.float().sum(), work.num_tokens

        run.phase = "train_step"
        loss = ex.train_step(plan, lens, run.rank, groups, loss_fn, [weight] if with_params else [])
        assert isinstance(loss, float)

    return drive


# -------------------------------------------------------------------------------------- checkpoint
def checkpoint_drive(method: str):
    """``seqpar.checkpoint``'s two contexts as torch's checkpoint enters them: the forward records each
    attention's (out, lse); the recomputation before backward replays them and sends nothing (Ulysses
    and USP: their q, k, v all-to-all only, whose head shards their backward needs)."""
    def drive(run: RankRun) -> None:
        from .nccl_cases import HKV, HQ, T_DENSE, D, _tensor

        run.phase = "shard"
        q, k, v, dout = (seqpar.shard(_tensor(run, 1, T_DENSE, h, D), method=method) for h in (HQ, HKV, HKV, HQ))
        recording, replaying = _module(CHECKPOINT).attention_context_fn()
        run.phase = "fwd"
        with recording:
            seqpar.attention(q, k, v, method=method, causal=True)
        run.phase = "recompute"
        with replaying:
            out = seqpar.attention(q, k, v, method=method, causal=True)
        again = [op.name for op in run.comm if op.phase == "recompute"]
        assert again == (["alltoall_base_"] if method in ("ulysses", "usp") else []), f"the recomputation sent {again}"
        run.phase = "bwd"
        out.backward(dout)

    return drive


# -------------------------------------------------------------------------------------- trainer
def _tiny_config(tmp: str) -> str:
    from .nccl_cases import TINY_LLAMA

    path = Path(tmp) / "tiny.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def train_drive(*argv: str):
    """``seqpar train ...`` for one step on torchrun's ranks: model on the GPU, attention sharded,
    the loss count and the gradients all-reduced."""
    def drive(run: RankRun) -> None:
        from seqpar.cli import main

        dist.destroy_process_group()
        run.phase = "fwd"
        with tempfile.TemporaryDirectory() as tmp:
            assert main(["train", "--model-config", _tiny_config(tmp), "--steps", "1", "--no-progress",
                         "--log-every", "1000", *argv]) == 0

    return drive


def hf_drive(run: RankRun) -> None:
    """``apply_context_parallel`` + ``shard_inputs`` + ``context_parallel_loss`` on a tiny Llama."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from seqpar.integrations.hf import (
        apply_context_parallel,
        context_parallel_loss,
        shard_inputs,
    )

    from .nccl_cases import TINY_LLAMA

    values = dict(TINY_LLAMA)
    values.pop("model_type")
    model = AutoModelForCausalLM.from_config(LlamaConfig(**values)).to("cuda")
    apply_context_parallel(model, method="zigzag_ring")
    tokens = torch.randint(0, 259, (1, 64), device="cuda")
    run.phase = "fwd"
    shard = shard_inputs(tokens, method="zigzag_ring", cu_seqlens=[0, 20, 64])
    logits = model(**shard.model_kwargs()).logits
    loss = context_parallel_loss(logits, shard.labels)
    assert loss.device.type == "cuda"
    run.phase = "bwd"
    loss.backward()


def cases():
    from .nccl_cases import Case

    return [
        Case("seqpar.checkpoint (replayed forward)", "dense", "world, zigzag_ring", checkpoint_drive("zigzag_ring"),
             needs=("fwd", "bwd"), host_reads={"fwd": 0, "recompute": 0, "bwd": 0}),
        *(Case("seqpar.checkpoint (replayed forward)", "dense", f"world, {m}", checkpoint_drive(m), ci=False,
               needs=("fwd", "bwd"), host_reads={"fwd": 0, "recompute": 0, "bwd": 0})
          for m in ("ulysses", "usp", "token_ring", "lightseq")),
        Case("calibrate: measure.phase_plans", "packed", "2 groups of 2", phase_plans_drive(2)),
        Case("calibrate: measure.phase_plans", "packed", "world", phase_plans_drive(4), ci=False),
        Case("calibrate: measure.phase_links", "dense", "2 groups of 2, world", phase_links_drive),
        Case("calibrate: measure.phase_overlap", "dense", "world", phase_overlap_drive, ci=False),
        Case("seqpar calibrate --quick", "dense+packed", "world", calibrate_drive, ci=False, command=True),
        Case("execute_plan + train_step(params=[])", "packed", "2 groups of 2", execute_drive(False),
             needs=("fwd", "train_step")),
        Case("execute_plan + train_step(params)", "packed", "2 groups of 2", execute_drive(True), ci=False,
             needs=("fwd", "train_step")),
        Case("seqpar train --cp 4", "packed", "world", train_drive("--seq-len", "64", "--context-parallel", "4"),
             command=True),
        Case("seqpar train --cp 2 (dp 2)", "packed", "mesh 2x2", train_drive("--seq-len", "64", "--context-parallel",
                                                                            "2"), ci=False, command=True),
        Case("seqpar train --adaptive", "packed", "plan: 2 groups of 2",
             train_drive("--adaptive", "--batch-size", "2", "--seq-len", "32768"), ci=False, command=True),
        Case("hf: apply_context_parallel + loss", "packed", "world", hf_drive, needs=("fwd", "bwd")),
    ]
