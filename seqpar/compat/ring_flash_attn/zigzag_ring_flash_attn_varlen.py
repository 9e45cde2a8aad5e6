"""The original's module ``ring_flash_attn.zigzag_ring_flash_attn_varlen`` (packed documents in zigzag halves
per rank) at the same path, its functions served by :mod:`.varlen`:
``from ring_flash_attn.zigzag_ring_flash_attn_varlen import ...`` becomes
``from seqpar.compat.ring_flash_attn.zigzag_ring_flash_attn_varlen import ...``."""

from .varlen import (zigzag_ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_kvpacked_func,
                     zigzag_ring_flash_attn_varlen_qkvpacked_func)

__all__ = ["zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
           "zigzag_ring_flash_attn_varlen_qkvpacked_func"]
