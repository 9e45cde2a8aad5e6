"""``seqpar.shard`` / ``seqpar.unshard``: a global tensor into the layout a method needs, and back.

``shard`` gives this rank's part (local, no communication); ``unshard`` gathers the parts from every
rank and restores global order (every rank gets the full tensor). Call them on everything indexed by
token: inputs, labels, position ids. The layouts are described in :mod:`seqpar.layouts.base` (dense),
:mod:`seqpar.layouts.packed` (``cu_seqlens``) and :mod:`seqpar.layouts.usp`; which one a method uses
is :func:`seqpar.layouts.placement.placement`.
"""

from __future__ import annotations

import torch

from ..comm import CommStats, TokenRingGroups
from ..comm.agreement import agreed, agreement_groups, check_ranks_enabled
from ..comm.fingerprint import call_fields
from ..methods import method as declared
from .packed import PackedLayout
from .placement import placement
from .stream import StreamLayout, check_stream_method, stream_layout, stream_shard, stream_unshard


def layout_of(method: str) -> str:
    """Name of the token layout used by ``method`` (ValueError for an unknown method)."""
    return declared(method).layout


def _check_dim(x, dim, argument: str) -> None:
    """``dim`` must name a dimension of ``x`` (no silent wrap-around of an out-of-range dim)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{argument}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is not a dimension of {argument} with shape {tuple(x.shape)}: pass the "
                         f"token dimension, an int in [{-x.dim()}, {x.dim() - 1}]")


def _check_packed_method(method: str, cu_seqlens) -> None:
    """Packed input is sharded per document for the softmax methods only."""
    if cu_seqlens is not None and not declared(method).softmax:
        raise NotImplementedError(
            f"cu_seqlens: method={method!r} is a linear method: its packed batches are sharded densely "
            "(contiguous, no padding); call seqpar.shard without cu_seqlens and pass cu_seqlens to the "
            "linear attention call")


def _check_ranks(entry: str, arguments: dict) -> None:
    """The cross-rank agreement of :mod:`seqpar.comm.agreement` for shard/unshard: the local checks
    that need no tensor geometry first (an error on some ranks only stops every rank), then every
    argument (shape, dtype, dim, method, cu_seqlens, group members ...) compared across ranks."""
    x = arguments["x"] if "x" in arguments else arguments["x_local"]
    group, method = arguments["group"], arguments["method"]
    ulysses_degree, ring_method = arguments["ulysses_degree"], arguments["ring_method"]

    def local_checks() -> None:
        placement(method, group, ulysses_degree=ulysses_degree, ring_method_name=ring_method)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")

    usp = isinstance(method, str) and method == "usp"
    agreed(agreement_groups(group, usp=usp, ulysses_degree=ulysses_degree), entry, call_fields(arguments),
           local_checks, device=x.device if isinstance(x, torch.Tensor) and x.is_cuda else None)


def _plain(group):
    """The process group or mesh behind ``group``: a ``TokenRingGroups`` (one group plus a duplicate
    communicator per traffic direction for ``seqpar.attention``) places tokens by its group."""
    return group.group if isinstance(group, TokenRingGroups) else group


def shard(x: torch.Tensor, *, group=None, method: str = "zigzag_ring", dim: int = 1, cu_seqlens=None,
          ulysses_degree: int | None = None, ring_method: str | None = None,
          check_ranks: bool = False) -> torch.Tensor:
    """This rank's part of a global tensor, in the layout ``method`` needs.

    Args:
        x: the global tensor, identical on every rank, e.g. ``[B, T_global, H, D]`` with ``dim=1``.
        group: ProcessGroup or 1-D DeviceMesh of the sequence-parallel ranks (None = world), or the
            ``TokenRingGroups`` given to ``seqpar.attention`` (its group is used).
        method: a softmax method of ``seqpar.METHODS`` or a linear method (contiguous shards).
        dim: the token dimension of ``x``.
        ulysses_degree, ring_method: ``method="usp"`` only, as given to ``seqpar.attention``.
        cu_seqlens: packed input (softmax methods): ``x`` is ``[1, T_total, ...]`` along ``dim``,
            ``cu_seqlens`` its global document offsets (int32, or a ``seqpar.packed_layout``).
            Every document is split in the method's layout and padded inside the library; the
            result is this rank's padded local stream (padding rows zero), the same length on
            every rank. Validated (ValueError) before anything else.
        check_ranks: True = first check with ceil(log2 N) small messages that every rank passed the same
            shape, dtype, dim, method and cu_seqlens (:mod:`seqpar.comm.agreement`); every rank then
            raises the same ValueError naming the disagreeing rank. Off unless asked for here: the
            environment variable ``SEQPAR_CHECK_RANKS`` does not apply to ``shard``, which is
            otherwise purely local (a variable must not turn it into a collective behind the caller).
    Returns:
        ``x`` restricted to this rank's tokens along ``dim``: ``T_local = T_global / N`` tokens.
        Purely local (no communication) unless ``check_ranks``.
    """
    group = _plain(group)
    arguments = dict(locals())
    if check_ranks is not False:
        if check_ranks is not True:
            raise ValueError(f"check_ranks: expected True or False, got {check_ranks!r}")
        _check_ranks("seqpar.shard", arguments)
    _check_dim(x, dim, "x")
    where = placement(method, group, ulysses_degree=ulysses_degree, ring_method_name=ring_method)
    _check_packed_method(method, cu_seqlens)
    if isinstance(cu_seqlens, StreamLayout):  # contiguous pieces of the stream (seqpar.layouts.stream)
        check_stream_method(method)
        return stream_shard(x, dim % x.dim(), cu_seqlens, where.info)
    return where.shard(x, dim % x.dim(), cu_seqlens)


def unshard(x_local: torch.Tensor, *, group=None, method: str = "zigzag_ring", dim: int = 1, cu_seqlens=None,
            stats: CommStats | None = None, ulysses_degree: int | None = None,
            ring_method: str | None = None, check_ranks: bool | None = None) -> torch.Tensor:
    """Gather every rank's part and restore global token order; every rank gets the full tensor.

    Inverse of :func:`shard`: ``unshard(shard(x)) == x`` exactly. ``x_local`` must have the same
    shape on every rank. This is a collective over ``group``. ``check_ranks`` (None = on, unless the
    environment variable ``SEQPAR_CHECK_RANKS=0``, read at each call): first check with ceil(log2 N)
    messages of 56 bytes each way per rank that every rank passed the same arguments (shape, dtype, dim, method,
    cu_seqlens, group members); every rank then raises a ValueError naming the disagreeing rank and
    argument instead of gathering mismatched buffers (which aborts a gloo process). ``False`` skips it.
    ``group`` as in :func:`shard`.
    """
    group = _plain(group)
    arguments = dict(locals())
    if torch.compiler.is_compiling():  # a collective with its rank check: runs between two graphs
        return _unshard_between_graphs(**arguments)
    if check_ranks_enabled(check_ranks):
        _check_ranks("seqpar.unshard", arguments)
    _check_dim(x_local, dim, "x_local")
    where = placement(method, group, ulysses_degree=ulysses_degree, ring_method_name=ring_method)
    _check_packed_method(method, cu_seqlens)
    if isinstance(cu_seqlens, StreamLayout):
        check_stream_method(method)
        return stream_unshard(x_local, dim % x_local.dim(), cu_seqlens, where.info, stats)
    return where.unshard(x_local, dim % x_local.dim(), cu_seqlens, stats)


def packed_layout(cu_seqlens, *, method: str = "zigzag_ring", group=None, ulysses_degree: int | None = None,
                  ring_method: str | None = None, split: str = "documents") -> PackedLayout | StreamLayout:
    """Build the packed geometry of a batch once; pass it as ``cu_seqlens=`` to ``seqpar.shard``,
    ``seqpar.unshard`` and ``seqpar.attention`` (same method and group) instead of the tensor.

    ``split``: ``"documents"`` (default, :mod:`seqpar.layouts.packed`): every document is split over
    all ranks in the method's layout (balanced, padded inside the library). ``"stream"``
    (:mod:`seqpar.layouts.stream`, ``method="ring"`` only): the packed stream ``[1, T_total]`` is cut
    into N contiguous pieces of ``T_total / N`` tokens, documents crossing rank boundaries (what a
    loader that slices a packed stream produces); each rank fetches only the K,V rows its documents
    need. Validates ``cu_seqlens`` (ValueError); local, no communication. Schedules and device index
    tensors are cached on the returned object, so every layer after the first reuses them.
    """
    declared(method, kind="softmax")
    group = _plain(group)
    if split not in ("documents", "stream"):
        raise ValueError(f"split={split!r}: expected 'documents' (every document split over the ranks) or "
                         "'stream' (the packed stream cut into N contiguous pieces)")
    if split == "stream":
        check_stream_method(method)
        return stream_layout(cu_seqlens, placement(method, group).info.size)
    return placement(method, group, ulysses_degree=ulysses_degree, ring_method_name=ring_method).packed(cu_seqlens)


# Under torch.compile, unshard (usually called outside the compiled model, on its outputs) runs
# eagerly between two graphs: a graph break, or with fullgraph=True an error giving this reason.
# shard is local indexing and compiles as it is.
_unshard_between_graphs = torch.compiler.disable(
    unshard, reason="seqpar.unshard runs outside torch.compile graphs (a graph break): call it on the compiled "
                    "function's outputs, or compile with fullgraph=False")

__all__ = ["layout_of", "packed_layout", "shard", "unshard"]
