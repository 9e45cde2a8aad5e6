"""``seqpar.linear_attention`` inside ``torch.compile``: the whole call as two opaque custom ops.

Under ``torch.compile`` (Dynamo tracing, ``torch.compiler.is_compiling()``),
:func:`seqpar.linear_attention` calls :func:`compiled_linear` instead of running: the graph gets one
``seqpar::linear_attention_fwd`` node, and its backward one ``seqpar::linear_attention_bwd`` node
(``torch.library.custom_op`` with a fake implementation and ``register_autograd``). Nothing of the
call is traced: the rank agreement, the checks, ``cu_seqlens``, the state exchange, every kernel and
everything that reads Python state (the ``seqpar.trace`` context variable, a ``CommStats``) run inside
the op when the compiled code runs, exactly as in eager mode: the op calls the same autograd
Function's ``forward`` and ``backward`` (:class:`~seqpar.linear.ops.LinearSPFunction`).

Tensors (``R`` state rows: ``B``, or 1 packed; ``N`` ranks):
    ``linear_attention_fwd(q, k [B, T_local, H, K], v [B, T_local, H, V], g [B, T_local, H(, K)] | None,
    initial_state [R, H, K, V] | None, cu_seqlens [docs + 1] int | None, key, final, gathered)
    -> (o [B, T_local, H, V], final state [R, H, K, V] (empty unless ``final``), saved)``; ``saved`` is
    what the Function keeps for backward besides its inputs, as tensors: ``[S_in [R, H, K, V], Gamma_end
    [R, H, K]]``, and for an all-gather plan (LASP-2) the gathered decays ``[N, R, H, K]`` too
    (``gathered = N``; 0 for a chain). States are float32 (float64 for float64 inputs).
    ``linear_attention_bwd(do, dfinal | None, q, k, v, g, initial_state, cu_seqlens, saved, key,
    need_dh0) -> (dq, dk, dv, dg, d initial_state)`` (``dg`` empty without ``g``, ``d initial_state``
    empty unless ``need_dh0``).

The non-tensor arguments (group, method, scale, output_final_state, a list ``cu_seqlens``, stats,
backend, check_ranks, trace) reach the op as an int ``key`` of a registry written at trace time, for
the reasons and with the guarantees of :mod:`seqpar.softmax.compiled`'s registry: the op runs long
after tracing and needs the caller's own objects back (its group, stats object and trace recorder);
the registry is append-only, keyed by value (a ``CommStats`` or ``Trace`` by identity), holds no
tensors, is never read in eager mode and is written only by the process that traced the graph.
``gathered`` and ``final`` are the other constants: the shapes the fake implementation returns,
so that it depends on the op's arguments alone (a graph cached on disk keys on them).

Single device: eager mode calls flash-linear-attention's ``chunk_gla`` on CUDA when it is installed;
under ``torch.compile`` the op runs seqpar's own chunk kernels (Triton on CUDA) instead, since fla's
call is no opaque op with saved tensors. The results agree within the dtype's rounding, not bit for bit.

Backward rebuilds the call's configuration from the key (the checks run again, host-side only,
without the rank agreement, which the forward did) and a fresh exchange that takes back the saved
decays (:meth:`~seqpar.linear.plans.GatherExchange.restore`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..comm.groups import group_info
from ..opregistry import CallRegistry, FunctionCtx, op_outputs, option_items, option_key
from ..tracing import begin, end, resolve
from .ops import LinearSPFunction
from .plans import make_exchange, resolve_plan

TENSOR_ARGUMENTS = ("q", "k", "v", "g", "initial_state")  # and cu_seqlens when it is a tensor


@dataclass(frozen=True)
class RegisteredCall:
    """The non-tensor half of one call: ``setup`` (the entry point's function that checks the call and
    returns its :class:`~seqpar.linear.ops.LinearConfig`), the options by name, and whether
    ``cu_seqlens`` is an op tensor."""

    setup: Callable
    options: tuple[tuple[str, Any], ...]
    cu_tensor: bool

    def arguments(self, q, k, v, g, initial_state, cu_seqlens) -> dict:
        """Every argument of the call, as :func:`seqpar.linear_attention` received it."""
        out = dict(self.options)
        out.update(q=q, k=k, v=v, g=g, initial_state=initial_state)
        if self.cu_tensor:
            out["cu_seqlens"] = cu_seqlens
        return out


_REGISTRY = CallRegistry("seqpar::linear_attention", "seqpar.linear_attention")  # key -> RegisteredCall


@torch.compiler.assume_constant_result
def register_call(setup, cu_tensor: bool, **options) -> int:
    """The key of a call's non-tensor arguments; run by Dynamo at trace time, its result a constant."""
    items = option_items(options)
    return _REGISTRY.register((setup, option_key(items), cu_tensor), RegisteredCall(setup, items, cu_tensor))


def _call(key: int) -> RegisteredCall:
    return _REGISTRY.get(key)


@torch.compiler.assume_constant_result
def gathered_ranks(key: int) -> int:
    """``N`` when the call's plan all-gathers (its backward keeps the gathered decays), else 0.

    A call whose method or group is invalid gets 0: the op then raises the eager ``ValueError``
    when it runs (on every rank, after the rank agreement), not Dynamo at trace time."""
    options = dict(_call(key).options)
    try:
        plan = resolve_plan(options["method"])
        return group_info(options["group"]).size if plan.exchange == "allgather" else 0
    except (ValueError, TypeError, RuntimeError):
        return 0


@torch.library.custom_op("seqpar::linear_attention_fwd", mutates_args=())
def linear_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
               initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, key: int, final: bool,
               gathered: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    call = _call(key)
    arguments = call.arguments(q, k, v, g, initial_state, cu_seqlens)
    trace = resolve(arguments["trace"])
    begin(trace, "linear fwd")
    cfg = call.setup(arguments, trace=trace)
    ctx = FunctionCtx()
    result = LinearSPFunction.forward(ctx, q, k, v, g, initial_state, cfg)
    end(trace, "linear fwd")
    o, ht = result if cfg.output_final_state else (result, q.new_empty(0))
    s_in, gam, exchange = ctx.saved
    inputs = (q, k, v, g, initial_state, cu_seqlens)
    o, ht, *saved = op_outputs([o, ht, s_in, gam, *exchange.kept()], inputs)
    return o, ht, saved


def _acc(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@linear_fwd.register_fake
def _linear_fwd_fake(q, k, v, g, initial_state, cu_seqlens, key, final, gathered):
    b, t, h, kd = q.shape
    vd, acc = v.shape[-1], _acc(q)
    o = q.new_empty((b, t, h, vd))
    ht = q.new_empty((b, h, kd, vd), dtype=acc) if final else q.new_empty(0)
    saved = [q.new_empty((b, h, kd, vd), dtype=acc), q.new_empty((b, h, kd), dtype=acc)]
    if gathered:
        saved.append(q.new_empty((gathered, b, h, kd), dtype=acc))
    return o, ht, saved


@torch.library.custom_op("seqpar::linear_attention_bwd", mutates_args=())
def linear_bwd(do: torch.Tensor, dfinal: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor | None, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
               saved: list[torch.Tensor], key: int, need_dh0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                           torch.Tensor, torch.Tensor]:
    call = _call(key)
    arguments = call.arguments(q, k, v, g, initial_state, cu_seqlens)
    trace = resolve(arguments["trace"])
    cfg = call.setup(arguments, trace=trace, first=False)
    s_in, gam, *kept = saved
    exchange = make_exchange(cfg.info, cfg.plan, cfg.stats, trace)
    exchange.restore(kept)
    ctx = FunctionCtx((q, k, v, g, initial_state), cfg, (True, True, True, g is not None, need_dh0),
                      saved=(s_in, gam, exchange))
    grads = list(LinearSPFunction.backward(ctx, do, dfinal)[:5])
    grads = [q.new_empty(0) if x is None else x for x in grads]
    return tuple(op_outputs(grads, (do, dfinal, q, k, v, g, initial_state, cu_seqlens, *saved)))


@linear_bwd.register_fake
def _linear_bwd_fake(do, dfinal, q, k, v, g, initial_state, cu_seqlens, saved, key, need_dh0):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0) if g is None else g.new_empty(g.shape),
            initial_state.new_empty(initial_state.shape) if need_dh0 else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, g, initial_state, cu_seqlens, key, _final, _gathered = inputs
    _o, _ht, saved = output
    ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens, *saved)
    ctx.key = key


def _backward(ctx, do, dfinal, _dsaved):
    q, k, v, g, initial_state, cu_seqlens, *saved = ctx.saved_tensors
    need_dh0 = initial_state is not None and ctx.needs_input_grad[4]
    dfinal = None if dfinal is None or dfinal.numel() == 0 else dfinal.contiguous()
    dq, dk, dv, dg, dh0 = linear_bwd(do.contiguous(), dfinal, q, k, v, g, initial_state, cu_seqlens, saved,
                                     ctx.key, need_dh0)
    return (dq, dk, dv, dg if g is not None else None, dh0 if need_dh0 else None, None, None, None, None)


linear_fwd.register_autograd(_backward, setup_context=_setup_context)


def compiled_linear(arguments: dict, setup: Callable):
    """:func:`seqpar.linear_attention` while Dynamo traces: register the options, emit the forward op.

    ``arguments``: every argument of the call by name; ``setup``: the entry point's
    ``(arguments, *, trace, first=True) -> LinearConfig``. Returns ``(o, final state or None)``.
    """
    for name in TENSOR_ARGUMENTS:
        value = arguments[name]
        if not isinstance(value, torch.Tensor) and not (name in ("g", "initial_state") and value is None):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")  # eager's words
    cu = arguments["cu_seqlens"]
    cu_tensor = isinstance(cu, torch.Tensor)
    options = {name: value for name, value in arguments.items()
               if name not in TENSOR_ARGUMENTS and not (name == "cu_seqlens" and cu_tensor)}
    key = register_call(setup, cu_tensor, **options)
    final = arguments["output_final_state"] is True  # anything else: the op raises eager's ValueError
    o, ht, _ = linear_fwd(arguments["q"], arguments["k"], arguments["v"], arguments["g"], arguments["initial_state"],
                          cu if cu_tensor else None, key, final, gathered_ranks(key))
    return (o, ht) if final else (o, None)


__all__ = ["RegisteredCall", "compiled_linear", "gathered_ranks", "linear_bwd", "linear_fwd", "register_call"]
