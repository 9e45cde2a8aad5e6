"""The row statistics a block backward reads, for a query bundle whose delta is given rather than
derived from ``out``.

A foreign query bundle: the executor sends another member's queries with delta =
rowsum(dout * out) (Hq numbers per row) instead of out (Hq x D). A gradient through the returned
lse (``return_lse=True``, :mod:`.lse`) changes only that delta: ``delta' = delta - dlse``, for the
own bundle too (and it travels as delta' to the members that compute this rank's rows). Kernels
that derive delta from ``out`` get a surrogate out with the same row sum; where none exists (a row
with ``dout = 0`` and ``delta' != 0``: a loss of the lse alone) the bundle goes to the kernels that
take delta itself (``out=None``: dispatch picks one whose backward works from delta).
"""

from __future__ import annotations

import torch

from .plans import Task


def surrogate_out(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """An ``out`` with ``rowsum(dout * out) == delta``, for block kernels that derive delta from
    ``out`` (torch's CPU and CUDA ops): a foreign query bundle travels with delta (Hq numbers per
    row) instead of out (Hq·D). out enters those backward ops only through that row sum. Built from
    ``dout / max|dout|`` so it neither overflows nor underflows (checked: fp32 gradients within
    2e-7 of the ones computed from the true out). A row with ``dout = 0`` gets 0 (row sum 0)."""
    d = dout.to(delta.dtype)
    m = d.abs().amax(-1, keepdim=True)
    u = torch.where(m > 0, d / m, 0.0)
    denom = m * (u * u).sum(-1, keepdim=True)
    return u * torch.where(m > 0, delta.transpose(1, 2).unsqueeze(-1) / denom, 0.0)


def kernel_out(dout: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor | None:
    """The surrogate ``out`` of rows ``dout [B, T, H, D_v]`` with ``delta [B, H, T]``, or None when
    it cannot carry them: some row that sees a key (finite ``lse``) has ``dout = 0`` but ``delta !=
    0``, which only a gradient through the lse produces. ``lse`` None: no such row can exist (delta
    is a row sum of dout), nothing is checked. The check reads one bool on the host (a device sync
    on GPU), only in calls with ``return_lse=True``."""
    if lse is not None:
        silent = dout.abs().amax(-1).transpose(1, 2) == 0  # [B, H, T]; NaN rows are not silent
        if bool((silent & (delta != 0) & torch.isfinite(lse)).any()):
            return None
    return surrogate_out(dout, delta)


def shifted_delta(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    """``delta' = rowsum(dout * out) - dlse`` ``[B, H, T]`` in ``acc`` (fp32, or float64), contiguous
    (``dlse`` None: delta itself)."""
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
    return (delta if dlse is None else delta - dlse.to(acc)).contiguous()


def with_lse_grad(parts: dict, dlse: torch.Tensor, acc: torch.dtype) -> None:
    """The own bundle ``parts`` (``dout``, ``out``) of a backward with a gradient ``dlse [B, Hq, T]``
    on the returned lse: delta' as ``parts["delta"]`` (what the bundle sends), and a mark that its
    own rows too take delta' (:func:`bundle_stats`)."""
    parts["delta"] = shifted_delta(parts["dout"], parts["out"], dlse, acc)
    parts["lse_grad"] = True


def lse_grad_stats(dout, out, lse, dlse) -> tuple:
    """``(out for the kernels or None, delta')`` of rows with ``dout``, ``out [B, T, H, D_v]``, ``lse``
    and a gradient ``dlse [B, H, T]`` on it: one block's or varlen call's backward arguments."""
    delta = shifted_delta(dout, out, dlse, lse.dtype)
    return kernel_out(dout, delta, lse), delta


def bundle_stats(task: Task, qp: dict, qr: slice, check: bool) -> tuple:
    """``(out, delta)`` of rows ``qr`` of a query bundle, as the block backward takes them: the own
    rows of a call without a gradient on the lse give ``(out, None)`` (the kernels derive delta);
    every other bundle carries delta, with the surrogate out made once per bundle (None: the
    kernels that take delta alone). ``check``: the call returned its lse (:func:`kernel_out`)."""
    if task.q == 0 and not qp.get("lse_grad"):
        return qp["out"][:, qr], None
    if "kernel_out" not in qp:
        qp["kernel_out"] = kernel_out(qp["dout"], qp["delta"], qp["lse"] if check else None)
    out = qp["kernel_out"]
    return (None if out is None else out[:, qr]), qp["delta"][:, :, qr]


__all__ = ["bundle_stats", "kernel_out", "lse_grad_stats", "shifted_delta", "surrogate_out", "with_lse_grad"]
