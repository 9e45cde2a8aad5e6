"""What the compiled forms of ``seqpar.attention`` and ``seqpar.linear_attention`` share: the registry
that hands a call's non-tensor arguments to a ``torch.library`` custom op as an int key, and the rules
an op's outputs must follow.

Under ``torch.compile`` each call is one opaque custom op each way (:mod:`seqpar.softmax.compiled`,
:mod:`seqpar.linear.compiled`). An op takes tensors and a few constants; the rest of a call (its
group, method, a ``CommStats`` or ``Trace`` of the caller's, ...) is registered when Dynamo traces
the call (``torch.compiler.assume_constant_result``: the key becomes a constant of the graph) and
looked up when the op runs. A :class:`CallRegistry` is append-only and keyed by value (an unhashable
option such as a ``CommStats`` by identity), holds no tensors, is never read in eager mode and is
written only by the process that traced the graph, so a key always means the same call.

Imports nothing of seqpar (the bottom layer, beside :mod:`seqpar.tracing`).
"""

from __future__ import annotations

from typing import Any

import torch


class Identity:
    """An unhashable option (a ``CommStats``, a list of groups, a ``Trace``) compared by identity."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return id(self.value)

    def __eq__(self, other):
        return isinstance(other, Identity) and other.value is self.value


def real(value):
    """The caller's object behind what Dynamo hands a constant function (a ProcessGroup arrives as
    a fake script object wrapping the real one); lists become tuples."""
    value = getattr(value, "real_obj", value)
    if isinstance(value, (list, tuple)):
        return tuple(real(x) for x in value)
    return value


def hashable(value):
    """``value`` itself when hashable, else an :class:`Identity` of it."""
    try:
        hash(value)
        return value
    except TypeError:
        return Identity(value)


def made_while_tracing(value) -> bool:
    """Whether Dynamo handed a constant function a stand-in for a seqpar object that the traced code
    itself creates (``stats = CommStats()`` inside the compiled function): such a stand-in is an
    instance whose attributes were never set, and the object the compiled code later returns is
    another one, so nothing counted into the stand-in could ever reach the caller."""
    if isinstance(value, tuple):
        return any(made_while_tracing(x) for x in value)
    attrs = getattr(value, "__dict__", None)
    return attrs is not None and not attrs and type(value).__module__.split(".")[0] == "seqpar"


def option_items(options: dict) -> tuple[tuple[str, Any], ...]:
    """A call's options as sorted ``(name, value)`` pairs, each value the caller's own object.

    Raises ``ValueError`` for an option object created inside the compiled function (see
    :func:`made_while_tracing`): the op would record into an object made while tracing, not the one
    the function returns."""
    items = tuple(sorted((name, real(value)) for name, value in options.items()))
    for name, value in items:
        if made_while_tracing(value):
            raise ValueError(f"{name}: this {type(value).__name__} is created inside the function torch.compile "
                             f"traces, so the compiled code cannot record into it; create it before the compiled "
                             f"function and pass it in (e.g. as an argument)")
    return items


def option_key(items: tuple[tuple[str, Any], ...]) -> tuple:
    """The value the registry keys ``items`` (from :func:`option_items`) on."""
    return tuple((name, hashable(value)) for name, value in items)


class CallRegistry:
    """Calls by int key, for the op named ``op`` (module docstring): ``register(value, call)`` returns
    the key of ``value`` (a hashable description of the call), storing ``call`` the first time."""

    def __init__(self, op: str, entry: str) -> None:
        self.op, self.entry = op, entry
        self._calls: list = []
        self._keys: dict = {}

    def register(self, value: tuple, call) -> int:
        if value not in self._keys:
            self._keys[value] = len(self._calls)
            self._calls.append(call)
        return self._keys[value]

    def get(self, key: int):
        if not 0 <= key < len(self._calls):
            raise RuntimeError(f"{self.op}: call key {key} was not issued in this process; a compiled graph that "
                               f"calls {self.entry} must be traced (torch.compile) in the process that runs it")
        return self._calls[key]


class FunctionCtx:
    """Stands in for autograd's ctx when an op runs an autograd Function's forward or backward
    directly: ``saved_tensors``, ``cfg``, ``needs_input_grad`` and any other attribute the Function
    reads (``**attrs``)."""

    def __init__(self, saved_tensors=(), cfg=None, needs_input_grad=(), **attrs):
        self.saved_tensors, self.cfg, self.needs_input_grad = tuple(saved_tensors), cfg, needs_input_grad
        self.__dict__.update(attrs)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):  # the op's outputs: the compiled wrappers detach them
        pass


def standard(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the contiguous strides a fake implementation promises (a copy only when not)."""
    if t.stride() == torch.empty(t.shape, device="meta").stride():
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def fresh(t: torch.Tensor, others) -> torch.Tensor:
    """``t``, copied when it shares memory with one of ``others``: an op's outputs may alias neither
    its inputs nor each other (a one-member Ulysses axis returns its inputs as the head-sharded
    tensors; allgather_kv's dK, dV are two halves of one reduce-scatter buffer; rank 0's incoming
    linear state is ``initial_state`` itself)."""
    if any(o is not None and o.numel() and t.numel() and o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
           for o in others):
        return t.clone()
    return t


def op_outputs(tensors, inputs) -> list[torch.Tensor]:
    """``tensors`` as op outputs: contiguous, aliasing neither ``inputs`` nor each other."""
    out: list[torch.Tensor] = []
    for t in tensors:
        out.append(standard(fresh(t, tuple(inputs) + tuple(out))))
    return out


__all__ = ["CallRegistry", "FunctionCtx", "Identity", "fresh", "hashable", "made_while_tracing", "op_outputs",
           "option_items", "option_key", "real", "standard"]
