"""FlashAttention-4's real Python signatures over a stand-in for its CuTe DSL kernels.

- :func:`interface_source` fetches ``flash_attn/cute/interface.py`` of one ``flash-attn-4`` release
  (``pip download``, a 0.5 MB pure-Python wheel, no dependencies) into
  ``~/.cache/seqpar/flash-attn-4/<version>/`` (``SEQPAR_CACHE_DIR`` overrides ``~/.cache/seqpar``),
  as ``flash_stub.py`` does for flash-attn 2; nothing of flash-attn-4 lives in the repository.
- :func:`stand_in` builds a module ``flash_attn.cute.interface`` from that source without importing
  it (it imports the CuTe DSL, whose CUDA libraries are a 92 MB wheel): ``_flash_attn_fwd`` and
  ``_flash_attn_bwd`` keep their real parameter lists and defaults (parsed with ``ast``), so a call
  with an unknown or missing argument raises ``TypeError`` as the real one would, and their bodies
  are replaced by :class:`Kernels`, which applies the real function's input asserts (dtypes, shapes,
  GQA, architecture, head dims through the real ``_validate_head_dims``, windows through the real
  ``_resolve_causal_local_window``) and returns outputs of the shapes the real code allocates.
- :func:`flash4_on_fake_gpu` installs it as ``flash_attn.cute`` (version ``flash-attn-4`` as
  pinned) on a simulated GPU with fake CUDA tensors.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.metadata
import sys
import types
import zipfile
from pathlib import Path
from unittest import mock

import torch

from .fake_cuda import fake_cuda
from .flash_stub import cache_dir, cached_source

REAL = ("_flash_attn_fwd", "_flash_attn_bwd")
PURE = ("_resolve_causal_local_window", "_validate_head_dims")  # plain Python, run as they are


def _wheel_interface(tmp: Path) -> bytes:
    (wheel,) = tmp.glob("flash_attn_4-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.read("flash_attn/cute/interface.py")


def interface_source(version: str) -> Path | str:
    """Path of the cached ``interface.py`` of ``version``, downloaded on a cache miss; on failure, a
    string saying why (the caller skips)."""
    cmd = [sys.executable, "-m", "pip", "download", f"flash-attn-4=={version}", "--no-deps", "--only-binary",
           ":all:", "-d", "{dir}", "-q", "--timeout", "10", "--retries", "1"]
    return cached_source(cache_dir(version, "flash-attn-4") / "interface.py", f"flash-attn-4 {version}", cmd,
                         _wheel_interface)


def _functions(source: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}


def returned_names(fn: ast.FunctionDef) -> list[list[str]]:
    """The leading names of every ``return`` tuple of ``fn`` (to check what the stand-in returns)."""
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and isinstance(node.value, (ast.Tuple, ast.IfExp)):
            value = node.value.body if isinstance(node.value, ast.IfExp) else node.value
            out.append([e.id if isinstance(e, ast.Name) else ast.unparse(e) for e in value.elts])
    return out


def _stub(fn: ast.FunctionDef) -> ast.FunctionDef:
    """``fn`` with its real parameters (annotations dropped) and a body that hands them to the kernels."""
    args = fn.args
    for a in args.args + args.kwonlyargs:
        a.annotation = None
    fn.body = [ast.parse(f"return __kernels__.{fn.name}(**locals())").body[0]]
    fn.decorator_list, fn.returns = [], None
    return fn


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)  # the real interface asserts


class Kernels:
    """What the real ``_flash_attn_fwd`` / ``_flash_attn_bwd`` check and allocate, on a GPU of
    ``capability``; ``calls`` records ``(name, causal, local, window_left, window_right, varlen)``."""

    def __init__(self, capability: tuple[int, int], pure: dict):
        self.arch = capability[0] * 10 + capability[1]
        self.pure = pure
        self.calls: list[tuple] = []

    def _common(self, name, q, k, v, causal, window_size_left, window_size_right, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, **_):
        _check(q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype,
               "q, k, v must have the same fp16/bf16 dtype")
        for n, t in (("q", q), ("k", k), ("v", v)):
            _check(t.is_cuda and t.stride(-1) == 1, f"{n} must be a CUDA tensor, contiguous in its last dim")
        varlen = cu_seqlens_q is not None
        _check(varlen == (cu_seqlens_k is not None), "cu_seqlens_q and cu_seqlens_k go together here")
        _check(q.dim() == (3 if varlen else 4) and k.shape[:-2] == v.shape[:-2], "q, k, v shapes")
        if varlen:
            for t in (cu_seqlens_q, cu_seqlens_k):
                _check(t.dtype == torch.int32 and t.stride(0) == 1 and t.shape == cu_seqlens_q.shape,
                       "cu_seqlens must be int32, contiguous, of shape (batch_size + 1,)")
            _check(max_seqlen_q is not None and max_seqlen_k is not None, "varlen needs max_seqlen_q/k")
        else:
            _check(q.shape[0] == k.shape[0], "q and k batch")
        num_head, head_dim = q.shape[-2:]
        _check(num_head % k.shape[-2] == 0, "num_head must be divisible by num_head_kv")
        if self.arch // 10 not in (8, 12):
            self.pure["_validate_head_dims"](head_dim, v.shape[-1], self.arch // 10, 8)
        resolved = self.pure["_resolve_causal_local_window"](causal, window_size_left, window_size_right)
        self.calls.append((name, *resolved, varlen))
        return varlen

    def _flash_attn_fwd(self, q, k, v, return_lse=False, out=None, lse=None, **kw):
        _check(self.arch // 10 in (8, 9, 10, 11, 12), "Unsupported compute capability")
        _check(return_lse and out is None and lse is None, "seqpar asks for lse, allocates nothing")
        varlen = self._common("fwd", q, k, v, **kw)
        num_head = q.shape[-2]
        shape = (num_head, q.shape[0]) if varlen else (q.shape[0], num_head, q.shape[1])
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        return out, torch.empty(shape, dtype=torch.float32, device=q.device), None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, dq=None, dk=None, dv=None, learnable_sink=None, **kw):
        _check(self.arch // 10 in (9, 10, 11, 12), "Unsupported compute capability")
        varlen = self._common("bwd", q, k, v, **kw)
        for n, t in (("out", out), ("dout", dout)):
            _check(t.dtype == q.dtype and t.shape[:-1] == q.shape[:-1] and t.stride(-1) == 1, f"{n} like q")
        want = (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[-2], q.shape[1])
        _check(lse.dtype == torch.float32 and tuple(lse.shape) == want and lse.is_contiguous(),
               f"lse must be contiguous float32 {want}, got {lse.dtype} {tuple(lse.shape)}")
        _check(learnable_sink is None and dq is None and dk is None and dv is None, "seqpar passes none of these")
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@functools.lru_cache(maxsize=4)
def _compiled(source_path: Path):
    """The real pure helpers and the stubbed real signatures of ``source_path``, compiled once."""
    fns = _functions(source_path.read_text())
    for name in PURE:
        fns[name].decorator_list = []  # lru_cache: not needed
    pure = compile(ast.Module([fns[n] for n in PURE], []), str(source_path), "exec")
    stubs = compile(ast.fix_missing_locations(ast.Module([_stub(fns[n]) for n in REAL], [])), str(source_path), "exec")
    return pure, stubs


def stand_in(source_path: Path, capability: tuple[int, int]) -> tuple[types.ModuleType, Kernels]:
    """The module ``flash_attn.cute.interface`` of the real source over :class:`Kernels`."""
    pure_code, stub_code = _compiled(source_path)
    pure: dict = {}
    exec(pure_code, pure)  # noqa: S102 - upstream's own plain-Python helpers
    kernels = Kernels(capability, pure)
    module = types.ModuleType("flash_attn.cute.interface")
    module.__kernels__ = kernels
    exec(stub_code, module.__dict__)  # noqa: S102
    return module, kernels


@contextlib.contextmanager
def flash4_on_fake_gpu(source_path: Path, version: str, capability: tuple[int, int] = (9, 0), *,
                       installed: str | None = None):
    """Fake CUDA on a simulated GPU with the stand-in importable as ``flash_attn.cute``; ``installed``:
    the ``flash-attn-4`` version ``importlib.metadata`` reports (default ``version``). Yields the
    :class:`Kernels` record."""
    module, kernels = stand_in(source_path, capability)
    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    package.__path__, cute.__path__ = [], []
    package.cute, cute.interface = cute, module
    real_version = importlib.metadata.version

    def version_of(name):
        return (installed or version) if name == "flash-attn-4" else real_version(name)

    from seqpar.kernels.flash4 import installed_version

    modules = {"flash_attn": package, "flash_attn.cute": cute, "flash_attn.cute.interface": module}
    installed_version.cache_clear()  # read once per process: make it read the patched metadata
    try:
        with mock.patch.dict(sys.modules, modules), mock.patch("importlib.metadata.version", version_of), \
                fake_cuda(capability) as contracts:
            yield kernels
    finally:
        installed_version.cache_clear()
    assert contracts.violations == [], contracts.violations
