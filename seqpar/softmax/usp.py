"""USP: Ulysses inside one mesh axis, a ring-family method across the other (docs/methods.md).

**Arrangement.** ``N = U·R`` ranks; rank ``(u, j)`` is member ``u`` of its Ulysses group (U ranks,
usually inside a node) and member ``j`` of its ring group (R ranks). ``u``, ``j`` are the ranks
inside those two ProcessGroups, so every order below is the groups' own member order.

**Layout** (what ``seqpar.shard(x, method="usp")`` gives): the ring method's layout over R
super-shards, each cut into U contiguous pieces of ``c = T/N`` tokens; rank ``(u, j)`` holds piece u
of super-shard j (:class:`seqpar.layouts.usp.USPLayout`); ``unshard`` inverts it exactly.

**Forward** (shapes per rank): q ``[B, c, Hq, D]``, k, v ``[B, c, Hkv, D]`` -> all-to-all inside the
Ulysses axis -> q ``[B, U·c, Hq/U, D]`` (the whole super-shard j, ring-local order, this member's
query heads) and k, v with the KV heads those heads use (GQA routing of :mod:`.ulysses`) -> the
ring method over the ring axis (the shared loop :func:`~seqpar.softmax.executor.ring_forward`, plan
from the registry for local length ``U·c``) -> out ``[B, U·c, Hq/U, D]`` -> inverse all-to-all ->
``[B, c, Hq, D]``. Backward runs the same primitives in reverse (one autograd Function, shared
with ``ulysses``). Volume per rank: Ulysses' volume for U ranks plus the ring method's volume for
R ranks on ``U·c`` tokens with ``n_me`` KV heads.

**Groups** (``group=``): a 2-D DeviceMesh, a pair ``(ulysses_group, ring_group)``, a
:class:`~seqpar.comm.usp_groups.USPGroups` from ``make_usp_groups`` or a plain group with
``ulysses_degree`` (:mod:`seqpar.comm.usp_groups`). With a plain group and ``1 < U < N`` the two
subgroups are built on every call (collective, with a warning): build them once with
``make_usp_groups`` and pass the result.

**Defaults.** ``ring_method="zigzag_ring"`` (balanced causal work). ``ulysses_degree`` =
``gcd(N, ranks per node)``, ranks per node from ``LOCAL_WORLD_SIZE`` (torchrun), else all N ranks
are taken to be on one node. Why: the all-to-all wants the intra-node links and inside a node it
moves fewer bytes than the ring for MHA ((U-1)/U·c·(2d+2d_kv) vs 2(U-1)·c·d_kv); the ring crosses
nodes, where its transfers overlap compute. The default cannot depend on Hq because ``shard`` and
``unshard`` (which see no heads) must agree with ``attention``; any Hq >= U is served (uneven head
shards, :mod:`.ulysses`), and for Hq < U the error names a degree that fits.
"""

from __future__ import annotations

import warnings

import torch

from ..comm.usp_groups import describe_usp, make_usp_groups
from ..methods import ring_method
from .executor import RingConfig
from .packed import packed_schedule
from .registry import dense_plan
from .ulysses import UlyssesAttention, UlyssesConfig, check_heads, ulysses_config
from .window import effective_window


def run_usp(q, k, v, call) -> torch.Tensor:
    """Runner of the ``usp`` method (``call``: the API's validated ``CallSpec``)."""
    return UlyssesAttention.apply(q, k, v, call.sinks, usp_setup(q, k, v, call))


def usp_setup(q, k, v, call) -> UlyssesConfig:
    """The :class:`UlyssesConfig` of a ``usp`` call, its ring axis inside.

    Everything that can fail is checked before the first collective (including building groups).
    """
    spec = ring_method(call.ring_method)
    axes = describe_usp(call.group, call.ulysses_degree)
    u = axes.ulysses_degree
    check_heads(q, u, what=f"ulysses_degree={u}" if call.ulysses_degree else
                f"the default ulysses_degree={u} (gcd(N, ranks per node))")
    t_super = axes.ulysses_degree * q.shape[1]
    # a window acts on the ring axis: the super-shards are the ring layout of the global sequence
    window = effective_window(call.window, call.packed, t_super * axes.ring_degree)
    if call.packed is not None:  # the ring member's packed stream, rebuilt by the all-to-all
        plan = packed_schedule(spec, call.packed, axes.j, call.causal, window)
    elif t_super % spec.layout_multiple:
        raise ValueError(f"q: ring_method={spec.name!r} needs an even super-shard (U*T_local = {t_super}); "
                         f"shard the sequence with seqpar.shard(x, method='usp', ...)")
    else:
        plan = dense_plan(spec, axes.j, axes.ring_degree, t_super, call.causal, window)
    if not axes.complete:
        warnings.warn("method='usp' builds its Ulysses and ring subgroups on this call (collective, and they "
                      "are not cached); build them once with make_usp_groups(group, ulysses_degree) and pass "
                      "the result as group=", stacklevel=3)
        axes = make_usp_groups(axes)
    ring = RingConfig(info=axes.ring, plan=plan, scale=call.scale, backend=call.backend,
                      grad_comm_dtype=call.grad_comm_dtype, stats=call.stats, trace=call.trace,
                      return_lse=call.return_lse)  # (here: the ring's backward may get a dlse)
    return ulysses_config(axes.ulysses, q, k, call, ring=ring)


__all__ = ["run_usp", "usp_setup"]
