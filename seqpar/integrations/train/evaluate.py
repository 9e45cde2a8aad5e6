"""Held-out evaluation of ``seqpar train``: ``--eval-data PATH``, ``--eval-every N``, ``--eval-batches K``.

The evaluation set is the first K packed sequences (``--seq-len`` tokens each, global) of
``--eval-data``, read and packed exactly like the training data (:mod:`.data` byte-level text files,
or with ``--model`` :mod:`.tokens`: text folders, JSONL, parquet/arrow tokenized by the model's
tokenizer; documents keep their boundaries), shuffled with a fixed seed (:data:`EVAL_SEED`, whatever
``--seed`` is). So every evaluation of every run sees the same K sequences, at any world size,
``--context-parallel`` degree or ``--adaptive``. K is capped at the sequences one pass over the data
holds (said at start). The set is opened by :func:`.config.open_eval_data` (also before any rank
starts, so a bad ``--eval-data`` fails once).

An evaluation runs the training model as it stands (its FSDP2 shards, context-parallel attention
over the training mesh and ``--cp-method``, the run's dtype: FSDP2 mixed precision, or autocast in
one process; the chunked loss of ``--loss-chunk``) under ``torch.no_grad()`` in eval mode. It
returns the token-weighted mean loss: the summed cross entropy of every valid label of the K
sequences over their number (global sum / global count, training's convention). Sequence ``i``
goes to data-parallel group ``i mod dp``, sharded over its cp ranks; a group with fewer sequences
than ``ceil(K / dp)`` runs its last pass on sequence 0 with weight 0 (FSDP2's collectives need the
same passes on every rank). ``--adaptive`` plans the K sequences in batches of ``--batch-size``
with its scheduler, one pass per rank per batch as in training.

Training is left as it was: the random-number state is restored afterwards, the model goes back to
train mode, and neither the optimizer, the loss scaler nor the data order is touched, so a run's
step records are the same with and without evaluation.
"""

from __future__ import annotations

import math
import time

import torch

from .config import DEFAULT_EVAL_BATCHES, EVAL_SEED, EvalSet, open_eval_data


def eval_due(cfg, step: int) -> bool:
    """Whether an evaluation follows ``step``: every ``--eval-every`` steps and after the last one."""
    return cfg.eval_data is not None and (step == cfg.steps or bool(cfg.eval_every) and step % cfg.eval_every == 0)


def eval_key(cfg, evalset: EvalSet | None) -> dict | None:
    """What identifies the evaluation set (saved with a checkpoint: a resumed run keeps the saved
    evaluations only when its set is the same): the data's fingerprint, the sequences and their length."""
    if evalset is None:
        return None
    data = evalset.data
    fingerprint = getattr(data, "fingerprint", None) or data.files.fingerprint
    return {"fingerprint": fingerprint, "sequences": evalset.count, "seq_len": cfg.seq_len}


def describe(cfg, evalset: EvalSet) -> str:
    """The start line's account of the evaluation."""
    every = "every step" if cfg.eval_every == 1 else f"every {cfg.eval_every} steps"
    when = f"{every} and at the end" if cfg.eval_every else "at the end"
    capped = (f" (all it holds; --eval-batches {evalset.requested} asked for more)"
              if evalset.count < evalset.requested else "")
    return (f"evaluation {when}: {evalset.count} x {cfg.seq_len} tokens of {cfg.eval_data}{capped}, "
            f"{len(evalset.data.lengths)} documents")


def _static_sums(cfg, rt, model, evalset: EvalSet, autocast) -> tuple[float, float]:
    """This rank's (loss sum, valid labels) on the fixed ``(dp, cp)`` mesh; every rank runs
    ``ceil(K / dp)`` forward passes."""
    from ..hf import shard_inputs
    from .step import token_loss

    total, labels = 0.0, 0.0
    for j in range(-(-evalset.count // rt.dp)):
        i = j * rt.dp + rt.dp_rank
        real = i < evalset.count  # else a weight-0 pass that keeps FSDP2's collectives matched
        tokens, cu = evalset.data.sequence(i if real else 0)
        shard = shard_inputs(tokens[None].to(rt.device), cu_seqlens=cu, group=rt.cp_group, method=cfg.cp_method)
        loss = token_loss(model, shard, autocast, cfg.loss_chunk)
        if real:
            total += float(loss.double())
            labels += shard.num_valid
    return total, labels


def _adaptive_sums(runner, rt, evalset: EvalSet, batch: int, autocast) -> tuple[float, float]:
    """This rank's (loss sum, valid labels) under ``--adaptive``: the K sequences in batches of
    ``batch``, each planned like a training step (one pass per rank per batch)."""
    total, labels = 0.0, 0.0
    seq_len = evalset.data.seq_len
    for first in range(0, evalset.count, batch):
        lengths = [seq_len] * min(batch, evalset.count - first)
        plan = runner.plan(lengths)
        s, n = runner.forward_sums(plan, lengths, lambda i: evalset.data.sequence(first + i), rt, autocast=autocast)
        total, labels = total + s, labels + n
    return total, labels


def evaluate(cfg, rt, model, evalset: EvalSet, step: int, autocast, runner=None, batch: int = 1) -> dict:
    """The evaluation record after ``step`` (collective: every rank calls it at the same step).

    ``eval_loss``: the global token-weighted mean cross entropy (nats per label) of the evaluation
    set; ``eval_ppl``: its exponential; ``eval_tokens``: the labels counted; ``eval_s``: wall seconds."""
    from .step import sum_over_ranks, sync

    sync(rt.device)
    t0 = time.perf_counter()
    devices = [rt.device.index or 0] if rt.device.type == "cuda" else []
    was_training = model.training
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        model.eval()
        try:
            if runner is None:
                local = _static_sums(cfg, rt, model, evalset, autocast)
            else:
                local = _adaptive_sums(runner, rt, evalset, batch, autocast)
        finally:
            model.train(was_training)
    total, labels = sum_over_ranks(list(local), rt, "eval loss all-reduce")
    sync(rt.device)
    loss = total / max(labels, 1.0)
    try:
        ppl = math.exp(loss)
    except OverflowError:
        ppl = math.inf
    return {"event": "eval", "step": step, "eval_loss": loss, "eval_ppl": ppl, "eval_tokens": int(labels),
            "eval_sequences": evalset.count, "eval_s": time.perf_counter() - t0}


__all__ = ["DEFAULT_EVAL_BATCHES", "EVAL_SEED", "EvalSet", "describe", "eval_due", "eval_key", "evaluate",
           "open_eval_data"]
