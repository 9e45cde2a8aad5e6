"""Token layouts: which global tokens each rank holds, for every method.

``shard`` turns a global tensor into this rank's part in the layout a method needs; ``unshard``
gathers the parts from every rank and restores global order (every rank gets the full tensor).
Call them on everything indexed by token: inputs, labels, position ids.

Layouts (N ranks, global length T):

- ``contiguous`` (``ring``, ``lightseq``, ``ulysses``, linear methods): rank r holds
  ``[r·T/N, (r+1)·T/N)``. Needs ``T % N == 0``.
- ``zigzag`` (``zigzag_ring``, ``allgather_kv``, ``token_ring``): the sequence is cut into 2N equal
  chunks and rank r holds chunks r and 2N-1-r, in that order. Needs ``T % 2N == 0``.
- ``striped`` (``striped_ring``): token i lives on rank ``i mod N``. Needs ``T % N == 0``.
- ``usp`` (``usp``): the composition of :mod:`seqpar.attention.usp`: the ring method's layout over R
  super-shards, each cut into U contiguous pieces; rank (u, j) holds piece u of super-shard j.
  Needs ``T % (R·lcm(m, U)) == 0`` (m = 2 for a zigzag ring method, else 1). ``shard``/``unshard``
  then take the same ``group``, ``ulysses_degree`` and ``ring_method`` as ``seqpar.attention``.
"""

from __future__ import annotations

import torch

from .comm import CommStats, all_gather_stack, group_info
from .packing import shard_packed, unshard_packed

LAYOUT_MULTIPLE = {"contiguous": 1, "zigzag": 2, "striped": 1}


def layout_of(method: str) -> str:
    """Name of the token layout used by ``method`` (ValueError for an unknown method)."""
    from .attention.registry import method_spec  # local import: the registry imports this module

    return method_spec(method, argument="method").layout


def check_global_length(T: int, n: int, layout: str, *, method: str, argument: str = "x") -> None:
    """Raise a ValueError that says which multiple is needed when T does not fit the layout."""
    multiple = LAYOUT_MULTIPLE[layout] * n
    if T % multiple:
        raise ValueError(
            f"{argument}: a sequence of {T} tokens cannot be split for method={method!r} over {n} ranks: "
            f"the {layout} layout needs a length that is a multiple of {multiple}"
            f"{' (2N)' if layout == 'zigzag' else ' (N)'}. Pad the sequence to "
            f"{-(-T // multiple) * multiple} tokens, or pass it as a packed batch with cu_seqlens, which "
            f"accepts any length once packed variable-length support has landed."
        )


def _packed_method(method: str) -> None:
    """Packed input is sharded per document for the softmax methods only."""
    from .attention.registry import METHODS, method_spec  # local import: the registry imports this module

    method_spec(method, argument="method")
    if method not in METHODS:
        raise NotImplementedError(
            f"cu_seqlens: method={method!r} is a linear method: its packed batches are sharded densely "
            "(contiguous, no padding); call seqpar.shard without cu_seqlens and pass cu_seqlens to the "
            "linear attention call")


def token_indices(T: int, n: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """Global token indices held by ``rank`` (in local order)."""
    if layout == "contiguous":
        c = T // n
        return torch.arange(rank * c, (rank + 1) * c, device=device)
    if layout == "zigzag":
        h = T // (2 * n)
        first = torch.arange(rank * h, (rank + 1) * h, device=device)
        second = torch.arange((2 * n - 1 - rank) * h, (2 * n - rank) * h, device=device)
        return torch.cat([first, second])
    if layout == "striped":
        return torch.arange(rank, T, n, device=device)
    raise ValueError(f"unknown layout {layout!r}")


def _usp_module(method, ulysses_degree, ring_method):
    """:mod:`seqpar.attention.usp` when ``method == "usp"`` (its layout composes two), else None."""
    from .attention import usp  # local import: the attention package imports this module

    usp.check_usp_options(method, ulysses_degree, ring_method)
    return usp if method == "usp" else None


def _check_dim(x, dim, argument: str) -> None:
    """``dim`` must name a dimension of ``x`` (no silent wrap-around of an out-of-range dim)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{argument}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is not a dimension of {argument} with shape {tuple(x.shape)}: pass the "
                         f"token dimension, an int in [{-x.dim()}, {x.dim() - 1}]")


def _check_ranks(entry, x, group, method, dim, cu_seqlens, ulysses_degree, ring_method) -> None:
    """The cross-rank agreement gather of :mod:`seqpar.comm.agreement` for shard/unshard: the local
    checks that need no tensor geometry first (an error on some ranks only stops every rank), then
    shape, dtype, dim, method and cu_seqlens compared across ranks."""
    from .attention.api import _agreement_groups  # local import: the attention package imports this module
    from .comm.agreement import agreed, offsets_fingerprint, shape_of

    def local_checks() -> None:
        _usp_module(method, ulysses_degree, ring_method)
        layout_of(method)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")

    fields = {"method": repr(method), "x of shape": shape_of(x), "dtype": str(getattr(x, "dtype", None)),
              "dim": repr(dim), "cu_seqlens": offsets_fingerprint(cu_seqlens),
              "ulysses_degree": repr(ulysses_degree), "ring_method": repr(ring_method)}
    agreed(_agreement_groups(method, group, ulysses_degree), entry, fields, local_checks,
           device=x.device if isinstance(x, torch.Tensor) and x.is_cuda else None)


def shard(x: torch.Tensor, *, group=None, method: str = "zigzag_ring", dim: int = 1, cu_seqlens=None,
          ulysses_degree: int | None = None, ring_method: str | None = None,
          check_ranks: bool = False) -> torch.Tensor:
    """This rank's part of a global tensor, in the layout ``method`` needs.

    Args:
        x: the global tensor, identical on every rank, e.g. ``[B, T_global, H, D]`` with ``dim=1``.
        group: ProcessGroup or 1-D DeviceMesh of the sequence-parallel ranks (None = world).
        method: a softmax method of ``seqpar.METHODS`` or a linear method (contiguous shards).
        dim: the token dimension of ``x``.
        ulysses_degree, ring_method: ``method="usp"`` only, as given to ``seqpar.attention``.
        cu_seqlens: packed input (softmax methods): ``x`` is ``[1, T_total, ...]`` along ``dim``,
            ``cu_seqlens`` its global document offsets (int32, or a ``seqpar.packed_layout``).
            Every document is split in the method's layout and padded inside the library; the
            result is this rank's padded local stream (padding rows zero), the same length on
            every rank. Validated (ValueError) before anything else.
        check_ranks: True = first check with one small all-gather that every rank passed the same
            shape, dtype, dim, method and cu_seqlens (:mod:`seqpar.comm.agreement`); every rank then
            raises the same ValueError naming the disagreeing rank. Off unless asked for here: the
            environment variable ``SEQPAR_CHECK_RANKS`` does not apply to ``shard``, which is
            otherwise purely local (a variable must not turn it into a collective behind the caller).
    Returns:
        ``x`` restricted to this rank's tokens along ``dim``: ``T_local = T_global / N`` tokens.
        Purely local (no communication) unless ``check_ranks``.
    """
    if check_ranks is not False:
        if check_ranks is not True:
            raise ValueError(f"check_ranks: expected True or False, got {check_ranks!r}")
        _check_ranks("seqpar.shard", x, group, method, dim, cu_seqlens, ulysses_degree, ring_method)
    _check_dim(x, dim, "x")
    usp = _usp_module(method, ulysses_degree, ring_method)
    if cu_seqlens is not None:
        _packed_method(method)
        if usp is not None:
            return usp.shard_usp_packed(x, cu_seqlens, group=group, dim=dim % x.dim(),
                                        ulysses_degree=ulysses_degree, ring_method=ring_method)
        from .attention.packed import resolve_layout

        info = group_info(group)
        pl = resolve_layout(cu_seqlens, layout_of(method), info.size, 1, x.shape[dim % x.dim()])
        return shard_packed(x, None, group, pl, dim)
    if usp is not None:
        return usp.shard_usp(x, group=group, dim=dim % x.dim(), ulysses_degree=ulysses_degree,
                             ring_method=ring_method)
    info = group_info(group)
    layout = layout_of(method)
    dim = dim % x.dim()
    check_global_length(x.shape[dim], info.size, layout, method=method)
    if layout == "contiguous":  # a slice whose start is known on the host (no device index to read back)
        t_local = x.shape[dim] // info.size
        return x.narrow(dim, info.rank * t_local, t_local).contiguous()
    return x.index_select(dim, token_indices(x.shape[dim], info.size, info.rank, layout, device=x.device))


def unshard(x_local: torch.Tensor, *, group=None, method: str = "zigzag_ring", dim: int = 1, cu_seqlens=None,
            stats: CommStats | None = None, ulysses_degree: int | None = None,
            ring_method: str | None = None, check_ranks: bool | None = None) -> torch.Tensor:
    """Gather every rank's part and restore global token order; every rank gets the full tensor.

    Inverse of :func:`shard`: ``unshard(shard(x)) == x`` exactly. ``x_local`` must have the same
    shape on every rank. This is a collective over ``group``. ``check_ranks`` (None = the
    environment variable ``SEQPAR_CHECK_RANKS=1``, read at each call): first check with one small
    all-gather that every rank passed the same shape, dtype, dim, method and cu_seqlens; every rank
    then raises the same ValueError naming the disagreeing rank instead of gathering mismatched buffers.
    """
    from .comm.agreement import check_ranks_enabled

    if check_ranks_enabled(check_ranks):
        _check_ranks("seqpar.unshard", x_local, group, method, dim, cu_seqlens, ulysses_degree, ring_method)
    _check_dim(x_local, dim, "x_local")
    usp = _usp_module(method, ulysses_degree, ring_method)
    if cu_seqlens is not None:
        _packed_method(method)
        if usp is not None:
            return usp.unshard_usp_packed(x_local, cu_seqlens, group=group, dim=dim % x_local.dim(),
                                          ulysses_degree=ulysses_degree, ring_method=ring_method, stats=stats)
        from .attention.packed import resolve_layout

        info = group_info(group)
        pl = resolve_layout(cu_seqlens, layout_of(method), info.size, 1, None)
        return unshard_packed(x_local, None, group, pl, dim, stats=stats)
    if usp is not None:
        return usp.unshard_usp(x_local, group=group, dim=dim % x_local.dim(), ulysses_degree=ulysses_degree,
                               ring_method=ring_method, stats=stats)
    info = group_info(group)
    layout = layout_of(method)
    dim = dim % x_local.dim()
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(f"x_local: the zigzag layout holds two equal chunks, got an odd length {x_local.shape[dim]}")
    moved = x_local.movedim(dim, 0)
    gathered = all_gather_stack(info, moved, stats=stats, name="unshard_all_gather")  # [N, T_local, ...]
    T = gathered.shape[0] * gathered.shape[1]
    flat = gathered.reshape(T, *moved.shape[1:])
    order = torch.cat([token_indices(T, info.size, r, layout, device=x_local.device) for r in range(info.size)])
    out = torch.empty_like(flat)
    out[order] = flat
    return out.movedim(0, dim).contiguous()
