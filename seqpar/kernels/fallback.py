"""Demotion of a backend whose kernel fails to compile or launch on this machine.

Capabilities say what a backend *should* serve; only running tells whether its kernel compiles
and launches on the user's GPU and build (a Triton configuration beyond the shared memory of
an sm_86, a torch build without kernels for this sm, flash-attn refusing the architecture).
When an automatically chosen backend fails that way (:meth:`Backend.launch_failure`), dispatch
records the :class:`KernelCase`, warns once naming the reason, and runs the next capable
backend; a forced ``backend=`` still raises. Every backend is exact, so a fallback changes
speed, never results.

:data:`FAILED_KERNELS` is the one piece of process-wide mutable state in the kernel layer, kept
because the alternative is worse: without it every call would retry (a failed Triton compile
costs seconds) and warn again. It is a cache of facts about this machine (as Triton's kernel
cache or torch's cuDNN plan cache), not a switch: it only ever removes a backend that has
already failed for that exact case, is bounded (:attr:`FailedKernels.MAX` entries), is shown
in dispatch errors, and ``FAILED_KERNELS.clear()`` forgets it (e.g. after changing drivers).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from .base import Backend


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """What decides whether a kernel compiles and launches: the device (hence its compute
    capability), dtype, head dim, mask kind (``"none"``, ``"causal"``, or ``"varlen"`` for the
    packed kernels), GQA or not, and the direction. Not the lengths: they change the grid, not
    the compiled kernel."""

    device: str
    dtype: torch.dtype
    head_dim: int
    kernel: str
    gqa: bool
    backward: bool

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, kernel: str, backward: bool) -> "KernelCase":
        """The case of ``q [.., H, D]`` against ``k [.., Hkv, D]``."""
        return cls(str(q.device), q.dtype, q.shape[-1], kernel, q.shape[-2] != k.shape[-2], backward)

    def __str__(self) -> str:
        where = self.device
        if self.device.startswith("cuda"):
            major, minor = torch.cuda.get_device_capability(torch.device(self.device))
            where += f" (sm_{major}{minor})"
        dtype = str(self.dtype).replace("torch.", "")
        return (f"{dtype} D={self.head_dim} {self.kernel}{' GQA' if self.gqa else ''} "
                f"{'backward' if self.backward else 'forward'} on {where}")


class FailedKernels:
    """``(backend name, case) -> reason`` of kernels that failed to compile or launch here."""

    MAX = 256  # distinct (backend, case) pairs: dtypes x head dims x masks x directions is far below

    def __init__(self) -> None:
        self._reasons: dict[tuple[str, KernelCase], str] = {}

    def reason(self, backend: str, case: KernelCase) -> str | None:
        return self._reasons.get((backend, case))

    def record(self, backend: str, case: KernelCase, reason: str) -> None:
        if len(self._reasons) >= self.MAX:  # forget the oldest: at worst it fails (and warns) again
            del self._reasons[next(iter(self._reasons))]
        self._reasons[(backend, case)] = reason

    def clear(self) -> None:
        self._reasons.clear()

    def __len__(self) -> int:
        return len(self._reasons)

    def __repr__(self) -> str:
        return f"FailedKernels({len(self)} of at most {self.MAX})"


#: The process-wide record (see the module docstring for why it exists and its limits).
FAILED_KERNELS = FailedKernels()


class Attempt:
    """``with Attempt(backend, case) as a:`` runs kernel calls of one automatically chosen
    backend. A launch failure is recorded in :data:`FAILED_KERNELS`, warned about once and
    swallowed (``a.failed`` holds the reason; the caller moves on to the next backend); any
    other exception propagates."""

    def __init__(self, backend: Backend, case: KernelCase):
        self.backend, self.case = backend, case
        self.failed: str | None = None

    def __enter__(self) -> "Attempt":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not isinstance(exc, Exception):
            return False
        why = self.backend.launch_failure(exc)
        if why is None:
            return False
        FAILED_KERNELS.record(self.backend.name, self.case, why)
        warnings.warn(
            f"seqpar: the {self.backend.name!r} attention kernel failed to compile or launch for "
            f"{self.case}: {why}. Using the next capable backend for this case from now on "
            f"(backend={self.backend.name!r} forces it; seqpar.kernels.FAILED_KERNELS.clear() retries).",
            RuntimeWarning,
            stacklevel=3,
        )
        self.failed = why
        return True
