"""The plan builders of the ring-family methods, resolved from their declarations in :mod:`seqpar.methods`.

A declaration names its builder as ``"module:function"``; nothing here lists methods. A builder is
``(rank, n, t_local, causal, transport) -> RingPlan | Schedule`` (:mod:`.plans`); a windowed
builder (``window_plan``) takes the window too (:mod:`.window`).
"""

from __future__ import annotations

import importlib
from typing import Callable

from ..methods import Method


def plan_builder(decl: Method, windowed: bool = False) -> Callable:
    """The schedule builder a ring-family declaration names (``windowed``: its ``window_plan``)."""
    target = decl.window_plan if windowed else decl.plan
    if decl.family != "ring" or target is None:
        what = "a windowed schedule" if windowed and decl.family == "ring" else "a schedule"
        raise ValueError(f"method={decl.name!r} has no {what}")
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"method={decl.name!r}: its plan {target!r} cannot be loaded ({exc})") from None


def dense_plan(decl: Method, rank: int, n: int, t_local: int, causal: bool, window: int | None = None):
    """This rank's plan for a dense local length ``t_local`` (``.schedule(t_local)`` expands it);
    with a ``window``, the method's windowed plan."""
    if window is None:
        return plan_builder(decl)(rank, n, t_local, causal, decl.transport)
    return plan_builder(decl, windowed=True)(rank, n, t_local, causal, decl.transport, window)


__all__ = ["dense_plan", "plan_builder"]
