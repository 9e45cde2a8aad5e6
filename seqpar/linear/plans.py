"""Scan plans: how the ranks exchange their states. ZeCO, LASP-2 and LASP-1 differ only here.

A plan is a frozen :class:`ScanPlan`; :func:`make_exchange` turns it into the object the shared
forward/backward (:mod:`seqpar.linear.ops`) drives through four calls::

    start_fwd(local, decay, first)   # local = S_loc [R, H, K, V], decay = Gamma_end [R, H, K]
    finish_fwd(want_final)           # -> (S_in [R, H, K, V], final state or None)
    start_bwd(local, decay, dht)     # local = this rank's own part of dS_in; dht = d(final state) or None
    finish_bwd()                     # -> dS_out [R, H, K, V] (the gradient of the state leaving this rank)

``overlap=True`` starts the exchange before the intra-chunk compute, ``False`` after it (LASP-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.allscan import (
    ChainScan,
    allgather_start,
    broadcast_from,
    fold_forward,
    fold_reverse,
    reduce_to,
)
from ..comm.groups import GroupInfo
from ..comm.stats import CommStats
from ..methods import LINEAR_METHODS
from ..methods import method as declared


@dataclass(frozen=True)
class ScanPlan:
    """``exchange``: ``"chain"`` (point-to-point All-Scan) or ``"allgather"`` (every state to every
    rank, combined locally). ``n_blocks``: row blocks along K that travel the chain separately.
    ``overlap``: post the exchange before the intra-chunk compute."""

    name: str
    exchange: str
    n_blocks: int = 1
    overlap: bool = True

    def __post_init__(self):
        if self.exchange not in ("chain", "allgather"):
            raise ValueError(f"method: ScanPlan.exchange must be 'chain' or 'allgather', got {self.exchange!r}")
        if not isinstance(self.n_blocks, int) or self.n_blocks < 1:
            raise ValueError(f"method: ScanPlan.n_blocks must be a positive int, got {self.n_blocks!r}")


#: the scan plans, by the ``plan`` name of the linear methods' declarations (seqpar.methods)
PLANS: dict[str, ScanPlan] = {
    # All-Scan: 4 row blocks of K pipeline the chain (about one state transfer plus N-1 block
    # latencies); the blocks are forwarded by a helper thread while the intra-chunk part computes.
    "zeco": ScanPlan("zeco", "chain", n_blocks=4, overlap=True),
    # LASP-2: one all-gather of (S_loc, Gamma_end), posted before the intra-chunk compute.
    "lasp2": ScanPlan("lasp2", "allgather", overlap=True),
    # LASP-1: the same chain, whole state at once, after the local compute.
    "lasp1": ScanPlan("lasp1", "chain", n_blocks=1, overlap=False),
}


def resolve_plan(method) -> ScanPlan:
    if isinstance(method, ScanPlan):
        return method
    if isinstance(method, str) and method in LINEAR_METHODS:
        return PLANS[declared(method, kind="linear").plan]
    raise ValueError(f"method={method!r} is not a linear-attention method; choose one of "
                     f"{', '.join(LINEAR_METHODS)} (or pass a seqpar.linear.ScanPlan)")


class ChainExchange:
    """Point-to-point All-Scan (ZeCO, LASP-1). Bytes per rank and call: one state forward (all but the
    last rank, ``"allscan"``), one state backward (all but the first); with ``output_final_state`` the
    last rank broadcasts the final state (``"broadcast_final_state"``) and every other rank sends its
    final-state gradient to it (``"reduce_final_state_grad"``)."""

    def __init__(self, info: GroupInfo, plan: ScanPlan, stats: CommStats | None, trace=None) -> None:
        self.info, self.plan, self.stats, self.trace = info, plan, stats, trace
        self._scan = None
        self._work = None

    def start_fwd(self, local, decay, first) -> None:
        self._scan = ChainScan(self.info, local, decay, first, n_blocks=self.plan.n_blocks,
                               stats=self.stats, name="allscan", trace=self.trace).start()

    def finish_fwd(self, want_final: bool):
        inc, out = self._scan.wait()
        self._scan = None
        final = None
        if want_final:
            tail = self.info.size - 1
            final = broadcast_from(self.info, out if self.info.rank == tail else None, tail, out,
                                   stats=self.stats, name="broadcast_final_state", trace=self.trace)
        return inc, final

    def start_bwd(self, local, decay, dht) -> None:
        first = first_id = None
        if dht is not None:  # every rank's copy of the final state feeds the loss: sum their gradients
            first, self._work, first_id = reduce_to(self.info, dht, self.info.size - 1, stats=self.stats,
                                                    name="reduce_final_state_grad", async_op=True, trace=self.trace)
        self._scan = ChainScan(self.info, local, decay, first, n_blocks=self.plan.n_blocks, reverse=True,
                               stats=self.stats, name="allscan", first_work=self._work, trace=self.trace,
                               first_id=first_id).start()

    def finish_bwd(self) -> torch.Tensor:
        inc, _ = self._scan.wait()
        if self._work is not None:
            self._work.wait()
        self._scan = self._work = None
        return inc

    def kept(self) -> list[torch.Tensor]:
        """The tensors the backward needs from the forward's exchange: none for the chain."""
        return []

    def restore(self, kept: list[torch.Tensor]) -> None:
        """Take back what :meth:`kept` gave (the compiled backward op, seqpar.linear.compiled)."""


class GatherExchange:
    """LASP-2: all-gather ``[S_loc | Gamma_end]`` (``R*H*K*(V+1)`` elements from each rank, so every
    rank receives ``(N-1)*R*H*K*(V+1)``), fold locally; backward all-gathers the local gradient terms
    (and the final-state gradients), the decays are kept from the forward pass."""

    def __init__(self, info: GroupInfo, plan: ScanPlan, stats: CommStats | None, trace=None) -> None:
        self.info, self.stats, self.trace = info, stats, trace
        self._pending = self._first = self.decays = None
        self._with_dht = False

    def start_fwd(self, local, decay, first) -> None:
        self._first = first
        x = torch.cat([local, decay.expand(local.shape[:-1])[..., None]], dim=-1)
        self._pending = allgather_start(self.info, x, stats=self.stats, name="all_gather_states",
                                        trace=self.trace)

    def finish_fwd(self, want_final: bool):
        x = self._pending.wait()
        locals_, self.decays = x[..., :-1], x[..., -1]
        inc = fold_forward(locals_, self.decays, self._first, self.info.rank)
        final = fold_forward(locals_, self.decays, self._first, self.info.size) if want_final else None
        self._pending = self._first = None
        return inc, final

    def start_bwd(self, local, decay, dht) -> None:
        self._with_dht = dht is not None
        x = local if dht is None else torch.cat([local, dht.to(local.dtype)], dim=-1)
        self._pending = allgather_start(self.info, x, stats=self.stats, name="all_gather_states",
                                        trace=self.trace)

    def finish_bwd(self) -> torch.Tensor:
        x = self._pending.wait()
        self._pending = None
        v = x.shape[-1] // 2 if self._with_dht else x.shape[-1]
        last = x[..., v:].sum(0) if self._with_dht else None
        return fold_reverse(x[..., :v], self.decays, last, self.info.rank)

    def kept(self) -> list[torch.Tensor]:
        """The tensors the backward needs from the forward's exchange: the gathered decays ``[N, R, H, K]``."""
        return [self.decays]

    def restore(self, kept: list[torch.Tensor]) -> None:
        """Take back what :meth:`kept` gave (the compiled backward op, seqpar.linear.compiled)."""
        (self.decays,) = kept


def make_exchange(info: GroupInfo, plan: ScanPlan, stats: CommStats | None, trace=None):
    cls = ChainExchange if plan.exchange == "chain" else GatherExchange
    return cls(info, plan, stats, trace)
