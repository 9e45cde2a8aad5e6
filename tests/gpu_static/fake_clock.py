"""Host clocks against GPU work in flight: a check of the fake-NCCL harness (:mod:`.fake_nccl`).

On a GPU, kernels and NCCL ops return to the host at once; ``Work.wait()`` on an NCCL op only makes
the current stream wait. A step, phase or benchmark timed by reading the host clock therefore
needs the device to have finished the work it issued, or it times the launches. :class:`DeviceClock`
follows, per simulated rank, the GPU work issued since the clock was last read:

- a kernel (an aten op on a fake CUDA tensor that launches one; views, allocations and metadata do
  not) is current-stream work; a host read of a CUDA value or a blocking copy to the host ends it;
- an NCCL op is on its own stream until ``Work.wait()`` puts the current stream behind it;
- ``torch.cuda.synchronize`` (and ``Stream``/``Event`` ``synchronize``, taken as the device) and
  NCCL's barrier (its allreduce is queued behind the communicator's earlier ops and the stream,
  and the host blocks on it) end both.

:func:`checked_clock` patches ``time.perf_counter``, the clock seqpar times with: a read from seqpar's
code while any such work is open is a violation (the read closes an interval that misses it), and
every read starts a new interval. :data:`HOST_CLOCKS` are the files whose clock times host work only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from unittest import mock

import torch

# aten ops on CUDA tensors that launch no kernel (allocation, metadata); views are told by ``is_view``
NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "resize_",
    "record_stream", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type", "set_"})
# the schedulers' solvers time their own search (time limits, solve times) between steps, on the host
HOST_CLOCKS = tuple(os.path.join("seqpar", "schedulers", f) for f in ("greedy.py", "assign.py", "planner.py"))


def _cuda(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _to_host(func, args, kwargs, out) -> bool:
    """A blocking copy of a CUDA tensor into host memory (``.cpu()``, ``.to("cpu")``, ``cpu_t.copy_(cuda_t)``)."""
    if func._opname not in ("_to_copy", "copy_") or kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return False
    src, dst = (args[1], args[0]) if func._opname == "copy_" else (args[0], out)
    return _cuda(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu"


@dataclass
class DeviceClock:
    """GPU work of one rank issued since its host clock was last read and not known to be done."""

    in_flight: str | None = None  # the first kernel or waited NCCL op on the current stream
    nccl_unwaited: str | None = None  # the first NCCL op no Work.wait() has put on that stream yet

    def c10d_op(self, name: str, site: str) -> None:
        if name == "barrier":
            self.device_idle()
        elif self.nccl_unwaited is None:
            self.nccl_unwaited = f"c10d.{name} at {site}"

    def aten_op(self, func, args, kwargs, out, flat, call_site) -> None:
        if _to_host(func, args, kwargs, out):
            self.stream_idle()
        elif func.namespace == "aten" and not func.is_view and func._opname not in NO_KERNEL \
                and any(_cuda(x) for x in flat):
            if self.in_flight is None:
                self.in_flight = f"aten.{func._opname} at {call_site()}"

    def nccl_waited(self) -> None:
        """``Work.wait()``: the current stream now waits for the NCCL work posted so far."""
        if self.nccl_unwaited is not None:
            self.in_flight = self.in_flight or self.nccl_unwaited
            self.nccl_unwaited = None

    def stream_idle(self) -> None:
        self.in_flight = None

    def device_idle(self) -> None:
        self.in_flight = self.nccl_unwaited = None


def clock_read(run, clock: str, site: str) -> None:
    """The host of ``run`` (a :class:`~.fake_c10d.RankRun`) read ``clock`` at ``site``: a violation on
    NCCL when GPU work is still open; the next interval starts here."""
    c = run.clock
    open_work = c.in_flight or c.nccl_unwaited
    if open_work is not None and run.backend == "nccl":
        run.flag("host clock read with GPU work in flight", clock, site,
                 f"{open_work} was issued since the last clock read and not waited for: synchronize the device "
                 "(torch.cuda.synchronize) before reading the clock")
    c.device_idle()


@contextlib.contextmanager
def checked_clock(run, call_site):
    """``time.perf_counter`` read from seqpar's code (but :data:`HOST_CLOCKS`) goes to :func:`clock_read`;
    ``Work.wait()`` tells ``run.clock``."""
    real = time.perf_counter
    # the fake process group's works (torch's FakeWork overrides Work.wait)
    works = [torch.distributed.Work] + [w for w in (getattr(torch._C._distributed_c10d, "FakeWork", None),) if w]

    def perf_counter():
        code = sys._getframe(1).f_code.co_filename
        if f"{os.sep}seqpar{os.sep}" in code and f"{os.sep}tests{os.sep}" not in code \
                and not code.endswith(HOST_CLOCKS):
            clock_read(run, "time.perf_counter", call_site())
        return real()

    def waiting(real_wait):
        def wait(work, *args, **kwargs):
            run.clock.nccl_waited()
            return real_wait(work, *args, **kwargs)
        return wait

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(time, "perf_counter", perf_counter))
        for cls in works:
            stack.enter_context(mock.patch.object(cls, "wait", waiting(cls.wait)))
        yield
