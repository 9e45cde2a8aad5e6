"""The original's module ``ring_flash_attn.zigzag_ring_flash_attn`` (zigzag shards) at the same path, its
functions served by :mod:`.dense`: ``from ring_flash_attn.zigzag_ring_flash_attn import ...`` becomes
``from seqpar.compat.ring_flash_attn.zigzag_ring_flash_attn import ...``."""

from .dense import (zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func,
                    zigzag_ring_flash_attn_qkvpacked_func)

__all__ = ["zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
           "zigzag_ring_flash_attn_qkvpacked_func"]
