"""Host side of the Triton block attention that needs no kernel: the packed-documents descriptor
(:class:`PackedSeqs`) and the validation that says why a call cannot be served (:func:`refusal`),
before any launch. Shapes and masks: :mod:`seqpar.kernels.triton_attention`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import torch

from . import triton_target

# Triton itself reads this variable when it is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MASKS = ("none", "causal", "causal_strict")
ALIGNS = ("top_left", "bottom_right")


def block_d(d: int) -> int:
    """The head-dim tile of a head dim ``d``: the next power of two, at least 16."""
    return max(16, 1 << max(d - 1, 0).bit_length())


# --------------------------------------------------------------------- packing
@dataclasses.dataclass(frozen=True)
class PackedSeqs:
    """Packed documents: device ``cu_seqlens`` for the kernels, host copies for
    checks and grids. Build once per batch (:meth:`build` or
    :meth:`from_lengths`) and pass it to every call; no call syncs the device.

    ``cu_seqlens_q/k``: int32 ``[n_docs + 1]``, non-decreasing from 0 (a
    document may be empty on one side). ``max_seqlen_q/k``: host ints, at
    least the longest document.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_docs(self) -> int:
        return len(self.cu_q) - 1

    @classmethod
    def build(cls, cu_seqlens_q, cu_seqlens_k, *, device=None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None) -> "PackedSeqs":
        """From flash-attn style ``cu_seqlens`` (tensors or int sequences).

        A device tensor is copied to the host once here (one sync).
        ``device``: where the kernels run (default: the tensors' device, else CPU).
        """
        hosts, devs = [], []
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if isinstance(cu, torch.Tensor):
                if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
                    raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got "
                                     f"{cu.dtype} of shape {tuple(cu.shape)}")
                device = cu.device if device is None else device
                host = [int(x) for x in cu.tolist()]
            elif isinstance(cu, Sequence) and all(isinstance(x, int) for x in cu):
                host = [int(x) for x in cu]
            else:
                raise ValueError(f"{name} must be an int tensor or a sequence of ints")
            if len(host) < 2 or host[0] != 0:
                raise ValueError(f"{name}={host} must start at 0 and hold n_docs + 1 >= 2 offsets")
            if any(b < a for a, b in zip(host, host[1:])):
                raise ValueError(f"{name}={host} must be non-decreasing (offsets of consecutive "
                                 "documents)")
            hosts.append(tuple(host))
        if len(hosts[0]) != len(hosts[1]):
            raise ValueError(f"cu_seqlens_q has {len(hosts[0]) - 1} documents and cu_seqlens_k "
                             f"{len(hosts[1]) - 1}: give both sides of every document")
        device = torch.device("cpu") if device is None else torch.device(device)
        for host in hosts:
            devs.append(torch.tensor(host, dtype=torch.int32, device=device))
        maxes = []
        for name, host, given in (("max_seqlen_q", hosts[0], max_seqlen_q),
                                  ("max_seqlen_k", hosts[1], max_seqlen_k)):
            longest = max(b - a for a, b in zip(host, host[1:]))
            if given is not None and given < longest:
                raise ValueError(f"{name}={given} is shorter than the longest document "
                                 f"({longest}): pass the true maximum or None")
            maxes.append(longest if given is None else int(given))
        return cls(devs[0], devs[1], hosts[0], hosts[1], maxes[0], maxes[1])

    @classmethod
    def from_lengths(cls, lens_q: Sequence[int], lens_k: Sequence[int], *, device=None):
        """From per-document lengths (host ints)."""
        cu_q, cu_k = [0], [0]
        for n in lens_q:
            cu_q.append(cu_q[-1] + int(n))
        for n in lens_k:
            cu_k.append(cu_k[-1] + int(n))
        return cls.build(cu_q, cu_k, device=device)


# ------------------------------------------------------------------ validation
def refusal(q, k, v, *, mask: str = "none", scale=None, causal_offset: int = 0,
            align: str = "top_left", window_left: int | None = None,
            packed: PackedSeqs | None = None, backward: bool = False) -> str | None:
    """Why the Triton kernel cannot serve this call (its backward if ``backward``), or ``None``.
    On a GPU that includes "no configuration fits the shared memory of sm_XX"."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    want = "[total, H, D] or [1, total, H, D] (packed)" if packed else "[B, T, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not (t.dim() == 4 or (packed is not None and t.dim() == 3)) or q.dim() != t.dim():
            return f"{name} has shape {tuple(t.shape)}: expected {want}"
        if packed is not None and t.dim() == 4 and t.shape[0] != 1:
            return f"{name} has batch {t.shape[0]}: packed inputs need batch 1 ({want})"
    if k.shape != v.shape:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape"
    if q.shape[0] != k.shape[0] and packed is None:
        return f"q batch {q.shape[0]} != k batch {k.shape[0]}"
    d, hq, hkv = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != d:
        return f"q head dim {d} != k head dim {k.shape[-1]}"
    if hkv == 0 or hq % hkv:
        return f"Hq={hq} must be a positive multiple of Hkv={hkv} (GQA)"
    if not 1 <= d <= MAX_HEAD_DIM:
        return f"head dim {d} unsupported: the Triton kernel serves 1..{MAX_HEAD_DIM}"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} unsupported: use float16, bfloat16 or float32"
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            return f"{name} dtype {t.dtype} != q dtype {q.dtype}"
        if t.device != q.device:
            return f"{name} is on {t.device}, q on {q.device}"
    target = triton_target.device_target(q.device)
    if target is None and not (q.device.type == "cpu" and INTERPRET):
        return f"runs on CUDA (or CPU under TRITON_INTERPRET=1), not on {q.device.type}"
    if mask not in MASKS:
        return f"mask={mask!r}: use one of {MASKS}"
    if align not in ALIGNS:
        return f"align={align!r}: use one of {ALIGNS}"
    if isinstance(causal_offset, bool) or not isinstance(causal_offset, int):
        return f"causal_offset={causal_offset!r} must be an int"
    if window_left is not None and (isinstance(window_left, bool)
                                    or not isinstance(window_left, int) or window_left < 0):
        return f"window_left={window_left!r} must be None or an int >= 0"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        return f"scale={scale!r} must be a finite float (usually D ** -0.5)"
    if packed is not None:
        if not isinstance(packed, PackedSeqs):
            return "packed must be a PackedSeqs (see PackedSeqs.build)"
        for side, t, cu in (("q", q, packed.cu_q), ("k", k, packed.cu_k)):
            if cu[-1] != t.shape[-3]:
                return (f"cu_seqlens_{side} ends at {cu[-1]} but {side} holds {t.shape[-3]} "
                        "tokens: the last offset must equal the total length")
        if packed.cu_seqlens_q.device != q.device:
            return f"packed was built for {packed.cu_seqlens_q.device}, q is on {q.device}"
    return triton_target.no_fit_reason(("dq", "dkdv") if backward else ("fwd",), q.element_size(),
                                       block_d(d), target)
