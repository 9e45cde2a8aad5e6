"""Cross-rank agreement: every rank of a group must make the same call, checked before any payload moves.

Ranks of a sequence-parallel group must call an entry point with the same shapes, dtypes, method,
mask, packing and options; when one does not, the ring pairs up buffers of different sizes: gloo
aborts the process whose receive is too small, a receive that is too large succeeds and returns
garbage, NCCL hangs or reads the wrong bytes. So by default (``check_ranks=None`` and
``SEQPAR_CHECK_RANKS`` unset or 1; ``check_ranks=False`` or ``SEQPAR_CHECK_RANKS=0`` opt out) an entry
point first checks that the call agrees on every rank, before any other communication:

- the call's fields (:func:`seqpar.comm.fingerprint.call_fields`: every argument) are hashed and
  ceil(log2 N) rounds of one 56-byte message each way compare the digests and each rank's local
  validation verdict (:func:`~seqpar.comm.fingerprint.quick_agreement`, on the CPU when the group
  takes CPU tensors);
- only when that finds a difference, the full fingerprints are gathered to say who passed what:
  a ``ValueError`` raised on some ranks only is re-raised on those ranks and every other rank raises
  one naming them; then each field is compared with the group's first member's, and every rank
  raises the same ``ValueError``, e.g. ``rank 2 passed q of shape (1, 64, 8, 16) but rank 0 passed
  (1, 32, 8, 16)``.

Cost: ceil(log2 N) messages of 56 bytes each way per rank and call (once per axis for usp on a 2-D
mesh or a pair of groups); measured in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from .channels import TokenRingGroups
from .collectives import all_gather_stack
from .fingerprint import FULL_TAG, clip, gather_rows, quick_agreement
from .groups import GroupInfo, _is_device_mesh, collective_device, group_info
from .usp_groups import USPGroups, describe_usp

ENV_VAR = "SEQPAR_CHECK_RANKS"
FINGERPRINT_BYTES = 8192  # fixed size (an all-gather needs one size on every rank)
_ERROR_CHARS = 600
_PROBLEM_CHARS = 300
_CARRY_FAILED, _CARRY_PROBLEMS = 2, 6  # what one gather passes on to the next (usp's second axis)


def check_ranks_enabled(check_ranks: bool | None) -> bool:
    """The effective setting: ``check_ranks`` when given, else ``SEQPAR_CHECK_RANKS`` (read now),
    else on."""
    if check_ranks is not None:
        if not isinstance(check_ranks, bool):
            raise ValueError(f"check_ranks: expected True, False or None (= ${ENV_VAR}, default on), "
                             f"got {check_ranks!r}")
        return check_ranks
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("", "1", "true", "yes", "on"):
        return True
    raise ValueError(f"${ENV_VAR}={os.environ[ENV_VAR]!r}: expected 1 or 0 (true/false)")


def _encode(entry: str, fields: dict[str, object], failed: list, problems: list) -> torch.Tensor:
    doc = {"entry": entry, "fields": {key: clip(str(value)) for key, value in fields.items()},
           "failed": [[r, _clip_error(t)] for r, t in failed[:_CARRY_FAILED]],
           "problems": [clip(p_, _PROBLEM_CHARS) for p_ in problems[:_CARRY_PROBLEMS]]}
    raw = json.dumps(doc).encode()
    if len(raw) > FINGERPRINT_BYTES:  # cannot happen with clipped values, unless a caller adds dozens
        raise ValueError(f"check_ranks: the argument fingerprint of {entry} needs {len(raw)} bytes, "
                         f"more than {FINGERPRINT_BYTES} (internal error: too many fields)")
    buf = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _clip_error(text: str) -> str:
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS] + " [...]"


def _decode(row: torch.Tensor) -> dict:
    raw = row.numpy().tobytes().rstrip(b"\0")
    return json.loads(raw.decode())


def check_agreement(infos: GroupInfo | list[GroupInfo], entry: str, fields: dict[str, object],
                    error: BaseException | None = None, *, device=None) -> None:
    """Raise the same ``ValueError`` on every rank of ``infos`` when the ranks disagree.

    ``fields`` maps a description (``"q of shape"``, ``"method"``) to this rank's value; ``error``
    is this rank's local validation error, or None. Order of checks: a local error on any rank
    (this rank's own error is re-raised as is, the others name the failing ranks), then ``entry``
    (every rank called the same function), then each field against the group's first member.
    ``device``: the inputs' CUDA device, used only when a group cannot carry CPU tensors
    (:func:`~seqpar.comm.fingerprint.check_device`: gloo and multi-backend groups gather on the CPU).

    Several groups (usp's two mesh axes, a grid: every group of one axis meets every group of the
    other) are gathered one after the other, each gather carrying what the previous ones found, so
    a disagreement anywhere in the grid reaches every rank (agreement along each axis separately
    would not: a rank whose row and column agree would go on alone).
    """
    infos = [infos] if isinstance(infos, GroupInfo) else list(infos)
    infos = [info for info in infos if not info.single]
    if not infos:
        if error is not None:
            raise error
        return
    me = infos[0].global_ranks[infos[0].rank]
    failed = [] if error is None else [(me, str(error))]
    problems: list[str] = []
    for info in infos:  # every gather happens on every rank before anything is raised
        buf = _encode(entry, fields, failed, problems)
        rows = [_decode(row) for row in gather_rows(info, buf, tag=FULL_TAG, device=device)]
        for row in rows:
            failed += [(r, t) for r, t in row["failed"] if r not in {f[0] for f in failed}]
            problems += [p_ for p_ in row["problems"] if p_ not in problems]
        problems += [p_ for p_ in _disagreements(info.global_ranks, rows) if p_ not in problems]
    if error is not None:
        raise error  # every other rank learns of it from the fingerprint
    if failed:
        first_rank, first = sorted(failed)[0]
        raise ValueError(f"{entry}: rank(s) {sorted(r for r, _ in failed)} rejected their arguments, so every "
                         f"rank of the group stops here (check_ranks); rank {first_rank} says: {first}")
    if problems:
        raise ValueError(f"{entry}: the ranks of the group passed incompatible arguments (check_ranks): "
                         + "; ".join(problems)
                         + ". Every rank must pass the same shapes, dtypes and options (and the same global "
                         "cu_seqlens); shard the global tensors with seqpar.shard on every rank.")


def agreed(infos: GroupInfo | list[GroupInfo], entry: str, fields: dict[str, object], prepare, *, device=None,
           trace=None):
    """Run the local checks ``prepare()``, then check agreement: first the digest rounds of
    :func:`~seqpar.comm.fingerprint.quick_agreement`, and only when it finds a difference (on every
    rank alike) :func:`check_agreement`, which says who passed what. A ``prepare`` error is held until
    after the gathers, so the other ranks raise naming this one instead of waiting. Returns what
    ``prepare`` returned when every rank agreed; raises on every rank otherwise. ``trace`` (a
    :class:`seqpar.Trace`) records the digest rounds, not the fingerprints' (which end in an error)."""
    error = result = None
    try:
        result = prepare()
    except Exception as exc:
        error = exc
    infos = [infos] if isinstance(infos, GroupInfo) else list(infos)
    gathering = [info for info in infos if not info.single]
    if gathering and quick_agreement(gathering, entry, fields, error is not None, device=device, trace=trace):
        return result
    check_agreement(gathering, entry, fields, error, device=device)
    if not gathering:
        return result
    # The digests differed, so the fingerprints differ too (clipped values carry a hash of the whole)
    raise ValueError(f"{entry}: the ranks of the group passed arguments whose digests differ, but no field "
                     "differs in the fingerprints (internal error: please report it); every rank stops here")


def _disagreements(ranks: tuple[int, ...], rows: list[dict]) -> list[str]:
    ref = rows[0]
    out = []
    for i, row in enumerate(rows[1:], start=1):
        if row["entry"] != ref["entry"]:
            out.append(f"rank {ranks[i]} called {row['entry']} but rank {ranks[0]} called {ref['entry']}")
            continue
        for key, value in ref["fields"].items():
            mine = row["fields"].get(key)
            if mine != value:
                out += [f"rank {ranks[i]} passed {key}{a} but rank {ranks[0]} passed {b}"
                        for a, b in _difference(str(mine), value)]
    return out


def _difference(mine: str, ref: str) -> list[tuple[str, str]]:
    """What differs between two values: for tensors (``shape ...; dtype ...; device ...``) only the
    parts that differ, as ``(" of shape (1, 16, 4, 16)", "(1, 8, 4, 16)")``; else the whole values."""
    a, b = mine.split("; "), ref.split("; ")
    pairs = [(x.split(" ", 1), y.split(" ", 1)) for x, y in zip(a, b) if x != y]
    if len(a) == len(b) > 1 and all(len(x) == len(y) == 2 and x[0] == y[0] for x, y in pairs):
        return [(f" of {x[0]} {x[1]}", y[1]) for x, y in pairs]
    return [(f" {mine}", ref)]


def agreement_groups(group, *, usp: bool = False, ulysses_degree: int | None = None) -> list[GroupInfo]:
    """The group(s) whose ranks must agree: the flat group, or for usp given as a mesh or a pair
    of groups its two axes (agreement along both axes is agreement of all, transitively)."""
    if isinstance(group, TokenRingGroups):
        group = group.group
    if not usp or not (isinstance(group, (tuple, list, USPGroups)) or _is_device_mesh(group)):
        return [group_info(group)]  # usp on a plain group: the flat group, whatever ulysses_degree says
    # the axes of a mesh or a pair whatever ulysses_degree says (it is in the fingerprint): a degree
    # that does not match is a local error, held until after the gather (raised before it, the other
    # ranks would wait for this one)
    axes = describe_usp(group, None)
    if axes.flat is not None:
        return [axes.flat]
    return [info for info in (axes.ulysses, axes.ring) if info is not None]


def check_same_on_ranks(cu_host: Sequence[int], group=None, *, device=None,
                        argument: str = "cu_seqlens", trace=None) -> None:
    """Cheap collective check that every rank passed the same ``cu_seqlens``.

    All-gathers a 3-number fingerprint (count, total, weighted checksum) on ``device``
    (default: the group's collective device, the GPU under NCCL). Every rank sees every
    fingerprint, so every rank raises the same ``ValueError`` and none is left waiting.
    ``trace``: records the all-gather (channel ``check_cu_seqlens``, 24 bytes per member).
    """
    info = group_info(group)
    if info.single:
        return
    device = collective_device(info.group) if device is None else device
    p = (1 << 61) - 1
    fp = torch.tensor([len(cu_host), cu_host[-1], sum((i + 1) * x for i, x in enumerate(cu_host)) % p],
                      dtype=torch.int64, device=device)
    got = all_gather_stack(info, fp, name="check_cu_seqlens", trace=trace).cpu()
    bad = [r for r in range(info.size) if not torch.equal(got[r], got[0])]
    if bad:
        raise ValueError(f"{argument} differs across ranks (ranks {bad} disagree with rank 0): pass the same "
                         "global cu_seqlens on every rank of the group")
