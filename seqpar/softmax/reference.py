"""Single-device reference attention on global tensors (for tests, benchmarks and users' checks).

Plain torch, any dtype (float64 for ground truth). GQA is handled by grouping query heads, so the
reference shares no code with the kernels it checks.
"""

from __future__ import annotations

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: float | None = None, cu_seqlens=None, window: int | None = None,
                        sinks=None) -> torch.Tensor:
    """Global attention. q, k ``[B, T, Hq|Hkv, D]``, v ``[B, T, Hkv, D_v]`` -> ``[B, T, Hq, D_v]``.

    ``cu_seqlens`` (int, ``[n_docs + 1]``) restricts attention to within each packed document.
    ``window``: query i sees keys j with ``i - window < j <= i`` (causal) or ``|i - j| < window``.
    ``sinks`` ``[Hq]``: one extra logit per head in every row's softmax, with no value (gpt-oss),
    written as an extra key column and dropped after the softmax; differentiable.
    Computes in the input dtype; pass float64 tensors for a ground truth.
    """
    B, T, Hq, _ = q.shape
    s = _scores(q, k, causal, softmax_scale, cu_seqlens, window, sinks)  # [B, Hkv, g, T, T (+1)]
    if sinks is not None:  # the sinks' column dropped after the softmax
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key (none here) would be NaN
    vt = v.permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, T, D_v]
    o = torch.matmul(p, vt)  # [B, Hkv, g, T, D_v]
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, v.shape[3])


def reference_lse(q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, softmax_scale: float | None = None,
                  cu_seqlens=None, window: int | None = None, sinks=None) -> torch.Tensor:
    """The log-sum-exp ``[B, Hq, T]`` of every row's scaled scores over the keys it sees, with
    ``exp(sinks[h])`` in the sum when given: the log of the softmax denominator of
    :func:`reference_attention` (``seqpar.attention(..., return_lse=True)``'s second result, global)."""
    B, T, Hq, _ = q.shape
    return torch.logsumexp(_scores(q, k, causal, softmax_scale, cu_seqlens, window, sinks), dim=-1).reshape(B, Hq, T)


def _scores(q, k, causal, softmax_scale, cu_seqlens, window, sinks) -> torch.Tensor:
    """Scaled scores ``[B, Hkv, g, T, T]``, -inf where masked, the sinks' column appended when given."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    g = Hq // Hkv
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    qg = q.reshape(B, T, Hkv, g, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, g, T, D]
    kt = k.permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, T, D]
    s = torch.matmul(qg, kt.transpose(-1, -2)) * scale  # [B, Hkv, g, T, T]
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed)
    if window is not None:
        pos = torch.arange(T, device=q.device)
        allowed = allowed & ((pos[:, None] - pos[None, :]).abs() < window)
    if cu_seqlens is not None:
        bounds = torch.as_tensor(cu_seqlens, device=q.device).long()
        doc = torch.bucketize(torch.arange(T, device=q.device), bounds[1:], right=True)
        allowed = allowed & (doc[:, None] == doc[None, :])
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # [Hq] -> a column [B, Hkv, g, T, 1] next to the keys
        column = sinks.to(s.dtype).reshape(1, Hkv, g, 1, 1).expand(B, Hkv, g, T, 1)
        s = torch.cat([s, column], dim=-1)
    return s
