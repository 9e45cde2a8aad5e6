"""Merging partial attention results of the same rows (fp32 accumulators).

Two partials ``(o1, l1)`` and ``(o2, l2)`` over disjoint key sets combine as
``l = logaddexp(l1, l2)``, ``o = exp(l1 - l) o1 + exp(l2 - l) o2``. The stable
form used here is ``o = o1 - sigmoid(l2 - l1) (o1 - o2)`` (a lerp from o1 to o2
with weight ``w = sigmoid(l2 - l1)``) and ``l = l1 - logsigmoid(l1 - l2)``.
Keep the accumulator in fp32 for the whole ring and cast once at the end.
"""

from __future__ import annotations

import torch


def new_accumulator(
    q_like_shape_B_T_H_D, device, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty running result for rows of shape ``[B, T, H, D]``.

    Returns ``(out, lse)``: zeros ``[B, T, H, D]`` and ``-inf`` ``[B, H, T]``,
    both in ``dtype`` (float32, or float64 for float64 checks). A row that
    never receives a block keeps ``out = 0, lse = -inf``.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype={dtype} for an accumulator: use torch.float32 (or float64)")
    shape = tuple(int(s) for s in q_like_shape_B_T_H_D)
    if len(shape) != 4:
        raise ValueError(f"q_like_shape_B_T_H_D={shape} must be [B, T, H, D]")
    b, t, h, _ = shape
    out = torch.zeros(shape, dtype=dtype, device=device)
    lse = torch.full((b, h, t), float("-inf"), dtype=dtype, device=device)
    return out, lse


def _check_merge(acc_out, acc_lse, out, lse) -> None:
    if acc_out.dim() != 4 or out.shape != acc_out.shape:
        raise ValueError(
            f"out {tuple(out.shape)} must match acc_out {tuple(acc_out.shape)}, both [B, T, H, D]"
        )
    b, t, h, _ = acc_out.shape
    for name, x in (("acc_lse", acc_lse), ("lse", lse)):
        if tuple(x.shape) != (b, h, t):
            raise ValueError(f"{name} {tuple(x.shape)} must be [B, H, T] = {(b, h, t)}")
    for name, x in (("acc_out", acc_out), ("acc_lse", acc_lse)):
        if x.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{name} is {x.dtype}: accumulators must be float32 (or float64)")
    if acc_lse.dtype != acc_out.dtype:
        raise ValueError(f"acc_lse dtype {acc_lse.dtype} != acc_out dtype {acc_out.dtype}")


def merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold the partial ``(out, lse)`` into ``(acc_out, acc_lse)`` in place.

    ``acc_out`` ``[B, T, H, D]`` and ``acc_lse`` ``[B, H, T]`` are float32 (or
    float64); ``out`` may be in any float dtype (bf16 is upcast here), ``lse``
    ``[B, H, T]`` float32/float64. Exact when either side is ``-inf``: the
    other side is taken unchanged (weight exactly 0 or 1), and two ``-inf``
    sides stay ``out = 0, lse = -inf`` without NaN.
    """
    _check_merge(acc_out, acc_lse, out, lse)
    acc = acc_out.dtype
    l1 = acc_lse
    l2 = lse.to(acc)
    # w = sigmoid(l2 - l1): 1 when l1 = -inf, 0 when l2 = -inf (also both -inf, where l2 - l1 is NaN).
    w = torch.where(torch.isneginf(l2), 0.0, torch.sigmoid(l2 - l1))
    # lerp(o1, o2, w) = o1 - w (o1 - o2); torch returns o2 exactly for w = 1 and o1 for w = 0.
    acc_out.lerp_(out.to(acc), w.transpose(1, 2).unsqueeze(-1))
    new_l = torch.where(torch.isneginf(l1), l2, l1 - torch.nn.functional.logsigmoid(l1 - l2))
    acc_lse.copy_(new_l)
