"""What a call looks like to the other ranks, and the cheap check that every rank made the same call.

An entry point (``seqpar.attention``, ``linear_attention``, ``unshard``) describes its call as
*fields*: one printable value per parameter, built by :func:`call_fields` from ALL of the call's
arguments (the entry point passes its ``locals()``), so an option added to an entry point is covered
without touching this module. Only :data:`LOCAL_ONLY` parameters, which never shape communication,
are left out. A tensor is described by shape, dtype and device type; document offsets
(``cu_seqlens``: a tensor, a list or a ``PackedLayout``) by their content; groups by their members;
anything else by ``repr``.

:func:`quick_agreement` then checks that every rank's fields hash to the same digest and that no
rank's local validation failed: the ranks combine a small state (any failure, the smallest and
largest value of each digest word) in ceil(log2 N) rounds of one message each way, or one
all-reduce on an NCCL-only group (:func:`reduce_state`). Only when that fails do the ranks gather
their full fingerprints (:func:`seqpar.comm.agreement.check_agreement`) to say who passed what.
Every rank ends with the same state, so every rank takes the same branch: no rank can go on while
another raises.

Where the gather travels (:func:`check_device`): on the CPU whenever the group's backend takes CPU
tensors (gloo, or a group created with ``backend="cpu:gloo,cuda:nccl"``, which is also what
``init_process_group()`` without a backend creates), so an NCCL job pays no device synchronisation.
A group with NCCL only cannot carry CPU tensors: the digest then travels on the GPU and reading it
back waits for the device (measured cost in docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from .channels import TokenRingGroups
from .collectives import all_gather_stack, all_reduce_
from .groups import GroupInfo, _is_device_mesh, group_info
from .p2p import exchange
from .usp_groups import USPGroups

#: parameters that never shape communication (a CommStats only counts bytes, a Trace only records;
#: the switch itself cannot be compared: a rank that skips the check does not take part in it)
LOCAL_ONLY = frozenset({"stats", "check_ranks", "trace"})
#: arguments whose content shapes communication (document offsets): described by count, total and hash
CONTENT_ARGUMENTS = frozenset({"cu_seqlens"})
DIGEST_LEN = 3  # 64-bit words of the fields' blake2b digest
#: the quick agreement's state: [some rank failed locally, each digest word's smallest, its largest]
STATE_WORDS = 1 + 2 * DIGEST_LEN
#: message tags of the two agreement gathers: an agreement message pairs only with its own kind
#: (never with a payload of the ring, whose tags are small, nor digest with full fingerprint)
QUICK_TAG, FULL_TAG = 0x5EC0, 0x5EC1
_FIELD_CHARS = 160  # longer values are cut and suffixed with a hash of the whole value
GRAD_FIELD = "inputs that need gradients (backward will run)"


def clip(text: str, limit: int = _FIELD_CHARS) -> str:
    """``text``, or its start and a hash of the whole when longer than ``limit`` (two different long
    values never clip to the same text, short of a hash collision)."""
    if len(text) <= limit:
        return text
    return text[:limit - 20] + "... #" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def offsets_fingerprint(cu_seqlens) -> str:
    """``cu_seqlens`` in a few characters: count, total and a hash of the offsets (None -> "None")."""
    if cu_seqlens is None:
        return "None"
    values = getattr(cu_seqlens, "cu_seqlens", cu_seqlens)  # a PackedLayout carries its offsets
    try:
        host = [int(x) for x in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    except Exception:  # noqa: BLE001 - invalid offsets: the local check reports them; compare their text
        return clip(repr(values))
    digest = hashlib.blake2b(repr(host).encode(), digest_size=6).hexdigest()
    return f"{len(host) - 1} documents, {host[-1] if host else 0} tokens, hash {digest}"


def _members(group) -> str:
    """A group's members by global rank (never raises: a bad group is the local checks' business)."""
    try:
        if isinstance(group, TokenRingGroups):
            return f"TokenRingGroups of ranks {list(group.info.global_ranks)}"
        # usp's own forms: the ranks of a row and of a column see different axis groups, so only
        # what every member of the grid shares is described (the gathers run along both axes)
        if isinstance(group, USPGroups):
            flat = "" if group.flat is None else f" of ranks {list(group.flat.global_ranks)}"
            return f"USPGroups {group.ulysses_degree} x {group.ring_degree}{flat}"
        if _is_device_mesh(group):
            return f"DeviceMesh {group.mesh.tolist()} dims {tuple(group.mesh_dim_names or ())}"
        if isinstance(group, (tuple, list)):
            return "(" + ", ".join(f"a group of {group_info(g).size} ranks" for g in group) + ")"
        return f"ranks {list(group_info(group).global_ranks)}"
    except Exception as exc:  # noqa: BLE001 - a description never fails
        return clip(f"invalid ({type(exc).__name__}: {exc})")


def describe(name: str, value) -> str:
    """One argument as the other ranks must see it to agree. Never raises."""
    if name in CONTENT_ARGUMENTS and value is not None:  # offsets (a tensor, a list, a PackedLayout)
        return offsets_fingerprint(value)
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}; dtype {value.dtype}; device {value.device.type}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return clip(repr(value))
    if name == "group" or isinstance(value, (TokenRingGroups, USPGroups)) or _is_device_mesh(value) or (
            dist.is_available() and isinstance(value, dist.ProcessGroup)):
        return _members(value)
    try:
        return clip(repr(value))
    except Exception:  # noqa: BLE001
        return f"a {type(value).__name__}"


def call_fields(arguments: dict, derived: dict | None = None) -> dict[str, str]:
    """The fields of a call from its ``arguments`` (name -> value, e.g. the entry point's
    ``locals()``), plus ``derived`` ones (name -> value resolved from several arguments, e.g. usp's
    arrangement) and whether backward will run (grad mode and any tensor that requires grad)."""
    fields = {name: describe(name, value) for name, value in arguments.items() if name not in LOCAL_ONLY}
    for name, value in (derived or {}).items():
        fields[name] = clip(str(value))
    grad = torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad
                                           for v in arguments.values())
    fields[GRAD_FIELD] = repr(grad)
    return fields


def field_digest(entry: str, fields: dict[str, str]) -> list[int]:
    """:data:`DIGEST_LEN` signed 64-bit words of the blake2b digest of ``entry`` and ``fields``."""
    raw = hashlib.blake2b(json.dumps([entry, fields], sort_keys=True).encode(), digest_size=8 * DIGEST_LEN).digest()
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 8 * DIGEST_LEN, 8)]


def takes_cpu(info: GroupInfo) -> bool:
    """Whether ``info``'s process group can carry CPU tensors (a gloo backend serves it)."""
    pg = info.group
    try:  # the devices the group's backends serve; not a public attribute, hence the fallback
        return any(d.type == "cpu" for d in pg._device_types)
    except AttributeError:
        return "gloo" in str(dist.get_backend(pg))


def check_device(info: GroupInfo, device=None) -> torch.device:
    """Where the agreement gather of ``info`` travels: the CPU when the group takes CPU tensors (no
    device synchronisation), else ``device`` (the inputs' CUDA device), else the current CUDA device."""
    if takes_cpu(info):
        return torch.device("cpu")
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device())


def gather_rows(info: GroupInfo, row: torch.Tensor, *, tag: int, device=None, trace=None) -> torch.Tensor:
    """``[N, *row.shape]`` on the CPU: every member's ``row`` in group order (the full fingerprints,
    gathered only once the quick agreement found a difference).

    On the CPU channel each member sends its row to every other member and receives theirs (2(N-1)
    small messages posted at once, one round): a dead or silent member is named exactly by the
    :class:`~seqpar.comm.PeerError` of its own transfer, where a collective could only name the
    group. Messages carry ``tag``, so they never pair with payloads or with the other gather. On a
    group without CPU support (NCCL only): one all-gather on ``device``. ``trace``: a
    :class:`seqpar.Trace` that records the messages (stream ``check_ranks``) or the all-gather.
    """
    where = check_device(info, device)
    if where.type != "cpu":
        return all_gather_stack(info, row.to(where), name="check_ranks", trace=trace).cpu()
    n, me = info.size, info.rank
    sends = [(row, d, tag) for d in range(1, n)]
    recvs = [(torch.empty_like(row), -d, tag) for d in range(1, n)]
    got = exchange(info, sends, recvs, name="check_ranks", trace=trace).wait()
    rows = [row] * n
    for d, buf in zip(range(1, n), got):
        rows[(me - d) % n] = buf
    return torch.stack(rows)


def agreement_offsets(n: int) -> list[int]:
    """The quick agreement's rounds on ``n`` members: in round ``j`` a member sends its state to the
    member ``2**j`` ahead and receives from the one ``2**j`` behind (ceil(log2 n) rounds)."""
    out, step = [], 1
    while step < n:
        out.append(step)
        step *= 2
    return out


def _combine(a: list[int], b: list[int]) -> list[int]:
    """Two states in one: any failure, then each digest word's smallest and largest value (equal in
    every word exactly when every state seen carried the same digest)."""
    k = DIGEST_LEN
    return [max(a[0], b[0]), *map(min, a[1:1 + k], b[1:1 + k]), *map(max, a[1 + k:], b[1 + k:])]


def reduce_state(info: GroupInfo, state: list[int], *, tag: int, device=None, trace=None) -> list[int]:
    """Every member's :data:`STATE_WORDS` state combined (:func:`_combine`: or, then each digest word's
    min and max, which do not mind seeing a state twice); the same list on every member, whichever
    channel carries it.

    On the CPU channel a dissemination: in each round of :func:`agreement_offsets` one message of
    :data:`STATE_WORDS` int64 to one member and one from another, so after ceil(log2 N) rounds every
    member has heard, directly or through others, from every member. Per call and rank that is
    ceil(log2 N) messages each way (10 at N = 1024) where sending the digest to every member took
    N - 1 (measured here: 40 us of host CPU per message pair, 40 ms per call at N = 1024;
    benchmarks/results/check_cost.md).
    Up to N = 4 the rounds still reach every member directly, so a dead or silent member is named
    exactly by each survivor's own transfer; beyond, by its direct partners, and the others by the
    partner that stopped. Messages carry ``tag``. On a group without CPU support (NCCL only):
    :func:`_reduce_on_device`."""
    where = check_device(info, device)
    if where.type != "cpu":
        return _reduce_on_device(info, state, where, trace)
    for step in agreement_offsets(info.size):
        mine, buf = torch.tensor(state, dtype=torch.int64), torch.empty(len(state), dtype=torch.int64)
        got = exchange(info, [(mine, step, tag)], [(buf, -step, tag)], name="check_ranks", trace=trace).wait()
        state = _combine(state, got[0].tolist())
    return state


def _reduce_on_device(info: GroupInfo, state: list[int], device, trace) -> list[int]:
    """:func:`reduce_state` on a device group, the same combination as :func:`_combine`: one
    all-reduce (max) of ``[failed, largest words, complement of the smallest words]`` (``~w``
    reverses the order of int64 without overflow), where an all-gather of the states would take
    N - 1 ring steps (NCCL runs a small all-reduce as a tree across nodes, O(log nodes) steps, or
    NVLS within a node)."""
    k = DIGEST_LEN
    words = [state[0], *state[1 + k:], *(~w for w in state[1:1 + k])]
    x = all_reduce_(info, torch.tensor(words, dtype=torch.int64, device=device), op=dist.ReduceOp.MAX,
                    name="check_ranks", trace=trace)
    got = x.cpu().tolist()
    return [got[0], *(~w for w in got[1 + k:]), *got[1:1 + k]]


def quick_agreement(infos: list[GroupInfo], entry: str, fields: dict[str, str], failed: bool,
                    *, device=None, trace=None) -> bool:
    """True when every rank of every group in ``infos`` reported no local error (``failed``) and the
    same digest of its fields: one :func:`reduce_state` per group. Each group's reduction carries
    the verdict of the previous ones, so on a grid of groups (usp's two axes) every rank ends with
    the same answer. ``trace`` records the messages (they are part of the call's communication)."""
    words = field_digest(entry, fields)
    bad = failed
    for info in infos:
        state = reduce_state(info, [int(bad), *words, *words], tag=QUICK_TAG, device=device, trace=trace)
        bad = bool(state[0]) or state[1:1 + DIGEST_LEN] != state[1 + DIGEST_LEN:]
    return not bad


__all__ = ["CONTENT_ARGUMENTS", "DIGEST_LEN", "FULL_TAG", "GRAD_FIELD", "LOCAL_ONLY", "QUICK_TAG", "STATE_WORDS",
           "agreement_offsets", "call_fields", "check_device", "clip", "describe", "field_digest", "gather_rows",
           "offsets_fingerprint", "quick_agreement", "reduce_state", "takes_cpu"]
