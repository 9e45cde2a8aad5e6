"""Rematerialisation-aware activation checkpointing (docs/methods.md, from DistAttn/LightSeq).

Layer-boundary checkpointing (``torch.utils.checkpoint`` around a whole transformer layer) re-runs
the layer in backward, including the attention forward and all its communication, although the
attention backward needs only q, k, v, out and lse. :func:`checkpoint` moves the boundary to the
attention output: the first forward runs the function once, keeping only its inputs and the
``(out, lse)`` of every seqpar attention call inside it; before backward the function is
recomputed, but each attention call then *replays* its recorded ``(out, lse)`` instead of
computing: only the cheap projections, norms and MLP run again. The attention forward and its
communication run once per training step; the attention backward runs as usual.

Memory per checkpointed layer: its inputs plus, per attention call, ``out [B, T_local, Hq, D]``
(input dtype) and ``lse [B, Hq, T_local]`` (fp32); Ulysses and USP keep ``out`` also in their
head-sharded layout, and their recomputation repeats one all-to-all (q, k, v to head shards, which
their backward needs) but not the attention, its ring or the output's all-to-all.

Example (a Llama-style stack; ``attn`` calls ``seqpar.attention``)::

    for layer in layers:
        x = seqpar.checkpoint(layer, x)      # instead of torch.utils.checkpoint.checkpoint

The function must call the attention the same way (same calls, same order, same shapes) when it
is recomputed; :class:`AttentionTape` checks that and raises otherwise. Randomness inside the
function (dropout) is handled by ``torch.utils.checkpoint`` as usual (RNG state is restored).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.utils.checkpoint as _torch_ckpt

# The tape of the innermost seqpar.checkpoint being run or recomputed in this thread, and the mode.
# A context variable, not a module switch: set only inside checkpoint()'s own dynamic extent.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("seqpar_attention_tape", default=None)


class AttentionTape:
    """The ``(out, lse)`` of each attention call of one checkpointed function call, in call order
    (``lse`` is whatever the call's backward needs besides its recomputed inputs: Ulysses and USP
    record their head-sharded ``(out, lse)`` there)."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, torch.Tensor, tuple]] = []
        self._next = 0
        self.replaying = False

    def record(self, out: torch.Tensor, lse) -> None:
        self.entries.append((out, lse, tuple(out.shape)))

    def replay(self, q: torch.Tensor, v: torch.Tensor) -> tuple:
        """The recorded result of the next attention call of the recomputation (its out:
        ``[B, T, Hq, D_v]``, q's rows and heads with v's head dim)."""
        if self._next >= len(self.entries):
            raise RuntimeError(
                f"seqpar.checkpoint: the recomputation called attention {self._next + 1} times, the forward "
                f"only {len(self.entries)}: the checkpointed function must make the same attention calls"
            )
        out, lse, shape = self.entries[self._next]
        if tuple(q.shape[:3]) + tuple(v.shape[3:]) != shape or q.dtype != out.dtype:
            raise RuntimeError(
                f"seqpar.checkpoint: attention call {self._next + 1} got q {tuple(q.shape)} {q.dtype}, v "
                f"{tuple(v.shape)} on "
                f"recomputation but recorded out {shape} {out.dtype}: the function is not deterministic"
            )
        self._next += 1
        return out, lse

    @contextlib.contextmanager
    def recording(self):
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def replaying_calls(self):
        token = _ACTIVE.set(self)
        self.replaying, self._next = True, 0
        try:
            yield
        finally:
            self.replaying = False
            _ACTIVE.reset(token)


def active_tape() -> AttentionTape | None:
    """The tape of the enclosing :func:`checkpoint` (None outside one)."""
    return _ACTIVE.get()


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with rematerialisation-aware activation checkpointing.

    Like ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` (same arguments,
    same results, gradients identical), except that the seqpar attention calls inside ``fn`` are
    not recomputed in backward: their ``(out, lse)`` are kept from the forward. Per training step,
    each attention forward (and its communication) therefore runs once instead of twice. Extra
    keyword arguments go to ``fn``; ``torch.utils.checkpoint`` options are not exposed.
    """
    tape = AttentionTape()
    return _torch_ckpt.checkpoint(fn, *args, use_reentrant=False,
                                  context_fn=lambda: (tape.recording(), tape.replaying_calls()), **kwargs)


def attention_context_fn():
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: a fresh tape per checkpointed call.

    Pass it wherever torch's checkpoint options are accepted (e.g. transformers'
    ``activation_checkpointing_kwargs``) to make that checkpointing rematerialisation-aware.
    """
    tape = AttentionTape()
    return tape.recording(), tape.replaying_calls()


def apply_checkpointing(model, mode: str = "attention"):
    """Turn on activation checkpointing per decoder layer of a transformers model.

    ``mode="attention"``: rematerialisation-aware (attention forwards are replayed, not recomputed);
    ``mode="layer"``: plain layer-boundary checkpointing. Goes through the model's public
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` on older transformers)
    with torch's ``context_fn`` option. Returns the model.
    """
    if mode not in ("attention", "layer"):
        raise ValueError(f"mode={mode!r}: choose 'attention' (rematerialisation-aware) or 'layer'")
    kwargs = {"use_reentrant": False}
    if mode == "attention":
        kwargs["context_fn"] = attention_context_fn
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"model: {type(model).__name__} has no activation_checkpointing_enable(); wrap its layers "
                         f"with seqpar.checkpoint(layer, *args) instead")
    return model
