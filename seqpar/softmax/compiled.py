"""``seqpar.attention`` inside ``torch.compile``: the whole call as two opaque custom ops.

Under ``torch.compile`` (Dynamo tracing, ``torch.compiler.is_compiling()``), :func:`seqpar.attention`
calls :func:`compiled_attention` instead of running: the graph gets one ``seqpar::attention_fwd``
node, and its backward one ``seqpar::attention_bwd`` node (``torch.library.custom_op`` with a fake
implementation and ``register_autograd``). Nothing of the call is traced: the rank agreement, the
checks, ``cu_seqlens``, the schedules, every message and kernel, and everything that reads Python
state (the ``seqpar.trace`` and ``seqpar.checkpoint`` context variables, a ``CommStats``) run inside
the op, when the compiled code runs, exactly as in eager mode: the op calls the same autograd
Function's ``forward`` and ``backward`` (:mod:`.executor`, :mod:`.ulysses`) that eager mode uses.

Tensors:
    ``attention_fwd(q [B, T_local, Hq, D], k, v [B, T_local, Hkv, D], sinks [Hq] | None,
    cu_seqlens [docs + 1] int | None, key, heads, *, with_lse=False) -> (out [B, T_local, Hq, D], saved)``; ``saved``
    are the tensors the Function keeps for backward besides its inputs and ``out``: ring family ``[lse
    [B, Hq, T_local]]``; Ulysses / USP the head-sharded ``[qh, kh, vh, outh, lse]`` (``[B, U*T_local,
    h, D]``, lse ``[B, h, U*T_local]``, h this member's heads), then, for ``with_lse``
    (``return_lse=True``), one more: the lse of this rank's rows ``[B, Hq, T_local]`` that the call
    returns (differentiable, :mod:`.lse`; not kept for backward). lse is float32 (float64 for float64).
    ``attention_bwd(dout, q, k, v, sinks, cu_seqlens, out, saved, key, dlse) -> (dq, dk, dv, dsinks)``
    (``dsinks`` empty without sinks; ``dlse [B, Hq, T_local]``: the returned lse's gradient, None when
    the lse is not returned or has none).

The non-tensor arguments (group, method, causal, window, stats, trace, ...) cannot be op arguments:
a ProcessGroup, a ``CommStats`` or a ``Trace`` is no tensor, int or string. They are registered once,
at trace time, under an int ``key`` that the graph carries as a constant. **Why a registry**: the op
runs long after tracing, in code that only has the graph's constants; it needs the caller's own
objects back (the stats object the bytes are counted into, the trace recorder, the group), so
something must map a constant to them, and only the process that traced the graph can. It is kept
as harmless as a registry can be: *append-only* (a key, once given, always means the same call),
*keyed by value* (the same call options always get the same key, so it grows with the number of
distinct call sites and options, not with the number of calls or steps; a ``CommStats`` or
``Trace`` counts by identity, as it is the caller's recorder), holding no tensors, never read in
eager mode, and written only at trace time. ``heads`` (:func:`saved_heads`) is the other constant:
the shapes of ``saved``, so that the fake implementation depends on the op's arguments alone.

Caching: Inductor's and AOTAutograd's on-disk caches key a graph by its code, constants included,
and Dynamo traces every graph in the process that runs it (registering its key there), so a cached
graph is safe to reuse in another process or on another rank. Not supported: running a graph that
this process did not trace (``torch.export``, Dynamo precompile): its keys may be unissued here (the
op raises) or name another call.

Backward rebuilds the call's configuration from the key and the saved tensors (the checks run
again, host-side only, without the rank agreement, which the forward did); schedules are cached.
Inside the backward op, the trace recorded into is the ``trace=`` argument or the ``seqpar.trace``
block active when backward runs (eager mode: the one active at forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..comm import group_info
from ..comm.usp_groups import describe_usp
from ..methods import method as declared
from ..opregistry import CallRegistry, FunctionCtx, fresh, option_items, option_key, standard
from ..tracing import begin, end, resolve
from .executor import RingAttention
from .ulysses import UlyssesAttention, split_heads

TENSOR_ARGUMENTS = ("q", "k", "v", "sinks")  # and cu_seqlens when it is a tensor

# How each Function's saved tensors (ctx.save_for_backward order) map to the op's tensors: a name is
# an input or ``out``, an int the index in the op's ``saved`` output.
_SAVED = {RingAttention: ("q", "k", "v", "out", 0, "sinks"),
          UlyssesAttention: (0, 1, 2, 3, 4, "sinks")}


@dataclass(frozen=True)
class RegisteredCall:
    """The non-tensor half of one call: ``setup`` (the entry point's function that checks the call
    and returns its autograd Function and arguments), the options by name, whether ``cu_seqlens``
    is an op tensor, and whether backward will run (known at trace time, not inside the op)."""

    setup: Callable
    options: tuple[tuple[str, Any], ...]
    cu_tensor: bool
    needs_grad: bool

    def arguments(self, q, k, v, sinks, cu_seqlens) -> dict:
        """Every argument of the call, as :func:`seqpar.attention` received it."""
        out = dict(self.options)
        out.update(q=q, k=k, v=v, sinks=sinks)
        if self.cu_tensor:
            out["cu_seqlens"] = cu_seqlens
        return out


_REGISTRY = CallRegistry("seqpar::attention", "seqpar.attention")  # key -> RegisteredCall (module docstring)


@torch.compiler.assume_constant_result
def register_call(setup, needs_grad: bool, cu_tensor: bool, **options) -> int:
    """The key of a call's non-tensor arguments; run by Dynamo at trace time, its result a constant."""
    items = option_items(options)
    return _REGISTRY.register((setup, option_key(items), cu_tensor, needs_grad),
                              RegisteredCall(setup, items, cu_tensor, needs_grad))


def _call(key: int) -> RegisteredCall:
    return _REGISTRY.get(key)


@torch.library.custom_op("seqpar::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, key: int, heads: int, *,
                  with_lse: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    call = _call(key)
    arguments = call.arguments(q, k, v, sinks, cu_seqlens)
    trace = resolve(arguments["trace"])
    begin(trace, "attention fwd")
    function, args = call.setup(q, k, v, arguments, trace=trace, needs_grad=call.needs_grad)
    ctx = FunctionCtx()
    out, lse = function.forward(ctx, *args) if with_lse else (function.forward(ctx, *args), None)
    out = standard(out)
    end(trace, "attention fwd")
    layout = _SAVED[function]
    saved = [None] * sum(isinstance(x, int) for x in layout)
    named = dict(zip(("q", "k", "v", "sinks"), args[:4]), out=out)
    for where, t in zip(layout, ctx.saved_tensors):
        if isinstance(where, int):
            saved[where] = standard(fresh(t, (q, k, v, out, *saved[:where])))
        elif t is not named[where]:
            raise RuntimeError(f"seqpar::attention_fwd: {function.__name__} saved another tensor than {where}")
    if with_lse:  # (a copy already, lse.returned; fresh() keeps the rule that outputs alias nothing)
        saved.append(standard(fresh(lse, (out, *saved))))
    return out, saved


@torch.compiler.assume_constant_result
def saved_heads(key: int, hq: int, hkv: int) -> int:
    """This rank's head-sharded shapes of a call, as one int the graph carries (0: ring family).

    The fake implementation reads them from here, never from the registry or the process group:
    compiled graphs are cached on disk by their code, and two ranks (or two processes) whose graphs
    read the same must produce the same shapes. ``U * 2**40 + h * 2**20 + h_kv``: the Ulysses
    degree and this member's query and KV heads."""
    options = dict(_call(key).options)
    family = declared(options["method"], kind="softmax").family
    if family == "ring":
        return 0
    if family == "usp":
        axes = describe_usp(options["group"], options["ulysses_degree"])
        u, me = axes.ulysses_degree, axes.u
    else:
        info = group_info(options["group"])
        u, me = info.size, info.rank
    q_split, kv_split = split_heads(hq, hkv, u)
    return (u << 40) | (q_split.count(me) << 20) | kv_split.count(me)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, sinks, cu_seqlens, key, heads, *, with_lse=False):
    out = q.new_empty(q.shape[:3] + v.shape[3:])  # [B, T, Hq, D_v]: v's head dim (MLA: D_v != D)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, t, hq, d = q.shape
    rows_lse = [q.new_empty((b, hq, t), dtype=acc)] if with_lse else []
    if heads == 0:  # ring family: lse
        return out, [q.new_empty((b, hq, t), dtype=acc), *rows_lse]
    u, h, hkv = heads >> 40, (heads >> 20) & 0xFFFFF, heads & 0xFFFFF
    return out, [q.new_empty((b, u * t, h, d)), k.new_empty((b, u * t, hkv, d)),
                 v.new_empty((b, u * t, hkv, v.shape[3])), q.new_empty((b, u * t, h, v.shape[3])),
                 q.new_empty((b, h, u * t), dtype=acc), *rows_lse]


@torch.library.custom_op("seqpar::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  sinks: torch.Tensor | None, cu_seqlens: torch.Tensor | None, out: torch.Tensor,
                  saved: list[torch.Tensor], key: int, dlse: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _call(key)
    arguments = call.arguments(q, k, v, sinks, cu_seqlens)
    trace = resolve(arguments["trace"])
    function, args = call.setup(q, k, v, arguments, trace=trace, first=False, needs_grad=True)
    named = dict(zip(("q", "k", "v", "sinks"), args[:4]), out=out)
    ctx = FunctionCtx([saved[w] if isinstance(w, int) else named[w] for w in _SAVED[function]], args[4],
               (True, True, True, sinks is not None, False))
    grads = list(function.backward(ctx, dout, *(() if dlse is None else (dlse,)))[:4])
    grads[3] = q.new_empty(0) if grads[3] is None else grads[3]
    inputs = (dout, q, k, v, sinks, cu_seqlens, out, *saved, dlse)
    for i, g in enumerate(grads):  # (dK, dV may be views of one buffer: allgather_kv's reduce-scatter)
        grads[i] = standard(fresh(g, inputs + tuple(grads[:i])))
    return tuple(grads)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, sinks, cu_seqlens, out, saved, key, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), (
        q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, sinks, cu_seqlens, key, _heads = inputs
    out, saved = output
    with_lse = keyword_only_inputs.get("with_lse", False)  # its last saved tensor: returned, not kept
    ctx.save_for_backward(q, k, v, sinks, cu_seqlens, out, *(saved[:-1] if with_lse else saved))
    ctx.key, ctx.with_lse = key, with_lse


def _backward(ctx, dout, dsaved):
    q, k, v, sinks, cu_seqlens, out, *saved = ctx.saved_tensors
    dlse = dsaved[-1] if ctx.with_lse else None  # the returned lse's gradient (zeros when not in the loss)
    dout = torch.zeros_like(out) if dout is None else dout  # (only the lse in the loss)
    dq, dk, dv, ds = attention_bwd(dout.contiguous(), q, k, v, sinks, cu_seqlens, out, saved, ctx.key,
                                   None if dlse is None else dlse.contiguous())
    return dq, dk, dv, (ds if sinks is not None and ctx.needs_input_grad[3] else None), None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(q, k, v, arguments: dict, setup: Callable):
    """:func:`seqpar.attention` while Dynamo traces: register the options, emit the forward op.
    Returns ``out``, or ``(out, lse)`` (both differentiable) when ``arguments["return_lse"]`` is True.

    ``arguments``: every argument of the call by name; ``setup``: the entry point's
    ``(q, k, v, arguments, *, trace, first=True, needs_grad) -> (Function, args)``.
    """
    for name in TENSOR_ARGUMENTS:
        value = arguments[name]
        if not isinstance(value, torch.Tensor) and not (name == "sinks" and value is None):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    cu = arguments["cu_seqlens"]
    cu_tensor = isinstance(cu, torch.Tensor)
    sinks = arguments["sinks"]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    options = {name: value for name, value in arguments.items()
               if name not in TENSOR_ARGUMENTS and not (name == "cu_seqlens" and cu_tensor)}
    key = register_call(setup, needs_grad, cu_tensor, **options)
    heads = saved_heads(key, int(q.shape[2]), int(k.shape[2]))
    with_lse = arguments["return_lse"] is True  # (anything but a bool: the op's checks raise ValueError)
    out, saved = attention_fwd(q, k, v, sinks, cu if cu_tensor else None, key, heads, with_lse=with_lse)
    return (out, saved[-1]) if with_lse else out


__all__ = ["RegisteredCall", "attention_bwd", "attention_fwd", "compiled_attention", "register_call", "saved_heads"]
