"""The batches a :class:`~seqpar.integrations.hf_trainer.ContextParallelTrainer` trains on: every batch the
Trainer's collator gives becomes one packed stream of documents (:func:`pack_batch`), and each
optimizer step's label count is agreed over the ranks (:func:`agree_label_count`).

A batch arrives in one of three forms, all turned into ``input_ids``, ``labels``, ``position_ids``
``[1, T_total]`` and ``cu_seqlens`` ``[num_docs + 1]`` (int32, flash-attn's convention):

- packed (``DataCollatorWithFlattening``): position ids restart at 0 at every document; the
  boundaries are read from them, one row or several;
- dense rows ``[B, T]`` without padding: each row is one document (that is what a causal model does
  with a batch: rows never attend to each other);
- right padding with an ``attention_mask``: each row's tokens before its padding are one document,
  the padding is dropped. Left padding, holes in the mask, or a label on a padded token (which the
  plain Trainer would train on) are refused with a ``ValueError`` that says how to flatten instead.

The packed form computes exactly what the plain Trainer computes on the same batch: the same tokens
at the same positions, attending within their own document, predicting the same labels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..hf import IGNORE_INDEX, shift_labels

__all__ = ["PACKED_KEYS", "agree_eval_loss", "agree_label_count", "count_labels", "pack_batch"]

#: the keys of a packed batch; ``cu_seqlens`` marks a batch already packed
PACKED_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens")
# transformers' flash-attention boundaries and sequence index from DataCollatorWithFlattening: the same
# documents as the position ids, recomputed here from them
_DERIVED = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
_FLATTEN_HINT = ("pass packed documents instead: data_collator=DataCollatorWithFlattening() (transformers) "
                 "concatenates the examples and restarts position_ids at every document")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1)


def _starts_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Document starts ``[num_docs]`` of a packed row ``[T]`` whose positions restart at 0 per document."""
    if position_ids[0] != 0:
        raise ValueError(f"position_ids: a packed row must start a document at position 0, got "
                         f"{int(position_ids[0])}; {_FLATTEN_HINT}")
    step = position_ids[1:] - position_ids[:-1]
    broken = (step != 1) & (position_ids[1:] != 0)
    if bool(broken.any()):
        at = int(broken.nonzero()[0]) + 1
        raise ValueError(f"position_ids: at token {at} the position goes from {int(position_ids[at - 1])} to "
                         f"{int(position_ids[at])}; packed documents count 0, 1, 2, ... and restart at 0 "
                         f"(left padding or custom positions cannot be split per document); {_FLATTEN_HINT}")
    return (position_ids == 0).nonzero().flatten()


def _rows_as_documents(input_ids, labels, attention_mask):
    """Dense or right-padded rows ``[B, T]`` -> the rows' tokens concatenated, one document per row."""
    B, T = input_ids.shape
    if attention_mask is None:
        lengths = torch.full((B,), T, dtype=torch.long)
    else:
        mask = attention_mask.to(torch.bool)
        lengths = mask.sum(dim=1).cpu()
        right = torch.arange(T, device=mask.device)[None] < lengths.to(mask.device)[:, None]
        if not bool((mask == right).all()):
            raise ValueError("attention_mask: the batch is not right-padded (padding before or between tokens); "
                             f"context-parallel training never attends across padding: {_FLATTEN_HINT}")
        if bool((lengths == 0).any()):
            raise ValueError("attention_mask: a row of the batch is all padding; drop empty examples from the dataset")
        if labels is not None and bool(((labels != IGNORE_INDEX) & ~mask).any()):
            raise ValueError("labels: a padded token carries a label (the plain Trainer would train on it); set "
                             "labels to -100 on padding (DataCollatorForLanguageModeling does) or "
                             f"{_FLATTEN_HINT}")
        keep = right.flatten()
        input_ids = input_ids.flatten()[keep][None]
        labels = labels.flatten()[keep][None] if labels is not None else None
    cu = torch.zeros(B + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    return _flat(input_ids), None if labels is None else _flat(labels), positions, cu


def pack_batch(batch: dict) -> dict:
    """One collated batch -> ``{"input_ids", "labels", "position_ids": [1, T_total], "cu_seqlens": [D + 1]}``.

    ``labels`` keep transformers' convention (aligned with ``input_ids``, -100 to skip; shifted later by
    :func:`~seqpar.integrations.hf.shard_inputs`). Raises ``ValueError`` naming the key for a batch
    that cannot be packed without changing what the model computes. Purely local.
    """
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError(f"inputs: expected a dict batch with input_ids, got "
                         f"{sorted(batch) if isinstance(batch, dict) else type(batch).__name__}")
    if "cu_seqlens" in batch:
        return batch
    extra = sorted(set(batch) - set(PACKED_KEYS) - _DERIVED - {"attention_mask"})
    if extra:
        raise ValueError(f"inputs: {', '.join(extra)} cannot be split over the sequence by the context-parallel "
                         "trainer (it shards input_ids, labels and position_ids); remove them from the batch")
    input_ids, labels = batch["input_ids"], batch.get("labels")
    if labels is None:
        raise ValueError("labels: the batch has no labels; the context-parallel trainer trains causal language "
                         "models on labels (DataCollatorWithFlattening and DataCollatorForLanguageModeling add them)")
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(f"input_ids, labels: expected [B, T] tensors of one shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(labels.shape)}")
    mask = batch.get("attention_mask")
    padded = mask is not None and not bool(mask.to(torch.bool).all())
    if batch.get("position_ids") is not None and not padded:
        positions = batch["position_ids"].reshape(input_ids.shape)
        starts = [_starts_from_positions(row) + i * input_ids.shape[1] for i, row in enumerate(positions)]
        total = input_ids.numel()
        cu = torch.cat([torch.cat(starts).cpu(), torch.tensor([total])])
        input_ids, labels, positions = _flat(input_ids), _flat(labels), _flat(positions)
    else:
        input_ids, labels, positions, cu = _rows_as_documents(input_ids, labels, mask if padded else None)
    device = input_ids.device
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions.to(device),
            "cu_seqlens": cu.to(device=device, dtype=torch.int32)}


def count_labels(packed: dict) -> int:
    """Next-token labels of a packed batch that count in the loss: what
    :func:`~seqpar.integrations.hf.shard_inputs` keeps (shifted, none across a document end)."""
    return int((shift_labels(packed["labels"], packed["cu_seqlens"]) != IGNORE_INDEX).sum())


def agree_label_count(count: int, error: str | None, *, world: int, cp: int, across_dp: bool,
                      device) -> int:
    """The label count each rank divides its loss by, agreed in one all-reduce over the world.

    ``count``: this rank's labels over the accumulation window (the same on every rank of a
    context-parallel group, which holds the same batches). Returns the sum over the data-parallel
    groups (``across_dp``: ``average_tokens_across_devices``) or ``count`` itself. ``error``: why this
    rank refused a batch; then every rank raises (this one with its reason), so that no data-parallel
    group waits in a collective for one that stopped.
    """
    if world == 1:
        if error:
            raise ValueError(error)
        return count
    both = torch.tensor([count, 1 if error else 0], dtype=torch.int64, device=device)
    dist.all_reduce(both)
    total, failed = (int(x) for x in both.tolist())
    if error:
        raise ValueError(error)
    if failed:
        raise ValueError(f"inputs: {failed // cp} data-parallel group(s) refused their batch (their ranks raised "
                         "the reason); this rank stops with them")
    return total // cp if across_dp else count


def agree_eval_loss(weighted: float, examples: int, error: str | None, *, world: int, cp: int, device) -> float:
    """The evaluation loss ``sum(n_i * loss_i) / sum(n_i)`` (``n_i`` examples in batch ``i``) over
    every data-parallel group's batches (each counted once: the ``cp`` ranks of a group hold the same
    values), in one all-reduce that also carries refusals (every rank raises, as in
    :func:`agree_label_count`)."""
    both = torch.tensor([weighted, float(examples), 1.0 if error else 0.0], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(both)
    if error:
        raise ValueError(error)
    if both[2] > 0:
        raise ValueError(f"inputs: {int(both[2]) // cp} data-parallel group(s) refused an evaluation batch (their "
                         "ranks raised the reason); this rank stops with them")
    return float(both[0] / both[1].clamp(min=1))
