"""Token layouts: which tokens each rank holds, as objects (dense, packed, USP, Ulysses blocks), and
``shard`` / ``unshard``. Above :mod:`seqpar.kernels` and :mod:`seqpar.comm`, below the attention
families, which read their geometry from here."""

from .base import LAYOUTS, Contiguous, Layout, Striped, Zigzag, layout_named
from .packed import PackedLayout, check_cu_seqlens, resolve_layout
from .placement import Placement, RankPlacement, USPPlacement, placement
from .shard import layout_of, packed_layout, shard, unshard
from .stream import StreamLayout, stream_layout
from .usp import USPLayout

__all__ = ["Contiguous", "LAYOUTS", "Layout", "PackedLayout", "Placement", "RankPlacement", "StreamLayout", "Striped",
           "USPLayout", "USPPlacement", "Zigzag", "check_cu_seqlens", "layout_named", "layout_of", "packed_layout",
           "placement", "resolve_layout", "shard", "stream_layout", "unshard"]
