"""Public block-attention entry points and backend dispatch.

``block_forward`` / ``block_backward`` (and ``block_forward_into``, which merges into running
accumulators, inside the kernel where the backend has ``caps.accumulate``) validate, pick a backend, reduce the
mask to the visible sub-block (:func:`seqpar.kernels.base.plan_block`), run
the backend there and pad the result back to the full block (a window band
runs natively on backends whose capabilities say ``window``, else as plain
pieces, each dispatched in turn, merged in fp32):

- rows that see no key get ``out = 0``, ``lse = -inf`` and ``dq = 0``;
- keys that no row sees get ``dk = dv = 0``.

Dispatch picks the highest-ranked backend that fits (flash4 > flash_attn > triton >
torch_cuda > cudnn > torch_cpu > reference for half/fp32; reference first for float64), except
where the committed table of GPU timings (:mod:`seqpar.kernels.dispatch_table`) has measured the
block's case: there the backends it lists come first, fastest first.
A forced ``backend=`` that cannot serve raises ``ValueError`` with its reason;
when nothing fits, one ``ValueError`` lists every backend with its reason. An
automatically chosen backend whose kernel fails to compile or launch for a
case is demoted for that case with one warning and the next one runs
(:mod:`seqpar.kernels.fallback`); a forced one raises.
"""

from __future__ import annotations

import torch

from .base import (
    Backend,
    BlockPlan,
    check_mask,
    check_qkv,
    check_scale,
    lse_dtype,
    plan_block,
)
from .cudnn import CudnnBackend
from .dispatch_table import DispatchTable, TableKey
from .fallback import FAILED_KERNELS, Attempt, KernelCase
from .flash import FlashAttnBackend
from .flash4 import Flash4Backend
from .masks import Band, band_pieces
from .merge import merge_, new_accumulator
from .reference import ReferenceBackend
from .torch_ops import TorchCPUBackend, TorchCUDABackend
from .triton_backend import TritonBackend

#: Every backend, highest priority first. Immutable: dispatch has no switches.
BACKENDS: tuple[Backend, ...] = tuple(
    sorted(
        (Flash4Backend(), FlashAttnBackend(), TritonBackend(), TorchCUDABackend(), CudnnBackend(), TorchCPUBackend(),
         ReferenceBackend()),
        key=lambda b: -b.caps.priority,
    )
)
BACKEND_NAMES: tuple[str, ...] = tuple(b.name for b in BACKENDS)
#: The measured backend order per case (immutable; read once from the committed file).
TABLE: DispatchTable = DispatchTable.load()


def available_backends(include_unavailable: bool = False) -> list[str]:
    """Names of the backends that can run here, highest priority first.

    "Can run" means on the CPU or on the current CUDA device (if any), with
    their packages importable; dtype, mask and shape limits aside (ask
    :func:`select_backend` for a concrete block). ``include_unavailable=True``
    lists every registered backend, i.e. every valid ``backend=`` name.
    """
    if include_unavailable:
        return list(BACKEND_NAMES)
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    return [
        b.name
        for b in BACKENDS
        if any(
            (not b.caps.devices or dev.type in b.caps.devices) and b.unavailable(dev) is None
            for dev in devices
        )
    ]


def _by_name(name: str) -> Backend:
    for b in BACKENDS:
        if b.name == name:
            return b
    raise ValueError(f"backend={name!r} is unknown: use None (automatic) or one of {list(BACKEND_NAMES)}")


def _kind(plan: BlockPlan) -> str:
    """The mask kind of a reduced block, as kernels are compiled for it."""
    return "window" if plan.window is not None else "causal" if plan.causal else "none"


def _candidates(q, k, v, mask, for_backward: bool, has_out: bool, reasons: list[str], packed: bool = False):
    """Backends that can serve this block, best first (a generator: the refusals of the rest are
    only evaluated when needed); appends ``"  name: why"`` to ``reasons`` for each one that cannot,
    including those demoted for this case (:data:`FAILED_KERNELS`). ``packed``: for a packed
    call (one varlen launch over many documents), ranked without a block plan."""
    plan = plan_block(q.shape[1], k.shape[1], mask)
    case = KernelCase.of(q, k, _kind(plan), for_backward)
    ranked = None if packed else plan
    order = sorted(BACKENDS, key=lambda b: b.rank(q.dtype, for_backward, ranked), reverse=True)
    if not packed and not plan.empty:  # measured cases: the table's order first
        order = TABLE.arrange(order, TableKey.of(q, plan, for_backward))
    for b in order:
        why = b.refusal(q, k, v, mask, for_backward, has_out)
        failed = None if why else FAILED_KERNELS.reason(b.name, case)
        if failed:
            why = f"failed to compile or launch here for {case}: {failed}"
        if why:
            reasons.append(f"  {b.name}: {why}")
        else:
            yield b


def _no_backend(q, k, mask, for_backward: bool, reasons: list[str]) -> ValueError:
    return ValueError(
        f"no attention backend fits q {tuple(q.shape)} {q.dtype} on {q.device}, "
        f"k {tuple(k.shape)}, mask={mask!r}, {'backward' if for_backward else 'forward'}:\n"
        + "\n".join(reasons)
    )


def select_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask,
    backend: str | None = None,
    for_backward: bool = False,
    has_out: bool = True,
) -> Backend:
    """The backend that serves this block (``q [B,Tq,Hq,D]``, ``k``/``v [B,Tk,Hkv,D]``).

    ``has_out=False`` (backward given only ``delta``) skips backends whose
    backward needs ``out``. ``backend="name"`` forces one. Raises
    ``ValueError`` for an unknown name, a forced backend that refuses (with
    its reason) or when none fits (listing every backend and why, including
    those whose kernel failed to compile or launch here for this case).
    """
    check_mask(mask)
    if backend is not None:
        chosen = _by_name(backend)
        why = chosen.refusal(q, k, v, mask, for_backward, has_out)
        if why:
            raise ValueError(f"backend={backend!r} cannot serve this block: {why}")
        return chosen
    reasons: list[str] = []
    for b in _candidates(q, k, v, mask, for_backward, has_out, reasons):
        return b
    raise _no_backend(q, k, mask, for_backward, reasons)


def _run(q, k, v, plan: BlockPlan, *, mask, backend, for_backward, has_out, call, pieces):
    """``call(chosen)`` on the forced backend, or on the best capable one, demoting those whose
    kernel fails to compile or launch (:class:`~seqpar.kernels.fallback.Attempt`) in turn. A
    window band goes to ``pieces()`` when the backend that serves it cannot run it in one call
    (:meth:`~seqpar.kernels.base.Backend.window_native`)."""
    if backend is not None:
        chosen = select_backend(q, k, v, mask=mask, backend=backend, for_backward=for_backward, has_out=has_out)
        return pieces() if plan.window is not None and not chosen.window_native(q, plan, for_backward) else call(chosen)
    reasons: list[str] = []
    case = KernelCase.of(q, k, _kind(plan), for_backward)
    for chosen in _candidates(q, k, v, mask, for_backward, has_out, reasons):
        if plan.window is not None and not chosen.window_native(q, plan, for_backward):
            return pieces()
        with Attempt(chosen, case) as attempt:
            return call(chosen)
        reasons.append(f"  {chosen.name}: failed to compile or launch here for {case}: {attempt.failed}")
    raise _no_backend(q, k, mask, for_backward, reasons)


def _mask_args(plan: BlockPlan) -> dict:
    return {"causal": plan.causal} if plan.window is None else {"causal": False, "window": plan.window}


def _flip(x: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    return None if x is None else torch.flip(x, (dim,))


def _pieces_forward(q, k, v, band: Band, scale: float, backend):
    """A reduced window block as plain pieces (:func:`~seqpar.kernels.masks.band_pieces`), each a
    block call of its own (reversed rows and keys where the piece says so), merged in fp32."""
    out, lse = new_accumulator(q.shape[:3] + v.shape[3:], q.device, dtype=lse_dtype(q.dtype))
    for p in band_pieces(q.shape[1], k.shape[1], band):
        qp, kp, vp = q[:, p.q0:p.q1], k[:, p.k0:p.k1], v[:, p.k0:p.k1]
        if p.flip:
            qp, kp, vp = (_flip(x, 1) for x in (qp, kp, vp))
        o, l_ = block_forward(qp, kp, vp, scale=scale, mask=p.mask, backend=backend)
        if p.flip:
            o, l_ = _flip(o, 1), _flip(l_, 2)
        merge_(out[:, p.q0:p.q1], lse[:, :, p.q0:p.q1], o, l_)
    return out.to(q.dtype), lse


def _pieces_backward(dout, q, k, v, out, lse, delta, band: Band, scale: float, backend):
    """Gradients of a reduced window block from its pieces, summed in fp32 (see _pieces_forward)."""
    acc = lse_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    for p in band_pieces(q.shape[1], k.shape[1], band):
        rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
        args = [dout[:, rows], q[:, rows], k[:, keys], v[:, keys], None if out is None else out[:, rows]]
        stats = [lse[..., rows], None if delta is None else delta[..., rows]]
        if p.flip:
            args, stats = [_flip(x, 1) for x in args], [_flip(x, 2) for x in stats]
        grads = block_backward(*args, stats[0], scale=scale, mask=p.mask, backend=backend, delta=stats[1])
        if p.flip:
            grads = [_flip(g, 1) for g in grads]
        dq[:, rows] += grads[0]
        dk[:, keys] += grads[1]
        dv[:, keys] += grads[2]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask="none",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block with its log-sum-exp.

    ``q [B, Tq, Hq, D]``, ``k``/``v [B, Tk, Hkv, D]`` (``Hq % Hkv == 0``, K/V
    never expanded on the wire; ``v`` may have its own head dim ``D_v``: MLA). ``mask`` is one of ``MASKS`` or a
    :class:`~seqpar.kernels.masks.Band`, aligned top-left when ``Tq != Tk``. Returns ``out [B, Tq, Hq, D_v]`` in q's dtype
    and ``lse [B, Hq, Tq]`` fp32 (fp64 for fp64 inputs); a row that sees no
    key has ``out = 0``, ``lse = -inf``.
    """
    check_qkv(q, k, v)
    check_scale(scale)
    b, tq, hq, d = q.shape
    plan = plan_block(tq, k.shape[1], mask)
    dv = v.shape[3]
    if plan.empty or b == 0 or hq == 0 or d == 0:
        select_backend(q, k, v, mask=mask, backend=backend)  # the same errors as a full block
        out = q.new_zeros((b, tq, hq, dv))
        lse = torch.full((b, hq, tq), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        return out, lse
    rows, keys = slice(plan.q_start, plan.q_stop), slice(plan.k_start, plan.k_stop)
    qr, kr, vr = q[:, rows], k[:, keys], v[:, keys]
    out, lse = _run(
        q, k, v, plan, mask=mask, backend=backend, for_backward=False, has_out=True,
        call=lambda chosen: chosen.forward(qr, kr, vr, scale=float(scale), **_mask_args(plan)),
        pieces=lambda: _pieces_forward(qr, kr, vr, plan.window, float(scale), backend),
    )
    lse = lse.to(lse_dtype(q.dtype))
    before, after = plan.q_start, tq - plan.q_stop
    if before or after:
        out = torch.cat([x for x in (out.new_zeros(b, before, hq, dv), out, out.new_zeros(b, after, hq, dv))
                         if x.shape[1]], dim=1)
        lse = torch.cat([x for x in (lse.new_full((b, hq, before), float("-inf")), lse,
                                     lse.new_full((b, hq, after), float("-inf"))) if x.shape[2]], dim=2)
    return out, lse


def block_forward_into(
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask="none",
    backend: str | None = None,
) -> None:
    """Merge the attention of one block into running accumulators, in place: the result of
    ``merge_(acc_out, acc_lse, *block_forward(q, k, v, ...))``. A backend with
    ``caps.accumulate`` merges inside its kernel (no ``out`` in q's dtype, no separate merge
    pass, no rounding of the block's ``out`` to q's dtype); any other runs its forward and
    :func:`~seqpar.kernels.merge.merge_`.

    ``q``, ``k``, ``v``, ``mask`` as in :func:`block_forward`; ``acc_out [B, Tq, Hq, D_v]`` and
    ``acc_lse [B, Hq, Tq]`` float32 (float64 for float64 inputs), e.g. from
    :func:`~seqpar.kernels.merge.new_accumulator`. Rows that see no key keep their values.
    """
    check_qkv(q, k, v)
    check_scale(scale)
    b, tq, hq, d = q.shape
    acc = lse_dtype(q.dtype)
    for name, x, shape in (("acc_out", acc_out, (b, tq, hq, v.shape[3])), ("acc_lse", acc_lse, (b, hq, tq))):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != acc or x.device != q.device:
            got = f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a {acc} tensor of shape {shape} on {q.device} "
                             f"(new_accumulator(out's shape, q.device)), got {got}")
    plan = plan_block(tq, k.shape[1], mask)
    if plan.empty or b == 0 or hq == 0 or d == 0:
        select_backend(q, k, v, mask=mask, backend=backend)  # the same errors as a full block
        return
    rows, keys = slice(plan.q_start, plan.q_stop), slice(plan.k_start, plan.k_stop)
    qr, kr, vr = q[:, rows], k[:, keys], v[:, keys]
    ao, al = acc_out[:, rows], acc_lse[:, :, rows]

    def call(chosen: Backend) -> None:
        if chosen.caps.accumulate and acc == torch.float32 and ao.stride(-1) == 1 and al.stride(-1) == 1:
            chosen.forward_into(ao, al, qr, kr, vr, scale=float(scale), **_mask_args(plan))
        else:
            merge_(ao, al, *chosen.forward(qr, kr, vr, scale=float(scale), **_mask_args(plan)))

    _run(q, k, v, plan, mask=mask, backend=backend, for_backward=False, has_out=True, call=call,
         pieces=lambda: merge_(ao, al, *_pieces_forward(qr, kr, vr, plan.window, float(scale), backend)))


def _check_rows(name: str, x: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if x is not None and tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor,
    *,
    scale: float,
    mask="none",
    backend: str | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the FINAL (merged) ``out`` and ``lse`` of its rows.

    ``dout``/``out``: ``[B, Tq, Hq, D_v]`` (``out`` may be the fp32
    accumulator); ``lse``: ``[B, Hq, Tq]``; ``delta`` = rowsum(dout * out) in
    fp32, ``[B, Hq, Tq]``, may replace ``out`` (``out=None``; dispatch then
    skips backends that need ``out``); given both, backends that can use
    ``delta`` use it. Returns ``(dq, dk, dv)`` in the input dtype, dk/dv with Hkv
    heads; summing them over all blocks of a row set gives the exact
    gradient. Rows with ``lse = -inf`` contribute nothing and give ``dq = 0``.
    """
    check_qkv(q, k, v)
    check_scale(scale)
    b, tq, hq, d = q.shape
    if not isinstance(dout, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise ValueError("dout and lse must be tensors ([B, Tq, Hq, D] and [B, Hq, Tq])")
    _check_rows("dout", dout, (b, tq, hq, v.shape[3]))
    _check_rows("out", out, (b, tq, hq, v.shape[3]))
    _check_rows("lse", lse, (b, hq, tq))
    _check_rows("delta", delta, (b, hq, tq))
    if out is None and delta is None:
        raise ValueError("block_backward needs `out` (the merged output) or `delta` = rowsum(dout*out)")
    tk = k.shape[1]
    plan = plan_block(tq, tk, mask)
    if plan.empty or b == 0 or hq == 0 or d == 0:
        select_backend(q, k, v, mask=mask, backend=backend, for_backward=True, has_out=out is not None)
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    rows, keys = slice(plan.q_start, plan.q_stop), slice(plan.k_start, plan.k_stop)
    acc = lse_dtype(q.dtype)
    lse_r = lse[..., rows].to(acc)
    # A row that saw no key anywhere has lse -inf; +inf makes its P exactly 0
    # (exp(s - inf)) where -inf would give exp(-inf + inf) = NaN.
    lse_r = torch.where(torch.isneginf(lse_r), float("inf"), lse_r)
    dor, qr, kr, vr = dout[:, rows], q[:, rows], k[:, keys], v[:, keys]
    outr = None if out is None else out[:, rows]
    delta_r = None if delta is None else delta[..., rows].to(acc)
    dq, dk, dv = _run(
        q, k, v, plan, mask=mask, backend=backend, for_backward=True, has_out=out is not None,
        call=lambda chosen: chosen.backward(dor, qr, kr, vr, outr, lse_r, scale=float(scale), delta=delta_r,
                                            **_mask_args(plan)),
        pieces=lambda: _pieces_backward(dor, qr, kr, vr, outr, lse_r, delta_r, plan.window, float(scale), backend),
    )
    return _pad(dq, 1, plan.q_start, tq - plan.q_stop), _pad(dk, 1, plan.k_start, tk - plan.k_stop), \
        _pad(dv, 1, plan.k_start, tk - plan.k_stop)


def _pad(x: torch.Tensor, dim: int, before: int, after: int) -> torch.Tensor:
    """``x`` with ``before`` zero rows in front of it and ``after`` behind, along ``dim``."""
    if not before and not after:
        return x
    parts = []
    for n in (before, after):
        shape = list(x.shape)
        shape[dim] = n
        parts.append(x.new_zeros(shape))
    return torch.cat([p for p in (parts[0], x, parts[1]) if p.shape[dim]], dim=dim)
