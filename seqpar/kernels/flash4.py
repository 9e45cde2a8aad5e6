"""FlashAttention-4 backend (optional extra ``seqpar[flash4]``: ``flash-attn-4==4.0.0b36``, the
``flash_attn.cute`` package written in the CuTe DSL), imported lazily.

Calls ``flash_attn.cute.interface._flash_attn_fwd(q, k, v, ..., return_lse=True) -> (out, lse,
...)`` and ``_flash_attn_bwd(q, k, v, out, dout, lse, ...) -> (dq, dk, dv)``: the backward takes an
EXTERNAL ``out`` / ``lse`` (a ring's merged ones), which the public autograd functions cannot. Both
are private, so the ``flash4`` extra pins one exact release and this module refuses any other by
version number (no probing of signatures); ``tests/test_gpu_static_flash4.py`` binds every call
seqpar makes to that release's real source, without a GPU.

Layout ``[B, T, H, D]`` (packed: ``[R, H, D]`` with ``cu_seqlens_q/k``); lse fp32 ``[B, Hq, Tq]``
(``[Hq, R]`` packed). GQA native (dK, dV with Hkv heads). GPUs: sm_90 (Hopper) and sm_100 / sm_110
(Blackwell); its sm_80 / sm_120 paths are left out (no sm_80 backward, sm_120 runs the sm_80 MMA).
Head dims (``_validate_head_dims``): sm_90 any multiple of 8 in 8..256, Blackwell 8..128 or 256;
the Hopper backward is only tested upstream for D <= 128, so a larger D is refused for the backward;
the Blackwell backward at D = 256 runs no local mode, so its window and non-square causal blocks
go to the next backend (found by compiling every call for sm_100a: ``tests/gpu_static/flash4_aot.py``).

Masks are aligned bottom-right (``mask.py``: offset ``seqlen_k - seqlen_q``) with unclamped
``window_size_left/right`` (``None``: unbounded), so every reduced block is one call: a band by its
translated bounds, a top-left causal block of any shape as the right bound ``Tq - Tk``. Sinks are not used here: seqpar adds a sink to each row's merged lse once
(:mod:`seqpar.softmax.sinks`), where a per-block in-kernel sink would count it once per block.

The first call of each configuration compiles its kernels (seconds; ``benchmarks/gpu_backends.py``
reports that time apart). Priority 42, above ``flash_attn`` (40): installing the extra asks for it;
the committed GPU timings (:mod:`.dispatch_table`) reorder what they have measured.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

import torch

from .base import HALF_DTYPES, Backend, Capabilities, launch_failure
from .flash import window_size
from .masks import Band

VERSION = "4.0.0b36"  # exactly the `flash4` extra's pin
DISTRIBUTION = "flash-attn-4"


@functools.lru_cache(maxsize=1)
def installed_version() -> str | None:
    """The installed ``flash-attn-4`` distribution's version, ``None`` if absent. Read once per
    process (a fact of the environment, like Python's import cache): a package-metadata lookup costs
    0.2-0.6 ms, and dispatch asks for every block; ``installed_version.cache_clear()`` re-reads it."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _load():
    """-> (module ``flash_attn.cute.interface``, None) or (None, reason)."""
    version = installed_version()
    if version is None:
        return None, f"{DISTRIBUTION} is not installed (pip install 'seqpar[flash4]')"
    if version != VERSION:
        return None, f"{DISTRIBUTION} {version} is not supported: seqpar needs exactly {VERSION} (the flash4 extra)"
    try:
        from flash_attn.cute import interface
    except Exception as exc:  # ImportError, or a CuTe DSL without its CUDA libraries
        return None, f"flash_attn.cute not importable ({type(exc).__name__}: {exc})"
    return interface, None


def _raised_in_flash4(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is in the ``flash_attn.cute`` package."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        where, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return os.path.join("flash_attn", "cute", "") in where


def head_dim_refusal(d: int, capability: tuple[int, int], for_backward: bool) -> str | None:
    """Why FlashAttention-4 does not run head dim ``d`` on ``capability``, or ``None``."""
    if d % 8 or not 8 <= d <= 256:
        return f"head dim {d}: FlashAttention-4 needs a multiple of 8 in 8..256"
    if capability[0] >= 10 and not (d <= 128 or d == 256):
        return f"head dim {d} on sm_{capability[0]}{capability[1]}: FlashAttention-4 runs 8..128 or 256 there"
    if for_backward and capability[0] == 9 and d > 128:
        return f"head dim {d}: FlashAttention-4's Hopper backward is tested for D <= 128 only"
    return None


def local_refusal(d: int, capability: tuple[int, int], for_backward: bool, local: bool) -> str | None:
    """Why FlashAttention-4 cannot run a block in its local mode (a window band, or top-left causal on
    a non-square block, both one call with a right bound): its Blackwell backward at D = 256 is a
    dedicated kernel that asserts no local attention (``sm100_hd256_2cta_fmha_backward.py``)."""
    if local and for_backward and capability[0] >= 10 and d == 256:
        return ("head dim 256 on Blackwell: FlashAttention-4's backward there runs no local window "
                "(window bands, non-square causal blocks)")
    return None


def _mask_args(tq: int, tk: int, causal: bool, window: Band | None) -> dict:
    """FlashAttention-4's ``causal`` / ``window_size_left`` / ``window_size_right`` (``None``:
    unbounded, bottom-right aligned) for a reduced top-left block: a band ``(lo, hi)`` as in
    :func:`seqpar.kernels.flash.window_size`, top-left causal as the band ``(None, 0)``, i.e. the
    right bound ``Tq - Tk`` (``is_causal`` itself on a square block)."""
    if window is None and causal:
        window = Band(None, 0)
    left, right = window_size(tq, tk, window)
    left, right = (None if left < 0 else left), (None if right < 0 else right)
    return {"causal": left is None and right == 0, "window_size_left": left,
            "window_size_right": None if left is None and right == 0 else right}


class Flash4Backend(Backend):
    """FlashAttention-4 (CuTe DSL) on Hopper and Blackwell, fp16/bf16."""

    name = "flash4"
    caps = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=HALF_DTYPES,
        head_dim_multiple=8,
        max_head_dim=256,
        needs_out=True,  # the backward's preprocess computes delta from `out`
        priority=42,
        window=True,  # bottom-right bounds, unclamped: any reduced band, and top-left causal as one
        varlen=True,  # cu_seqlens_q/k of the same two functions
    )

    def unavailable(self, device: torch.device) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        mod, why = _load()
        if mod is None:
            return why
        cap = torch.cuda.get_device_capability(device)
        if cap[0] not in (9, 10, 11):
            return f"FlashAttention-4 is used on sm_90 and sm_100/110 only, got sm_{cap[0]}{cap[1]}"
        return None

    def extra_refusal(self, q, k, v, plan, for_backward: bool) -> str | None:
        cap, d = torch.cuda.get_device_capability(q.device), q.shape[-1]
        local = plan.window is not None or (plan.causal and not plan.empty and not plan.square)
        return head_dim_refusal(d, cap, for_backward) or local_refusal(d, cap, for_backward, local)

    def varlen_refusal(self, q, calls, for_backward: bool) -> str | None:
        local = any(not c.causal and any(w >= 0 for w in c.window) for c in calls)
        return local_refusal(q.shape[-1], torch.cuda.get_device_capability(q.device), for_backward, local)

    def launch_failure(self, exc: BaseException) -> str | None:
        """Also the CuTe DSL's compile errors (exceptions of the ``cutlass`` package) and an
        ``AssertionError`` raised inside ``flash_attn.cute``: how FlashAttention-4 says a
        configuration is not implemented (an automatic choice then demotes to the next backend)."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if any(c.__module__.startswith("cutlass") for c in type(exc).__mro__):
            return f"{type(exc).__name__}: {first}"[:300]
        if isinstance(exc, AssertionError) and _raised_in_flash4(exc):
            return f"AssertionError in FlashAttention-4: {first}"[:300]
        return launch_failure(exc)

    def forward(self, q, k, v, *, scale: float, causal: bool, window: Band | None = None):
        fa, _ = _load()
        with torch.no_grad():
            out, lse = fa._flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True,
                                          **_mask_args(q.shape[1], k.shape[1], causal, window))[:2]
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, *, scale: float, causal: bool, delta, window: Band | None = None):
        fa, _ = _load()
        dt = q.dtype
        dq, dk, dv = fa._flash_attn_bwd(q, k, v, out.to(dt), dout.to(dt), lse.float().contiguous(),
                                        softmax_scale=scale, **_mask_args(q.shape[1], k.shape[1], causal, window))[:3]
        return dq, dk, dv

    def varlen_forward(self, q, k, v, call, cu_q, cu_k, *, scale: float, acc=None):
        fa, _ = _load()
        left, right = (None if w < 0 else w for w in call.window)
        with torch.no_grad():
            out, lse = fa._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=call.max_q,
                                          max_seqlen_k=call.max_k, softmax_scale=float(scale), causal=call.causal,
                                          window_size_left=left, window_size_right=right, return_lse=True)[:2]
        return out, lse.float()

    def varlen_backward(self, dout, q, k, v, out, lse, delta, call, cu_q, cu_k, *, scale: float):
        fa, _ = _load()
        dt = q.dtype
        left, right = (None if w < 0 else w for w in call.window)
        return fa._flash_attn_bwd(q, k, v, out.to(dt), dout.to(dt), lse.float().contiguous(),
                                  softmax_scale=float(scale), causal=call.causal, window_size_left=left,
                                  window_size_right=right, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                  max_seqlen_q=call.max_q, max_seqlen_k=call.max_k)[:3]
