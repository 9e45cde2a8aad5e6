"""USP: Ulysses inside one mesh axis, a ring-family method across the other (ALGORITHMS.md §4).

**Arrangement.** ``N = U·R`` ranks; rank ``(u, j)`` is member ``u`` of its Ulysses group (U ranks,
usually inside a node) and member ``j`` of its ring group (R ranks). ``u``, ``j`` are the ranks
inside those two ProcessGroups, so every order below is the groups' own member order.

**Layout composition** (what ``seqpar.shard(x, method="usp")`` gives; ``c = T/N``):

1. the ring method's layout over R *super-shards* of ``T/R`` tokens: super-shard ``j`` is
   ``token_indices(T, R, j, ring layout)`` in ring-local order (contiguous, zigzag or striped);
2. super-shard ``j`` is cut into U contiguous pieces of ``c`` tokens; rank ``(u, j)`` holds piece u.

So rank ``(u, j)`` holds ``ring_tokens(j)[u·c : (u+1)·c]``; a global length must be a multiple of
``R·lcm(m, U)`` (m = 2 for the zigzag layout, else 1). ``unshard`` inverts it exactly (one gather
over the whole group when the caller gave one, else over the Ulysses axis and then the ring axis).

**Forward** (shapes per rank): q ``[B, c, Hq, D]``, k, v ``[B, c, Hkv, D]`` -> all-to-all inside the
Ulysses axis -> q ``[B, U·c, Hq/U, D]`` (the whole super-shard j, ring-local order, this member's
query heads) and k, v with the KV heads those heads use (GQA routing of :mod:`.ulysses`) -> the
ring method over the ring axis (the shared loop :func:`~seqpar.attention.ring.ring_forward`, plan
from the registry for local length ``U·c``) -> out ``[B, U·c, Hq/U, D]`` -> inverse all-to-all ->
``[B, c, Hq, D]``. Backward runs the same primitives in reverse (one autograd Function, shared
with ``ulysses``). Volume per rank: Ulysses' volume for U ranks plus the ring method's volume for
R ranks on ``U·c`` tokens with ``n_me`` KV heads.

**Groups** (``group=``): a 2-D DeviceMesh (dims named ``"ulysses"`` and ``"ring"``, otherwise
ordered (ulysses, ring)); a pair ``(ulysses_group, ring_group)`` of ProcessGroups; a
:class:`USPGroups` from :func:`make_usp_groups`; or a plain ProcessGroup / None with
``ulysses_degree``. In the last case Ulysses groups are blocks of U consecutive ranks
(``u = rank % U``, ``j = rank // U``) and the two subgroups are built on every call when
``1 < U < N``: ``torch.distributed.new_group`` is collective over the whole job, so every rank must
call with the same arguments. Build them once with :func:`make_usp_groups` and pass the returned
object instead (it is the only place they are cached: an object the caller owns).

**Defaults.** ``ring_method="zigzag_ring"`` (balanced causal work). ``ulysses_degree`` =
``gcd(N, ranks per node)``, ranks per node from ``LOCAL_WORLD_SIZE`` (torchrun), else all N ranks
are taken to be on one node. Why: the all-to-all wants the intra-node links and inside a node it
moves fewer bytes than the ring for MHA ((U-1)/U·c·(2d+2d_kv) vs 2(U-1)·c·d_kv); the ring crosses
nodes, where its transfers overlap compute. The default cannot depend on Hq because ``shard`` and
``unshard`` (which see no heads) must agree with ``attention``; when Hq is not divisible by the
default, the error names a degree that fits.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..comm import CommStats, GroupInfo, all_gather_stack, group_info
from ..comm.groups import _is_device_mesh
from ..layout import LAYOUT_MULTIPLE, token_indices
from .registry import REGISTRY, MethodSpec
from .ring import RingConfig
from .ulysses import UlyssesAttention, check_heads, ulysses_config

DEFAULT_RING_METHOD = "zigzag_ring"


@dataclass(frozen=True)
class USPGroups:
    """This rank's place in a USP arrangement: ``ulysses_degree x ring_degree`` ranks.

    ``u``/``j``: this rank's member index on the Ulysses / ring axis. ``ulysses``/``ring``: the two
    axes (None until built, for a plain group with ``1 < U < N``). ``flat``: the whole group as one
    ProcessGroup when the caller gave one (member ``i`` is ``(i % U, i // U)``), else None.
    """

    ulysses_degree: int
    ring_degree: int
    u: int
    j: int
    ulysses: GroupInfo | None = None
    ring: GroupInfo | None = None
    flat: GroupInfo | None = None

    @property
    def complete(self) -> bool:
        return self.ulysses is not None and self.ring is not None


def default_ulysses_degree(n: int) -> int:
    """``gcd(N, ranks per node)``; ranks per node from ``LOCAL_WORLD_SIZE``, else N (one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(local) if local.isdigit() and int(local) > 0 else n
    return math.gcd(n, per_node)


def ring_method_spec(ring_method: str | None) -> MethodSpec:
    """The registry entry of the ring-axis method (any ring-family method, present or future)."""
    name = DEFAULT_RING_METHOD if ring_method is None else ring_method
    ring_methods = tuple(n for n, s in REGISTRY.items() if s.family == "ring" and s.plan is not None)
    if not isinstance(name, str) or name not in ring_methods:
        raise ValueError(f"ring_method={name!r} is not a ring-family method; choose one of {', '.join(ring_methods)}")
    return REGISTRY[name]


def _single(global_rank: int) -> GroupInfo:
    return GroupInfo(None, 0, 1, (global_rank,))


def _degree_mismatch(where: str, found: int, given: int) -> ValueError:
    return ValueError(f"group: {where} has {found} ranks on the Ulysses axis but ulysses_degree={given}; "
                      f"pass ulysses_degree={found} (or None), or a group arranged for {given}")


def _from_mesh(mesh, ulysses_degree) -> USPGroups:
    if mesh.ndim != 2:
        raise ValueError(f"group: method='usp' takes a 2-D DeviceMesh (ulysses, ring), got a {mesh.ndim}-D mesh")
    names = tuple(mesh.mesh_dim_names or ())
    dims = (names.index("ulysses"), names.index("ring")) if {"ulysses", "ring"} <= set(names) else (0, 1)
    if ulysses_degree is not None and ulysses_degree != mesh.size(dims[0]):
        raise _degree_mismatch(f"the DeviceMesh of shape {tuple(mesh.shape)} (ulysses = dim {dims[0]})",
                               mesh.size(dims[0]), ulysses_degree)
    ulysses, ring = (group_info(mesh.get_group(d)) for d in dims)
    return USPGroups(ulysses.size, ring.size, ulysses.rank, ring.rank, ulysses, ring)


def _from_pair(pair, ulysses_degree) -> USPGroups:
    if len(pair) != 2:
        raise ValueError(f"group: expected a pair (ulysses_group, ring_group), got {len(pair)} groups")
    ulysses = group_info(pair[0], argument="group[0] (the Ulysses group)")
    ring = group_info(pair[1], argument="group[1] (the ring group)")
    shared = set(ulysses.global_ranks) & set(ring.global_ranks)
    if len(shared) != 1:
        raise ValueError(f"group: the Ulysses group {list(ulysses.global_ranks)} and the ring group "
                         f"{list(ring.global_ranks)} must meet in exactly this rank (a U x R grid)")
    if ulysses_degree is not None and ulysses_degree != ulysses.size:
        raise _degree_mismatch("the Ulysses group", ulysses.size, ulysses_degree)
    return USPGroups(ulysses.size, ring.size, ulysses.rank, ring.rank, ulysses, ring)


def describe_usp(group=None, ulysses_degree: int | None = None) -> USPGroups:
    """Resolve ``group`` (any form above) and the degrees, locally: no communication, no new groups.

    Raises ValueError for a wrong group type, a mesh of the wrong shape, or a degree that does not
    divide the group or does not match the mesh / pair.
    """
    if ulysses_degree is not None and (isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int)
                                       or ulysses_degree < 1):
        raise ValueError(f"ulysses_degree={ulysses_degree!r}: expected a positive int or None (default)")
    if isinstance(group, USPGroups):
        if ulysses_degree is not None and ulysses_degree != group.ulysses_degree:
            raise _degree_mismatch("the USPGroups", group.ulysses_degree, ulysses_degree)
        return group
    if _is_device_mesh(group):
        return _from_mesh(group, ulysses_degree)
    if isinstance(group, (tuple, list)):
        return _from_pair(group, ulysses_degree)
    flat = group_info(group)
    n = flat.size
    u_deg = default_ulysses_degree(n) if ulysses_degree is None else ulysses_degree
    if n % u_deg:
        raise ValueError(f"ulysses_degree={u_deg} does not divide the {n} ranks of group; pass a divisor of {n}")
    me = flat.global_ranks[flat.rank]
    ulysses = flat if u_deg == n else (_single(me) if u_deg == 1 else None)
    ring = flat if u_deg == 1 else (_single(me) if u_deg == n else None)
    return USPGroups(u_deg, n // u_deg, flat.rank % u_deg, flat.rank // u_deg, ulysses, ring, flat)


def make_usp_groups(group=None, ulysses_degree: int | None = None) -> USPGroups:
    """Build the Ulysses and ring subgroups of a plain group once; pass the result as ``group=``.

    Collective over the whole job when ``1 < ulysses_degree < N`` (``torch.distributed.new_group``):
    every rank must call it with the same arguments, in the same order relative to other group
    creations; ``group`` must then span the whole world (for a smaller sequence-parallel group pass
    a 2-D DeviceMesh or a pair of groups instead). Ulysses groups are blocks of U consecutive ranks.
    A mesh, a pair or a USPGroups is returned as resolved, without creating anything.
    """
    axes = describe_usp(group, ulysses_degree)
    if axes.complete:
        return axes
    flat, u_deg, r_deg = axes.flat, axes.ulysses_degree, axes.ring_degree
    if flat.global_ranks != tuple(range(dist.get_world_size())):
        raise ValueError(
            "group: make_usp_groups creates subgroups with torch.distributed.new_group, which every "
            "process of the job must enter, so it needs the whole world as group; for a smaller "
            "sequence-parallel group pass a 2-D DeviceMesh or a (ulysses_group, ring_group) pair"
        )
    # every rank creates every group, in the same order; it keeps the two it belongs to
    ulysses = [dist.new_group([j * u_deg + u for u in range(u_deg)]) for j in range(r_deg)][axes.j]
    ring = [dist.new_group([j * u_deg + u for j in range(r_deg)]) for u in range(u_deg)][axes.u]
    return replace(axes, ulysses=group_info(ulysses), ring=group_info(ring))


# ----------------------------------------------------------------------------- layout


def usp_length_multiple(ulysses_degree: int, ring_degree: int, ring_method: str | None = None) -> int:
    """Global lengths USP splits evenly are the multiples of R·lcm(m, U), with m the ring layout's
    own multiple (2 for zigzag: two chunks per ring rank)."""
    return ring_degree * math.lcm(LAYOUT_MULTIPLE[ring_method_spec(ring_method).layout], ulysses_degree)


def _check_length(T: int, axes: USPGroups, spec: MethodSpec, argument: str) -> None:
    m = LAYOUT_MULTIPLE[spec.layout]
    multiple = usp_length_multiple(axes.ulysses_degree, axes.ring_degree, spec.name)
    if T % multiple:
        raise ValueError(
            f"{argument}: a sequence of {T} tokens cannot be split for method='usp' with "
            f"ulysses_degree={axes.ulysses_degree} x {axes.ring_degree} ranks of ring_method={spec.name!r}: "
            f"the length must be a multiple of R*lcm({m}, U) = {multiple}; pad it to {-(-T // multiple) * multiple}"
        )


def usp_token_indices(T: int, axes: USPGroups, ring_layout: str, u: int, j: int, device=None) -> torch.Tensor:
    """Global token indices held by rank ``(u, j)``, in local order (see the module docstring)."""
    c = T // (axes.ulysses_degree * axes.ring_degree)
    return token_indices(T, axes.ring_degree, j, ring_layout, device=device)[u * c:(u + 1) * c]


def shard_usp(x: torch.Tensor, *, group, dim: int, ulysses_degree, ring_method) -> torch.Tensor:
    """This rank's part of ``x`` in the USP layout (local: no communication, no new groups)."""
    spec = ring_method_spec(ring_method)
    axes = describe_usp(group, ulysses_degree)
    _check_length(x.shape[dim], axes, spec, "x")
    idx = usp_token_indices(x.shape[dim], axes, spec.layout, axes.u, axes.j, device=x.device)
    return x.index_select(dim, idx)


def unshard_usp(x_local: torch.Tensor, *, group, dim: int, ulysses_degree, ring_method,
                stats: CommStats | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_usp`; a collective over the whole USP group."""
    spec = ring_method_spec(ring_method)
    axes = describe_usp(group, ulysses_degree)
    moved = x_local.movedim(dim, 0)
    u_deg, r_deg = axes.ulysses_degree, axes.ring_degree
    T = u_deg * r_deg * moved.shape[0]
    _check_length(T, axes, spec, "x_local")
    if axes.flat is not None:  # one gather; member i is (i % U, i // U)
        gathered = all_gather_stack(axes.flat, moved, stats=stats, name="unshard_all_gather")
        order = [usp_token_indices(T, axes, spec.layout, i % u_deg, i // u_deg) for i in range(u_deg * r_deg)]
    else:  # super-shard over the Ulysses axis, then the ring layout over the ring axis
        sup = all_gather_stack(axes.ulysses, moved, stats=stats, name="unshard_all_gather")
        gathered = all_gather_stack(axes.ring, sup.reshape(-1, *moved.shape[1:]), stats=stats,
                                    name="unshard_all_gather")
        order = [token_indices(T, r_deg, j, spec.layout) for j in range(r_deg)]
    flat = gathered.reshape(T, *moved.shape[1:])
    out = torch.empty_like(flat)
    out[torch.cat(order).to(x_local.device)] = flat
    return out.movedim(0, dim).contiguous()


def shard_usp_packed(x: torch.Tensor, cu_seqlens, *, group, dim: int, ulysses_degree, ring_method) -> torch.Tensor:
    """Packed input: the ring member's padded packed stream (ring method's layout over R members,
    padded to a multiple of U), cut into U contiguous pieces; rank (u, j) holds piece u. Local."""
    from .packed import resolve_layout

    spec = ring_method_spec(ring_method)
    axes = describe_usp(group, ulysses_degree)
    pl = resolve_layout(cu_seqlens, spec.layout, axes.ring_degree, axes.ulysses_degree, x.shape[dim])
    rows, src = pl.shard_index(axes.j, x.device)
    moved = x.movedim(dim, 0)
    stream = moved.new_zeros((pl.t_local, *moved.shape[1:]))
    stream.index_copy_(0, rows, moved.index_select(0, src))
    c = pl.t_local // axes.ulysses_degree
    return stream.narrow(0, axes.u * c, c).movedim(0, dim).contiguous()


def unshard_usp_packed(x_local: torch.Tensor, cu_seqlens, *, group, dim: int, ulysses_degree, ring_method,
                       stats: CommStats | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_usp_packed` (padding removed); a collective over the USP group."""
    from .packed import resolve_layout

    spec = ring_method_spec(ring_method)
    axes = describe_usp(group, ulysses_degree)
    pl = resolve_layout(cu_seqlens, spec.layout, axes.ring_degree, axes.ulysses_degree, None)
    moved = x_local.movedim(dim, 0)
    if moved.shape[0] * axes.ulysses_degree != pl.t_local:
        raise ValueError(f"x_local has {moved.shape[0]} rows along dim {dim} but this packed batch holds "
                         f"{pl.t_local // axes.ulysses_degree} per rank: pass the output of seqpar.shard with "
                         "the same cu_seqlens, method='usp' and group")
    if axes.flat is not None:  # member i = (i % U, i // U): j-major, so the rows are ring streams in order
        gathered = all_gather_stack(axes.flat, moved, stats=stats, name="unshard_all_gather")
    else:
        sup = all_gather_stack(axes.ulysses, moved, stats=stats, name="unshard_all_gather")
        gathered = all_gather_stack(axes.ring, sup.reshape(-1, *moved.shape[1:]), stats=stats,
                                    name="unshard_all_gather")
    flat = gathered.reshape(axes.ring_degree * pl.t_local, *moved.shape[1:])
    return flat.index_select(0, pl.unshard_index(x_local.device)).movedim(0, dim).contiguous()


# ----------------------------------------------------------------------------- runner


def run_usp(q, k, v, call) -> torch.Tensor:
    """Runner of the ``usp`` method (``call``: the API's validated ``CallSpec``).

    Everything that can fail is checked before the first collective (including building groups).
    """
    spec = ring_method_spec(call.ring_method)
    axes = describe_usp(call.group, call.ulysses_degree)
    check_heads(q, axes.ulysses_degree, what="ulysses_degree" if call.ulysses_degree else
                "the default ulysses_degree (gcd(N, ranks per node))")
    t_super = axes.ulysses_degree * q.shape[1]
    if call.packed is not None:  # the ring member's packed stream, rebuilt by the all-to-all
        from .packed import packed_schedule  # local import: packed imports this package's registry

        plan = packed_schedule(spec, call.packed, axes.j, call.causal)
    elif t_super % LAYOUT_MULTIPLE[spec.layout]:
        raise ValueError(f"q: ring_method={spec.name!r} needs an even super-shard (U*T_local = {t_super}); "
                         f"shard the sequence with seqpar.shard(x, method='usp', ...)")
    else:
        plan = spec.plan(axes.j, axes.ring_degree, t_super, call.causal, spec.transport)
    if not axes.complete:
        warnings.warn("method='usp' builds its Ulysses and ring subgroups on this call (collective, and they "
                      "are not cached); build them once with make_usp_groups(group, ulysses_degree) and pass "
                      "the result as group=", stacklevel=3)
        axes = make_usp_groups(axes)
    ring = RingConfig(info=axes.ring, plan=plan, scale=call.scale, backend=call.backend,
                      grad_comm_dtype=call.grad_comm_dtype, stats=call.stats)
    return UlyssesAttention.apply(q, k, v, ulysses_config(axes.ulysses, q, k, call, ring=ring))


def check_usp_options(method, ulysses_degree, ring_method) -> None:
    """ValueError when a USP-only option is given to another method."""
    if method != "usp":
        for name, value in (("ulysses_degree", ulysses_degree), ("ring_method", ring_method)):
            if value is not None:
                raise ValueError(f"{name}={value!r}: only method='usp' takes it (method={method!r}); "
                                 f"drop it, or use method='usp'")
