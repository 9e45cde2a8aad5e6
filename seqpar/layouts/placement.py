"""A method's token layout bound to a group: this rank's shard of a global tensor, and the way back.

:func:`placement` is the one place that maps a method (and its group) to a layout object:

- :class:`RankPlacement`: a dense :class:`~seqpar.layouts.base.Layout` over a flat group (every
  method but usp);
- :class:`USPPlacement`: the :class:`~seqpar.layouts.usp.USPLayout` of a ``U x R`` USP arrangement.

Both shard and unshard dense tensors and packed streams (``cu_seqlens``), by the same two moves:
pick this rank's rows by index (local, no communication), and gather every rank's rows and put them
back in global order (one all-gather, or one per USP axis).
"""

from __future__ import annotations

import dataclasses

import torch

from ..comm import CommStats, GroupInfo, all_gather_stack, group_info
from ..comm.usp_groups import USPGroups, describe_usp
from ..methods import check_usp_options, ring_method
from ..methods import method as declared
from .base import Layout, layout_named
from .packed import PackedLayout, resolve_layout
from .usp import USPLayout


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0)


def _scatter_real(moved: torch.Tensor, pl: PackedLayout, member: int) -> torch.Tensor:
    """The padded local stream of ring/flat member ``member`` (real rows copied, padding zero)."""
    rows, src = pl.shard_index(member, moved.device)
    out = moved.new_zeros((pl.t_local, *moved.shape[1:]))
    out.index_copy_(0, rows, moved.index_select(0, src))
    return out


def _put_in_order(flat: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(flat)
    out[order] = flat
    return out


class Placement:
    """Interface: ``packed(cu_seqlens, total_tokens)``, ``shard(x, dim, cu_seqlens)``,
    ``unshard(x_local, dim, cu_seqlens, stats)``; ``dim`` is already a valid non-negative dim."""

    method: str

    def packed(self, cu_seqlens, total_tokens: int | None = None, argument: str = "cu_seqlens") -> PackedLayout:
        raise NotImplementedError

    def shard(self, x: torch.Tensor, dim: int, cu_seqlens=None) -> torch.Tensor:
        raise NotImplementedError

    def unshard(self, x_local: torch.Tensor, dim: int, cu_seqlens=None,
                stats: CommStats | None = None) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _check_rows(x_local: torch.Tensor, dim: int, rows: int, method: str) -> None:
        if x_local.shape[dim] != rows:
            raise ValueError(f"x_local has {x_local.shape[dim]} rows along dim {dim} but this packed batch holds "
                             f"{rows} per rank: pass the output of seqpar.shard with the same cu_seqlens, "
                             f"method={method!r} and group")


@dataclasses.dataclass(frozen=True)
class RankPlacement(Placement):
    """A dense layout over the flat group ``info``."""

    layout: Layout
    info: GroupInfo
    method: str

    def packed(self, cu_seqlens, total_tokens=None, argument="cu_seqlens"):
        return resolve_layout(cu_seqlens, self.layout, self.info.size, 1, total_tokens, argument=argument)

    def shard(self, x, dim, cu_seqlens=None):
        n, rank = self.info.size, self.info.rank
        if cu_seqlens is not None:
            pl = self.packed(cu_seqlens, x.shape[dim])
            return _scatter_real(_rows(x, dim), pl, rank).movedim(0, dim).contiguous()
        self.layout.check_length(x.shape[dim], n, method=self.method)
        return self.layout.take(x, dim, n, rank)

    def unshard(self, x_local, dim, cu_seqlens=None, stats=None):
        n = self.info.size
        pl = None if cu_seqlens is None else self.packed(cu_seqlens)
        if pl is not None:
            self._check_rows(x_local, dim, pl.t_local, self.method)
        elif self.layout.chunks > 1 and x_local.shape[dim] % self.layout.chunks:
            raise ValueError(f"x_local: the {self.layout.name} layout holds {self.layout.chunks} equal chunks, "
                             f"got a length of {x_local.shape[dim]}")
        moved = _rows(x_local, dim)
        gathered = all_gather_stack(self.info, moved, stats=stats, name="unshard_all_gather")
        flat = gathered.reshape(n * moved.shape[0], *moved.shape[1:])
        if pl is not None:
            return flat.index_select(0, pl.unshard_index(x_local.device)).movedim(0, dim).contiguous()
        T = flat.shape[0]
        order = torch.cat([self.layout.token_indices(T, n, r, device=x_local.device) for r in range(n)])
        return _put_in_order(flat, order).movedim(0, dim).contiguous()


@dataclasses.dataclass(frozen=True)
class USPPlacement(Placement):
    """The USP layout of ``axes``: ``ring`` laid out over the R ring members, cut in U pieces."""

    axes: USPGroups
    ring: Layout
    method: str = "usp"

    @property
    def layout(self) -> USPLayout:
        return USPLayout(self.ring, self.axes.ulysses_degree, self.axes.ring_degree)

    @property
    def member(self) -> int:
        """This rank's flat index ``i = j·U + u``."""
        return self.axes.j * self.axes.ulysses_degree + self.axes.u

    def packed(self, cu_seqlens, total_tokens=None, argument="cu_seqlens"):
        a = self.axes
        return resolve_layout(cu_seqlens, self.ring, a.ring_degree, a.ulysses_degree, total_tokens, argument=argument)

    def shard(self, x, dim, cu_seqlens=None):
        a, n = self.axes, self.axes.ulysses_degree * self.axes.ring_degree
        if cu_seqlens is not None:  # the ring member's padded stream, cut into U contiguous pieces
            pl = self.packed(cu_seqlens, x.shape[dim])
            stream = _scatter_real(_rows(x, dim), pl, a.j)
            c = pl.t_local // a.ulysses_degree
            return stream.narrow(0, a.u * c, c).movedim(0, dim).contiguous()
        self.layout.check_length(x.shape[dim], n)
        return self.layout.take(x, dim, n, self.member)

    def _gather(self, moved: torch.Tensor, stats) -> torch.Tensor:
        """Every rank's rows, flat member order (j-major: ring member j's U pieces in a row)."""
        a = self.axes
        if a.flat is not None:  # member i of the flat group is (i % U, i // U)
            gathered = all_gather_stack(a.flat, moved, stats=stats, name="unshard_all_gather")
        else:
            sup = all_gather_stack(a.ulysses, moved, stats=stats, name="unshard_all_gather")
            gathered = all_gather_stack(a.ring, sup.reshape(-1, *moved.shape[1:]), stats=stats,
                                        name="unshard_all_gather")
        return gathered.reshape(-1, *moved.shape[1:])

    def unshard(self, x_local, dim, cu_seqlens=None, stats=None):
        a = self.axes
        n = a.ulysses_degree * a.ring_degree
        moved = _rows(x_local, dim)
        if cu_seqlens is not None:
            pl = self.packed(cu_seqlens)
            self._check_rows(x_local, dim, pl.t_local // a.ulysses_degree, self.method)
            flat = self._gather(moved, stats)
            return flat.index_select(0, pl.unshard_index(x_local.device)).movedim(0, dim).contiguous()
        T = n * moved.shape[0]
        self.layout.check_length(T, n, argument="x_local")
        flat = self._gather(moved, stats)
        order = torch.cat([self.layout.token_indices(T, n, i, device=x_local.device) for i in range(n)])
        return _put_in_order(flat, order).movedim(0, dim).contiguous()


def placement(method, group=None, *, ulysses_degree: int | None = None,
              ring_method_name: str | None = None) -> Placement:
    """The :class:`Placement` of ``method`` on ``group`` (local: no communication, no new groups).

    ValueError for an unknown method, a usp-only option given to another method, or a group that
    does not fit (see :func:`seqpar.comm.usp_groups.describe_usp`)."""
    decl = declared(method)
    check_usp_options(method, ulysses_degree, ring_method_name)
    if decl.family == "usp":
        ring = layout_named(ring_method(ring_method_name).layout)
        return USPPlacement(describe_usp(group, ulysses_degree), ring)
    return RankPlacement(layout_named(decl.layout), group_info(group), method)


__all__ = ["Placement", "RankPlacement", "USPPlacement", "placement"]
