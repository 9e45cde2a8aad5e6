"""Block masks as bands of visible diagonals, their reduction to the visible sub-block, and the
cut of a band into plain pieces. Host-side integer geometry only (no torch).

Inside one block, query ``i`` and key ``j`` are counted from 0 (TOP-LEFT alignment when
``Tq != Tk``). A mask is a :class:`Band` ``(lo, hi)``: key ``j`` is visible to query ``i`` iff
``lo <= j - i <= hi`` (``None``: unbounded on that side). The three named masks are bands:

- ``"none"`` = ``Band(None, None)``: every key;
- ``"causal"`` = ``Band(None, 0)``: ``j <= i``;
- ``"causal_strict"`` = ``Band(None, -1)``: ``j < i`` (the second diagonal of striped layouts).

A sliding window adds a lower bound. Between query rows at global offset ``oq`` and key rows at
``ok`` of two contiguous pieces, a causal window of ``W`` tokens (query ``p`` sees keys
``p - W < p' <= p``) is ``Band(oq - ok - (W - 1), oq - ok)``; the symmetric non-causal window
(``|p - p'| < W``) is ``Band(oq - ok - (W - 1), oq - ok + (W - 1))``. Plans name a band only
where it cuts a block; everywhere else they keep the names.

:func:`plan_block` reduces any band to the rows and keys that see / are seen by something and
re-expresses it there: plain ``none`` or top-left ``causal``, or (a window) a :class:`Band` with
a finite bound. :func:`band_pieces` cuts such a reduced band into pieces that are plain
``none`` / ``causal`` / ``causal_strict`` blocks, some of them on reversed rows and keys (a lower
edge ``j >= i + lo`` is an upper edge once both orders are reversed), so that a kernel that only
knows the named masks computes a window with no masked work beyond the diagonals' triangles.
"""

from __future__ import annotations

import dataclasses
import operator

MASKS = ("none", "causal", "causal_strict")


@dataclasses.dataclass(frozen=True)
class Band:
    """Visible diagonals of a block: query ``i`` sees key ``j`` iff ``lo <= j - i <= hi``
    (``None``: no bound on that side). Both bounds ints; ``lo <= hi`` when both are given."""

    lo: int | None = None
    hi: int | None = None

    def __post_init__(self) -> None:
        for name in ("lo", "hi"):
            x = getattr(self, name)
            if x is not None and (isinstance(x, bool) or not hasattr(x, "__index__")):
                raise ValueError(f"Band.{name}={x!r} must be an int or None")
            if x is not None:
                object.__setattr__(self, name, operator.index(x))
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise ValueError(f"Band(lo={self.lo}, hi={self.hi}): lo must be <= hi (no key would be visible)")

    def shifted(self, rows: int, keys: int) -> "Band":
        """The same band in the frame of a sub-block starting ``rows`` rows and ``keys`` keys in."""
        d = rows - keys
        return Band(None if self.lo is None else self.lo + d, None if self.hi is None else self.hi + d)

    def sees(self, i: int, j: int) -> bool:
        return (self.lo is None or j - i >= self.lo) and (self.hi is None or j - i <= self.hi)


NAMED = {"none": Band(None, None), "causal": Band(None, 0), "causal_strict": Band(None, -1)}


def check_mask(mask) -> None:
    """Raise ``ValueError`` unless ``mask`` is one of :data:`MASKS` or a :class:`Band`."""
    if not isinstance(mask, Band) and mask not in MASKS:
        raise ValueError(f"mask={mask!r} is not supported: use one of {MASKS} or a Band(lo, hi)")


def as_band(mask) -> Band:
    """The :class:`Band` of a named mask or of a band."""
    check_mask(mask)
    return mask if isinstance(mask, Band) else NAMED[mask]


def canonical(mask) -> "str | Band":
    """A named mask when the band equals one, else the band (plans keep names where they can)."""
    band = as_band(mask)
    return next((name for name, b in NAMED.items() if b == band), band)


def window_band(offset: int, window: int, causal: bool, stride: int = 1) -> Band | None:
    """The band of a block between a query piece and a key piece under a sliding window, or
    ``None`` when no pair of the two pieces is in the window.

    Pieces hold global positions ``g_q + stride * i`` and ``g_k + stride * j``; ``offset`` is
    ``g_q - g_k``, so ``p - p' = offset - stride * (j - i)``. Causal: ``0 <= p - p' < window``;
    else ``|p - p'| < window``. With stride 1 that is ``Band(offset - (window - 1), offset)``
    (causal) or ``Band(offset - (window - 1), offset + (window - 1))``.
    """
    lo = (offset - window) // stride + 1
    hi = offset // stride if causal else _ceil_div(window + offset, stride) - 1
    return Band(lo, hi) if lo <= hi else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """The part of a masked ``[tq, tk]`` block that any key reaches.

    Rows ``q_start:q_stop`` meet keys ``k_start:k_stop``; rows outside see nothing and keys
    outside are seen by no row. In that sub-block every row sees at least one key, and the mask
    is ``causal`` (top-left ``j <= i``, then ``k_stop - k_start <= q_stop - q_start``), plain
    (``causal`` False, ``window`` None) or ``window``, a :class:`Band` in sub-block coordinates
    with at least one bound that cuts it. ``empty``: no row sees any key.
    """

    q_start: int
    k_stop: int
    causal: bool
    tq: int
    tk: int
    k_start: int = 0
    q_stop: int | None = None  # None: tq
    window: Band | None = None

    def __post_init__(self) -> None:
        if self.q_stop is None:
            object.__setattr__(self, "q_stop", self.tq)

    @property
    def empty(self) -> bool:
        return self.q_start >= self.q_stop or self.k_stop <= self.k_start

    @property
    def rows(self) -> int:
        return max(0, self.q_stop - self.q_start)

    @property
    def keys(self) -> int:
        return max(0, self.k_stop - self.k_start)

    @property
    def square(self) -> bool:
        """True when the sub-block is square (top-left == bottom-right causal)."""
        return self.rows == self.keys


def plan_block(tq: int, tk: int, mask) -> BlockPlan:
    """Reduce ``mask`` (a name of :data:`MASKS` or a :class:`Band`) on a ``[tq, tk]`` block
    (top-left aligned) to a :class:`BlockPlan`.

    Row ``i`` sees keys ``max(0, i + lo) .. min(tk - 1, i + hi)``, so rows
    ``max(0, -hi) .. min(tq, tk - lo)`` see something and keys ``max(0, lo) .. min(tk, tq + hi)``
    are seen. ``none``: all rows, all keys; ``causal``: keys ``:min(tk, tq)``; ``causal_strict``:
    rows ``1:`` as plain causal against keys ``:min(tk, tq - 1)``. A bound that no longer cuts the
    sub-block is dropped.
    """
    band = as_band(mask)
    lo, hi = band.lo, band.hi
    q0 = 0 if hi is None else max(0, -hi)
    q1 = tq if lo is None else max(q0, min(tq, tk - lo))
    k0 = 0 if lo is None else max(0, lo)
    k1 = tk if hi is None else max(k0, min(tk, tq + hi))
    if q1 <= q0 or k1 <= k0:
        return BlockPlan(tq, 0, hi is not None and lo is None, tq, tk)
    sub = band.shifted(q0, k0)
    lo, hi = sub.lo, sub.hi
    if hi is not None and hi >= k1 - k0 - 1:
        hi = None
    if lo is not None and lo <= -(q1 - q0 - 1):
        lo = None
    causal = lo is None and hi == 0
    window = None if lo is None and hi in (None, 0) else Band(lo, hi)
    return BlockPlan(q0, k1, causal, tq, tk, k_start=k0, q_stop=q1, window=window)


def visible_pairs(tq: int, tk: int, mask) -> int:
    """Number of (query, key) pairs a ``[tq, tk]`` block sees under ``mask`` (top-left)."""
    p = plan_block(tq, tk, mask)
    if p.empty:
        return 0
    n, last = p.rows, p.keys - 1
    band = p.window or as_band("causal" if p.causal else "none")
    hi, lo = band.hi, band.lo
    # sum over rows of min(last, i + hi) - max(0, i + lo) + 1, in closed form
    if hi is None:
        top = n * last
    else:
        t = min(max(last - hi + 1, 0), n)  # rows with i + hi <= last
        top = t * (t - 1) // 2 + t * hi + (n - t) * last
    if lo is None:
        bottom = 0
    else:
        u = min(max(-lo, 0), n)  # rows with i + lo < 0 see key 0 first
        bottom = (n - u) * (u + n - 1) // 2 + (n - u) * lo
    return top - bottom + n


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``q0:q1`` against keys ``k0:k1`` of a reduced block under the named ``mask``, applied
    top-left to the rows and keys as they are (``flip`` False) or with both orders reversed."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: str
    flip: bool = False


def band_pieces(tq: int, tk: int, band: Band) -> tuple[Piece, ...]:
    """Cut the window ``band`` of a reduced ``[tq, tk]`` block (:attr:`BlockPlan.window`) into
    :class:`Piece` s whose visible pairs are exactly the band's, each once.

    With both bounds, the rows that see key 0 form one piece (an upper edge), and the others go in
    tiles of ``w = hi - lo + 1`` (the band's width): a tile meets a lower triangle (``j >= i + lo``: ``causal`` on reversed rows and keys), possibly a full
    rectangle, and an upper triangle (``j <= i + hi``: ``causal_strict``). A single upper bound
    ``hi > 0`` is a full rectangle (keys ``:hi + 1``) and a ``causal_strict`` block; a single lower
    bound is the same on reversed orders.
    """
    out: list[Piece] = []
    if band.lo is None or band.hi is None:
        _one_edge(0, tq, 0, tk, band, out)
        return tuple(out)
    lo, hi = band.lo, band.hi
    w = hi - lo + 1
    first = min(tq, 1 - lo)  # rows i <= -lo see key 0: the lower edge does not cut them
    _reduce(0, first, 0, tk, band, out)
    for a in range(first, tq, w):
        m = min(w, tq - a)
        for k0, k1 in ((a + lo, a + m + lo), (a + m + lo, a + hi + 1), (a + hi + 1, a + m + hi)):
            k0, k1 = max(k0, 0), min(k1, tk)
            if k1 > k0:
                _reduce(a, a + m, k0, k1, band, out)
    return tuple(out)


def _reduce(q0: int, q1: int, k0: int, k1: int, band: Band, out: list) -> None:
    """Append the pieces of rows ``q0:q1`` x keys ``k0:k1`` of a block under ``band`` (block frame)."""
    p = plan_block(q1 - q0, k1 - k0, band.shifted(q0, k0))
    if p.empty:
        return
    q0, q1, k0, k1 = q0 + p.q_start, q0 + p.q_stop, k0 + p.k_start, k0 + p.k_stop
    if p.window is None:
        out.append(Piece(q0, q1, k0, k1, "causal" if p.causal else "none"))
    elif p.window.lo is not None and p.window.hi is not None:
        raise AssertionError(f"internal: a tile of a band kept both edges ({p.window})")  # pragma: no cover
    else:
        _one_edge(q0, q1, k0, k1, p.window, out)


def _one_edge(q0: int, q1: int, k0: int, k1: int, band: Band, out: list) -> None:
    """A reduced sub-block whose band has one bound: an upper edge ``hi >= 0`` (keys up to ``hi``
    are seen by every row, the rest is ``causal_strict``), or a lower edge, which is an upper edge
    ``hi' = (k1 - k0) - (q1 - q0) - lo`` of the block with rows and keys reversed."""
    flip = band.hi is None
    hi = (k1 - k0) - (q1 - q0) - band.lo if flip else band.hi
    if hi == 0:  # top-left causal in the reversed frame
        out.append(Piece(q0, q1, k0, k1, "causal", flip))
        return
    split = hi + 1  # keys [0, hi] in the (possibly reversed) frame are visible to every row
    if flip:
        full, rest = (k1 - split, k1), (k0, k1 - split)
    else:
        full, rest = (k0, k0 + split), (k0 + split, k1)
    out.append(Piece(q0, q1, full[0], full[1], "none"))
    if rest[1] > rest[0] and q1 - q0 > 1:
        out.append(Piece(q0, q1, rest[0], rest[1], "causal_strict", flip))
