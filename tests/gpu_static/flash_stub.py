"""flash-attn's real Python interface over a stand-in for its compiled extension.

- :func:`interface_source` fetches ``flash_attn/flash_attn_interface.py`` of one release from
  PyPI's sdist (``pip download``, no build) into ``~/.cache/seqpar/flash-attn/<version>/``
  (``SEQPAR_CACHE_DIR`` overrides ``~/.cache/seqpar``); nothing of flash-attn lives in the
  repository.
- :class:`FlashExtension` stands for ``flash_attn_2_cuda``: ``fwd``, ``bwd``, ``varlen_fwd``,
  ``varlen_bwd`` apply the input checks of ``csrc/flash_attn/flash_api.cpp`` (``mha_fwd``,
  ``mha_bwd``, ``mha_varlen_fwd``, ``mha_varlen_bwd``; identical from 2.7.0 to 2.8.3 except the
  GPU rule: before 2.7.3 only sm_8x and sm_90, from 2.7.3 any sm >= 80) and the lse layouts the
  kernels read through raw pointers, and return outputs of the shapes the C++ code allocates.
- :func:`flash_attn_on_fake_gpu` imports the interface with the stand-in, makes ``import
  flash_attn`` find it, and runs flash-attn's ``torch.library`` custom ops through their real
  Python bodies (``FakeTensorMode`` would otherwise call their fake kernels and never reach the
  extension); each call is also compared with flash-attn's own fake kernel.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqpar.kernels.flash import version_tuple

from .fake_cuda import fake_cuda

#: Every flash-attn release the ``flash`` extra admits (``>=2.7,<3``), checked on PyPI 2026-11.
ADMITTED = ("2.7.0.post2", "2.7.1.post4", "2.7.2.post1", "2.7.3", "2.7.4.post1", "2.8.0.post2", "2.8.1",
            "2.8.2", "2.8.3", "2.8.3.post1", "2.8.3.post2")
#: In CI: the oldest and the newest admitted release (the GPU rule changed in between).
CI_VERSIONS = ("2.7.0.post2", "2.8.3.post2")
DOWNLOAD_TIMEOUT_S = 60  # one sdist (8-10 s measured, 2.6-8.5 MB) or one 0.5 MB wheel


def cache_dir(version: str, package: str = "flash-attn") -> Path:
    root = Path(os.environ.get("SEQPAR_CACHE_DIR", Path.home() / ".cache" / "seqpar"))
    return root / package / version


def cached_source(target: Path, label: str, cmd: list[str], extract, env: dict | None = None) -> Path | str:
    """``target`` (one source file of a released package) from the cache, or on a miss: ``cmd`` (a
    ``pip download`` into the temporary directory it is formatted with, ``{dir}``), then
    ``extract(dir) -> bytes`` of the file, written to the cache atomically. On failure, a string
    saying why (the caller skips)."""
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([c.format(dir=tmp) for c in cmd], env=env, capture_output=True, text=True,
                           timeout=DOWNLOAD_TIMEOUT_S, check=True)
            text = extract(Path(tmp))
        except (subprocess.SubprocessError, OSError, ValueError, KeyError, StopIteration, tarfile.TarError,
                zipfile.BadZipFile) as exc:
            stderr = [line for line in (getattr(exc, "stderr", None) or "").splitlines() if line.strip()]
            detail = stderr[-1] if stderr else f"{type(exc).__name__}: {exc}"
            return f"{label} sources not cached in {target.parent} and not downloadable: {detail}"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.part")  # atomic: a concurrent or killed run never
    partial.write_bytes(text)  # leaves a half-written file in the cache
    partial.replace(target)
    return target


def _sdist_interface(tmp: Path) -> bytes:
    (sdist,) = tmp.glob("flash_attn-*.tar.gz")
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/flash_attn/flash_attn_interface.py"))
        return tar.extractfile(member).read()


def interface_source(version: str) -> Path | str:
    """Path of the cached ``flash_attn_interface.py`` of ``version``, downloading it on a cache
    miss; on failure, a string saying why (the caller skips)."""
    cmd = [sys.executable, "-m", "pip", "download", f"flash-attn=={version}", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", "{dir}", "-q", "--timeout", "10", "--retries", "1"]
    return cached_source(cache_dir(version) / "flash_attn_interface.py", f"flash-attn {version}", cmd,
                         _sdist_interface, env=dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE"))


def _round128(x: int) -> int:
    return (x + 127) // 128 * 128


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)  # what TORCH_CHECK raises in the extension


def _shape(t: torch.Tensor, name: str, *shape: int) -> None:
    _check(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")


class FlashExtension(types.ModuleType):
    """``flash_attn_2_cuda`` of flash-attn ``version`` on a GPU of ``capability``; records calls.
    ``fail[name] = exc`` makes function ``name`` raise ``exc`` (a kernel that cannot launch)."""

    def __init__(self, version: str, capability: tuple[int, int]):
        super().__init__("flash_attn_2_cuda")
        self.version, self.capability = version_tuple(version), tuple(capability)
        self.calls: list[str] = []
        self.fail: dict[str, BaseException] = {}

    def _called(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    # -------------------------------------------------------------- checks shared by the four
    def _gpu(self) -> None:
        major, minor = self.capability
        if self.version >= (2, 7, 3):
            ok = major >= 8
        else:
            ok = major == 8 or (major, minor) == (9, 0)
        _check(ok, "FlashAttention only supports Ampere GPUs or newer.")

    def _inputs(self, q, k, v, *extra) -> None:
        self._gpu()
        _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
        for name, t in (("key", k), ("value", v), *extra):
            _check(t.dtype == q.dtype, f"query and {name} must have the same dtype")
        for name, t in (("q", q), ("k", k), ("v", v), *extra):
            _check(t.is_cuda, f"{name} must be on CUDA")
            _check(t.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
        d = q.shape[-1]
        _check(d <= 256, "FlashAttention only supports head dimension at most 256")
        _check(d % 8 == 0, "head_size should be a multiple of 8")
        hq, hk = q.shape[-2], k.shape[-2]
        _check(hq % hk == 0, "Number of heads in key/value must divide number of heads in query")

    @staticmethod
    def _options(p_dropout, softcap, alibi_slopes, window_size_left, window_size_right, batch, heads) -> None:
        _check(0.0 <= p_dropout < 1.0, "p_dropout must be in [0, 1)")
        if softcap > 0.0:
            _check(p_dropout == 0.0, "Softcapping does not support dropout for now")
        _check(isinstance(window_size_left, int) and isinstance(window_size_right, int), "window sizes must be ints")
        if alibi_slopes is not None:
            _check(alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
            _check(alibi_slopes.stride(-1) == 1, "ALiBi slopes tensor must have contiguous last dimension")
            _check(tuple(alibi_slopes.shape) in ((heads,), (batch, heads)), "ALiBi slopes shape")

    @staticmethod
    def _cu_seqlens(cu: torch.Tensor, name: str, batch: int) -> None:
        _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
        _check(cu.is_cuda, f"{name} must be on CUDA")
        _check(cu.is_contiguous(), f"{name} must be contiguous")
        _shape(cu, name, batch + 1)

    def _grads(self, q, k, v, dq, dk, dv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = []
        for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if g is None:
                g = torch.empty_like(like)
            _check(g.dtype == q.dtype, f"{name} must have the same dtype as q")
            _check(g.is_cuda and g.stride(-1) == 1, f"{name} must have contiguous last dimension")
            _shape(g, name, *like.shape)
            out.append(g)
        return tuple(out)

    @staticmethod
    def _lse(lse: torch.Tensor, *shape: int) -> None:
        """Not a TORCH_CHECK: the backward kernels read lse through a raw pointer in this layout
        (``(b * h + head) * seqlen_q + row``; varlen: ``head * total_q + row``, unpadded)."""
        _check(lse.is_cuda and lse.dtype == torch.float32 and lse.is_contiguous() and tuple(lse.shape) == shape,
               f"softmax_lse must be contiguous float32 {shape} on CUDA, got {lse.dtype} {tuple(lse.shape)} "
               f"strides {lse.stride()}")

    @staticmethod
    def _forward_outputs(q, out_, return_softmax, p_dropout, lse_shape, p_shape):
        if out_ is not None:
            _check(out_.dtype == q.dtype and out_.stride(-1) == 1, "Output must have the same dtype as inputs")
            _shape(out_, "out", *q.shape)
        _check(not return_softmax or p_dropout > 0.0, "return_softmax is only supported when p_dropout > 0.0")
        out = torch.empty_like(q) if out_ is None else out_
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        p = torch.empty(p_shape if return_softmax else (0,), dtype=q.dtype, device=q.device)
        return [out, lse, p, torch.empty((2,), dtype=torch.int64, device=q.device)]

    # -------------------------------------------------------------- the extension's functions
    def fwd(self, q, k, v, out_, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left,
            window_size_right, softcap, return_softmax, gen_):
        self._called("fwd")
        self._inputs(q, k, v)
        b, sq, h, d = q.shape
        _check(b > 0, "batch size must be positive")
        _shape(k, "k", b, k.shape[1], k.shape[2], d)
        _shape(v, "v", *k.shape)
        self._options(p_dropout, softcap, alibi_slopes, window_size_left, window_size_right, b, h)
        return self._forward_outputs(q, out_, return_softmax, p_dropout, (b, h, sq), (b, h, _round128(sq), _round128(k.shape[1])))

    def varlen_fwd(self, q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table,
                   alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
                   window_size_left, window_size_right, softcap, return_softmax, gen_):
        self._called("varlen_fwd")
        self._inputs(q, k, v)
        batch = cu_seqlens_q.numel() - 1
        _check(batch > 0, "batch size must be positive")
        self._cu_seqlens(cu_seqlens_q, "cu_seqlens_q", batch)
        self._cu_seqlens(cu_seqlens_k, "cu_seqlens_k", batch)
        _check(block_table is None and seqused_k is None and leftpad_k is None, "seqpar uses no paged/used-k/leftpad")
        total_q, h, d = q.shape
        _shape(v, "v", *k.shape)
        _check(k.dim() == 3 and k.shape[2] == d, "k must be (total_k, num_heads_k, head_size)")
        _check(isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), "max_seqlen must be ints")
        self._options(p_dropout, softcap, alibi_slopes, window_size_left, window_size_right, batch, h)
        return self._forward_outputs(q, out_, return_softmax, p_dropout, (h, total_q),
                                     (batch, h, _round128(max_seqlen_q), _round128(max_seqlen_k)))

    def bwd(self, dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes, p_dropout, softmax_scale, is_causal,
            window_size_left, window_size_right, softcap, deterministic, gen_, rng_state):
        self._called("bwd")
        self._inputs(q, k, v, ("out", out), ("dout", dout))
        self._backward_gpu(q, p_dropout)
        b, sq, h, _ = q.shape
        for name, t in (("out", out), ("dout", dout)):
            _shape(t, name, *q.shape)
        _shape(v, "v", *k.shape)
        self._lse(softmax_lse, b, h, sq)
        self._options(p_dropout, softcap, alibi_slopes, window_size_left, window_size_right, b, h)
        dq, dk, dv = self._grads(q, k, v, dq_, dk_, dv_)
        softmax_d = torch.empty((b, h, _round128(sq)), dtype=torch.float32, device=q.device)
        return [dq, dk, dv, softmax_d]

    def varlen_bwd(self, dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
                   window_size_right, softcap, deterministic, gen_, rng_state):
        self._called("varlen_bwd")
        self._inputs(q, k, v, ("out", out), ("dout", dout))
        self._backward_gpu(q, p_dropout)
        batch = cu_seqlens_q.numel() - 1
        _check(batch > 0, "batch size must be positive")
        self._cu_seqlens(cu_seqlens_q, "cu_seqlens_q", batch)
        self._cu_seqlens(cu_seqlens_k, "cu_seqlens_k", batch)
        total_q, h, _ = q.shape
        for name, t in (("out", out), ("dout", dout)):
            _shape(t, name, *q.shape)
        _shape(v, "v", *k.shape)
        self._lse(softmax_lse, h, total_q)
        self._options(p_dropout, softcap, alibi_slopes, window_size_left, window_size_right, batch, h)
        dq, dk, dv = self._grads(q, k, v, dq_, dk_, dv_)
        softmax_d = torch.empty((h, total_q + 128 * batch), dtype=torch.float32, device=q.device)
        return [dq, dk, dv, softmax_d]

    def _backward_gpu(self, q, p_dropout) -> None:
        if self.version < (2, 7, 3) and q.shape[-1] > 192 and p_dropout > 0.0:
            _check(self.capability in ((8, 0), (9, 0)), "FlashAttention backward for head dim > 192 with dropout "
                   "requires A100/A800 or H100/H800")

    def fwd_kvcache(self, *args, **kwargs):
        raise NotImplementedError("seqpar never calls flash_attn_with_kvcache")


class RealCustomOps(TorchDispatchMode):
    """Runs flash-attn's ``torch.library`` custom ops through their real Python bodies (which call
    the extension) instead of their fake kernels, and checks that the extension's outputs have
    the shapes and dtypes of flash-attn's own fake kernel."""

    def __init__(self, interface: types.ModuleType):
        super().__init__()
        self.interface = interface

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "flash_attn":
            return func(*args, **kwargs)
        opdef = getattr(self.interface, func._opname)
        real = opdef._init_fn(*args, **kwargs)
        fake = opdef._abstract_fn(*args, **kwargs)
        for r, f in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (real, fake))):
            if isinstance(r, torch.Tensor) and r.numel() and f.numel():
                assert (r.shape, r.dtype) == (f.shape, f.dtype), f"{func}: extension {r.shape} vs fake {f.shape}"
        return real


def load_interface(source: Path, version: str, extension: FlashExtension) -> types.ModuleType:
    """Import ``source`` as ``flash_attn.flash_attn_interface`` of a package ``flash_attn`` whose
    ``__version__`` is ``version``, with ``extension`` as ``flash_attn_2_cuda``; returns the package.
    Importing re-registers flash-attn's custom ops, so the last version loaded is the live one."""
    package = types.ModuleType("flash_attn")
    package.__version__, package.__path__ = version, []
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.__package__, interface.__file__ = "flash_attn", str(source)
    saved = sys.modules.get("flash_attn_2_cuda")
    sys.modules["flash_attn_2_cuda"] = extension
    try:
        exec(compile(  # noqa: S102 (flash-attn's own interface module, from its sdist)
            source.read_text(), str(source), "exec"), interface.__dict__)
    finally:
        if saved is None:
            sys.modules.pop("flash_attn_2_cuda")
        else:
            sys.modules["flash_attn_2_cuda"] = saved
    package.flash_attn_interface = interface
    return package


@contextlib.contextmanager
def flash_attn_on_fake_gpu(source: Path, version: str, capability: tuple[int, int]):
    """:func:`fake_cuda` plus flash-attn ``version`` importable over the stand-in extension;
    yields ``(extension, contracts)`` (the :class:`FlashExtension` and the SDPA contract record)."""
    extension = FlashExtension(version, capability)
    package = load_interface(source, version, extension)
    modules = {"flash_attn": package, "flash_attn.flash_attn_interface": package.flash_attn_interface,
               "flash_attn_2_cuda": extension}
    with fake_cuda(capability) as contracts, contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules, modules))
        stack.enter_context(RealCustomOps(package.flash_attn_interface))
        yield extension, contracts

