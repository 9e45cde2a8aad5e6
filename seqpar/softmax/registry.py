"""The plan builders of the ring-family methods, resolved from their declarations in :mod:`seqpar.methods`.

A declaration names its builder as ``"module:function"``; nothing here lists methods. A builder is
``(rank, n, t_local, causal, transport) -> RingPlan | Schedule`` (:mod:`.plans`).
"""

from __future__ import annotations

import importlib
from typing import Callable

from ..methods import Method


def plan_builder(decl: Method) -> Callable:
    """The schedule builder a ring-family declaration names."""
    if decl.family != "ring" or decl.plan is None:
        raise ValueError(f"method={decl.name!r} is not a ring-family method: it has no schedule")
    module, _, name = decl.plan.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"method={decl.name!r}: its plan {decl.plan!r} cannot be loaded ({exc})") from None


def dense_plan(decl: Method, rank: int, n: int, t_local: int, causal: bool):
    """This rank's plan for a dense local length ``t_local`` (``.schedule(t_local)`` expands it)."""
    return plan_builder(decl)(rank, n, t_local, causal, decl.transport)


__all__ = ["dense_plan", "plan_builder"]
