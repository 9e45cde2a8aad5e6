"""ring-flash-attention's ``llama3_*`` functions: the packed stream cut into N contiguous pieces.

Rank r holds tokens ``[r·T_local, (r+1)·T_local)`` of the packed stream (``T_local = T_total / N``),
so documents cross rank boundaries (seqpar's stream layout, :mod:`seqpar.layouts.stream`).
:func:`llama3_flash_attn_prepare_cu_seqlens` turns the global offsets into this rank's arguments,
as the original does: ``cu_seqlens_q`` (the local pieces of documents), ``cu_seqlens_k`` (the same
documents from their starts: a document that began on an earlier rank reaches back), their maximum
lengths and ``local_k_slice`` (the global K,V rows this rank's queries need).

The original all-gathers every rank's K,V (``heads_k_stride`` heads at a time) and keeps
``local_k_slice``. seqpar fetches only the rows each rank needs, directly from their owners
(:mod:`seqpar.softmax.stream`); ``heads_k_stride`` is checked (it must divide Hkv) and otherwise
not needed. Because the other ranks' documents are not among a rank's arguments, each call first
all-gathers every rank's document boundaries (a few integers per document); the HF adapter
(:mod:`.adapters.hf_adapter`) gets the global offsets once per batch and skips that.

Shapes: q ``[T_local, Hq, D]``, k, v ``[T_local, Hkv, D]``; out ``[T_local, Hq, D]``; with
``return_attn_probs=True`` ``(out, lse, None)``, lse ``[Hq, T_local]`` fp32.
"""

from __future__ import annotations

import functools

import torch

from seqpar.comm import all_gather_stack, group_info
from seqpar.comm.agreement import agreed
from seqpar.comm.groups import collective_device
from seqpar.layouts import StreamLayout, check_cu_seqlens

from ._core import attend, check_options, eager_only, option_fields, result
from .varlen import check_streams, split


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int):
    """This rank's arguments of :func:`llama3_flash_attn_varlen_func` from the global ``cu_seqlens``.

    Returns ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``: offsets as
    tensors of ``cu_seqlens``' dtype and device, lengths as ints, ``local_k_slice`` a slice of global
    token rows (causal: from the start of this rank's first document to the end of its piece; not
    causal: to the end of its last document). ValueError when ``T_total % world_size``.
    """
    cu = check_cu_seqlens(cu_seqlens, None)
    layout = cached_stream_layout(cu, world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: expected an int in [0, {world_size})")
    t, pieces = layout.t_local, layout.pieces[rank]
    first, last = pieces[0][0], pieces[-1][0]
    k_start = cu[first]
    k_stop = (rank + 1) * t if causal else cu[last + 1]
    q_offsets = [a - rank * t for _, a, _ in pieces] + [t]
    k_offsets = [0] + [a - k_start for _, a, _ in pieces[1:]] + [k_stop - k_start]
    as_tensor = functools.partial(torch.tensor, dtype=cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor)
                                  else torch.int32, device=getattr(cu_seqlens, "device", None))
    max_q = max(b - a for a, b in zip(q_offsets, q_offsets[1:]))
    max_k = max(b - a for a, b in zip(k_offsets, k_offsets[1:]))
    return as_tensor(q_offsets), as_tensor(k_offsets), max_q, max_k, slice(k_start, k_stop)


@functools.lru_cache(maxsize=16)
def cached_stream_layout(global_cu: tuple[int, ...], n: int) -> StreamLayout:
    """The stream layout of one batch, kept for the next layers' calls (its schedules are cached on it)."""
    return StreamLayout(n, global_cu)


def _local_boundaries(cu_q, cu_k, local_k_slice, causal: bool, rank: int, t_local: int) -> list[int]:
    """Check one rank's arguments against each other (no communication) and return the global
    document boundaries they show: the start of its first document and every boundary inside its piece."""
    q = check_cu_seqlens(cu_q, t_local, argument="cu_seqlens_q")
    k = check_cu_seqlens(cu_k, None, argument="cu_seqlens_k")
    if not isinstance(local_k_slice, slice) or not all(isinstance(x, int) for x in (local_k_slice.start,
                                                                                    local_k_slice.stop)):
        raise ValueError(f"local_k_slice={local_k_slice!r}: pass the slice returned by "
                         "llama3_flash_attn_prepare_cu_seqlens")
    lo = rank * t_local
    start, stop = local_k_slice.start, local_k_slice.stop
    inner = [lo + x for x in q[1:-1]]
    expect_k = (0, *(x - start for x in inner), stop - start)
    stop_ok = stop == lo + t_local if causal else stop >= lo + t_local
    if not (0 <= start <= lo) or not stop_ok or k != expect_k:
        raise ValueError("cu_seqlens_q, cu_seqlens_k, local_k_slice: these do not describe rank "
                         f"{rank}'s piece [{lo}, {lo + t_local}) of one packed stream with causal={causal}; build "
                         "them with llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size) "
                         "with the same causal")
    return [start] + inner


def _local_checks(inputs, unpack, cu_q, cu_k, local_k_slice, heads_k_stride, options: dict, rank: int):
    """Every argument of one rank, checked locally: ``(q, k, v, window, boundaries)``."""
    q, k, v = unpack(*inputs)
    window = check_options(**options)
    check_streams(q, k, v)
    hkv = k.shape[1]
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int) or heads_k_stride < 1 \
            or hkv % heads_k_stride:
        raise ValueError(f"heads_k_stride={heads_k_stride!r}: expected a positive int dividing the {hkv} K,V heads")
    return q, k, v, window, _local_boundaries(cu_q, cu_k, local_k_slice, options["causal"], rank, q.shape[0])


def _global_layout(info, mine: list[int], t_local: int) -> StreamLayout:
    """The global offsets rebuilt from every rank's boundaries (two small all-gathers)."""
    device = collective_device(info.group) if not info.single else torch.device("cpu")
    counts = all_gather_stack(info, torch.tensor([len(mine)], device=device), name="llama3_offsets")
    row = torch.full((int(counts.max()),), -1, dtype=torch.int64, device=device)
    row[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
    every = all_gather_stack(info, row, name="llama3_offsets").flatten().tolist()
    return cached_stream_layout(tuple(sorted({x for x in every if x >= 0} | {0, info.size * t_local})), info.size)


@eager_only
def _run(inputs, unpack, cu_seqlens_q, cu_seqlens_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
         window_size, alibi_slopes, deterministic, return_attn_probs, group):
    options = dict(dropout_p=dropout_p, alibi_slopes=alibi_slopes, window_size=window_size, deterministic=deterministic,
                   return_attn_probs=return_attn_probs, causal=causal, softmax_scale=softmax_scale)
    info = group_info(group)
    fields = option_fields(inputs[0], causal=causal, window_size=window_size, dropout_p=dropout_p,
                           softmax_scale=softmax_scale, return_attn_probs=return_attn_probs,
                           T_local=getattr(inputs[0], "shape", (None,))[0])
    # always agreed (even with SEQPAR_CHECK_RANKS=0): the all-gathers below must not start on some ranks only
    q, k, v, window, mine = agreed([info], "ring_flash_attn.llama3_flash_attn_varlen_func", fields,
                                   lambda: _local_checks(inputs, unpack, cu_seqlens_q, cu_seqlens_k, local_k_slice,
                                                         heads_k_stride, options, info.rank),
                                   device=inputs[0].device if getattr(inputs[0], "is_cuda", False) else None)
    layout = _global_layout(info, mine, q.shape[0])
    return stream_attention(q, k, v, layout, softmax_scale=softmax_scale, causal=causal, window=window, group=group,
                            return_attn_probs=return_attn_probs)


def stream_attention(q, k, v, layout: StreamLayout, *, softmax_scale, causal, window, group, return_attn_probs):
    """``[T_local, H, D]`` pieces of the packed stream through ``seqpar.attention`` (method ``"ring"``)."""
    out, lse = attend(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), method="ring", causal=causal,
                      softmax_scale=softmax_scale, window=window, group=group, cu_seqlens=layout,
                      return_lse=return_attn_probs)
    return result(out.squeeze(0), None if lse is None else lse.squeeze(0), return_attn_probs)


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None):
    """Attention over this rank's contiguous piece of a packed stream (see the module docstring)."""
    return _run((q, k, v), lambda *x: x, cu_seqlens_q, cu_seqlens_k, heads_k_stride, local_k_slice, dropout_p,
                softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False, group=None):
    """As :func:`llama3_flash_attn_varlen_func` with kv ``[T_local, 2, Hkv, D]``."""
    return _run((q, kv), lambda q, kv: (q, *split(kv, 2, "kv")), cu_seqlens_q, cu_seqlens_k, heads_k_stride,
                local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                return_attn_probs, group)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None):
    """As :func:`llama3_flash_attn_varlen_func` with qkv ``[T_local, 3, H, D]``."""
    return _run((qkv,), lambda qkv: split(qkv, 3, "qkv"), cu_seqlens_q, cu_seqlens_k, heads_k_stride, local_k_slice,
                dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)


__all__ = ["llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func",
           "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_varlen_qkvpacked_func"]
