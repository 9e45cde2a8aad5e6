"""What every function of :mod:`seqpar.compat.ring_flash_attn` shares: the peer's options mapped to
seqpar's (or refused), the call itself, and the log-sum-exp of ``return_attn_probs``.

The output always comes from :func:`seqpar.attention` (its checks, rank agreement, tracing and
checkpointing apply). The peer's own arguments are checked first, on every rank, by :func:`checked`:
a mistake made on one rank only raises on every rank instead of leaving the others waiting.

``return_attn_probs=True`` also needs the merged log-sum-exp: the same single call of
``seqpar.attention`` returns it (``return_lse=True``), so asking for it costs no second forward.
"""

from __future__ import annotations

import math

import torch

from seqpar.comm import group_info
from seqpar.comm.agreement import agreed, check_ranks_enabled
from seqpar.softmax import attention


def check_options(*, dropout_p, alibi_slopes, window_size, deterministic, return_attn_probs, causal,
                  softmax_scale) -> int | None:
    """The peer's options checked (ValueError naming the argument, before any communication) and its
    ``window_size`` as seqpar's ``window`` (None: no window)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r}: seqpar's attention is exact and implements no attention "
                         "dropout; pass dropout_p=0.0 (set the model's attention_dropout to 0)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: seqpar does not implement ALiBi biases; pass alibi_slopes=None "
                         "(models with ALiBi cannot use this drop-in)")
    for name, value in (("causal", causal), ("return_attn_probs", return_attn_probs)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected True or False, got {value!r}")
    if deterministic is not None and not isinstance(deterministic, bool):  # transformers passes None
        raise ValueError(f"deterministic: expected True, False or None, got {deterministic!r}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not softmax_scale > 0 or not math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale: expected a positive finite number or None, got {softmax_scale!r}")
    return window_of(window_size, causal)


def window_of(window_size, causal: bool) -> int | None:
    """flash-attn's ``window_size=(left, right)`` (-1: unbounded) as seqpar's ``window`` W.

    Causal: query i sees keys ``i - left .. i``, so ``W = left + 1`` (``right`` is capped by the
    causal mask, as in flash-attn). Non-causal: seqpar's window is symmetric, ``left == right`` gives
    ``W = left + 1``; unequal sides are refused."""
    try:
        left, right = (int(x) for x in window_size)
        if (left, right) != tuple(window_size):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"window_size={window_size!r}: expected a pair of ints (left, right), -1 for no "
                         "limit, e.g. (-1, -1)") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size={window_size!r}: each side is -1 (no limit) or a number of tokens >= 0")
    if causal:
        return None if left == -1 else left + 1
    if left != right:
        raise ValueError(f"window_size={window_size!r}: with causal=False seqpar's sliding window is symmetric; "
                         "pass equal sides (w, w), or (-1, -1) for none")
    return None if left == -1 else left + 1


def eager_only(fn):
    """``fn`` run eagerly under ``torch.compile`` (a graph break around each call): the drop-in's rank
    checks and llama3's offset all-gathers cannot be traced; ``fullgraph=True`` refuses it, saying why."""
    return torch.compiler.disable(fn, reason="the ring-flash-attention drop-in runs eagerly (its rank checks cannot "
                                             "be traced); under fullgraph=True call seqpar.attention (one op)")


def checked(group, entry: str, fields: dict, local_checks, *, like=None):
    """``local_checks()`` (no communication) with seqpar's rank agreement around it
    (:func:`seqpar.comm.agreement.agreed`, ceil(log2 N) small messages; off with
    ``SEQPAR_CHECK_RANKS=0``): an error on any rank raises on every rank, and ``fields`` (the
    options every rank must pass alike) are compared. ``like``: an input tensor (its CUDA device
    carries the messages on NCCL groups). Returns what ``local_checks`` returned."""
    if not check_ranks_enabled(None):
        return local_checks()
    device = like.device if isinstance(like, torch.Tensor) and like.is_cuda else None
    return agreed([group_info(group)], entry, fields, local_checks, device=device)


def option_fields(x, **options) -> dict:
    """What every rank passes alike: the local input's dtype and number of dims, and the options."""
    fields = {"input": f"{x.dim()}-D {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__}
    fields.update({name: repr(value) for name, value in options.items()})
    return fields


def attend(q, k, v, *, method: str, causal: bool, softmax_scale, window, group, cu_seqlens=None,
           return_lse: bool = False):
    """``seqpar.attention`` on ``[B, T_local, H, D]`` inputs, once; with ``return_lse`` also the merged
    lse ``[B, Hq, T_local]`` of the same call (fp32 as the peer returns it), else None.

    The lse is differentiable, as seqpar.attention's is (:mod:`seqpar.softmax.lse`), where the peer's
    backward drops the lse's gradient silently. Kept so: code written for the peer does not put the
    lse in its loss, and an lse without a gradient (None, or zeros from a compiled graph around
    the call) runs the backward without one, bit for bit and with the same bytes; code that does
    differentiate it (merging with another attention) gets the exact gradient, not a silently wrong one."""
    result = attention(q, k, v, group=group, method=method, causal=causal, softmax_scale=softmax_scale,
                       cu_seqlens=cu_seqlens, window=window, return_lse=return_lse)
    if not return_lse:
        return result, None
    out, lse = result
    return out, lse.float()


def result(out, lse, return_attn_probs: bool):
    """The peer's return value: ``out``, or ``(out, lse, None)`` (no attention probabilities)."""
    return (out, lse, None) if return_attn_probs else out
