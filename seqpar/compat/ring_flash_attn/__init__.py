"""ring-flash-attention's public API (0.1.x) on seqpar: change one import to switch::

    import seqpar.compat.ring_flash_attn as ring_flash_attn       # was: import ring_flash_attn
    from seqpar.compat.ring_flash_attn import zigzag_ring_flash_attn_func

Same function names, argument names, defaults, token layouts and return values; runs on CPU (gloo)
and GPU (NCCL), needs no flash-attn build, never expands GQA's K,V heads:

- dense ``[B, T_local, H, D]`` (:mod:`.dense`): ``ring_flash_attn_func`` (contiguous chunks),
  ``zigzag_ring_flash_attn_func`` (chunks r and 2N-1-r), ``stripe_flash_attn_func`` (token i on
  rank i mod N), each with ``_kvpacked_func`` and ``_qkvpacked_func`` forms;
- packed ``[T_local, H, D]`` with every document split over the ranks (:mod:`.varlen`):
  ``ring_flash_attn_varlen_func``, ``zigzag_ring_flash_attn_varlen_func`` (+ packed forms), local
  ``cu_seqlens`` = global // N;
- the packed stream cut into N contiguous pieces (:mod:`.llama3`):
  ``llama3_flash_attn_prepare_cu_seqlens``, ``llama3_flash_attn_varlen_func`` (+ packed forms);
- the original's module paths too (``.ring_flash_attn``, ``.zigzag_ring_flash_attn``,
  ``.stripe_flash_attn``, ``.ring_flash_attn_varlen``, ``.zigzag_ring_flash_attn_varlen``,
  ``.llama3_flash_attn_varlen``: the same functions), for code that imports from them;
- the HF adapter (:mod:`.adapters.hf_adapter`, the original's module path): ``substitute_hf_flash_attn``,
  ``update_ring_flash_attn_params``, ``use_ring_attn``, ``DATA_PARAMS``.

``return_attn_probs=True`` returns ``(out, lse, None)`` like the original (lse fp32, ``[B, H, T_local]``
dense, ``[H, T_local]`` varlen; from the same single forward). Under ``torch.compile`` each call runs
eagerly (``torch.compiler.disable``: a graph break around it; its rank checks and, for llama3, the
offsets' all-gathers cannot be traced), so ``fullgraph=True`` refuses them; ``seqpar.attention``
itself compiles as one op. Where seqpar differs:

- exact ``window_size`` in every layout (causal: ``(left, *)``; non-causal: symmetric ``(w, w)``);
- ``zigzag_*`` and ``stripe_*`` also take ``causal=False`` (the original asserts causal);
- ``dropout_p > 0`` and ``alibi_slopes`` raise ``ValueError`` on every rank before any communication
  (seqpar implements neither); ``deterministic`` is accepted (seqpar's results do not depend on it);
- ``max_seqlen*`` and ``heads_k_stride`` are accepted and not needed (``heads_k_stride`` must
  divide the K,V heads, as in the original);
- the HF adapter applies a model's ``sliding_window`` W as transformers' own attention functions do
  (each query sees W keys, itself included); the original passes ``window_size=(W, W)``, one key more.
"""

from .dense import (ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func,
                    stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func,
                    zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func,
                    zigzag_ring_flash_attn_qkvpacked_func)
from . import adapters
from .adapters.hf_adapter import substitute_hf_flash_attn, update_ring_flash_attn_params, use_ring_attn
from .llama3 import (llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func,
                     llama3_flash_attn_varlen_kvpacked_func, llama3_flash_attn_varlen_qkvpacked_func)
from .varlen import (ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func,
                     ring_flash_attn_varlen_qkvpacked_func, zigzag_ring_flash_attn_varlen_func,
                     zigzag_ring_flash_attn_varlen_kvpacked_func, zigzag_ring_flash_attn_varlen_qkvpacked_func)

__all__ = ["adapters", "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func",
           "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_varlen_qkvpacked_func",
           "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
           "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
           "ring_flash_attn_varlen_qkvpacked_func", "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func",
           "stripe_flash_attn_qkvpacked_func", "substitute_hf_flash_attn", "update_ring_flash_attn_params",
           "use_ring_attn", "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_varlen_func",
           "zigzag_ring_flash_attn_varlen_kvpacked_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func"]
