"""The original's module ``ring_flash_attn.llama3_flash_attn_varlen`` (the packed stream cut into contiguous
pieces) at the same path, its functions served by :mod:`.llama3`:
``from ring_flash_attn.llama3_flash_attn_varlen import ...`` becomes
``from seqpar.compat.ring_flash_attn.llama3_flash_attn_varlen import ...``."""

from .llama3 import (llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func,
                     llama3_flash_attn_varlen_kvpacked_func, llama3_flash_attn_varlen_qkvpacked_func)

__all__ = ["llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func",
           "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_varlen_qkvpacked_func"]
