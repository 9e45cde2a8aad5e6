"""A GPU machine as seqpar sees it, on the CPU build of torch: ``torch.cuda`` stand-ins and fake CUDA tensors.

- :class:`FakeCudaModule` patches ``torch.cuda``: one GPU per local rank (sm_90), ``set_device``
  remembered, ``synchronize``/streams/events recorded; one used on a CPU device, or a stream made
  for a CPU tensor, is a violation (CUDA streams and events belong behind a CUDA check).
- :func:`fake_tensor_mode`: torch's ``FakeTensorMode`` (shapes, dtypes and devices without data).
- :func:`cuda_methods_mode`: a ``TorchFunctionMode`` for what the CPU build cannot do with fake CUDA
  tensors. ``__getitem__``, ``__setitem__``, ``contiguous``, ``copy_``, ``.to``/``.cuda()``, ``~``,
  ``nonzero``, ``new_tensor``, ``uniform_`` raise
  "not linked with support for cuda devices" (their Python bindings take a CUDA device guard): they
  are rerouted to the equivalent aten ops, which is what those bindings call on a GPU. Autograd
  never records (over fake CUDA tensors that aborts the process: :func:`no_autograd`) and
  ``Tensor.backward`` / ``torch.autograd.grad`` run the recorded Functions' backward instead.
"""

from __future__ import annotations

import contextlib
import sys
import types
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

H100_SMEM = 232_448  # shared memory per block, sm_90
_STREAM_APIS = ("torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.synchronize", "torch.cuda.current_stream",
                "torch.cuda.stream", "Tensor.record_stream")


def is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


class _NoDeviceFakeTensorMode(FakeTensorMode):
    # torch.cuda.is_available() answers True here, but no CUDA tensor may ever be made for real
    # (FakeTensorMode would constant-fold small CUDA tensors on the device)
    avoid_device_init = property(lambda self: True)


def fake_tensor_mode() -> FakeTensorMode:
    # torch's cache of fake results is one per process and its keys leave out the current CUDA device:
    # a tensor made on "cuda" by the rank simulated before would come back on that rank's GPU
    FakeTensorMode.cache_clear()
    # real tensors made before the mode (module constants, a CPU cu_seqlens) may meet fake ones
    return _NoDeviceFakeTensorMode(allow_non_fake_inputs=True)


def _index(device) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.type == "cuda" else -1


class _Stream(torch.Stream):
    """A CUDA stream as torch's bindings accept it (``Tensor.record_stream`` parses a ``torch.Stream``).
    :meth:`FakeCudaModule.patch` binds a subclass to its module (``cuda``)."""

    cuda: FakeCudaModule

    def __new__(cls, device=None, priority: int = 0, **_):
        index = cls.cuda.device if _index(device) in (None, -1) else _index(device)
        return super().__new__(cls, stream_id=0, device_index=index, device_type=1)  # 1: CUDA

    def __init__(self, device=None, priority: int = 0, **_):
        self.cuda.check_device("torch.cuda.Stream", device)

    def wait_stream(self, other):
        self.cuda.check_stream("Stream.wait_stream", other)

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or torch.cuda.Event()

    def synchronize(self):
        self.cuda.run.clock.device_idle()

    def query(self):
        return True


class _Event:
    cuda: FakeCudaModule

    def __init__(self, enable_timing: bool = False, **_):
        self.cuda.check_device("torch.cuda.Event", None)

    def record(self, stream=None):
        if stream is not None:
            self.cuda.check_stream("Event.record", stream)

    def wait(self, stream=None):
        pass

    def synchronize(self):
        self.cuda.run.clock.device_idle()

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1.0


class FakeCudaModule:
    """``torch.cuda`` of a machine with ``devices`` GPUs, seen from local rank ``local``."""

    def __init__(self, run, local: int, devices: int | None = None):
        self.run, self.local = run, local
        self.devices = devices or max(run.world_size, local + 1)
        self.device = 0
        self.device_set: int | None = None
        self.calls: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ checks
    def _violation(self, name: str, detail: str) -> None:
        from .fake_nccl import call_site

        self.run.flag("CUDA stream/event/sync outside a CUDA path", name, call_site(), detail)

    def check_device(self, name: str, device) -> None:
        """A CPU device is wrong anywhere; on a CPU job (gloo, CPU tensors) any stream, event or
        synchronisation is: seqpar must choose them from the tensors, not from ``is_available()``."""
        from .fake_nccl import call_site

        self.calls.append((name, call_site()))
        if _index(device) == -1:
            self._violation(name, f"device {device}")
        elif self.run.backend != "nccl" and name in _STREAM_APIS:
            self._violation(name, "on a CPU job (gloo, CPU tensors)")

    def check_stream(self, name: str, stream) -> None:
        if not isinstance(stream, _Stream):
            self._violation(name, f"not a CUDA stream: {stream!r}")

    # ------------------------------------------------------------------ torch.cuda
    def set_device(self, device) -> None:
        self.check_device("torch.cuda.set_device", device)
        self.device = self.device_set = _index(device)

    def current_device(self) -> int:
        return self.device

    def synchronize(self, device=None) -> None:
        self.check_device("torch.cuda.synchronize", device)
        self.run.clock.device_idle()

    def current_stream(self, device=None):
        self.check_device("torch.cuda.current_stream", device)
        return torch.cuda.Stream(device)

    def stream(self, s):
        self.check_device("torch.cuda.stream", None)
        if s is not None:
            self.check_stream("torch.cuda.stream", s)
        return contextlib.nullcontext(s)

    def properties(self, device=None):
        self.check_device("torch.cuda.get_device_properties", device)
        return types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 << 30,
                                     multi_processor_count=132, shared_memory_per_block_optin=H100_SMEM,
                                     shared_memory_per_multiprocessor=233_472, warp_size=32)

    def patch(self):
        """Patch ``torch.cuda`` for the body."""
        mem = lambda device=None: (self.check_device("torch.cuda memory", device), 0)[1]  # noqa: E731
        table = {
            "is_available": lambda: True, "device_count": lambda: self.devices, "is_initialized": lambda: True,
            "_lazy_init": lambda: None, "current_device": self.current_device, "set_device": self.set_device,
            "synchronize": self.synchronize, "get_device_capability": lambda device=None: (9, 0),
            "get_device_name": lambda device=None: "NVIDIA H100 80GB HBM3", "get_device_properties": self.properties,
            "Stream": type("Stream", (_Stream,), {"cuda": self}), "Event": type("Event", (_Event,), {"cuda": self}),
            "current_stream": self.current_stream, "default_stream": self.current_stream, "stream": self.stream,
            "mem_get_info": lambda device=None: (self.check_device("torch.cuda.mem_get_info", device),
                                                 (80 << 30, 80 << 30))[1],
            "memory_allocated": mem, "max_memory_allocated": mem, "memory_reserved": mem,
            "reset_peak_memory_stats": lambda device=None: self.check_device("torch.cuda memory", device),
            "empty_cache": lambda: None, "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None,
        }
        stack = contextlib.ExitStack()
        for name, fn in table.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, fn))
        stack.enter_context(mock.patch.object(torch.cuda.nccl, "version", lambda: (2, 27, 3)))  # torch asks on send
        return stack


# ------------------------------------------------------------------------------------ tensor methods
def _fake_cuda(t) -> bool:
    return is_fake(t) and t.device.type == "cuda"


def _basic_index(x, index):
    """``x[index]`` for ints, slices, None and Ellipsis through aten view ops, and the tensor indices
    left for ``aten.index`` / ``aten.index_put_`` (``[None, t]``: a tensor index on dim 1)."""
    index = index if isinstance(index, tuple) else (index,)
    index = tuple(torch.tensor(i) if isinstance(i, list) else i for i in index)  # a list is a tensor index
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if any(i is Ellipsis for i in index):
        at = next(j for j, i in enumerate(index) if i is Ellipsis)
        index = index[:at] + (slice(None),) * (x.dim() - n_real) + index[at + 1:]
    dim, tensors = 0, {}
    for i in index:
        if i is None:
            x = torch.ops.aten.unsqueeze.default(x, dim)
            dim += 1
        elif isinstance(i, slice):
            if i != slice(None):
                x = torch.ops.aten.slice.Tensor(x, dim, i.start, i.stop, i.step or 1)
            dim += 1
        elif isinstance(i, torch.Tensor):
            tensors[dim] = i
            dim += 1
        else:
            x = torch.ops.aten.select.int(x, dim, int(i))
    return x, ([tensors.get(d) for d in range(max(tensors) + 1)] if tensors else None)


def _getitem(x, index):
    x, tensors = _basic_index(x, index)
    return x if tensors is None else torch.ops.aten.index.Tensor(x, tensors)


def _setitem(x, index, value):
    target, tensors = _basic_index(x, index)
    if tensors is not None:
        value = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=x.dtype, device=x.device)
        torch.ops.aten.index_put_.default(target, tensors, value)
    elif isinstance(value, torch.Tensor):
        torch.ops.aten.copy_.default(target, value)
    else:
        torch.ops.aten.fill_.Scalar(target, value)


def _nonzero(x, *, as_tuple=False):
    idx = torch.ops.aten.nonzero.default(x)
    return tuple(torch.ops.aten.select.int(idx, 1, d) for d in range(x.dim())) if as_tuple else idx


def _to(x, *args, **kwargs):
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    copy = kwargs.get("copy", False)
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not copy and (device is None or device == x.device) and (dtype is None or dtype == x.dtype) \
            and memory_format is None:
        return x
    return torch.ops.aten._to_copy.default(x, dtype=dtype or x.dtype, device=device or x.device,
                                           memory_format=memory_format)


@contextlib.contextmanager
def no_autograd():
    """Grad mode off for real (no graph is recorded, whatever ``requires_grad`` says), while
    ``torch.is_grad_enabled()`` answers True to seqpar's code, as in a training step (torch's own
    callers get the truth: ``no_grad`` restores what it read)."""
    real = torch.is_grad_enabled

    def is_grad_enabled():
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return True if caller.startswith("seqpar") else real()

    with torch.no_grad(), mock.patch.object(torch, "is_grad_enabled", is_grad_enabled):
        yield


def fake_tolist(run, shadows):
    """``FakeTensor.tolist`` (one ``item()`` per element) answered from the shadow at once."""
    def tolist(x):
        run.host_read(x, "tolist")
        value = shadows.get(x)
        return (torch.ones(x.shape, dtype=x.dtype) if value is None else value).tolist()

    return mock.patch.object(FakeTensor, "tolist", tolist)


def cuda_methods_mode(run, shadows, tape_backward) -> TorchFunctionMode:
    T = torch.Tensor

    def contiguous(x, memory_format=torch.contiguous_format):
        return x if x.is_contiguous(memory_format=memory_format) else \
            torch.ops.aten.clone.default(x, memory_format=memory_format)

    def record_stream(x, stream):
        run.cuda.check_device("Tensor.record_stream", x.device)
        run.cuda.check_stream("Tensor.record_stream", stream)

    def grad(outputs, inputs, grad_outputs=None, **_):
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        tape_backward(run)
        return tuple(torch.zeros_like(i) for i in inputs)

    def host(convert):
        def read(x, *args):
            run.host_read(x, convert.__name__)
            value = shadows.get(x)
            if value is None:  # a value nobody knows (an op without a CPU kernel made it): a plausible one
                value = torch.ones(x.shape, dtype=x.dtype)
            return convert(value, *args)
        return read

    fake_only = { T.item: host(T.item), T.__int__: host(T.__int__),
                 T.__float__: host(T.__float__), T.__bool__: host(T.__bool__), T.__index__: host(T.__index__),
                 T.__format__: host(T.__format__)}
    cuda_only = {
        T.__getitem__: _getitem, T.__setitem__: _setitem, T.contiguous: contiguous,
        T.copy_: lambda x, src, non_blocking=False: torch.ops.aten.copy_.default(x, src, non_blocking),
        T.__invert__: torch.ops.aten.bitwise_not.default, T.nonzero: _nonzero,
        T.uniform_: lambda x, a=0.0, b=1.0, generator=None: torch.ops.aten.uniform_.default(x, a, b,
                                                                                            generator=generator),
        T.new_tensor: lambda x, data, dtype=None, device=None, requires_grad=False:
            torch.tensor(data, dtype=dtype or x.dtype, device=device or x.device),
    }
    any_tensor = {
        T.to: _to, T.cuda: lambda x, device=None, non_blocking=False: _to(x, device or "cuda"),
        T.record_stream: record_stream,
        T.backward: lambda *a, **k: tape_backward(run), torch.autograd.backward: lambda *a, **k: tape_backward(run),
        torch.autograd.grad: grad,
    }

    class CudaMethods(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if device is not None and str(device) == "cuda":  # the C++ side would take GPU 0, not the current one
                kwargs = {**kwargs, "device": torch.device("cuda", torch.cuda.current_device())}
            if func in any_tensor:
                with self:  # the handlers run torch code (a Function's backward) under this mode too
                    return any_tensor[func](*args, **kwargs)
            if func in fake_only and is_fake(args[0]):
                return fake_only[func](*args, **kwargs)
            if func in cuda_only and _fake_cuda(args[0]):
                return cuda_only[func](*args, **kwargs)
            return func(*args, **kwargs)

    return CudaMethods()
