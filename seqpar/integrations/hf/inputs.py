"""The inputs and the loss of a model converted by :func:`~seqpar.integrations.hf.apply_context_parallel`:
this rank's shard of a batch (:func:`shard_inputs`) and the global mean loss from it
(:func:`context_parallel_loss`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...comm import group_info
from ...comm.collectives import peer_errors
from ...layouts import shard

__all__ = ["IGNORE_INDEX", "ShardedInputs", "context_parallel_loss", "packed_position_ids", "shard_inputs",
           "shift_labels"]

IGNORE_INDEX = -100  # the label value transformers' and torch's cross-entropy skip


# ----------------------------------------------------------------------------- inputs


def _as_cu_seqlens(cu_seqlens, T: int, device) -> torch.Tensor:
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [num_docs + 1], got shape {tuple(cu.shape)} "
                         f"and dtype {cu.dtype}")
    host = cu.tolist()
    if host[0] != 0 or host[-1] != T or any(b <= a for a, b in zip(host, host[1:])):
        raise ValueError(f"cu_seqlens: must start at 0, increase strictly (no empty document) and end at the "
                         f"packed length {T}; got {host if len(host) <= 12 else host[:6] + ['...'] + host[-3:]}")
    return cu.to(device=device, dtype=torch.int32)


def shift_labels(labels: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """Next-token targets for ``labels`` ``[B, T]`` (global, unsharded): ``out[:, t] = labels[:, t+1]``,
    and ``IGNORE_INDEX`` at the last token of the sequence and of every document of ``cu_seqlens``."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        ends = torch.as_tensor(cu_seqlens, device=labels.device).long()[1:] - 1
        out[:, ends] = IGNORE_INDEX
    return out


def packed_position_ids(cu_seqlens, T: int, device=None) -> torch.Tensor:
    """Positions ``[1, T]`` that restart at 0 at every document start of ``cu_seqlens``."""
    cu = torch.as_tensor(cu_seqlens, device=device).long()
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return (torch.arange(T, device=device) - starts).unsqueeze(0)


@dataclass(frozen=True)
class ShardedInputs:
    """This rank's part of a batch, in the token layout of the method.

    ``input_ids``, ``position_ids``, ``labels``: ``[B, T_local]``. ``labels`` are already shifted
    (predict the next token), ``IGNORE_INDEX`` where there is nothing to predict or on padding.
    ``cu_seqlens``: the global int32 document boundaries to pass to attention (None: one dense
    sequence per batch row). ``token_index``: ``[T_local]`` global position of each local token in
    the (packed) sequence, -1 on padding the library added.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor | None
    token_index: torch.Tensor

    def model_kwargs(self) -> dict:
        """Keyword arguments for ``model(**kwargs)``: ids, positions, cu_seqlens, ``use_cache=False``."""
        kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.cu_seqlens is not None:
            kwargs["cu_seqlens"] = self.cu_seqlens
        return kwargs

    @property
    def num_valid(self) -> int:
        """Labels on this rank that count in the loss."""
        return int((self.labels != IGNORE_INDEX).sum())


def shard_inputs(input_ids: torch.Tensor, *, labels: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cu_seqlens=None, group=None,
                 method: str = "zigzag_ring") -> ShardedInputs:
    """This rank's shard of a global batch, ready for a model converted by :func:`apply_context_parallel`.

    Args:
        input_ids: ``[B, T_global]``, identical on every rank; for packed documents ``[1, T_total]``.
        labels: ``[B, T_global]`` in transformers' convention (aligned with ``input_ids``, -100 to
            skip); default ``input_ids``. Shifted here, before sharding, so the target of the last
            token of a shard (held by the next rank) is not lost.
        position_ids: ``[T_global]`` or ``[B, T_global]`` global positions; default ``0..T-1``, or
            restarting at 0 at every document when ``cu_seqlens`` is given.
        cu_seqlens: global document boundaries of the packed stream (flash-attn convention); the
            same on every rank. Documents do not attend to each other and no label crosses them.
        group, method: as for :func:`apply_context_parallel` (use the same ones).
    Purely local (no communication). A dense length that does not fit the method's layout raises
    ``ValueError`` saying which length to pad to.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids: expected an integer tensor [B, T_global], got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    B, T = input_ids.shape
    device = input_ids.device
    cu = None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"input_ids: packed documents (cu_seqlens) are one stream [1, T_total], got batch {B}")
        cu = _as_cu_seqlens(cu_seqlens, T, device)
    if labels is None:
        labels = input_ids
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels: shape {tuple(labels.shape)} differs from input_ids {tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = packed_position_ids(cu, T, device) if cu is not None else torch.arange(T, device=device)[None]
    position_ids = torch.as_tensor(position_ids, device=device)
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.shape[-1] != T or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids: expected [T_global] or [B, T_global] = [{B}, {T}], got "
                         f"{tuple(position_ids.shape)}")
    position_ids = position_ids.expand(B, T)
    targets = shift_labels(labels, cu)
    # Shard the token index (1-based so that padding the library adds, zero-filled, stands out),
    # then gather every token-indexed tensor by it: one layout for ids, positions and labels.
    index = shard(torch.arange(1, T + 1, device=device)[None], group=group, method=method, dim=1,
                         cu_seqlens=cu)[0] - 1
    valid = index >= 0
    take = index.clamp(min=0)
    ids = torch.where(valid, input_ids[:, take], torch.zeros_like(input_ids[:, take]))
    pos = torch.where(valid, position_ids[:, take], torch.zeros_like(position_ids[:, take]))
    lab = torch.where(valid, targets[:, take], torch.full_like(targets[:, take], IGNORE_INDEX))
    return ShardedInputs(input_ids=ids, position_ids=pos, labels=lab, cu_seqlens=cu,
                         token_index=torch.where(valid, index, torch.full_like(index, -1)))


# ----------------------------------------------------------------------------- loss


def context_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, group=None, *,
                          num_valid: int | torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens of ``group``, from this rank's shard.

    Args:
        logits: ``[..., V]`` this rank's logits (e.g. ``[B, T_local, V]``); computed in fp32.
        labels: matching ``[...]`` shifted labels from :func:`shard_inputs` (``IGNORE_INDEX`` skipped).
        group: the ranks whose tokens form the batch (None = default group / single device).
        num_valid: the global number of valid labels if already known (e.g. over several
            micro-batches); otherwise it is all-reduced here.
    Returns:
        A scalar whose value is the global mean loss (the same on every rank) and whose gradient is
        this rank's share: ``sum(local token losses) / global count``. Summing parameter gradients
        over the group (``all_reduce`` SUM, not mean) gives exactly the single-device gradient.
    """
    info = group_info(group)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels: shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)[:-1]}")
    local = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    if num_valid is None:
        count = (labels != IGNORE_INDEX).sum().to(torch.float64)
        if not info.single:
            with peer_errors(info, "label count all-reduce"):
                dist.all_reduce(count, group=info.group)
    else:
        count = torch.as_tensor(num_valid, dtype=torch.float64, device=local.device)
    count = count.clamp(min=1).to(local.device)
    total = local.detach().to(torch.float64).clone()
    if not info.single:
        with peer_errors(info, "loss all-reduce"):
            dist.all_reduce(total, group=info.group)
    share = local / count.to(local.dtype)
    return share + (total / count).to(local.dtype) - share.detach()
