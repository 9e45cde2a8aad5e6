"""Fake CUDA tensors on the CPU build of torch, a simulated GPU, and the layout contracts of
torch's CUDA attention kernels, checked on the real arguments seqpar passes.

- :func:`simulated_gpu` makes ``torch.cuda.is_available()``, ``get_device_capability()`` and
  ``torch.backends.cuda.is_flash_attention_available()`` answer as a chosen GPU.
- :func:`fake_cuda` adds a ``FakeTensorMode`` (tensors made with ``device="cuda"`` carry shapes,
  strides and dtypes but no data) and :class:`TensorMethodShim`: on this build ``contiguous``,
  ``__getitem__``, ``__setitem__``, ``copy_`` and ``.to(device)`` of a fake CUDA tensor raise
  "not linked with support for cuda devices" (their Python bindings open a CUDA device guard);
  the shim runs the same aten ops without the guard.
- :class:`AtenContracts` intercepts the four SDPA ops seqpar calls and checks what the CUDA
  kernels assume beyond what torch's fake kernels check (:mod:`.sdpa_contracts`).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .sdpa_contracts import CHECKS

aten = torch.ops.aten
#: Shared memory per block (opt-in) of the simulated GPUs, bytes (Triton's targets, checked by ptxas).
SMEM_OPTIN = {(7, 5): 65_536, (8, 0): 166_912, (9, 0): 232_448, (10, 0): 232_448}


@contextlib.contextmanager
def simulated_gpu(capability: tuple[int, int], *, flash_sdp: bool = True, name: str | None = None,
                  cudnn: int | None = 91900):
    """Make torch answer as one GPU of ``capability`` (e.g. ``(8, 0)``); ``flash_sdp``: whether
    this torch build has its flash-attention kernel (Windows and ROCm builds may not); ``cudnn``:
    the cuDNN version of the build (torch 2.11 + CUDA 13 ships 9.19), ``None``: no cuDNN."""
    props = mock.Mock(major=capability[0], minor=capability[1], name=name or f"fake sm_{capability[0]}{capability[1]}",
                      multi_processor_count=108, total_memory=80 << 30,
                      shared_memory_per_block_optin=SMEM_OPTIN.get(tuple(capability), 101_376))
    with contextlib.ExitStack() as stack:
        for target, value in (
            ("torch.cuda.is_available", True),
            ("torch.cuda.device_count", 1),
            ("torch.cuda.current_device", 0),
            ("torch.cuda.get_device_capability", capability),
            ("torch.cuda.get_device_name", props.name),
            ("torch.cuda.get_device_properties", props),
            ("torch.backends.cuda.is_flash_attention_available", flash_sdp),
            ("torch.backends.cudnn.is_available", cudnn is not None),
            ("torch.backends.cudnn.version", cudnn),
        ):
            stack.enter_context(mock.patch(target, return_value=value))
        yield


def _fake_cuda(x) -> bool:
    return isinstance(x, FakeTensor) and x.device.type == "cuda"


def _index(x: torch.Tensor, idx) -> torch.Tensor:
    """Basic indexing (ints, slices, ``...``, ``None``) with aten view ops; anything else raises
    so that the shim never answers for an indexing form it does not implement."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if sum(i is Ellipsis for i in idx) > 1:
        raise IndexError("an index can only have a single ellipsis")
    used = sum(i is not None and i is not Ellipsis for i in idx)
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        idx = idx[:at] + (slice(None),) * (x.dim() - used) + idx[at + 1:]
    dim = 0
    for i in idx:
        if i is None:
            x = aten.unsqueeze.default(x, dim)
            dim += 1
        elif isinstance(i, bool) or not isinstance(i, (int, slice)):
            raise NotImplementedError(f"fake CUDA shim: index {i!r} of type {type(i).__name__}")
        elif isinstance(i, int):
            x = aten.select.int(x, dim, i)
        else:
            start, stop, step = i.indices(x.shape[dim])
            x = aten.slice.Tensor(x, dim, start, max(start, stop), step)
            dim += 1
    return x


class TensorMethodShim(TorchFunctionMode):
    """Runs the Tensor methods whose bindings open a CUDA device guard as plain aten ops on fake
    CUDA tensors; every other call passes through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not args or not _fake_cuda(args[0]):
            return func(*args, **kwargs)
        x = args[0]
        if func is torch.Tensor.contiguous:
            fmt = kwargs.get("memory_format", args[1] if len(args) > 1 else torch.contiguous_format)
            return x if x.is_contiguous(memory_format=fmt) else aten.clone.default(x, memory_format=fmt)
        if func is torch.Tensor.__getitem__:
            return _index(x, args[1])
        if func is torch.Tensor.__setitem__:
            view, value = _index(x, args[1]), args[2]
            if isinstance(value, torch.Tensor):
                aten.copy_.default(view, value)
            else:
                aten.fill_.Scalar(view, value)
            return None
        if func is torch.Tensor.copy_:
            return aten.copy_.default(x, args[1])
        if func is torch.Tensor.to:
            device, dtype, _, fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
            device = x.device if device is None else torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = x.device
            dtype = x.dtype if dtype is None else dtype
            if device == x.device and dtype == x.dtype:
                return x
            return aten._to_copy.default(x, dtype=dtype, device=device,
                                         memory_format=fmt or torch.preserve_format)
        return func(*args, **kwargs)


class AtenContracts(TorchDispatchMode):
    """Checks every call of torch's SDPA CUDA ops against the kernels' layout contracts.

    ``calls``: op names in call order; ``violations``: one line per broken contract.
    """

    def __init__(self, capability: tuple[int, int]):
        super().__init__()
        self.capability = capability
        self.calls: list[str] = []
        self.violations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = CHECKS.get(func)
        if check is not None:
            name = func.overloadpacket.__name__
            self.calls.append(name)
            self.violations += [f"{name}: {v}" for v in check(self.capability, *args, **kwargs)]
        return func(*args, **kwargs)


class CPUBuildFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that never materialises a tensor on the device: it decides that from
    ``torch.cuda.is_available()``, which :func:`simulated_gpu` makes answer True, and this build
    has no CUDA runtime (``torch.tensor(..., device="cuda")`` would fail)."""

    avoid_device_init = True


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int] = (9, 0), *, flash_sdp: bool = True, cudnn: int | None = 91900):
    """Simulated GPU + fake CUDA tensors + contract checks; yields the :class:`AtenContracts`."""
    contracts = AtenContracts(capability)
    with simulated_gpu(capability, flash_sdp=flash_sdp, cudnn=cudnn), CPUBuildFakeMode(), TensorMethodShim(), contracts:
        yield contracts


def cuda_tensor(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A fake CUDA tensor (call inside :func:`fake_cuda`)."""
    return torch.empty(shape, dtype=dtype, device="cuda")
