"""ring-flash-attention's packed (varlen) functions with every document split over the ranks.

A packed batch is one stream of documents, ``cu_seqlens`` its global offsets (flash-attn
convention). Each document of length L is split over the N ranks in the function's layout, and
rank r's local stream is its pieces of every document, in document order:

- ``ring_flash_attn_varlen_*``: piece r of N contiguous pieces of each document (L divisible by N);
- ``zigzag_ring_flash_attn_varlen_*``: chunks r and 2N-1-r of 2N chunks of each document
  (L divisible by 2N).

So every rank passes the same LOCAL offsets ``cu_seqlens = global_cu_seqlens // N``. These are
seqpar's per-document packed layouts (:mod:`seqpar.layouts.packed`) for ``"ring"`` and
``"zigzag_ring"`` when no document needs padding, which is what the original requires; seqpar
itself pads any length (``seqpar.attention(..., cu_seqlens=global_cu_seqlens)``).

Shapes: q ``[T_local, Hq, D]``, k, v ``[T_local, Hkv, D]``; ``kvpacked``: kv ``[T_local, 2, Hkv, D]``;
``qkvpacked``: qkv ``[T_local, 3, H, D]``. Returns out ``[T_local, Hq, D]``, or with
``return_attn_probs=True`` ``(out, lse, None)``, lse ``[Hq, T_local]`` fp32 (flash-attn >= 2.6's
varlen layout). ``max_seqlen`` is accepted and not needed (seqpar derives the geometry from
``cu_seqlens`` once per batch).
"""

from __future__ import annotations

import functools

import torch

from seqpar.comm import group_info
from seqpar.layouts import PackedLayout, check_cu_seqlens, layout_of

from ._core import attend, check_options, checked, eager_only, option_fields, result

#: per layout: how many equal chunks of every document one rank's piece is made of
_CHUNKS = {"ring": 1, "zigzag_ring": 2}


@functools.lru_cache(maxsize=16)
def _layout(global_cu: tuple[int, ...], method: str, n: int) -> PackedLayout:
    """The packed layout of one batch, kept for the next layers' calls (its schedules are cached on it)."""
    return PackedLayout.from_cu_seqlens(global_cu, n, layout_of(method))


def packed_layout_of(cu_seqlens, t_local: int, method: str, group) -> PackedLayout:
    """seqpar's packed layout for the peer's LOCAL offsets (ValueError before any communication)."""
    local = check_cu_seqlens(cu_seqlens, t_local)
    chunks = _CHUNKS[method]
    odd = [b - a for a, b in zip(local, local[1:]) if (b - a) % chunks]
    if odd:
        raise ValueError(f"cu_seqlens: {method} splits every document into 2 chunks per rank, but local document "
                         f"length(s) {odd[:5]} are odd: every global document length must be a multiple of 2N "
                         "(pad documents, or call seqpar.attention with the global cu_seqlens, which pads for you)")
    n = group_info(group).size
    return _layout(tuple(x * n for x in local), method, n)


@eager_only
def _run(method, inputs, unpack, cu_seqlens, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
         deterministic, return_attn_probs, group):
    def local():
        q, k, v = unpack(*inputs)
        window = check_options(dropout_p=dropout_p, alibi_slopes=alibi_slopes, window_size=window_size,
                               deterministic=deterministic, return_attn_probs=return_attn_probs, causal=causal,
                               softmax_scale=softmax_scale)
        check_streams(q, k, v)
        return q, k, v, window, packed_layout_of(cu_seqlens, q.shape[0], method, group)

    fields = option_fields(inputs[0], causal=causal, window_size=window_size, dropout_p=dropout_p,
                           softmax_scale=softmax_scale, return_attn_probs=return_attn_probs)
    q, k, v, window, layout = checked(group, f"ring_flash_attn varlen ({method})", fields, local, like=inputs[0])
    out, lse = attend(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), method=method, causal=causal,
                      softmax_scale=softmax_scale, window=window, group=group, cu_seqlens=layout,
                      return_lse=return_attn_probs)
    return result(out.squeeze(0), None if lse is None else lse.squeeze(0), return_attn_probs)


def check_streams(q, k, v) -> None:
    """The varlen functions take packed streams ``[T_local, H, D]`` (ValueError otherwise)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}: the varlen functions take "
                             "[T_local, H, D]")


def split(packed, parts: int, argument: str):
    """``[T_local, parts, H, D]`` -> ``parts`` views ``[T_local, H, D]`` (ValueError for another shape)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 4 or packed.shape[1] != parts:
        raise ValueError(f"{argument} has shape {tuple(getattr(packed, 'shape', ()))}: expected "
                         f"[T_local, {parts}, H, D]")
    return tuple(packed[:, i] for i in range(parts))


def _family(method: str, doc: str):
    """The three varlen entry points of one layout, with the peer's signatures."""

    def varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False,
                    group=None):
        return _run(method, (q, k, v), lambda *x: x, cu_seqlens, dropout_p, softmax_scale, causal, window_size,
                    alibi_slopes, deterministic, return_attn_probs, group)

    def varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                             return_attn_probs=False, group=None):
        return _run(method, (q, kv), lambda q, kv: (q, *split(kv, 2, "kv")), cu_seqlens, dropout_p, softmax_scale,
                    causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)

    def varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                              return_attn_probs=False, group=None):
        return _run(method, (qkv,), lambda qkv: split(qkv, 3, "qkv"), cu_seqlens, dropout_p, softmax_scale, causal,
                    window_size, alibi_slopes, deterministic, return_attn_probs, group)

    for f in (varlen_func, varlen_kvpacked_func, varlen_qkvpacked_func):
        f.__doc__ = f"{doc} See :mod:`seqpar.compat.ring_flash_attn.varlen` for layouts and shapes."
    return varlen_func, varlen_kvpacked_func, varlen_qkvpacked_func


ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func, ring_flash_attn_varlen_qkvpacked_func = _family(
    "ring", "Packed documents, each cut into N contiguous pieces (local cu_seqlens = global // N).")
(zigzag_ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_kvpacked_func,
 zigzag_ring_flash_attn_varlen_qkvpacked_func) = _family(
    "zigzag_ring", "Packed documents, each in 2N chunks, rank r holding chunks r and 2N-1-r (local cu_seqlens = "
    "global // N).")

for _name in ("ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
              "ring_flash_attn_varlen_qkvpacked_func", "zigzag_ring_flash_attn_varlen_func",
              "zigzag_ring_flash_attn_varlen_kvpacked_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func"):
    globals()[_name].__name__ = globals()[_name].__qualname__ = _name
del _name

__all__ = ["ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
           "ring_flash_attn_varlen_qkvpacked_func", "zigzag_ring_flash_attn_varlen_func",
           "zigzag_ring_flash_attn_varlen_kvpacked_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func"]
