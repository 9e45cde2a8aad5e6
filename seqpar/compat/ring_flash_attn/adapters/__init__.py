"""The original's ``ring_flash_attn.adapters`` package: its HF adapter at the same module path
(:mod:`.hf_adapter`), so ``ring_flash_attn.adapters.hf_adapter.substitute_hf_flash_attn(...)`` keeps
working after ``import seqpar.compat.ring_flash_attn as ring_flash_attn``."""

from . import hf_adapter
from .hf_adapter import substitute_hf_flash_attn, update_ring_flash_attn_params

__all__ = ["hf_adapter", "substitute_hf_flash_attn", "update_ring_flash_attn_params"]
