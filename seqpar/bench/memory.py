"""Peak memory of one forward + backward, per rank.

What is measured (:class:`PeakMemory`), relative to the live memory when the measurement starts
(the inputs, already allocated, are not counted):

- **CUDA**: ``torch.cuda.max_memory_allocated - memory_allocated`` at the start, after
  ``reset_peak_memory_stats``: the peak of bytes held by tensors of the caching allocator
  (workspace included, cache reservations not).
- **CPU**: every allocation and free of torch's CPU allocator during the call, recorded by
  ``torch.profiler`` with ``profile_memory=True``; the peak of their running sum. This counts all
  tensors (saved activations, communication buffers, temporaries, kernel scratch that goes
  through the allocator) and nothing else (Python objects, gloo's own buffers, glibc arenas).
  Unlike the process' peak RSS it is not monotone across calls and does not depend on what the
  allocator kept mapped from earlier rows. The first profiled call in a process costs ~2-3 s of
  profiler start-up, which is why it runs once, after the timed repeats.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch


# What torch's profiler writes on its own while it records memory: its start and stop lines, and
# the allocator's note when a block allocated before the profile is freed inside it (every input
# and cached buffer is one). They say nothing about the run, so they are dropped from the output.
_PROFILER_NOISE = ("Memory block of unknown size was allocated before the profiling started",
                   "profiler_start", "profiler_stop", "ProfilerStart", "ProfilerStop")


@contextlib.contextmanager
def _native_stderr_without_profiler_noise():
    """Hold back what C++ code writes to file descriptor 2 inside the block and write it out at the
    end without the profiler's own lines (:data:`_PROFILER_NOISE`); anything else C++ printed is
    kept. Python exceptions are unaffected; stderr is restored on exit."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2 (e.g. an embedded interpreter)
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(noise in line for noise in _PROFILER_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class PeakMemory:
    """Context manager: ``with PeakMemory(device) as m: ...``; then ``m.peak`` is the peak bytes
    allocated inside the block above what was live when it started."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak = 0
        self._prof = None
        self._quiet = None
        self._start = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._quiet = _native_stderr_without_profiler_noise()
            self._quiet.__enter__()  # the whole profiled block: the allocator's note comes mid-block
            try:
                self._prof.__enter__()
            except BaseException:
                self._quiet.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device) - self._start)
            return
        try:
            self._prof.__exit__(*exc)
        finally:
            self._quiet.__exit__(None, None, None)
        if exc[0] is None:
            self.peak = allocation_peak(self._prof)


def allocation_peak(prof) -> int:
    """Peak of the running sum of the CPU allocator's ``[memory]`` events of a finished profile
    (positive = allocation, negative = free), in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:  # a CPU-only profile: every [memory] event is the CPU allocator's
        live += e.nbytes()
        peak = max(peak, live)
    return int(peak)
