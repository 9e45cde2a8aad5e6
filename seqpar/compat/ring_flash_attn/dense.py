"""ring-flash-attention's dense functions: ``[B, T_local, H, D]`` shards of one sequence per rank.

Token layouts (N = ranks of ``group``, the global sequence of T tokens):

- ``ring_flash_attn_*``: contiguous chunks, rank r holds tokens ``[r·T/N, (r+1)·T/N)``
  (seqpar's ``"ring"``);
- ``zigzag_ring_flash_attn_*``: the sequence in 2N chunks, rank r holds chunks r and 2N-1-r,
  concatenated (seqpar's ``"zigzag_ring"``; T divisible by 2N);
- ``stripe_flash_attn_*``: token i on rank i mod N, local row a is global token a·N + r
  (seqpar's ``"striped_ring"``).

``seqpar.shard(x, method=...)`` with those method names produces exactly these shards. Shapes:
q ``[B, T_local, Hq, D]``, k, v ``[B, T_local, Hkv, D]`` (``Hq % Hkv == 0``, GQA: K,V are never
expanded); ``kvpacked``: kv ``[B, T_local, 2, Hkv, D]``; ``qkvpacked``: qkv ``[B, T_local, 3, H, D]``.
Returns out ``[B, T_local, Hq, D]`` in q's dtype, or with ``return_attn_probs=True``
``(out, lse, None)``, lse ``[B, Hq, T_local]`` fp32 (natural log, not differentiable).

Differences from the original, all documented at :mod:`seqpar.compat.ring_flash_attn`: the zigzag
and stripe functions also take ``causal=False``; ``window_size`` is exact in every layout;
``dropout_p > 0`` and ``alibi_slopes`` raise ``ValueError``; ``deterministic`` is accepted (seqpar's
results do not depend on it).
"""

from __future__ import annotations

import torch

from ._core import attend, check_options, checked, eager_only, option_fields, result


@eager_only
def _run(method, inputs, unpack, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
         return_attn_probs, group):
    def local():
        q, k, v = unpack(*inputs)
        window = check_options(dropout_p=dropout_p, alibi_slopes=alibi_slopes, window_size=window_size,
                               deterministic=deterministic, return_attn_probs=return_attn_probs, causal=causal,
                               softmax_scale=softmax_scale)
        return q, k, v, window

    fields = option_fields(inputs[0], causal=causal, window_size=window_size, dropout_p=dropout_p,
                           softmax_scale=softmax_scale, return_attn_probs=return_attn_probs)
    q, k, v, window = checked(group, f"ring_flash_attn ({method})", fields, local, like=inputs[0])
    out, lse = attend(q, k, v, method=method, causal=causal, softmax_scale=softmax_scale, window=window,
                      group=group, return_lse=return_attn_probs)
    return result(out, lse, return_attn_probs)


def _split(packed, parts: int, argument: str):
    """``[B, T, parts, H, D]`` -> ``parts`` views ``[B, T, H, D]`` (ValueError for another shape)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 5 or packed.shape[2] != parts:
        raise ValueError(f"{argument} has shape {tuple(getattr(packed, 'shape', ()))}: expected "
                         f"[B, T_local, {parts}, H, D]")
    return tuple(packed[:, :, i] for i in range(parts))


def _family(method: str, doc: str):
    """The three entry points of one layout (plain, kvpacked, qkvpacked), with the peer's signatures."""

    def func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
             deterministic=False, return_attn_probs=False, group=None):
        return _run(method, (q, k, v), lambda *x: x, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                    deterministic, return_attn_probs, group)

    def kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                      alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
        return _run(method, (q, kv), lambda q, kv: (q, *_split(kv, 2, "kv")), dropout_p, softmax_scale, causal,
                    window_size, alibi_slopes, deterministic, return_attn_probs, group)

    def qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                       alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
        return _run(method, (qkv,), lambda qkv: _split(qkv, 3, "qkv"), dropout_p, softmax_scale, causal,
                    window_size, alibi_slopes, deterministic, return_attn_probs, group)

    for f, form in ((func, "q, k, v"), (kvpacked_func, "q and kv = stack([k, v], dim=2)"),
                    (qkvpacked_func, "qkv = stack([q, k, v], dim=2)")):
        f.__doc__ = f"{doc} Inputs: {form}. See :mod:`seqpar.compat.ring_flash_attn.dense` for shapes."
    return func, kvpacked_func, qkvpacked_func


ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func = _family(
    "ring", "Attention over contiguous shards (rank r holds tokens [r·T/N, (r+1)·T/N)), seqpar method 'ring'.")
zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func = _family(
    "zigzag_ring",
    "Attention over zigzag shards (rank r holds chunks r and 2N-1-r of 2N), seqpar method 'zigzag_ring'.")
stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func = _family(
    "striped_ring", "Attention over striped shards (token i on rank i mod N), seqpar method 'striped_ring'.")

for _name in ("ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
              "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
              "zigzag_ring_flash_attn_qkvpacked_func", "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func",
              "stripe_flash_attn_qkvpacked_func"):
    globals()[_name].__name__ = globals()[_name].__qualname__ = _name
del _name

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
           "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
           "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func"]
