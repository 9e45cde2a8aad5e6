"""The original's module ``ring_flash_attn.ring_flash_attn`` (contiguous shards) at the same path, its
functions served by :mod:`.dense`: ``from ring_flash_attn.ring_flash_attn import ...`` becomes
``from seqpar.compat.ring_flash_attn.ring_flash_attn import ...``."""

from .dense import ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func

__all__ = ["ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func"]
