"""``seqpar.linear_attention``: sequence-parallel gated linear attention (ZeCO, LASP-2, LASP-1)."""

from __future__ import annotations

import math

import torch

from ..comm.agreement import agreed, check_ranks_enabled, check_same_on_ranks
from ..comm.fingerprint import call_fields
from ..comm.groups import group_info
from ..comm.stats import CommStats
from ..tracing import Trace, begin, end, resolve
from .geometry import build_shard, check_cu_seqlens
from .compiled import compiled_linear
from .kernels import fla_refusal, select_kernel
from .ops import LinearConfig, LinearSPFunction
from .plans import resolve_plan

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name, t, dims):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in dims:
        raise ValueError(f"{name}: expected {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name}: expected a floating dtype (float16/bfloat16/float32/float64), got {t.dtype}")


def _validate(q, k, v, g, scale, initial_state, output_final_state, stats):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, (4,))
    if k.shape != q.shape:
        raise ValueError(f"k: shape {tuple(k.shape)} must equal q's {tuple(q.shape)} ([B, T_local, H, K])")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v: shape {tuple(v.shape)} must be [B, T_local, H, V] with q's B, T_local, H "
                         f"{tuple(q.shape[:3])}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"v: q, k, v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] < 1:
        raise ValueError("q: the local sequence is empty (T_local = 0)")
    devices = {t.device for t in (q, k, v, g, initial_state) if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"q: q, k, v, g, initial_state must be on one device, got {sorted(map(str, devices))}")
    if g is not None:
        _check_tensor("g", g, (3, 4))
        if g.shape != q.shape and g.shape != q.shape[:3]:
            raise ValueError(f"g: shape {tuple(g.shape)} must be [B, T_local, H, K] = {tuple(q.shape)} "
                             f"(per-key decay) or [B, T_local, H] = {tuple(q.shape[:3])} (scalar decay)")
        # Positive log-decays would make the state grow without bound; we refuse rather than clamp.
        # `<= 0` is False for NaN too, so a NaN decay (which would poison every later state) is refused.
        if not bool((g <= 0).all()):
            bad = "NaN" if bool(g.isnan().any()) else f"a maximum of {float(g.max())}"
            raise ValueError(f"g: the log-decay must be <= 0 everywhere, and not NaN (use e.g. F.logsigmoid), "
                             f"got {bad}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale: expected a positive finite number or None (= K ** -0.5), got {scale!r}")
    if not isinstance(output_final_state, bool):
        raise ValueError(f"output_final_state: expected True or False, got {output_final_state!r}")
    if stats is not None and not isinstance(stats, CommStats):
        raise ValueError(f"stats: expected a seqpar CommStats or None, got {type(stats).__name__}")


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None, *,
                     group=None, method="zeco", scale: float | None = None,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     cu_seqlens=None, stats: CommStats | None = None, backend: str | None = None,
                     check_ranks: bool | None = None, trace: Trace | None = None):
    """Gated linear attention over a sequence split contiguously across the ranks of ``group``.

    Semantics of flash-linear-attention's ``chunk_gla``, per head with state ``S [K, V]``:
    ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t`` and ``o_t = scale * q_t S_t``.

    Shapes (``N`` ranks in ``group``, ``T_global = N * T_local``; rank ``p`` holds global tokens
    ``[p*T_local, (p+1)*T_local)``, e.g. from ``seqpar.shard(x, method="zeco")``):

    - ``q``, ``k``: ``[B, T_local, H, K]``; ``v``: ``[B, T_local, H, V]`` (one dtype).
    - ``g``: log-decay ``<= 0``, ``[B, T_local, H, K]`` (per key channel) or ``[B, T_local, H]`` (one per
      head, broadcast over K), or None (no decay: plain linear attention). A positive value raises
      ``ValueError`` (no silent clamp).
    - ``cu_seqlens``: packed documents. The GLOBAL cumulative lengths (int32 tensor or list, starting
      at 0, ending at ``T_global``) of the packed stream ``[1, T_global, H, K]``; the same on every rank.
      The state resets at every document start; a shard's first piece continues the state of the
      previous rank unless a document starts exactly at the shard's first token.
    - ``initial_state``: ``[B, H, K, V]`` (``[1, H, K, V]`` packed: it feeds the first document), the
      state before global token 0; the same on every rank.
    - returns ``o``: ``[B, T_local, H, V]`` in the input dtype, and the final state ``[B, H, K, V]`` (the
      state after the last global token, of the last document when packed) on every rank when
      ``output_final_state``, else None. States are float32 (float64 for float64 inputs).

    ``method``: ``"zeco"`` (All-Scan: one state per rank, pipelined in blocks of K rows and overlapped
    with the intra-chunk compute), ``"lasp2"`` (all-gather of every rank's state and decay),
    ``"lasp1"`` (the chain, whole state at once, after the local compute), or a
    :class:`~seqpar.linear.ScanPlan`. ``group``: a ProcessGroup, a 1-D DeviceMesh, or None (the world;
    one device when torch.distributed is not initialised). ``stats``: a :class:`CommStats` that gets the
    bytes this rank sends, by phase. ``backend``: ``"torch"``, ``"triton"`` or None (automatic).

    Gradients flow to q, k, v, g and initial_state. Every rank's copy of the final state is an output:
    their gradients are summed. The gradient of ``initial_state`` comes out on the group's first rank
    (zero elsewhere), so summing it over the group (as for any replicated tensor) gives the full one.
    Computation is in float32 (float64 for float64 inputs); gradients come back in the inputs' dtypes.

    ``check_ranks``: check first, with ceil(log2 N) 56-byte messages per rank (on the CPU when the group
    takes CPU tensors), that every rank passed the same arguments (every argument but ``stats``:
    shapes, dtypes, method, scale, initial_state, output_final_state, cu_seqlens, group members;
    :mod:`seqpar.comm.agreement`); on a mismatch, or a ValueError on some ranks only (e.g. a positive
    ``g`` on one rank), every rank raises a ValueError naming the rank(s) and argument instead of
    hanging or returning a wrong result. None (default): on, unless ``SEQPAR_CHECK_RANKS=0`` (read
    at each call); ``False`` skips it, with that risk.

    ``trace``: a :class:`seqpar.Trace` that records this rank's kernels and messages, forward and
    backward (default: the enclosing ``with seqpar.trace(...)`` block's, else none).

    Under ``torch.compile`` (``fullgraph=True`` too, any backend) the call is one opaque op each way
    (``seqpar::linear_attention_fwd`` / ``_bwd``, :mod:`seqpar.linear.compiled`): the rank check,
    ``stats`` and ``trace`` behave as in eager mode. One device on CUDA runs seqpar's own chunk kernels
    there, not flash-linear-attention's.

    Raises ``ValueError`` naming the argument before any communication for bad input;
    :class:`seqpar.PeerError` when a peer rank crashes or times out during the call.
    """
    arguments = dict(locals())  # every parameter: the rank agreement covers an option added later too
    if torch.compiler.is_compiling():  # torch.compile: the call is one opaque op (seqpar.linear.compiled)
        return compiled_linear(arguments, _setup)
    return _linear(arguments)


def _linear(arguments: dict):
    """:func:`linear_attention` once its arguments are captured."""
    q, k, v, g, initial_state = (arguments[n] for n in ("q", "k", "v", "g", "initial_state"))
    trace = resolve(arguments["trace"])
    begin(trace, "linear fwd")
    return _launch(q, k, v, g, initial_state, *_checked(arguments, trace))


def _checked(arguments: dict, trace, first: bool = True):
    """Every check of a call (:func:`_prepare`), and unless ``first`` is False (the compiled backward
    op: the forward checked across ranks already) the rank agreement or the packed offsets' check."""
    q, k, v, g, group = (arguments[n] for n in ("q", "k", "v", "g", "group"))
    method, scale, initial_state, output_final_state, cu_seqlens, stats, backend, check_ranks = (
        arguments[n] for n in ("method", "scale", "initial_state", "output_final_state", "cu_seqlens", "stats",
                               "backend", "check_ranks"))
    info = group_info(group)
    args = (method, scale, initial_state, output_final_state, cu_seqlens, stats, backend, trace)
    if not first:
        return _prepare(q, k, v, g, info, *args)
    if not check_ranks_enabled(check_ranks):
        prepared = _prepare(q, k, v, g, info, *args)
        if prepared[2] is not None:  # packed: the same offsets on every rank (a 3-number all-gather, as
            # for softmax attention); different offsets would silently mix documents across ranks
            check_same_on_ranks(prepared[2], group, device=q.device if q.is_cuda else None, trace=trace)
        return prepared
    return agreed(info, "seqpar.linear_attention", call_fields(arguments),
                  lambda: _prepare(q, k, v, g, info, *args),
                  device=q.device if isinstance(q, torch.Tensor) and q.is_cuda else None, trace=trace)


def _setup(arguments: dict, *, trace, first: bool = True) -> LinearConfig:
    """The checked configuration of a call, for the compiled ops (seqpar.linear.compiled): the same
    checks and configuration as eager mode, always with seqpar's chunk kernels (flash-linear-attention's
    single-device path is not an opaque op)."""
    return _config(arguments["q"], *_checked(arguments, trace, first))


def _prepare(q, k, v, g, info, method, scale, initial_state, output_final_state, cu_seqlens, stats, backend,
             trace):
    """Every local check (no communication); returns what :func:`_launch` needs."""
    _validate(q, k, v, g, scale, initial_state, output_final_state, stats)
    plan = resolve_plan(method)
    bsz, t_local, hh, kd = q.shape
    cu = None
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, batch=bsz, t_local=t_local, world=info.size)
    rows = 1 if cu is not None else bsz
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, (4,))
        want = (rows, hh, kd, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: expected shape [{'1' if cu else 'B'}, H, K, V] = {want}, got "
                             f"{tuple(initial_state.shape)}")
    scale = float(kd ** -0.5 if scale is None else scale)
    kernel = select_kernel(q, backend)
    return info, plan, cu, scale, kernel, output_final_state, stats, backend, trace


def _launch(q, k, v, g, initial_state, info, plan, cu, scale, kernel, output_final_state, stats, backend, trace):
    if info.single and backend is None and fla_refusal(q) is None:
        end(trace, "linear fwd")  # one device, flash-linear-attention's kernels: nothing of ours to trace
        return _fla_single(q, k, v, g, scale, initial_state, output_final_state, cu)
    cfg = _config(q, info, plan, cu, scale, kernel, output_final_state, stats, backend, trace)
    out = LinearSPFunction.apply(q, k, v, g, initial_state, cfg)
    end(trace, "linear fwd")
    return out if output_final_state else (out, None)


def _config(q, info, plan, cu, scale, kernel, output_final_state, stats, backend, trace) -> LinearConfig:
    """The Function's configuration from :func:`_prepare`'s result (host-side only)."""
    bsz, t_local = q.shape[:2]
    shard = build_shard(info.rank, info.size, bsz, t_local, cu)
    return LinearConfig(info, plan, shard, kernel.layout(shard.seq_lens, q.device), kernel, scale,
                        output_final_state, stats, trace)


def _fla_single(q, k, v, g, scale, h0, output_final_state, cu):
    """One device on CUDA with flash-linear-attention installed: its fused kernels, our semantics
    (per-document states inside, the first document takes ``h0``, the last one's state comes out)."""
    from fla.ops.gla import chunk_gla

    if g is None:
        g = torch.zeros_like(q)
    elif g.dim() == 3:
        g = g[..., None].expand_as(q)
    cu_t = None
    if cu is not None:
        cu_t = torch.tensor(cu, dtype=torch.long, device=q.device)
        if h0 is not None and len(cu) > 2:
            h0 = torch.cat([h0, h0.new_zeros(len(cu) - 2, *h0.shape[1:])])
    o, ht = chunk_gla(q, k, v, g, scale=scale, initial_state=None if h0 is None else h0.float(),
                      output_final_state=output_final_state, cu_seqlens=cu_t)
    return o, (ht[-1:] if (ht is not None and cu is not None) else ht)
