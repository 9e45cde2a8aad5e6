"""c10d under the fake-NCCL ranks (:mod:`.fake_nccl`): what every collective and point-to-point
op received, checked as NCCL would take it; host values of fake tensors (CPU shadows); object
collectives; and the pairing of the ranks' operations (:func:`mismatches`)."""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .fake_clock import DeviceClock
from .fake_gpu import FakeCudaModule, is_fake

_SCALAR_OPS = ("_local_scalar_dense", "equal", "is_nonzero", "allclose")
# floating-point results larger than this get no shadow: host reads need indices, counts, fingerprints
# and scalars; replaying the attention arithmetic on the CPU too took 2.3 s of 4.2 (packed zigzag row)
SHADOW_FLOATS = 64


@dataclass(frozen=True)
class Violation:
    """A CUDA or NCCL contract broken by seqpar code: ``kind``, the op, the call site and what was wrong."""

    kind: str
    op: str
    site: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.site}: {self.detail}"


@dataclass(frozen=True)
class CommOp:
    """One c10d operation as a rank issued it: ``group`` (its name) and ``ranks`` (global), the peer
    (global) and tag of a point-to-point op, every tensor's ``(shape, dtype)``, the call site and phase."""

    name: str
    group: str
    ranks: tuple
    peer: int | None
    tag: int | None
    specs: tuple
    site: str
    phase: str

    def __str__(self) -> str:
        peer = f" peer {self.peer} tag {self.tag}" if self.peer is not None else ""
        return f"{self.name} on {list(self.ranks)}{peer} {[s for s, _ in self.specs]} at {self.site}"


@dataclass
class RankRun:
    """What one simulated rank did: its c10d ops (:class:`CommOp`, tagged with ``phase``, which the
    caller sets), violations, the autograd tape and the Functions whose backward ran."""

    rank: int
    world_size: int
    backend: str = "nccl"
    comm: list = field(default_factory=list)
    phase: str = "fwd"
    violations: list = field(default_factory=list)
    tape: list = field(default_factory=list)
    backward_calls: list = field(default_factory=list)
    host_reads: list = field(default_factory=list)  # (what, call site, phase) of every read of a CUDA value
    cuda: FakeCudaModule | None = None
    result: object = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    clock: DeviceClock = field(default_factory=DeviceClock)  # GPU work the host clock would miss

    def ops(self, phase: str | None = None) -> list[str]:
        return [op.name for op in self.comm if phase is None or op.phase == phase]

    def host_read(self, x: torch.Tensor, what: str) -> None:
        """A value of ``x`` read on the host: on a GPU, a device-to-host copy the host waits for."""
        if x.device.type == "cuda":
            with self.lock:
                self.host_reads.append((what, call_site(), self.phase))
            self.clock.stream_idle()  # the host waited for the stream that made x

    def flag(self, kind: str, op: str, site: str, detail: str) -> None:
        with self.lock:
            self.violations.append(Violation(kind, op, site, detail))

    def assert_clean(self) -> None:
        if self.violations:
            lines = "\n  ".join(str(v) for v in self.violations[:20])
            raise AssertionError(f"rank {self.rank} of {self.world_size}: {len(self.violations)} "
                                 f"violation(s):\n  {lines}")


def call_site() -> str:
    """The innermost seqpar frame of the current stack (else the test's), as ``file:line in fn``."""
    frames = traceback.extract_stack()[:-1]
    for top in ("/seqpar/", "/tests/"):
        for fr in reversed(frames):
            path = fr.filename.replace(os.sep, "/")
            if top in path and "gpu_static/fake_" not in path:
                return f"{path[path.rindex(top) + 1:]}:{fr.lineno} in {fr.name}"
    return "?"


def describe(t: torch.Tensor) -> str:
    kind = "fake " if is_fake(t) else ""
    return f"{kind}{t.device} tensor {tuple(t.shape)} {t.dtype}"


# ----------------------------------------------------------------------------------------------- c10d
_REDUCE = {0: lambda v: v.sum(0), 1: lambda v: v.mean(0), 2: lambda v: v.prod(0), 3: lambda v: v.amin(0),
           4: lambda v: v.amax(0)}  # c10d's RedOpType: SUM, AVG, PRODUCT, MIN, MAX


class Recorder(TorchDispatchMode):
    """Innermost dispatch mode: checks c10d ops, answers host reads from shadows, keeps shadows."""

    def __init__(self, run: RankRun, shadows: WeakIdKeyDictionary, shared: dict):
        super().__init__()
        self.run, self.shadows, self.shared, self.calls = run, shadows, shared, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        if func.namespace == "c10d":
            self._check_comm(func, args, kwargs)
        elif not any(is_fake(t) for t in flat) and not any(_is_cuda(x) for x in flat):
            with _disable_current_modes():  # host work on CPU tensors: real, values and all
                return func(*args, **kwargs)
        if func.namespace == "aten" and func._opname in _SCALAR_OPS:
            return self._host_read(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            return self._from_shadow(func, args, kwargs)
        if func.namespace == "c10d":
            self._fill_collective(func._opname, args)
            self.run.clock.c10d_op(func._opname, call_site())
        else:
            self._shadow(func, args, kwargs, out)
            self.run.clock.aten_op(func, args, kwargs, out, flat, call_site)
        return out

    def _fill_collective(self, name: str, args) -> None:
        """Shadows of a collective's outputs. Data never moves between the simulated ranks, so a gather
        or an all-to-all gives every slot what this rank sent; an all-reduce combines the values of the
        ranks simulated before (same group, same call) with this rank's standing in for the later ones;
        a broadcast gives what the root sent if it was simulated before."""
        def sh(t):  # a real (CPU) tensor is its own value
            return (self.shadows.get(t) if is_fake(t) else t) if isinstance(t, torch.Tensor) else None

        pg = next((ProcessGroup.unbox(a) for a in args if type(a).__name__ == "ScriptObject"
                   and "ProcessGroup" in str(a._type())), None)
        key = (pg.group_name if pg is not None else "", name, self.calls.get((pg, name), 0))
        self.calls[(pg, name)] = key[2] + 1
        with _disable_current_modes():
            if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
                pairs = [(args[0], args[1])] if name == "_allgather_base_" else list(zip(args[0], args[1]))
                for o, i in pairs:
                    if sh(o) is not None and sh(i) is not None:
                        sh(o).view(-1, *sh(i).shape).copy_(sh(i))
            elif name == "_reduce_scatter_base_":
                out, inp = sh(args[0]), sh(args[1])
                if out is not None and inp is not None:
                    out.copy_(inp.view(-1, *out.shape).sum(0))
            elif name == "alltoall_base_":
                out, inp = sh(args[0]), sh(args[1])
                if out is not None and inp is not None and out.shape == inp.shape:
                    out.copy_(inp)
            elif name == "allreduce_":
                for i, t in enumerate(args[0]):
                    mine = sh(t)
                    if mine is None:
                        continue
                    stored = self.shared.setdefault(key + (i,), [])
                    before = [v for v in stored if v.shape == mine.shape]  # other shapes: a reported mismatch
                    values = before + [mine.clone()] * (pg.size() - len(before))
                    stored.append(mine.clone())
                    mine.copy_(_REDUCE[args[2]._get_method("op")()](torch.stack(values)))
            elif name == "broadcast_":
                root = args[2] == pg.rank()
                for i, t in enumerate(args[0]):
                    if sh(t) is not None and root:
                        self.shared[key + (i,)] = sh(t).clone()
                    elif sh(t) is not None and key + (i,) in self.shared:
                        sh(t).copy_(self.shared[key + (i,)])

    def _from_shadow(self, func, args, kwargs):
        """An op whose output shape depends on values (``nonzero``, boolean masks): computed on the
        shadows, then a fake tensor of that shape on the inputs' device."""
        sargs, skwargs = self._shadow_args(args, kwargs)  # KeyError: no values, no answer
        with _disable_current_modes():
            sout = func(*sargs, **skwargs)
        device = next(t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))

        def fake_of(s):
            if not isinstance(s, torch.Tensor):
                return s
            f = torch.empty_strided(s.shape, s.stride(), dtype=s.dtype, device=device)
            self.shadows[f] = s
            return f

        return tree_map(fake_of, sout)

    def _check_comm(self, func, args, kwargs) -> None:
        name, site = func._opname, call_site()
        pg = next((ProcessGroup.unbox(a) for a in args if type(a).__name__ == "ScriptObject"
                   and "ProcessGroup" in str(a._type())), None)
        ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else ()
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        peer = ranks[args[2]] if name in ("send", "recv_") and ranks else None
        tag = args[3] if name in ("send", "recv_") else None
        if name == "barrier":  # torch makes the barrier's own tensor; NCCL uses the current device
            tensors = []
        op = CommOp(name, pg.group_name if pg is not None else "", ranks, peer, tag,
                    tuple((tuple(t.shape), t.dtype) for t in tensors), site, self.run.phase)
        with self.run.lock:
            self.run.comm.append(op)
        if peer is not None and peer == self.run.rank:
            self.run.flag("point-to-point op with itself", name, site, f"rank {peer}")
        if self.run.backend != "nccl":  # gloo takes CPU tensors
            return
        current = self.run.cuda.current_device()
        for t in tensors:
            if t.device.type != "cuda":
                self.run.flag("CPU tensor in an NCCL op", name, site, describe(t))
            elif t.device.index not in (None, current):
                self.run.flag("tensor not on the rank's current CUDA device", name, site,
                              f"{describe(t)}, current device cuda:{current}")

    def _host_read(self, func, args, kwargs):
        self.run.host_read(args[0], func._opname)
        try:
            sargs, skwargs = self._shadow_args(args, kwargs)
        except KeyError:
            return _default_read(func, args)
        with _disable_current_modes():
            return func(*sargs, **skwargs)

    def _shadow_args(self, args, kwargs):
        def sub(x):
            if isinstance(x, torch.Tensor) and is_fake(x):
                return self.shadows[x]  # KeyError: unknown value
            if isinstance(x, torch.device) and x.type == "cuda":
                return torch.device("cpu")
            return x

        sargs = tree_map(sub, args)
        skwargs = {k: ("cpu" if k == "device" and v is not None and torch.device(v).type == "cuda" else sub(v))
                   for k, v in kwargs.items()}
        return sargs, skwargs

    def _shadow(self, func, args, kwargs, out) -> None:
        fakes = [f for f in tree_flatten(out)[0] if isinstance(f, torch.Tensor)]
        if not fakes:
            return
        if any(f.is_floating_point() and f.numel() > SHADOW_FLOATS for f in fakes):
            self._forget_written(func, args)  # bulk arithmetic: no host read needs its values
            return
        try:
            sargs, skwargs = self._shadow_args(args, kwargs)
        except KeyError:
            self._forget_written(func, args)
            return
        try:
            with _disable_current_modes():
                sout = func(*sargs, **skwargs)
        except Exception:  # an op with no CPU kernel (torch's CUDA attention ops): value unknown
            self._forget_written(func, args)
            return
        souts = [s for s in tree_flatten(sout)[0] if isinstance(s, torch.Tensor)]
        for f, s in zip(fakes, souts):
            if is_fake(f):
                self.shadows[f] = s

    def _forget_written(self, func, args) -> None:
        """An in-place op not replayed on the shadows: the tensors it wrote have unknown values now."""
        for a, arg in zip(func._schema.arguments, args):
            if a.alias_info is not None and a.alias_info.is_write:
                for t in tree_flatten(arg)[0]:
                    if isinstance(t, torch.Tensor):
                        self.shadows.pop(t, None)


def _is_cuda(x) -> bool:
    return (isinstance(x, torch.Tensor) and x.device.type == "cuda") or \
        (isinstance(x, (torch.device, str)) and str(x).startswith("cuda"))


def _default_read(func, args):
    """A host read of a value nobody knows (its shadow was lost): a plausible one."""
    if func._opname in ("equal", "is_nonzero", "allclose"):
        return True
    t = args[0]
    return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)


def mismatches(runs: list[RankRun]) -> list[str]:
    """What NCCL would hang on or mis-deliver: per communicator, members issuing different collectives
    (name, dtypes, shapes; all_to_all shapes may differ), and point-to-point sends from a to b that do
    not pair, in order, with b's receives from a (NCCL ignores tags: the i-th send meets the i-th
    receive, so a tag or a shape that differs there means another payload in that buffer)."""
    out = []
    coll: dict = {}
    sends: dict = {}
    recvs: dict = {}
    for run in runs:
        for op in run.comm:
            if op.name == "batch_isend_irecv":
                continue
            if op.peer is not None:
                a, b = (run.rank, op.peer) if op.name == "send" else (op.peer, run.rank)
                (sends if op.name == "send" else recvs).setdefault((op.group, a, b), []).append(op)
            elif op.ranks:
                coll.setdefault(op.group, {}).setdefault(run.rank, []).append(op)
    for group, per_rank in coll.items():
        ranks = sorted(per_rank)
        members = per_rank[ranks[0]][0].ranks
        if ranks != sorted(members):
            out.append(f"group {list(members)}: only ranks {ranks} issued collectives on it")
        ref = per_rank[ranks[0]]
        for r in ranks[1:]:
            mine = per_rank[r]
            if len(mine) != len(ref):
                out.append(f"group {list(members)}: rank {r} issued {len(mine)} collectives, "
                           f"rank {ranks[0]} {len(ref)}")
            for x, y in zip(ref, mine):
                same = (x.name, [d for _, d in x.specs]) == (y.name, [d for _, d in y.specs])
                if not same or (x.name != "alltoall_base_" and x.specs != y.specs):
                    out.append(f"group {list(members)}: rank {ranks[0]} {x} but rank {r} {y}")
                    break
    out += _first_batches(runs)
    for key in sorted(set(sends) | set(recvs)):
        s, r = sends.get(key, []), recvs.get(key, [])
        if len(s) != len(r):
            out.append(f"{key[1]} -> {key[2]}: {len(s)} sends but {len(r)} receives ({s[:1] or r[:1]})")
        for x, y in zip(s, r):
            if (x.tag, x.specs) != (y.tag, y.specs):
                out.append(f"{key[1]} -> {key[2]}: send {x} pairs with receive {y}")
                break
    return out


def _first_batches(runs: list[RankRun]) -> list[str]:
    """NCCL: when ``batch_isend_irecv`` is the first operation on a communicator, every member must
    take part in it (torch's documentation of ``batch_isend_irecv``; the communicator is created
    there, collectively)."""
    first: dict = {}
    for run in runs:
        for op in run.comm:
            if op.ranks and len(op.ranks) > 1:
                first.setdefault(op.group, {}).setdefault(run.rank, op)
    out = []
    for per_rank in first.values():
        batch = [r for r, op in per_rank.items() if op.name == "batch_isend_irecv"]
        if batch and len(batch) != len(next(iter(per_rank.values())).ranks):
            op = per_rank[batch[0]]
            others = sorted(set(op.ranks) - set(batch))
            out.append(f"group {list(op.ranks)}: first used by a batch_isend_irecv of ranks {batch} at {op.site}, "
                       f"which ranks {others} do not join (their first op there: "
                       f"{[str(per_rank[r]) if r in per_rank else 'none' for r in others]})")
    return out


@contextlib.contextmanager
def batch_marker(run: RankRun):
    """``dist.batch_isend_irecv``, recorded as one op before its sends and receives."""
    real = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        group = p2p_op_list[0].group if p2p_op_list else None
        pg = group if group is not None else dist.group.WORLD
        with run.lock:
            run.comm.append(CommOp("batch_isend_irecv", pg.group_name, tuple(dist.get_process_group_ranks(pg)),
                                   None, None, (), call_site(), run.phase))
        return real(p2p_op_list)

    with mock.patch.object(dist, "batch_isend_irecv", batch_isend_irecv):
        yield


@contextlib.contextmanager
def object_collectives(run: RankRun, shared: dict):
    """``broadcast_object_list`` / ``all_gather_object``, recorded and emulated: a broadcast gives the
    other ranks what the source held when it ran (ranks run in order, so rank 0's objects reach the
    later ranks), an all-gather gives every slot this rank's object. Under NCCL the objects travel on
    ``torch.cuda.current_device()``: a rank other than 0 that has not set its device would use GPU 0."""
    counts: dict = {}

    def check(name):
        site = call_site()
        with run.lock:
            run.comm.append(CommOp(name, "", (), None, None, (), site, run.phase))
        if run.backend == "nccl" and run.cuda.device_set is None and run.rank != 0:
            run.flag("object collective before torch.cuda.set_device", name, site,
                     f"NCCL would use cuda:0 on rank {run.rank}")
        key = (name, counts.get(name, 0))
        counts[name] = key[1] + 1
        return key

    def broadcast_object_list(object_list, src=0, group=None, device=None, **_):
        key = check("broadcast_object_list")
        if dist.get_rank() == src:
            shared[key] = list(object_list)
        elif key in shared:
            object_list[:] = shared[key]

    def all_gather_object(object_list, obj, group=None):
        check("all_gather_object")
        object_list[:] = [obj] * len(object_list)

    with mock.patch.object(dist, "broadcast_object_list", broadcast_object_list), \
            mock.patch.object(dist, "all_gather_object", all_gather_object):
        yield
