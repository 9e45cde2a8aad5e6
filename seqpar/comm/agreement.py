"""Cross-rank agreement: one cheap all-gather that checks every rank passed compatible arguments.

Ranks of a sequence-parallel group must call an entry point with the same shapes, dtypes, method,
mask and packing; when one does not, the ring pairs up buffers of different sizes and the job hangs
or fails far from the cause. With ``check_ranks=True`` (or the environment variable
``SEQPAR_CHECK_RANKS=1``; the argument wins, the variable is read at call time) an entry point
first gathers a small fingerprint of its arguments from every rank, before any other communication:

- every rank's local validation error (a ``ValueError`` raised on some ranks only is re-raised on
  every rank, naming the ranks that raised it),
- then each field (``q of shape``, ``dtype``, ``method``, ``cu_seqlens`` ...) compared with rank 0's:
  every rank raises the same ``ValueError``, e.g. ``rank 2 passed q of shape (1, 64, 8, 16) but rank
  0 passed (1, 32, 8, 16)``.

Cost: one all-gather of :data:`FINGERPRINT_BYTES` bytes per rank (two for usp on a 2-D mesh or a
pair of groups): cheap, but not free, hence off by default.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import torch

from .channels import TokenRingGroups
from .collectives import all_gather_stack
from .groups import GroupInfo, collective_device, group_info
from .usp_groups import describe_usp

ENV_VAR = "SEQPAR_CHECK_RANKS"
FINGERPRINT_BYTES = 8192  # fixed size (an all-gather needs one size on every rank)
_FIELD_CHARS = 160  # longer values are cut and suffixed with a hash of the whole value
_ERROR_CHARS = 600
_PROBLEM_CHARS = 300
_CARRY_FAILED, _CARRY_PROBLEMS = 2, 6  # what one gather passes on to the next (usp's second axis)


def check_ranks_enabled(check_ranks: bool | None) -> bool:
    """The effective setting: ``check_ranks`` when given, else ``SEQPAR_CHECK_RANKS`` (read now)."""
    if check_ranks is not None:
        if not isinstance(check_ranks, bool):
            raise ValueError(f"check_ranks: expected True, False or None (= ${ENV_VAR}), got {check_ranks!r}")
        return check_ranks
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${ENV_VAR}={os.environ[ENV_VAR]!r}: expected 1 or 0 (true/false)")


def shape_of(x) -> str:
    """A printable shape for a tensor argument (its type name otherwise: fingerprints never fail)."""
    if isinstance(x, torch.Tensor):
        return str(tuple(x.shape))
    return "None" if x is None else f"a {type(x).__name__}"


def offsets_fingerprint(cu_seqlens) -> str:
    """``cu_seqlens`` in a few characters: count, total and a hash of the offsets (None -> "None")."""
    if cu_seqlens is None:
        return "None"
    values = getattr(cu_seqlens, "cu_seqlens", cu_seqlens)  # a PackedLayout carries its offsets
    try:
        host = [int(x) for x in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    except Exception:  # invalid offsets: the local check reports them; compare their text here
        return _clip(repr(values))
    digest = hashlib.blake2b(repr(host).encode(), digest_size=6).hexdigest()
    return f"{len(host) - 1} documents, {host[-1] if host else 0} tokens, hash {digest}"


def _clip(text: str, limit: int = _FIELD_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit - 20] + "... #" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def _encode(entry: str, fields: dict[str, object], failed: list, problems: list) -> torch.Tensor:
    doc = {"entry": entry, "fields": {key: _clip(str(value)) for key, value in fields.items()},
           "failed": [[r, _clip_error(t)] for r, t in failed[:_CARRY_FAILED]],
           "problems": [_clip(p_, _PROBLEM_CHARS) for p_ in problems[:_CARRY_PROBLEMS]]}
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
    raw = bytes(row.tolist()).rstrip(b"\0")
    return json.loads(raw.decode())


def check_agreement(infos: GroupInfo | list[GroupInfo], entry: str, fields: dict[str, object],
                    error: BaseException | None = None, *, device=None) -> None:
    """Raise the same ``ValueError`` on every rank of ``infos`` when the ranks disagree.

    ``fields`` maps a description (``"q of shape"``, ``"method"``) to this rank's value; ``error``
    is this rank's local validation error, or None. Order of checks: a local error on any rank
    (this rank's own error is re-raised as is, the others name the failing ranks), then ``entry``
    (every rank called the same function), then each field against the group's first member.
    ``device``: where the fingerprint travels (default: each group's collective device, the GPU
    under NCCL whatever the device of the tensors checked, e.g. a CPU tensor given to ``shard``).

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
        buf = _encode(entry, fields, failed, problems).to(collective_device(info.group) if device is None else device)
        rows = [_decode(row) for row in all_gather_stack(info, buf, name="check_ranks").cpu()]
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


def agreed(infos: GroupInfo | list[GroupInfo], entry: str, fields: dict[str, object], prepare, *, device=None):
    """Run the local checks ``prepare()`` and then :func:`check_agreement`: a ``prepare`` error is
    held until after the gather, so the other ranks raise naming this one instead of waiting.
    Returns what ``prepare`` returned (every rank has agreed by then)."""
    error = result = None
    try:
        result = prepare()
    except Exception as exc:
        error = exc
    check_agreement(infos, entry, fields, error, device=device)
    return result


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
                out.append(f"rank {ranks[i]} passed {key} {mine} but rank {ranks[0]} passed {value}")
    return out


def agreement_groups(group, *, usp: bool = False, ulysses_degree: int | None = None) -> list[GroupInfo]:
    """The group(s) whose ranks must agree: the flat group, or for usp given as a mesh or a pair
    of groups its two axes (agreement along both axes is agreement of all, transitively)."""
    if isinstance(group, TokenRingGroups):
        group = group.group
    if not usp:
        return [group_info(group)]
    axes = describe_usp(group, ulysses_degree)
    if axes.flat is not None:
        return [axes.flat]
    return [info for info in (axes.ulysses, axes.ring) if info is not None]


def check_same_on_ranks(cu_host: Sequence[int], group=None, *, device=None,
                        argument: str = "cu_seqlens") -> None:
    """Cheap collective check that every rank passed the same ``cu_seqlens``.

    All-gathers a 3-number fingerprint (count, total, weighted checksum) on ``device``
    (default: the group's collective device, the GPU under NCCL). Every rank sees every
    fingerprint, so every rank raises the same ``ValueError`` and none is left waiting.
    """
    info = group_info(group)
    if info.single:
        return
    device = collective_device(info.group) if device is None else device
    p = (1 << 61) - 1
    fp = torch.tensor([len(cu_host), cu_host[-1], sum((i + 1) * x for i, x in enumerate(cu_host)) % p],
                      dtype=torch.int64, device=device)
    got = all_gather_stack(info, fp, name="check_cu_seqlens").cpu()
    bad = [r for r in range(info.size) if not torch.equal(got[r], got[0])]
    if bad:
        raise ValueError(f"{argument} differs across ranks (ranks {bad} disagree with rank 0): pass the same "
                         "global cu_seqlens on every rank of the group")
