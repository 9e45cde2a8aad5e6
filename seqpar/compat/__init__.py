"""Peers' public APIs, served by seqpar: switch to seqpar by changing one import.

- :mod:`seqpar.compat.ring_flash_attn`: ring-flash-attention 0.1.x (its functions, argument names,
  defaults, token layouts and HF adapter), on seqpar's executor, on CPU and GPU.

A peer API that keeps global state (ring-flash-attention's HF adapter does) keeps it here and only
here; the rest of seqpar takes groups and options explicitly.
"""
