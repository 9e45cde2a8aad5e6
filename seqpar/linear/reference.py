"""Float64 (or any dtype) token-by-token reference with the public semantics of
:func:`seqpar.linear.linear_attention` on the whole (unsharded) sequence.

``q, k``: ``[B, T_global, H, K]``, ``v``: ``[B, T_global, H, V]``, ``g`` as in the API; ``cu_seqlens``:
global, ``B = 1``; ``initial_state`` ``[B, H, K, V]`` (``[1, H, K, V]`` packed: the first document's).
Returns ``(o [B, T_global, H, V], final state [B, H, K, V])``, differentiable with autograd.
"""

from __future__ import annotations

import torch

from ..kernels.linear_chunk import naive_recurrent_gla


def reference_linear_attention(q, k, v, g=None, *, scale=None, initial_state=None, cu_seqlens=None):
    h0 = initial_state
    if cu_seqlens is not None and h0 is not None:
        n_docs = len(cu_seqlens) - 1
        h0 = torch.cat([h0, h0.new_zeros(n_docs - 1, *h0.shape[1:])])
    o, ht = naive_recurrent_gla(q, k, v, g, scale, h0, cu_seqlens)
    return o, (ht[-1:] if cu_seqlens is not None else ht)
