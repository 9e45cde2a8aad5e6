"""Autograd and threads for the fake-NCCL ranks (:mod:`.fake_nccl`).

Autograd over fake CUDA tensors aborts the process (it records the CUDA stream of every input), so
no graph is ever recorded: :func:`function_apply` replaces ``torch.autograd.Function.apply``, runs
``forward`` with a stand-in ``ctx`` and puts the call on the rank's tape; :func:`tape_backward`
(what ``tensor.backward`` and ``torch.autograd.grad`` do there) runs the taped Functions' ``backward``
last first, with gradients shaped like their outputs, and checks each gradient against its input.
Only seqpar's own Functions matter here (ring, Ulysses/USP, linear): the gradients of the
surrounding model are not computed.
"""

from __future__ import annotations

import contextlib
import threading
from unittest import mock

import torch


class _Ctx:
    """Stand-in for an autograd ``ctx``: saved tensors, and every tensor input needing a gradient."""

    def __init__(self, args):
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args)
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *args):
        pass

    def mark_dirty(self, *args):
        pass

    def set_materialize_grads(self, value):
        pass


def function_apply(run, call_site):
    """``torch.autograd.Function.apply`` for the rank ``run``: forward now, backward on the tape."""
    def apply(cls, *args, **kwargs):
        ctx = _Ctx(args)
        with torch.no_grad():
            out = cls.forward(ctx, *args, **kwargs)
        run.tape.append((cls, ctx, args, out, call_site()))
        return out

    return classmethod(apply)


def tape_backward(run) -> None:
    """Run the recorded Functions' backward, last first, with gradients shaped like their outputs."""
    tape, run.tape = run.tape, []
    for cls, ctx, args, out, site in reversed(tape):
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outs]
        with torch.no_grad():
            res = cls.backward(ctx, *grads)
        res = res if isinstance(res, tuple) else (res,)
        run.backward_calls.append((cls.__name__, site))
        for i, a in enumerate(args):
            g = res[i] if i < len(res) else None
            if not isinstance(a, torch.Tensor) or g is None:
                continue
            if (g.shape, g.dtype, g.device) != (a.shape, a.dtype, a.device):
                run.flag("gradient unlike its input", f"{cls.__name__}.backward", site,
                         f"input {i}: {tuple(a.shape)} {a.dtype} on {a.device}, gradient {tuple(g.shape)} "
                         f"{g.dtype} on {g.device}")


@contextlib.contextmanager
def inline_threads():
    """seqpar's helper threads (the All-Scan chain) run at ``start()``, in the calling thread: torch's
    fake tensor mode is not thread-safe and dispatch modes are per thread. Transfers complete at
    once on the fake group, so the order of work is the same as with a thread; ``join`` returns."""
    start, join = threading.Thread.start, threading.Thread.join

    def inline_start(self):
        if getattr(self._target, "__module__", "").startswith("seqpar"):
            self._seqpar_inline = True
            self.run()
        else:
            start(self)

    def inline_join(self, timeout=None):
        if not getattr(self, "_seqpar_inline", False):
            join(self, timeout)

    with mock.patch.object(threading.Thread, "start", inline_start), \
            mock.patch.object(threading.Thread, "join", inline_join):
        yield
