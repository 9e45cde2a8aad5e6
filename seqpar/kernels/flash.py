"""flash-attn 2 backend (optional extra ``seqpar[flash]``), imported lazily.

Forward uses the public ``flash_attn_func(..., return_attn_probs=True)``,
which gives ``(out, lse, _)`` with lse ``[B, Hq, Tq]`` fp32. The backward must
be fed the *merged* out/lse of the row, which the public autograd path cannot
do, so it calls ``flash_attn.flash_attn_interface._flash_attn_backward``; we
rely on its flash-attn 2.7 / 2.8 form (separate ``window_size_left/right``,
``softcap``, caller-allocated ``dq/dk/dv``) and refuse other versions by
version number rather than probing signatures: the ``flash`` extra admits
exactly ``>=2.7,<3`` (2.6 takes ``window_size`` as one tuple; 3.x is a
different interface). Every admitted release is checked against its real
Python interface by ``tests/test_gpu_static_flash.py``.

GPUs: flash-attn 2.7.0 - 2.7.2 run on sm_8x and sm_90 only (``mha_fwd``:
"FlashAttention only supports Ampere GPUs or newer"), 2.7.3 and later on any
sm >= 80.

GQA is native (dK/dV come back with Hkv heads). Causal is bottom-right aligned
in flash-attn >= 2.1, so it serves causal only when the reduced block of
:func:`seqpar.kernels.base.plan_block` is square, where both alignments agree:
that covers ``causal`` with ``Tq <= Tk`` and ``causal_strict`` with
``Tq <= Tk + 1`` (rows ``1:`` against keys ``:Tq-1``, the shifted diagonal).

Windows are native: flash-attn's ``window_size=(left, right)`` lets query ``i`` see keys
``i + Tk - Tq - left .. i + Tk - Tq + right`` (bottom-right aligned, -1 = unbounded), so a reduced
band ``(lo, hi)`` is ``left = Tk - Tq - lo``, ``right = hi - (Tk - Tq)``; both are >= 0 on a
reduced block (its first key is seen by row 0 and its last row sees a key), whatever its shape.
flash-attn's ``mha_fwd`` / ``mha_varlen_fwd`` turn a bound ``>= Tk`` (``>= max_seqlen_k``) into -1:
harmless on the left, but on the right it would show keys the band hides (a tall block, ``right =
hi + Tq - Tk``), so such bands run as plain pieces and such packed calls as block calls
(:func:`flash_pieces`, :func:`clamp_refusal`).
"""

from __future__ import annotations

import re

import torch

from .base import HALF_DTYPES, Backend, Capabilities
from .masks import Band

MIN_VERSION = (2, 7)  # inclusive, as the `flash` extra: flash-attn>=2.7,<3
MAX_VERSION = (3, 0)  # exclusive


def version_tuple(version: str) -> tuple[int, int, int]:
    """``"2.7.1.post4"`` -> ``(2, 7, 1)``; unparsable -> ``(0, 0, 0)``."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else (0, 0, 0)


def _load():
    """-> (module flash_attn_interface, None) or (None, reason).

    Not memoised (no module state): after the first success Python's import
    cache makes this a dict lookup, and it only runs for CUDA tensors.
    """
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except Exception as exc:  # ImportError, or a broken CUDA build
        return None, f"flash_attn not importable ({type(exc).__name__}: {exc})"
    version = getattr(flash_attn, "__version__", "0")
    if not MIN_VERSION <= version_tuple(version)[:2] < MAX_VERSION:
        return None, (f"flash_attn {version} is not supported: seqpar needs flash-attn >= "
                      f"{'.'.join(map(str, MIN_VERSION))}, < {'.'.join(map(str, MAX_VERSION))}")
    return flash_attn_interface, None


def arch_refusal(version: str, capability: tuple[int, int]) -> str | None:
    """Why flash-attn ``version`` cannot run on a GPU of ``capability``, or ``None``."""
    major, minor = capability
    if version_tuple(version) >= (2, 7, 3):
        return None if major >= 8 else f"flash_attn needs compute capability >= 8.0, got {capability}"
    if major == 8 or (major, minor) == (9, 0):
        return None
    return f"flash_attn {version} runs on sm_8x and sm_90 only (>= 2.7.3 for other GPUs), got {capability}"


def window_size(tq: int, tk: int, window) -> tuple[int, int]:
    """flash-attn's ``(left, right)`` for a reduced band on a ``[tq, tk]`` block (``(-1, -1)``:
    no window); see the module docstring."""
    if window is None:
        return -1, -1
    shift = tk - tq  # flash-attn aligns bottom-right: query i's diagonal is key i + shift
    return (-1 if window.lo is None else shift - window.lo), (-1 if window.hi is None else window.hi - shift)


def flash_pieces(tq: int, tk: int, causal: bool, window: Band | None) -> list[tuple[slice, tuple[int, int]]] | None:
    """The kernel calls of a reduced ``[tq, tk]`` block: ``(query rows, (left, right))`` on disjoint
    rows (keys: all ``tk``), or ``None`` when the kernel's clamping cannot express the band."""
    if window is not None:
        left, right = window_size(tq, tk, window)
        return None if right >= tk else [(slice(0, tq), (left, right))]
    if not causal:
        return [(slice(0, tq), (-1, -1))]
    if tq - tk < tk:  # top-left causal = right bound tq - tk, below the clamp
        return [(slice(0, tq), (-1, tq - tk))]
    return [(slice(0, tk), (-1, 0)), (slice(tk, tq), (-1, -1))]  # rows >= tk see every key


def clamp_refusal(window: tuple[int, int], max_q: int, max_k: int) -> str | None:
    """Why flash-attn's clamping (a bound ``>= max_seqlen_k`` becomes ``-1``) would change a packed
    call with bottom-right ``window = (left, right)`` and documents of up to ``max_q`` rows, or
    ``None``. Only a right bound can hurt: unbounded on the right, a document's first rows would see
    keys past ``right`` (they are harmless once ``right >= max_q - 1``)."""
    right = window[1]
    if max_k <= right < max_q - 1:
        return (f"window_size_right={right} >= max_seqlen_k={max_k} is clamped to unbounded by the kernel, "
                f"which would show keys to the first rows of documents of up to {max_q} rows")
    return None


def varlen_refusal(calls) -> str | None:
    """The first :func:`clamp_refusal` of packed ``calls``, or ``None``."""
    for call in calls:
        why = None if call.causal else clamp_refusal(call.window, call.max_q, call.max_k)
        if why:
            return why
    return None


class FlashAttnBackend(Backend):
    """flash-attn 2 kernels on CUDA, fp16/bf16, D % 8 == 0, D <= 256."""

    name = "flash_attn"
    caps = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=HALF_DTYPES,
        head_dim_multiple=8,  # the private backward does not pad D for us
        max_head_dim=256,
        needs_out=True,  # the kernel derives delta from `out`
        priority=40,
        square_causal_only=True,
        window=True,
        varlen=True,  # flash_attn_varlen_func and the private _flash_attn_varlen_backward
    )

    def unavailable(self, device):
        if not torch.cuda.is_available():
            return "CUDA is not available"
        mod, why = _load()
        if mod is None:
            return why
        import flash_attn

        return arch_refusal(flash_attn.__version__, torch.cuda.get_device_capability(device))

    def window_native(self, q, plan, for_backward: bool) -> bool:
        """A band whose right bound flash-attn would clamp to unbounded (``>= Tk``) runs as plain
        pieces (:func:`flash_pieces`)."""
        return flash_pieces(plan.rows, plan.keys, False, plan.window) is not None

    def varlen_refusal(self, q, calls, for_backward: bool) -> str | None:
        return varlen_refusal(calls)

    def forward(self, q, k, v, *, scale, causal, window=None):
        fa, _ = _load()
        with torch.no_grad():
            out, lse, _ = fa.flash_attn_func(
                q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal,
                window_size=window_size(q.shape[1], k.shape[1], window), return_attn_probs=True
            )
        return out, lse[..., : q.shape[1]]

    def backward(self, dout, q, k, v, out, lse, *, scale, causal, delta, window=None):
        fa, _ = _load()
        dt = q.dtype
        left, right = window_size(q.shape[1], k.shape[1], window)
        q, k, v = (x.contiguous() for x in (q, k, v))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fa._flash_attn_backward(
            dout.to(dt).contiguous(),
            q,
            k,
            v,
            out.to(dt).contiguous(),
            lse.float().contiguous(),
            dq,
            dk,
            dv,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=left,
            window_size_right=right,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=None,
        )
        return dq, dk, dv

    def varlen_forward(self, q, k, v, call, cu_q, cu_k, *, scale, acc=None):
        fa, _ = _load()
        with torch.no_grad():
            out, lse, _ = fa.flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, call.max_q, call.max_k, dropout_p=0.0, softmax_scale=float(scale),
                causal=call.causal, window_size=call.window, return_attn_probs=True)
        if lse.dim() != 2:  # flash-attn >= 2.7 returns unpadded [Hq, total_q]
            raise RuntimeError(f"flash_attn_varlen_func returned lse of shape {tuple(lse.shape)}, "
                               "expected [Hq, total_q] (flash-attn >= 2.7)")
        return out, lse

    def varlen_backward(self, dout, q, k, v, out, lse, delta, call, cu_q, cu_k, *, scale):
        fa, _ = _load()
        dt = q.dtype
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fa._flash_attn_varlen_backward(
            dout.to(dt), q, k, v, out.to(dt), lse.float().contiguous(), dq, dk, dv, cu_q, cu_k,
            call.max_q, call.max_k, dropout_p=0.0, softmax_scale=float(scale), causal=call.causal,
            window_size_left=call.window[0], window_size_right=call.window[1], softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None)
        return dq, dk, dv
