"""The process groups of USP: ``U x R`` ranks, Ulysses inside one axis, a ring method across the other.

``group=`` of ``method="usp"`` may be a 2-D DeviceMesh (dims named ``"ulysses"`` and ``"ring"``,
otherwise ordered (ulysses, ring)), a pair ``(ulysses_group, ring_group)`` of ProcessGroups, a
:class:`USPGroups` from :func:`make_usp_groups`, or a plain ProcessGroup / None with
``ulysses_degree``. In the last case Ulysses groups are blocks of U consecutive ranks
(``u = rank % U``, ``j = rank // U``) and the two subgroups are built by :func:`make_usp_groups`
(collective over the whole job); build them once and pass the returned object.

Default ``ulysses_degree``: ``gcd(N, ranks per node)``, ranks per node from ``LOCAL_WORLD_SIZE``
(torchrun), else all N ranks are taken to be on one node (see :mod:`seqpar.softmax.usp` for why).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch.distributed as dist

from .groups import GroupInfo, _is_device_mesh, group_info


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
