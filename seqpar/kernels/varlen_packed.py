"""The packed path of :mod:`seqpar.kernels.varlen`: segments gathered into contiguous streams
described by ``cu_seqlens`` (:class:`PackedCall`), served by the varlen kernels of a backend whose
capabilities say ``varlen`` (flash-attn's ``flash_attn_varlen_func``, seqpar's Triton kernel).

Choice (:func:`packed_backend`): a forced ``backend=`` with ``caps.varlen`` serves the packed calls
(or raises ``ValueError`` with its reason); a forced one without it leaves them to per-segment
block calls. Automatically, the backend that block dispatch ranks first for these streams decides:
its varlen kernel runs when it has ``caps.varlen`` and that kernel has not failed to compile or
launch here (:data:`~seqpar.kernels.fallback.FAILED_KERNELS`), else the per-segment block calls
run. So a varlen kernel never replaces a higher-ranked backend's block calls (under
``TRITON_INTERPRET=1`` the Triton backend ranks below every other one and is never chosen).

Streams: ``q [1, Tq, Hq, D]``, ``k``/``v [1, Tk, Hkv, D]``, ``lse``/``delta [1, Hq, Tq]`` fp32;
``segments`` a :class:`~seqpar.kernels.varlen.VarlenSegments`. Each parts function runs every
launch before the caller writes anything back, so a path that fails half-way leaves no trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .base import Backend, plan_block
from .dispatch import _by_name, _candidates
from .fallback import FAILED_KERNELS, Attempt, KernelCase
from .flash import window_size


@dataclasses.dataclass(frozen=True)
class PackedCall:
    """One launch of a packed (varlen) kernel that takes ``cu_seqlens``.

    The query rows ``q_rows`` (``(start, length)`` ranges, in order) are gathered
    into one contiguous stream, the key rows ``k_rows`` into another; document
    ``b`` is rows ``cu_q[b]:cu_q[b+1]`` of the first against ``cu_k[b]:cu_k[b+1]``
    of the second. Query ranges are pairwise disjoint. ``causal`` holds for every
    document, and causal documents are square (then top-left and flash-attn's
    bottom-right alignment agree). ``window``: flash-attn's ``(left, right)``,
    bottom-right aligned per document (``-1`` = unbounded).
    """

    causal: bool
    q_rows: tuple[tuple[int, int], ...]
    k_rows: tuple[tuple[int, int], ...]
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    max_q: int
    max_k: int
    window: tuple[int, int] = (-1, -1)


def colour(items: list[tuple], length: Callable[[tuple], int]) -> list[list[tuple]]:
    """Split items ``(q_start, ...)`` into groups whose rows ``[q_start, q_start + length(item))``
    are pairwise disjoint: greedy interval colouring by start (optimal; a packed stream
    usually needs one group)."""
    layers: list[list[tuple]] = []
    ends: list[int] = []
    for item in sorted(items):
        for i, end in enumerate(ends):
            if end <= item[0]:
                layers[i].append(item)
                ends[i] = item[0] + length(item)
                break
        else:
            layers.append([item])
            ends.append(item[0] + length(item))
    return layers


def _pieces(seg) -> list[tuple[int, int, int, int, bool, tuple[int, int]]]:
    """A segment as ``(q_start, q_len, k_start, k_len, causal, window)`` pieces whose causal ones
    are square; a window piece carries flash-attn's ``(left, right)`` for its reduced block."""
    p = plan_block(seg.q_len, seg.k_len, seg.mask)
    if p.empty:
        return []
    q0, rows, k0 = seg.q_start + p.q_start, p.rows, seg.k_start + p.k_start
    if p.window is not None:
        return [(q0, rows, k0, p.keys, False, window_size(rows, p.keys, p.window))]
    if not p.causal:
        return [(q0, rows, k0, p.keys, False, (-1, -1))]
    out = [(q0, p.keys, k0, p.keys, True, (-1, -1))]  # square causal diagonal
    if rows > p.keys:  # rows below the diagonal see every kept key
        out.append((q0 + p.keys, rows - p.keys, k0, p.keys, False, (-1, -1)))
    return out


def plan_packed(segments) -> tuple[PackedCall, ...]:
    """The packed calls that cover ``segments`` (:class:`~seqpar.kernels.varlen.Segment`)."""
    pieces = [pc for seg in segments for pc in _pieces(seg)]
    calls = []
    for kind in sorted({(pc[4], pc[5]) for pc in pieces}):
        for layer in colour([pc for pc in pieces if (pc[4], pc[5]) == kind], lambda pc: pc[1]):
            cu_q, cu_k = [0], [0]
            for pc in layer:
                cu_q.append(cu_q[-1] + pc[1])
                cu_k.append(cu_k[-1] + pc[3])
            calls.append(PackedCall(
                kind[0], tuple((pc[0], pc[1]) for pc in layer), tuple((pc[2], pc[3]) for pc in layer),
                tuple(cu_q), tuple(cu_k), max(pc[1] for pc in layer), max(pc[3] for pc in layer), kind[1]))
    return tuple(calls)


def rows_disjoint(calls: tuple[PackedCall, ...]) -> bool:
    """Whether no query row is in two of ``calls`` (then accumulator rows gathered for one launch
    are written by no other, and every launch can run before any scatter)."""
    ranges = sorted(r for c in calls for r in c.q_rows if r[1])
    return all(a[0] + a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def packed_backend(q, k, v, backend: str | None, for_backward: bool, has_out: bool,
                   calls: tuple[PackedCall, ...] = ()) -> Backend | None:
    """The backend whose varlen kernel serves these streams, or ``None`` for per-segment block calls
    (the choice in the module docstring; a varlen kernel that cannot express ``calls``,
    :meth:`~seqpar.kernels.base.Backend.varlen_refusal`, leaves them to block calls too). Raises
    ``ValueError`` for an unknown name or a forced varlen backend that cannot serve."""
    if backend is not None:
        chosen = _by_name(backend)
        if chosen.varlen_refusal(q, calls, for_backward):
            return None
        why = chosen.refusal(q, k, v, "none", for_backward, has_out)
        if why:
            raise ValueError(f"backend={backend!r} cannot serve this varlen block: {why}")
        return chosen
    first = next(_candidates(q, k, v, "none", for_backward, has_out, [], packed=True), None)
    if first is None or first.varlen_refusal(q, calls, for_backward):
        return None
    return None if FAILED_KERNELS.reason(first.name, KernelCase.of(q, k, "varlen", for_backward)) else first


def run_packed(q, k, v, backend: str | None, for_backward: bool, has_out: bool, run: Callable[[Backend], list],
               calls: tuple[PackedCall, ...] = ()):
    """``run(chosen)`` on the backend of :func:`packed_backend` for ``calls``, or ``None`` for
    per-segment calls. When chosen automatically, a launch failure demotes its varlen case (one
    warning) and gives ``None``: the caller falls back to per-segment block calls."""
    chosen = packed_backend(q, k, v, backend, for_backward, has_out, calls)
    if chosen is None:
        return None
    if backend is not None:
        return run(chosen)
    with Attempt(chosen, KernelCase.of(q, k, "varlen", for_backward)):
        return run(chosen)
    return None


def forward_parts(chosen: Backend, q, k, v, segments, scale: float, acc: tuple) -> list[tuple]:
    """One varlen launch per packed call -> ``[(q_index, out [R, Hq, D], lse [Hq, R], merged)]``.
    In-kernel accumulation (``caps.accumulate``, fp32 accumulators, calls on disjoint rows): the
    accumulator rows are gathered, merged into by the kernel and come back ``merged`` (to scatter);
    otherwise ``out``/``lse`` are the block's own (to merge)."""
    calls = segments.packed_calls()
    into = chosen.caps.accumulate and acc[0].dtype == torch.float32 and \
        segments.cache.get("rows_disjoint", lambda: rows_disjoint(calls))
    parts = []
    for i, call in enumerate(calls):
        qi, ki, cu_q, cu_k = segments.packed_tensors(i, q.device)
        gathered = (acc[0][0].index_select(0, qi), acc[1][0].index_select(1, qi)) if into else None
        o, lse = chosen.varlen_forward(q[0].index_select(0, qi), k[0].index_select(0, ki), v[0].index_select(0, ki),
                                       call, cu_q, cu_k, scale=scale, acc=gathered)
        parts.append((qi, o, lse, into))
    return parts


def backward_parts(chosen: Backend, dout, q, k, v, out, lse, delta, segments, scale: float) -> list[tuple]:
    """One varlen backward per packed call -> ``[(q_index, k_index, dq, dk, dv)]``."""
    parts = []
    for i, call in enumerate(segments.packed_calls()):
        qi, ki, cu_q, cu_k = segments.packed_tensors(i, q.device)
        qp, kp, vp = (x[0].index_select(0, j) for x, j in ((q, qi), (k, ki), (v, ki)))
        rows = [None if x is None else x[0].index_select(0, qi) for x in (dout, out)]
        stats = [x[0].index_select(1, qi) for x in (lse, delta)]
        parts.append((qi, ki, *chosen.varlen_backward(rows[0], qp, kp, vp, rows[1], *stats, call, cu_q, cu_k,
                                                      scale=scale)))
    return parts
