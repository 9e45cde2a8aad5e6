"""Fake NCCL: one rank of an N-rank NCCL job on GPUs, simulated in this process without a GPU.

:func:`nccl_rank` sets up one rank (:func:`run_ranks` runs the ranks of a job one after the other):

- torch's fake process group (``torch.testing._internal.distributed.fake_pg``) as the *CUDA* backend
  only (``"cuda:fake"``), reported as ``"nccl"`` by ``dist.get_backend``; the launcher variables set
  as torchrun sets them (RANK = LOCAL_RANK, WORLD_SIZE), and ``init_process_group`` of any backend
  makes the fake group, so seqpar's commands run as under torchrun;
- fake CUDA tensors (``FakeTensorMode``); host work on CPU tensors runs for real, and fake tensors
  whose values a host read may need (integers, booleans, small floats) keep a CPU *shadow*, so
  ``.item()``, ``.tolist()``, ``torch.equal`` see real values (:mod:`.fake_c10d`: a gather gives
  what this rank sent, an all-reduce combines the ranks simulated so far);
- ``torch.cuda`` answering like a machine with one GPU per rank (:mod:`.fake_gpu`);
- checks (:mod:`.fake_c10d`): every c10d op's tensors (no CPU tensor, none off the rank's GPU, no
  transfer to itself), streams, events and synchronisations only on CUDA paths, every read of a CUDA
  value on the host counted, no clock read of seqpar's that closes an interval with GPU work still
  in flight (:mod:`.fake_clock`), and across the ranks (:func:`~.fake_c10d.mismatches`) the
  collectives and send/receive pairs NCCL would hang on or mis-deliver;
- an autograd stand-in (:mod:`.fake_autograd`): autograd over fake CUDA tensors aborts the process.

The torch internals this needs are imported by this package's ``fake_*`` modules only.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import (
    FakeStore,  # registers the "fake" backend
)
from torch.utils.weak import WeakIdKeyDictionary

from .fake_autograd import function_apply, inline_threads, tape_backward
from .fake_clock import checked_clock
from .fake_c10d import (
    CommOp,
    RankRun,
    Recorder,
    Violation,
    batch_marker,
    call_site,
    mismatches,
    object_collectives,
)
from .fake_gpu import (
    FakeCudaModule,
    cuda_methods_mode,
    fake_tensor_mode,
    fake_tolist,
    no_autograd,
)

__all__ = ["CommOp", "RankRun", "Violation", "WORLD", "nccl_rank", "run_ranks"]

WORLD = 4


@contextlib.contextmanager
def nccl_rank(rank: int, world_size: int = WORLD, *, backend: str = "nccl", kernels: str | None = "reference",
              set_device: bool = True, shared: dict | None = None):
    """Simulate ``rank`` of ``world_size`` torchrun ranks (one GPU each, local rank = rank) for the
    body; yields its :class:`RankRun`. The default group exists on entry and is destroyed on exit.

    ``backend="nccl"``: the fake group takes CUDA tensors only. ``"gloo"``: a CPU job on the same
    machine (the fake group takes any tensor): there, any CUDA stream, event or synchronisation is a
    violation. ``kernels="reference"``: seqpar's plain-torch block kernels only (fake CUDA tensors run
    them), so the communication under test runs as it does whatever kernel a GPU picks; None:
    seqpar's own dispatch. ``set_device``: select GPU ``rank`` first, as a script using seqpar's
    functions must (False for seqpar's commands, which do it themselves). ``shared``: what the
    collectives of the ranks simulated before left (:func:`run_ranks`).
    """
    shared = {} if shared is None else shared
    run = RankRun(rank, world_size, backend)
    cuda = run.cuda = FakeCudaModule(run, rank)
    shadows = WeakIdKeyDictionary()
    fake = fake_tensor_mode()
    group_backend = "cuda:fake" if backend == "nccl" else "fake"

    @contextlib.contextmanager
    def modes():
        with torch.no_grad(), fake, cuda_methods_mode(run, shadows, tape_backward), Recorder(run, shadows, shared):
            yield

    def init_process_group(*args, **kwargs):  # torchrun's ranks: the fake group, whatever backend is asked for
        if dist.is_initialized():
            raise RuntimeError("init_process_group: the default group exists already")
        _REAL_INIT(group_backend, rank=rank, world_size=world_size, store=FakeStore())

    def get_backend(group=None):
        b = _REAL_GET_BACKEND(group)
        return dist.Backend(backend) if "fake" in str(b) else b

    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    threads = torch.get_num_threads()  # commands set their own
    init_process_group()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.dict(os.environ, env))
            stack.enter_context(cuda.patch())
            stack.enter_context(mock.patch.object(dist, "init_process_group", init_process_group))
            stack.enter_context(mock.patch.object(dist, "get_backend", get_backend))
            stack.enter_context(fake_tolist(run, shadows))
            stack.enter_context(no_autograd())
            stack.enter_context(mock.patch.object(torch.autograd.Function, "apply", function_apply(run, call_site)))
            stack.enter_context(inline_threads())
            stack.enter_context(object_collectives(run, shared))
            stack.enter_context(batch_marker(run))
            stack.enter_context(checked_clock(run, call_site))
            if kernels == "reference":
                stack.enter_context(_reference_kernels_only())
            stack.enter_context(modes())
            if set_device and backend == "nccl":
                torch.cuda.set_device(rank)
            yield run
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)


_REAL_INIT, _REAL_GET_BACKEND = dist.init_process_group, dist.get_backend


def run_ranks(fn, world_size: int = WORLD, **kwargs) -> list[RankRun]:
    """``fn(run)`` on every rank in turn (``run.result`` keeps what it returns); raises listing the
    violations of the first rank that has some, then every mismatch between the ranks' operations."""
    runs, shared, run = [], {}, None
    for r in range(world_size):
        try:
            with nccl_rank(r, world_size, shared=shared, **kwargs) as run:
                run.result = fn(run)
        except Exception as exc:
            if run is not None and run.rank == r and run.violations:  # often the cause: say so first
                raise AssertionError(f"{type(exc).__name__}: {exc}\nafter {run.violations[0]}") from exc
            raise
        run.assert_clean()
        runs.append(run)
    problems = mismatches(runs)
    if problems:
        raise AssertionError(f"{len(problems)} mismatch(es) between ranks:\n  " + "\n  ".join(problems[:20]))
    return runs


@contextlib.contextmanager
def _reference_kernels_only():
    """seqpar's plain-torch kernels only: the softmax ``reference`` backend and the linear ``torch``
    chunk kernel (Triton, torch's CUDA attention ops, flash-attn and fla have suites of their own)."""
    from seqpar.kernels import dispatch
    from seqpar.linear import api as linear_api
    from seqpar.linear import kernels as linear_kernels

    why = "not used by the fake-NCCL checks"
    keep = tuple(b for b in dispatch.BACKENDS if b.name == "reference")
    with mock.patch.object(dispatch, "BACKENDS", keep), \
            mock.patch.object(linear_kernels.TritonChunkKernel, "refusal", staticmethod(lambda q: why)), \
            mock.patch.object(linear_api, "fla_refusal", lambda q: why):
        yield


