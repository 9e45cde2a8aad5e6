"""Local (one-rank) GLA kernels in phases, and their selection.

The sequence-parallel code needs the local computation split so that the exchange of states can run
during the expensive part (see :mod:`seqpar.kernels.linear_chunk` for the maths):

=============  ==========================================================  ======================
phase          computes                                                    cost
=============  ==========================================================  ======================
``states``     chunk states ``h`` and final states from given start states  ``T*K*V`` + scan
``intra``      intra-chunk output (no state term)                           ``T*C*(K+V)``, heavy
``output``     adds ``scale*(q*e^b) h``, back to token order                ``T*K*V``
``dstates``    reverse scan: state gradients                                ``T*K*V`` + scan
``bwd_intra``  ``dq`` and the intra-chunk parts of ``dk``, ``dv``           heavy
``bwd_finish`` state terms of ``dk``, ``dv``; ``dg``                        ``T*K*V``
=============  ==========================================================  ======================

Backends: ``"torch"`` (any device, float64 too) and ``"triton"`` (CUDA, or CPU under
``TRITON_INTERPRET=1``; float16/bfloat16/float32 inputs, computed in float32), which replaces the two
heavy phases. :func:`select_kernel` explains every refusal. flash-linear-attention's public
``chunk_gla`` does not expose these phases, so it serves only the single-device path
(:func:`fla_refusal`).
"""

from __future__ import annotations

import torch

from ..kernels import linear_chunk as lc

KERNELS = ("torch", "triton")


class TorchChunkKernel:
    """Plain-torch phases (:mod:`seqpar.kernels.linear_chunk`)."""

    name = "torch"

    def __init__(self, chunk: int = lc.CHUNK) -> None:
        self.chunk = chunk

    @staticmethod
    def refusal(q: torch.Tensor) -> str | None:
        return None

    def layout(self, seq_lens, device) -> lc.ChunkLayout:
        return lc.make_layout(seq_lens, self.chunk, device)

    prepare = staticmethod(lc.gla_prepare)
    states = staticmethod(lc.gla_states)
    intra = staticmethod(lc.gla_intra)
    output = staticmethod(lc.gla_output)
    dstates = staticmethod(lc.gla_dstates)
    bwd_intra = staticmethod(lc.gla_bwd_intra)
    bwd_finish = staticmethod(lc.gla_bwd_finish)

    @staticmethod
    def chunk_grad(do: torch.Tensor, p: lc.GLAPrep) -> torch.Tensor:
        return lc.to_chunks(do.reshape(-1, *do.shape[2:]).to(p.q.dtype), p.lay)


class TritonChunkKernel(TorchChunkKernel):
    """Triton kernels for ``intra`` and ``bwd_intra`` (:mod:`seqpar.kernels.linear_triton`)."""

    name = "triton"

    @staticmethod
    def refusal(q: torch.Tensor) -> str | None:
        from ..kernels import linear_triton as lt

        if not lt.HAVE_TRITON:
            return "triton is not installed"
        if q.device.type != "cuda" and not (lt.INTERPRET and q.device.type == "cpu"):
            return (f"needs a CUDA tensor (or CPU with TRITON_INTERPRET=1 set before seqpar's Triton "
                    f"kernels were imported), got device {q.device.type}")
        if q.dtype == torch.float64:
            return "computes in float32; float64 inputs use the torch kernel"
        return None

    @staticmethod
    def intra(p):
        from ..kernels import linear_triton as lt

        return lt.intra_fwd(p.q, p.k, p.v, p.b, p.scale)

    @staticmethod
    def bwd_intra(p, do_c, h):
        from ..kernels import linear_triton as lt

        dq, dk, dv = lt.intra_bwd(p.q, p.k, p.v, p.b, do_c, p.scale)
        eq = None if p.b is None else p.b.exp()
        dqi = (do_c.flatten(0, 1) @ h.flatten(0, 1).transpose(-1, -2)).view_as(dq).mul_(p.scale)
        dq += dqi if eq is None else dqi * eq
        return dq, dk, dv


_CLASSES = {"torch": TorchChunkKernel, "triton": TritonChunkKernel}


def select_kernel(q: torch.Tensor, backend: str | None = None, chunk: int = lc.CHUNK):
    """The kernel for ``q``'s device and dtype: ``backend`` if given (``ValueError`` with the reason if
    it cannot run), else Triton on CUDA when it can, else torch."""
    if backend is not None:
        if backend not in _CLASSES:
            raise ValueError(f"backend={backend!r} is unknown; choose one of {', '.join(KERNELS)} or None")
        why = _CLASSES[backend].refusal(q)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot run this call: {why}")
        return _CLASSES[backend](chunk)
    if q.device.type == "cuda" and TritonChunkKernel.refusal(q) is None:
        return TritonChunkKernel(chunk)
    return TorchChunkKernel(chunk)


def fla_refusal(q: torch.Tensor) -> str | None:
    """Why flash-linear-attention's ``chunk_gla`` cannot serve this single-device call (None: it can).

    Needs CUDA, fla >= 0.3 (``[B, T, H, K]`` is its only layout from then on; older versions default to
    head-first and would silently misread our tensors) and a half or float32 dtype.
    """
    if q.device.type != "cuda":
        return "fla's kernels need CUDA"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"fla does not compute in {q.dtype}"
    try:
        import fla  # noqa: F401
        from fla.ops.gla import chunk_gla  # noqa: F401
    except Exception as exc:  # not installed, or its import failed
        return f"flash-linear-attention is not importable ({type(exc).__name__})"
    version = tuple(int(x) for x in fla.__version__.split(".")[:2] if x.isdigit())
    if version < (0, 3):
        return f"fla {fla.__version__} < 0.3 (head-first default)"
    return None
