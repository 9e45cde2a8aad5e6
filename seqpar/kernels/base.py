"""Shared pieces of the block-attention kernel layer: masks, validation, the
backend protocol and the reduction of a masked block to what a kernel sees.

Shapes (flash-attn layout, per rank; ``T`` is the length of this block only):

- ``q``: ``[B, Tq, Hq, D]``; ``k``: ``[B, Tk, Hkv, D]``, ``v``: ``[B, Tk, Hkv, D_v]`` with
  ``Hq % Hkv == 0``. Query head ``h`` uses key/value head ``h // (Hq // Hkv)``. ``D_v`` (the value
  head dim) is usually ``D``; MLA models (DeepSeek-V2/V3) use ``D_v != D`` (192/128), served by
  backends with ``caps.value_dim``.
- ``out``: ``[B, Tq, Hq, D_v]`` in q's dtype; ``lse``: ``[B, Hq, Tq]`` float32
  (float64 for float64 inputs), natural log of the sum of ``exp(scale * q.k)``
  over the keys the row sees.

Masks (:mod:`seqpar.kernels.masks`), aligned TOP-LEFT when ``Tq != Tk`` (query
``i`` and key ``j`` are positions inside this block, both counted from 0):

- ``"none"``: every key is visible.
- ``"causal"``: key ``j`` is visible to query ``i`` iff ``j <= i``; so a query
  ``i >= Tk`` sees every key.
- ``"causal_strict"``: ``j < i`` (the second diagonal of striped layouts);
  query 0 sees nothing.
- a :class:`~seqpar.kernels.masks.Band` ``(lo, hi)``: ``lo <= j - i <= hi``
  (sliding windows; the three names are bands too).

A row that sees no key has ``out = 0`` and ``lse = -inf``.

Every mask is first reduced (:func:`plan_block`) to a sub-block in which a
kernel only ever needs ``"none"``, top-left ``"causal"`` with ``Tk <= Tq``, or
(a window) a band with a bound that cuts it, and in which every row sees at
least one key. This is what keeps torch's CPU flash op (which returns
``lse = 0``, not ``-inf``, for a fully masked row, and crashes on empty inputs)
away from rows it gets wrong. A backend whose capabilities do not include
``window`` gets a window cut into plain pieces (:func:`~seqpar.kernels.masks.band_pieces`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .masks import MASKS, Band, BlockPlan, as_band, check_mask, plan_block

HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def check_scale(scale: float) -> None:
    """Raise ``ValueError`` unless ``scale`` is a finite real number."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} must be a finite float (usually D ** -0.5)")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate the shapes, dtypes and devices of one attention block.

    ``q``: ``[B, Tq, Hq, D]``; ``k``: ``[B, Tk, Hkv, D]``; ``v``: ``[B, Tk, Hkv, D_v]`` (``D_v`` may
    differ from ``D``: MLA); ``Hq % Hkv == 0``; one dtype and one device for all three. Raises ``ValueError`` naming the
    offending argument.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [B, T, H, D] (flash-attn layout), got shape {tuple(t.shape)}"
            )
    for dim, what in enumerate(("batch", "sequence length", "heads")):
        if k.shape[dim] != v.shape[dim]:
            raise ValueError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in {what} (dim {dim}): "
                "v must be [B, Tk, Hkv, D_v] with k's B, Tk and Hkv"
            )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q batch {q.shape[0]} != k batch {k.shape[0]}: q, k, v need the same B")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} != k head dim {k.shape[3]}: q, k, v need the same D")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"q has {hq} heads and k has {hkv}: Hq must be a positive multiple of Hkv (GQA)"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != q dtype {q.dtype}: cast q, k, v to one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: move q, k, v to one device")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of lse (and of fp accumulators) for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: Triton's exceptions for a kernel that cannot be built or launched with its configuration:
#: compile errors (incl. static asserts), shared memory / registers beyond the GPU's limits, ptxas
#: failures, no autotuning configuration left. Matched by class name along the MRO (no import of
#: triton); its InterpreterError (a kernel bug under TRITON_INTERPRET=1) is not among them.
_TRITON_FAILURES = frozenset({"CompilationError", "OutOfResources", "PTXASError", "AutotunerError"})

#: RuntimeError messages of CUDA launches and kernel libraries that cannot run a case on this GPU
#: or build (never bad input, never a numerical problem).
_LAUNCH_MESSAGES = (
    "no kernel image is available",  # cudaErrorNoKernelImageForDevice: not built for this sm
    "invalid device function",  # cudaErrorInvalidDeviceFunction: idem
    "too many resources requested for launch",  # cudaErrorLaunchOutOfResources: registers/threads
    "does not have enough shared-memory",  # torch's memory-efficient kernels
    "no kernel found to launch",  # torch's memory-efficient kernels: none fits this GPU
    "only supports ampere gpus or newer",  # flash-attn / torch's flash kernels on older GPUs
    "ptxas",  # PTX assembly failed (e.g. unsupported sm)
)


def launch_failure(exc: BaseException) -> str | None:
    """``"ExcType: first line"`` when ``exc`` says a kernel failed to compile or launch on this
    GPU (Triton compile / resource errors, CUDA "no kernel image", out of shared memory,
    unsupported architecture), else ``None``: ``ValueError`` (bad input), out of memory, an
    illegal memory access and every other error are not launch failures and must propagate."""
    triton = any(c.__module__.startswith("triton") and c.__name__ in _TRITON_FAILURES for c in type(exc).__mro__)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not triton and not (isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _LAUNCH_MESSAGES)):
        return None
    # Triton's compile errors start with the source location and end with the message.
    text = " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    return f"{type(exc).__name__}: {text}"[:300]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can serve; checked by :meth:`Backend.refusal`.

    ``devices``: device types (``"cpu"``, ``"cuda"``), empty = any.
    ``head_dim_multiple`` / ``max_head_dim``: constraint on D (``None`` = none).
    ``gqa``: serves ``Hq != Hkv``. ``needs_out``: backward needs the merged
    ``out`` (cannot work from ``delta`` alone). ``priority``: higher wins.
    ``preferred_dtypes``: dtypes for which this backend outranks all others
    regardless of ``priority`` (the reference claims float64: float64 is the
    verification dtype and plain matmuls are the ground truth there).
    ``square_causal_only``: causal only when the reduced block is square
    (kernels with bottom-right alignment, e.g. flash-attn >= 2.1).
    ``window``: serves a reduced window band itself (``forward`` / ``backward``
    get ``window=Band``); otherwise dispatch cuts the window into plain
    ``none`` / ``causal`` pieces (:func:`~seqpar.kernels.masks.band_pieces`),
    some on reversed rows and keys, and merges them.
    ``varlen``: serves packed calls (:meth:`Backend.varlen_forward` / :meth:`Backend.varlen_backward`
    on one :class:`~seqpar.kernels.varlen.PackedCall`: documents given by ``cu_seqlens``, causal
    documents square, flash-attn's bottom-right ``(left, right)`` windows).
    ``accumulate``: merges a block into running fp32 accumulators inside its kernel
    (:meth:`Backend.forward_into`, and ``acc=`` of :meth:`Backend.varlen_forward`).
    ``value_dim``: serves a value head dim ``D_v`` different from q's and k's ``D`` (MLA models);
    ``head_dim_multiple`` / ``max_head_dim`` then apply to both.
    """

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    masks: frozenset[str] = frozenset(MASKS)
    head_dim_multiple: int = 1
    max_head_dim: int | None = None
    gqa: bool = True
    needs_out: bool = False
    priority: int = 0
    preferred_dtypes: frozenset[torch.dtype] = frozenset()
    square_causal_only: bool = False
    window: bool = False
    varlen: bool = False
    accumulate: bool = False
    value_dim: bool = False


class Backend:
    """A block-attention implementation plus what it can serve.

    Subclasses set ``name`` and ``caps`` and implement :meth:`forward` and
    :meth:`backward` on a *reduced* block (see :func:`plan_block`): inputs are
    non-empty, ``causal`` means top-left causal with ``Tk <= Tq``, ``window``
    (backends with ``caps.window`` only) a band with a bound that cuts the
    block, every row sees at least one key, and the lse given to ``backward`` holds no ``-inf``
    (rows that saw nothing anywhere carry ``+inf`` there, which zeroes their
    probabilities). The public entry points in :mod:`seqpar.kernels.dispatch`
    do the reduction and the padding back.
    """

    name: str = "?"
    caps: Capabilities

    def unavailable(self, device: torch.device) -> str | None:
        """Why this backend cannot run at all on ``device`` here (missing
        package, no CUDA, old GPU), or ``None``."""
        return None

    def extra_refusal(self, q, k, v, plan: BlockPlan, for_backward: bool) -> str | None:
        """Backend-specific refusal beyond :class:`Capabilities`; ``None`` = fits."""
        return None

    def refusal(self, q, k, v, mask, for_backward: bool, has_out: bool) -> str | None:
        """Why this backend cannot serve this case, or ``None`` if it can. A window band is
        served natively (``caps.window``) or as plain pieces (the named masks it serves)."""
        c = self.caps
        if c.devices and q.device.type not in c.devices:
            return f"runs on {sorted(c.devices)}, not on {q.device.type}"
        why = self.unavailable(q.device)
        if why:
            return why
        if q.dtype not in c.dtypes:
            names = sorted(str(d).replace("torch.", "") for d in c.dtypes)
            return f"dtype {str(q.dtype).replace('torch.', '')} not in {names}"
        plan = plan_block(q.shape[1], k.shape[1], mask)
        if plan.window is not None and not self.window_native(q, plan, for_backward) and not {"none", "causal", "causal_strict"} <= c.masks:
            return f"a window band needs the masks none, causal and causal_strict, not only {sorted(c.masks)}"
        named = mask if not isinstance(mask, Band) else "causal" if plan.causal else "none"
        if plan.window is None and named not in c.masks:
            return f"mask {named!r} not in {sorted(c.masks)}"
        d = q.shape[-1]
        if d % c.head_dim_multiple:
            return f"head dim {d} is not a multiple of {c.head_dim_multiple}"
        if c.max_head_dim is not None and d > c.max_head_dim:
            return f"head dim {d} > {c.max_head_dim}"
        dv = v.shape[-1]
        if dv != d and not c.value_dim:
            return f"value head dim {dv} != query/key head dim {d} (MLA): this kernel needs equal head dims"
        if dv != d and (dv % c.head_dim_multiple or (c.max_head_dim is not None and dv > c.max_head_dim)):
            return f"value head dim {dv} is not a multiple of {c.head_dim_multiple} up to {c.max_head_dim}"
        if not c.gqa and q.shape[2] != k.shape[2]:
            return f"no GQA (Hq={q.shape[2]}, Hkv={k.shape[2]})"
        if for_backward and c.needs_out and not has_out:
            return "backward needs `out` (was given only `delta`)"
        if c.square_causal_only and plan.causal and not plan.empty and not plan.square:
            return (
                f"causal only on square blocks (bottom-right aligned kernel); mask {mask!r} with "
                f"Tq={q.shape[1]}, Tk={k.shape[1]} reduces to {plan.tq - plan.q_start}x{plan.k_stop}"
            )
        return self.extra_refusal(q, k, v, plan, for_backward)

    def window_native(self, q: torch.Tensor, plan: BlockPlan, for_backward: bool) -> bool:
        """Whether this backend runs the reduced window band of ``plan`` of a block ``q`` in one call
        (``forward`` / ``backward`` with ``window=``; ``for_backward``: which of the two); otherwise
        dispatch cuts it into plain pieces. ``caps.window``, unless a backend can express only some
        bands (kernels with clamped window bounds, a kernel that serves windows for some dtypes)."""
        return self.caps.window

    def varlen_refusal(self, q: torch.Tensor, calls, for_backward: bool) -> str | None:
        """Why this backend's varlen kernel cannot serve the packed ``calls``
        (:class:`~seqpar.kernels.varlen_packed.PackedCall`) of streams like ``q`` (then per-segment
        block calls run), or ``None``. Backends without ``caps.varlen`` always give a reason."""
        return None if self.caps.varlen else "no varlen kernel"

    def launch_failure(self, exc: BaseException) -> str | None:
        """Why ``exc``, raised by this backend's kernel, means it cannot compile or launch this
        case on this machine (see :func:`launch_failure`), or ``None`` for any other error."""
        return launch_failure(exc)

    def rank(self, dtype: torch.dtype, for_backward: bool = False,
             plan: BlockPlan | None = None) -> tuple[bool, int]:
        """Sort key for dispatch: preferred dtype first, then priority (a backend may rank a block's
        backward, ``for_backward``, or a kind of reduced block, ``plan``, differently)."""
        return (dtype in self.caps.preferred_dtypes, self.caps.priority)

    def forward(self, q, k, v, *, scale: float, causal: bool):
        """Reduced block forward -> ``(out [B,Tq,Hq,D] q.dtype, lse [B,Hq,Tq] fp32/fp64)``.
        Backends with ``caps.window`` also take ``window=Band`` (then ``causal`` is False)."""
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, *, scale: float, causal: bool, delta):
        """Reduced block backward -> ``(dq, dk, dv)`` in q's dtype, dk/dv with Hkv heads.

        ``out`` may be ``None`` when ``delta`` (``[B, Hq, Tq]`` fp32/fp64) is
        given; backends with ``caps.needs_out`` always get ``out``.
        """
        raise NotImplementedError

    def forward_into(self, acc_out, acc_lse, q, k, v, *, scale: float, causal: bool, window=None) -> None:
        """Backends with ``caps.accumulate``: merge the reduced block's attention into ``acc_out``
        ``[B, Tq, Hq, D]`` / ``acc_lse [B, Hq, Tq]`` (fp32, unit last stride) in place, as
        :func:`~seqpar.kernels.merge.merge_` of :meth:`forward` would."""
        raise NotImplementedError

    def varlen_forward(self, q, k, v, call, cu_q, cu_k, *, scale: float, acc=None):
        """Backends with ``caps.varlen``: one packed call on gathered streams ``q [Rq, Hq, D]``,
        ``k``/``v [Rk, Hkv, D]`` (document ``b``: rows ``call.cu_q[b]:call.cu_q[b+1]`` against
        ``call.cu_k[b]:call.cu_k[b+1]``; ``cu_q``/``cu_k`` the same offsets as int32 device tensors)
        -> ``(out [Rq, Hq, D] q.dtype, lse [Hq, Rq] fp32)``. With ``acc=(acc_out [Rq, Hq, D],
        acc_lse [Hq, Rq])`` fp32 (``caps.accumulate`` only): merge into them in place, return them."""
        raise NotImplementedError

    def varlen_backward(self, dout, q, k, v, out, lse, delta, call, cu_q, cu_k, *, scale: float):
        """Backends with ``caps.varlen``: gradients of one packed call from the FINAL merged
        ``lse [Hq, Rq]`` and ``delta = rowsum(dout * out) [Hq, Rq]`` fp32 (``out [Rq, Hq, D]`` too,
        ``None`` allowed unless ``caps.needs_out``) -> ``(dq [Rq, Hq, D], dk, dv [Rk, Hkv, D])`` in
        q's dtype. Streams as in :meth:`varlen_forward`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} priority={self.caps.priority}>"
