"""The attention of :class:`~seqpar.integrations.hf.ShardedCache` beyond a fresh prefill: queries
against K,V that lie sharded over the ranks, each slot tagged with its global position.

Every path is seqpar's block kernel with log-sum-exp (:func:`seqpar.kernels.block_forward_into`)
on this rank's slots, and the exact merge of partial results in fp32:

- :func:`local_partial`: queries (contiguous runs of global positions) against this rank's slots,
  causal in global order, optionally a sliding window; slots every query sees go in one ``"none"``
  block, the rest in contiguous runs with their :class:`~seqpar.kernels.Band`.
- :func:`combine_replicated`: the decode combine. Every rank holds the same queries and a partial
  ``(out, lse)`` over its slots; ``"allgather"`` gathers all partials in one all-gather and merges
  them in rank order; ``"tree"`` all-reduces the max of lse, then the sums of ``exp(lse - max)·out``
  and ``exp(lse - max)`` in one all-reduce (tree attention). Both give every rank the same bytes.
- :func:`pass_q`: prefill over a cached prefix, query passing: all-gather the new queries, each
  rank attends all of them to its slots, one all-to-all returns each partial to its queries' rank.
- :func:`pass_kv`: prefill over a cached prefix, K,V passing: each rank's slots go once around the
  ring (N - 1 exchanges, overlapped with the block attention of the block in hand).

Shapes: queries ``[B, Tq, Hq, D]``; slots ``k``, ``v`` ``[B, S, Hkv, D]`` with positions ``[S]``
(int64 on the host, increasing); results ``out [B, Tq, Hq, D]`` and ``lse [B, Hq, Tq]`` in fp32.
"""

from __future__ import annotations

import math

import torch

from ...comm import all_gather_stack, all_reduce_, all_to_all
from ...comm.p2p import exchange
from ...kernels import Band, block_forward_into, merge_, new_accumulator

__all__ = ["choose_combine", "choose_prefill", "combine_replicated", "combine_seconds", "local_partial", "pass_kv", "pass_q",
           "query_runs"]


def query_runs(positions: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive positions as ``(first_row, length, first_position)``."""
    runs: list[list[int]] = []
    for row, p in enumerate(positions):
        if runs and p == runs[-1][2] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([row, 1, p])
    return [tuple(r) for r in runs]


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype of inputs of ``dtype``: float32 (float64 for float64 reference runs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_runs(pos: torch.Tensor, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive positions among the slots ``lo .. hi - 1`` (host int64, increasing):
    ``(slot, length, position)``."""
    if hi <= lo:
        return []
    p = pos[lo:hi]
    breaks = (torch.nonzero(p[1:] - p[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0] + breaks, breaks + [hi - lo]
    return [(lo + s, e - s, int(p[s])) for s, e in zip(starts, ends)]


def _accumulator(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(out, lse)`` for the rows of ``q``: out with V's head dim (MLA models' differs from q's)."""
    return new_accumulator(q.shape[:-1] + v.shape[-1:], q.device, dtype=_acc(q.dtype))


def _slots(pos: torch.Tensor, position: int) -> int:
    """Index of the first slot at ``position`` or above (positions increase along the slots)."""
    return int(torch.searchsorted(pos, torch.tensor([position], dtype=pos.dtype)))


def local_partial(q, runs, k, v, pos, *, scale: float, window: int | None, backend=None,
                  acc=None, floors: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the query rows ``runs`` (``(row, length, position)``) of ``q`` to the slots
    ``k``, ``v`` at host positions ``pos`` (increasing), causal in global order (query p sees slot
    p' <= p, and p' > p - window with a window); merged into ``acc`` (fp32 ``(out, lse)``, new when
    None). Slots every row of a run sees are one contiguous range (one ``"none"`` block, no copy);
    the partly seen ones, above the run's first position and below its last row's window, go by
    runs of consecutive positions with their :class:`~seqpar.kernels.Band`.

    ``floors`` (one int per batch row, or None): batch row b sees only slots at positions
    ``>= floors[b]`` (a left-padded row's first real token; its pads lie below). Rows with equal
    floors side by side are computed together; a query below its row's floor sees no slot
    (``out = 0``, ``lse = -inf``)."""
    out, lse = acc if acc is not None else _accumulator(q, v)
    if pos.numel() == 0:
        return out, lse
    if not floors or not any(floors):
        _rows_partial(q, runs, k, v, pos, out, lse, 0, scale, window, backend)
        return out, lse
    if len(runs) == 1 and runs[0][1] == 1 and len(set(floors)) > 1:  # a decode step: two calls, any floors
        _decode_floors(q, runs[0], k, v, pos, out, lse, floors, scale, window, backend)
        return out, lse
    start = 0
    for b in range(1, len(floors) + 1):  # batch rows in runs of equal floors: slices are views
        if b == len(floors) or floors[b] != floors[start]:
            sl = slice(start, b)
            _rows_partial(q[sl], runs, k[sl], v[sl], pos, out[sl], lse[sl], floors[start], scale, window, backend)
            start = b
    return out, lse


def _decode_floors(q, run, k, v, pos, out, lse, floors: list[int], scale, window, backend) -> None:
    """:func:`local_partial` of one query per batch row (a decode step) under distinct ``floors``:
    the slots at or above the highest floor, which every row sees, in one kernel call for the whole
    batch; those below it (the pad columns of the less padded rows) by :func:`_masked_slots`. Per run
    of equal floors it took one kernel call each: a batch of 32 prompts of 27 lengths, 27 calls per
    layer and token."""
    row, _length, first = run
    top = max(floors)
    _rows_partial(q, [run], k, v, pos, out, lse, top, scale, window, backend)
    lo, hi = _slots(pos, min(floors)), min(_slots(pos, top), _slots(pos, first + 1))
    if window is not None:
        lo = max(lo, _slots(pos, first - window + 1))
    if hi > lo:
        _masked_slots(q[:, row:row + 1], k, v, pos, lo, hi, floors, scale,
                      out[:, row:row + 1], lse[:, :, row:row + 1])


#: elements of the largest temporary of :func:`_masked_slots` (scores, or a chunk of K or V in the
#: accumulator's dtype): 2**24, 64 MiB in fp32, whatever the length of the padded range
_MASKED_CHUNK = 1 << 24


def _masked_slots(q1, k, v, pos, lo: int, hi: int, floors: list[int], scale, out1, lse1) -> None:
    """Merge into ``(out1, lse1)`` (``[B, 1, Hq, D]``, ``[B, Hq, 1]``) the attention of the one query
    per row ``q1`` to slots ``lo:hi``, row b seeing those at positions ``>= floors[b]``: a masked
    softmax in the accumulator's dtype, GQA by grouping the query heads (K, V are not expanded), in
    chunks of slots so that a long padded range never makes a large temporary."""
    acc, (b, _one, hq, d), hkv, dv = out1.dtype, q1.shape, k.shape[2], v.shape[-1]
    qg = q1[:, 0].to(acc).reshape(b, hkv, hq // hkv, d)  # query head i * group + j reads kv head i
    floor = torch.tensor(floors, device=q1.device)[:, None]
    step = max(1, _MASKED_CHUNK // (b * max(hq, hkv * max(d, dv))))
    for a in range(lo, hi, step):
        e = min(hi, a + step)
        seen = pos[a:e].to(q1.device)[None, :] >= floor  # [B, L]
        scores = torch.einsum("bhgd,blhd->bhgl", qg, k[:, a:e].to(acc)) * scale
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        part_lse = torch.logsumexp(scores, -1)  # -inf for a row that sees none of these slots
        probs = torch.exp(scores - part_lse[..., None]).nan_to_num(0.0)
        part = torch.einsum("bhgl,blhd->bhgd", probs, v[:, a:e].to(acc))
        merge_(out1, lse1, part.reshape(b, 1, hq, dv), part_lse.reshape(b, hq, 1))


def _rows_partial(q, runs, k, v, pos, out, lse, floor: int, scale, window, backend) -> None:
    """:func:`local_partial` of batch rows that share one ``floor`` (slots below it unseen)."""
    bottom = _slots(pos, floor) if floor > 0 else 0
    for row, length, first in runs:
        last = first + length - 1
        qr, ao, al = q[:, row:row + length], out[:, row:row + length], lse[:, :, row:row + length]
        any_lo = 0 if window is None else _slots(pos, first - window + 1)  # seen by the first row's window
        all_lo = 0 if window is None else _slots(pos, last - window + 1)  # seen by every row's window
        any_lo, all_lo = max(any_lo, bottom), max(all_lo, bottom)
        all_hi, any_hi = _slots(pos, first + 1), _slots(pos, last + 1)
        if all_hi > all_lo:
            block_forward_into(ao, al, qr, k[:, all_lo:all_hi], v[:, all_lo:all_hi], scale=scale, mask="none",
                               backend=backend)
            partly = _key_runs(pos, any_lo, all_lo) + _key_runs(pos, all_hi, any_hi)
        else:  # a window shorter than the run, or a floor above its first row: no slot is seen by every row
            partly = _key_runs(pos, any_lo, any_hi)
        for slot, n, p0 in partly:
            # query i (position first + i) sees key j (position p0 + j) iff first - p0 - (W-1) <= j - i <= first - p0
            lo = None if window is None else first - p0 - (window - 1)
            block_forward_into(ao, al, qr, k[:, slot:slot + n], v[:, slot:slot + n], scale=scale,
                               mask=Band(lo, first - p0), backend=backend)


def _pack(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D + 1]`` in lse's dtype (fp32): out with lse as its last channel (one message)."""
    return torch.cat([out.to(lse.dtype), lse.transpose(1, 2).unsqueeze(-1)], dim=-1)


def _unpack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x[..., :-1], x[..., -1].transpose(1, 2).contiguous()


def _merge_all(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``[N, B, T, H, D + 1]`` packed partials in member order (the same order on every rank)."""
    out, lse = new_accumulator(parts.shape[1:-1] + (parts.shape[-1] - 1,), parts.device, dtype=parts.dtype)
    for part in parts:
        merge_(out, lse, *_unpack(part))
    return out, lse


def combine_replicated(info, out, lse, mode: str, *, stats=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact combine of every rank's partial ``(out, lse)`` of the same query rows (fp32 results,
    the same bytes on every rank). ``mode``: ``"allgather"`` or ``"tree"`` (module docstring)."""
    if info.single:
        return out.to(lse.dtype), lse
    if mode == "allgather":
        return _merge_all(all_gather_stack(info, _pack(out, lse), stats=stats, name="decode_all_gather"))
    top = lse.clone()
    all_reduce_(info, top, op=torch.distributed.ReduceOp.MAX, stats=stats, name="decode_tree_max")
    unseen = torch.isneginf(top)  # no rank has a key for the row
    w = torch.where(unseen | torch.isneginf(lse), 0.0, torch.exp(lse - torch.where(unseen, 0.0, top)))
    sums = _pack(out.to(lse.dtype) * w.transpose(1, 2).unsqueeze(-1), w)
    all_reduce_(info, sums, stats=stats, name="decode_tree_sum")
    num, den = _unpack(sums)
    safe = torch.where(den > 0, den, 1.0)
    merged = torch.where((den > 0).transpose(1, 2).unsqueeze(-1), num / safe.transpose(1, 2).unsqueeze(-1), 0.0)
    return merged, torch.where(den > 0, top + torch.log(safe), float("-inf"))


def pass_q(info, q, member_runs, k, v, pos, *, scale, window, backend=None, stats=None, floors=None):
    """Prefill over a cached prefix by passing queries: ``q`` is this rank's ``[B, T_local, Hq, D]``
    (every rank the same T_local), ``member_runs[m]`` the query runs of member m. Returns this
    rank's rows merged over every rank's slots (fp32 out, lse). ``floors``: as for :func:`local_partial`."""
    gathered = all_gather_stack(info, q, stats=stats, name="prefill_q_all_gather")
    parts = torch.stack([_pack(*local_partial(gathered[m], member_runs[m], k, v, pos, scale=scale,
                                              window=window, backend=backend, floors=floors))
                         for m in range(info.size)])
    received = all_to_all(info, parts, stats=stats, name="prefill_partials_all_to_all")
    return _merge_all(received)


def pass_kv(info, q, runs, k, v, pos, *, scale, window, backend=None, stats=None, floors=None):
    """Prefill over a cached prefix by passing K,V: this rank's slots (``k``, ``v``, host ``pos``)
    travel once around the ring while each rank attends its query ``runs`` to every block in turn.
    Block sizes differ per rank: one all-gather of the sizes first. Returns fp32 (out, lse).
    ``floors``: as for :func:`local_partial`."""
    acc = _accumulator(q, v)
    if info.single:
        return local_partial(q, runs, k, v, pos, scale=scale, window=window, backend=backend, acc=acc, floors=floors)
    size = torch.tensor([pos.numel()], dtype=torch.int64, device=k.device)
    sizes = all_gather_stack(info, size, stats=stats, name="prefill_kv_sizes").flatten().tolist()
    block = (k.contiguous(), v.contiguous(), pos.to(k.device))
    for step in range(info.size):
        pending = None
        if step < info.size - 1:
            src_send, src_recv = (info.rank - step) % info.size, (info.rank - step - 1) % info.size
            bufs = [torch.empty((k.shape[0], sizes[src_recv], *k.shape[2:]), dtype=k.dtype, device=k.device),
                    torch.empty((v.shape[0], sizes[src_recv], *v.shape[2:]), dtype=v.dtype, device=v.device),
                    torch.empty((sizes[src_recv],), dtype=torch.int64, device=k.device)]
            sends = [(t, 1, tag) for tag, t in enumerate(block)] if sizes[src_send] else []
            recvs = [(b, -1, tag) for tag, b in enumerate(bufs)] if sizes[src_recv] else []
            pending = exchange(info, sends, recvs, stats=stats, name="prefill_kv_ring")
        local_partial(q, runs, block[0], block[1], block[2].cpu(), scale=scale, window=window, backend=backend,
                      acc=acc, floors=floors)
        if pending is not None:
            pending.wait()
            block = tuple(bufs)
    return acc


def choose_prefill(new: int, past: int, hq: int, hkv: int, n: int, *, flops: float, bandwidth: float,
                   itemsize: int) -> str:
    """``"pass_kv"`` or ``"pass_q"`` for ``new`` tokens over a ``past``-token cache (Meta's rule).

    K,V passing sends every slot once around the ring: ``(past + new)·2·Hkv`` head-rows; query
    passing sends the new queries and their partial outputs: about ``new·Hq`` head-rows each way.
    So query passing moves fewer bytes when ``new / (past + new) < 2·Hkv / Hq``. K,V passing is
    still as fast when each ring step's block attention hides its transfer: a step computes
    ``4·(new/N)·((past+new)/N)·Hq·D`` flops while ``((past+new)/N)·2·Hkv·D·itemsize`` bytes move,
    hidden when ``new >= N·flops·Hkv·itemsize / (2·Hq·bandwidth)`` (``flops`` per second of the
    block kernel, ``bandwidth`` bytes per second of one link)."""
    if new >= n * flops * hkv * itemsize / (2.0 * hq * bandwidth):
        return "pass_kv"
    return "pass_kv" if new / max(1, past + new) >= 2.0 * hkv / hq else "pass_q"


def combine_seconds(n: int, partial_bytes: int, lse_bytes: int, *, latency: float, bandwidth: float) -> dict:
    """Modelled seconds of the two decode combines on links of ``latency`` s and ``bandwidth`` B/s:
    the ring all-gather of the ``partial_bytes`` (out, lse) of every member, ``(N-1)·(α + m/β)``, and
    the tree combine, two all-reduces (the ``lse_bytes`` max, then the partial sums) each up and down
    a binary tree, ``2·ceil(log2 N)`` steps of ``α + m/β``."""
    if n <= 1:
        return {"allgather": 0.0, "tree": 0.0}
    depth = 2 * math.ceil(math.log2(n))
    return {"allgather": (n - 1) * (latency + partial_bytes / bandwidth),
            "tree": depth * (2 * latency + (lse_bytes + partial_bytes) / bandwidth)}


def choose_combine(n: int, partial_bytes: int, lse_bytes: int, *, latency: float, bandwidth: float) -> str:
    """``"allgather"`` (one collective, N - 1 steps) or ``"tree"`` (two all-reduces of log N depth),
    whichever :func:`combine_seconds` models faster: the all-gather up to ~16 ranks for a decode
    step's small partials, the tree beyond, and sooner for large batches."""
    t = combine_seconds(n, partial_bytes, lse_bytes, latency=latency, bandwidth=bandwidth)
    return "allgather" if t["allgather"] <= t["tree"] else "tree"
