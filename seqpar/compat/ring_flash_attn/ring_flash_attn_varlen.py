"""The original's module ``ring_flash_attn.ring_flash_attn_varlen`` (packed documents split per rank) at the
same path, its functions served by :mod:`.varlen`:
``from ring_flash_attn.ring_flash_attn_varlen import ...`` becomes
``from seqpar.compat.ring_flash_attn.ring_flash_attn_varlen import ...``."""

from .varlen import (ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func,
                     ring_flash_attn_varlen_qkvpacked_func)

__all__ = ["ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
           "ring_flash_attn_varlen_qkvpacked_func"]
