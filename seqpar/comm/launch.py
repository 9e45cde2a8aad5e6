"""How this process was started, and what it may use: torchrun detection, the default process group
of launched ranks, usable cores, progress bars. Used by the commands (``seqpar bench``, ``calibrate``,
``train``); local CPU ranks spawned by a command are :class:`seqpar.comm.pool.LocalRanks`."""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist


def launched_by_torchrun() -> bool:
    """True when a launcher (torchrun) started this process as one of its ranks (RANK and WORLD_SIZE
    are set): the commands then use the launched ranks instead of spawning their own."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def progress_track(items, description: str, enabled: bool = True):
    """``items`` under a transient rich progress bar (the items themselves when disabled or rich is
    missing: it is an optional extra)."""
    if not enabled:
        return items
    try:
        from rich.progress import track
    except ImportError:
        return items
    return track(items, description=description, transient=True)


@contextlib.contextmanager
def launched_process_group():
    """For ranks started by a launcher (torchrun): the default process group for the body, NCCL on
    the local GPU (with gloo beside it for CPU tensors: seqpar's rank-agreement check then costs no
    device synchronisation) when CUDA is available, else gloo. One created here is destroyed on exit, after a
    barrier when the body succeeded, so no rank tears down its connections while another one still
    talks (gloo aborts a rank whose peer vanished mid-teardown). One that already existed is kept."""
    owned = not dist.is_initialized()
    if owned:
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    ok = False
    try:
        yield
        ok = True
    finally:
        if owned:
            if ok:
                dist.barrier()
            dist.destroy_process_group()
