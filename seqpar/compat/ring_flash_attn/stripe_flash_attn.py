"""The original's module ``ring_flash_attn.stripe_flash_attn`` (striped shards) at the same path, its functions
served by :mod:`.dense`: ``from ring_flash_attn.stripe_flash_attn import ...`` becomes
``from seqpar.compat.ring_flash_attn.stripe_flash_attn import ...``."""

from .dense import stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func

__all__ = ["stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func"]
