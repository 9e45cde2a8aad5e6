"""Token layouts as objects: which global positions each of N ranks holds, in local order.

One class per layout; every other piece of geometry derives from :meth:`Layout.positions`:

- ``Contiguous`` (``ring``, ``lightseq``, ``ulysses``, linear methods): rank r holds
  ``[r·c, (r+1)·c)`` with ``c = T/N``.
- ``Zigzag`` (``zigzag_ring``, ``allgather_kv``, ``token_ring``): the sequence is cut into 2N equal
  chunks; rank r holds chunks r and 2N-1-r, in that order.
- ``Striped`` (``striped_ring``): token i lives on rank ``i mod N``.

In every layout the local order is the global order (positions increase along the local rows).
That is what makes packed input simple (:mod:`seqpar.layouts.packed`): a document is padded at its
end to a multiple of ``chunks·N`` and laid out like a dense sequence, so the real tokens of every
rank's piece are a prefix of it, and a dense schedule clipped to those prefixes is exact.
USP composes a ring layout with contiguous Ulysses pieces (:mod:`seqpar.layouts.usp`).
"""

from __future__ import annotations

import torch


class Layout:
    """Base class: ``chunks`` equal chunks per rank; subclasses give :meth:`positions` and
    :meth:`real_count` (the same geometry, the second in closed form for long documents)."""

    name: str = "?"
    chunks: int = 1

    def multiple(self, n: int) -> int:
        """Global lengths this layout splits over ``n`` ranks are the multiples of this."""
        return self.chunks * n

    def positions(self, T: int, n: int, rank: int) -> list[int]:
        """Global positions held by ``rank``, in local order (``T`` a multiple of :meth:`multiple`)."""
        raise NotImplementedError

    def real_count(self, L: int, T: int, n: int, rank: int) -> int:
        """How many of ``rank``'s positions of a sequence padded to ``T`` lie below ``L`` (its real
        tokens, a prefix of its rows): ``sum(p < L for p in positions(T, n, rank))``."""
        raise NotImplementedError

    def token_indices(self, T: int, n: int, rank: int, device=None) -> torch.Tensor:
        """:meth:`positions` as an int64 tensor on ``device``."""
        return torch.tensor(self.positions(T, n, rank), dtype=torch.int64, device=device)

    def take(self, x: torch.Tensor, dim: int, n: int, rank: int) -> torch.Tensor:
        """``rank``'s rows of ``x`` along ``dim`` (a new tensor; the index never travels to the host)."""
        return x.index_select(dim, self.token_indices(x.shape[dim], n, rank, device=x.device))

    def check_length(self, T: int, n: int, *, method: str, argument: str = "x") -> None:
        """ValueError that says which multiple is needed when ``T`` does not split over ``n`` ranks."""
        multiple = self.multiple(n)
        if T % multiple:
            raise ValueError(
                f"{argument}: a sequence of {T} tokens cannot be split for method={method!r} over {n} ranks: "
                f"the {self.name} layout needs a length that is a multiple of {multiple}"
                f"{' (2N)' if self.chunks == 2 else ' (N)'}. Pad the sequence to "
                f"{-(-T // multiple) * multiple} tokens, or pass it as a packed batch with cu_seqlens, which "
                "accepts any length.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


def _clamp(x: int, hi: int) -> int:
    return max(0, min(x, hi))


class Contiguous(Layout):
    name = "contiguous"

    def positions(self, T, n, rank):
        c = T // n
        return list(range(rank * c, (rank + 1) * c))

    def real_count(self, L, T, n, rank):
        c = T // n
        return _clamp(L - rank * c, c)

    def token_indices(self, T, n, rank, device=None):
        c = T // n
        return torch.arange(rank * c, (rank + 1) * c, device=device)

    def take(self, x, dim, n, rank):  # one slice: no index tensor at all
        c = x.shape[dim] // n
        return x.narrow(dim, rank * c, c).contiguous()


class Zigzag(Layout):
    name = "zigzag"
    chunks = 2

    def positions(self, T, n, rank):
        h = T // (2 * n)
        return list(range(rank * h, (rank + 1) * h)) + list(range((2 * n - 1 - rank) * h, (2 * n - rank) * h))

    def real_count(self, L, T, n, rank):
        h = T // (2 * n)
        return _clamp(L - rank * h, h) + _clamp(L - (2 * n - 1 - rank) * h, h)

    def token_indices(self, T, n, rank, device=None):
        h = T // (2 * n)
        return torch.cat([torch.arange(rank * h, (rank + 1) * h, device=device),
                          torch.arange((2 * n - 1 - rank) * h, (2 * n - rank) * h, device=device)])


class Striped(Layout):
    name = "striped"

    def positions(self, T, n, rank):
        return list(range(rank, T, n))

    def real_count(self, L, T, n, rank):
        return max(0, -(-(L - rank) // n))

    def token_indices(self, T, n, rank, device=None):
        return torch.arange(rank, T, n, device=device)


#: the dense layouts by name (``seqpar.methods.Method.layout``; ``"usp"`` composes one of them)
LAYOUTS: dict[str, Layout] = {cls.name: cls() for cls in (Contiguous, Zigzag, Striped)}


def layout_named(name, *, argument: str = "layout") -> Layout:
    """The layout object of ``name`` (a :class:`Layout` is returned as is)."""
    if isinstance(name, Layout):
        return name
    if name not in LAYOUTS:
        raise ValueError(f"{argument}={name!r} is unknown: use one of {tuple(LAYOUTS)}")
    return LAYOUTS[name]


__all__ = ["Contiguous", "LAYOUTS", "Layout", "Striped", "Zigzag", "layout_named"]
