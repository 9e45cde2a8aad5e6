"""Hugging Face transformers: one call makes a decoder model context-parallel.

- :mod:`.convert`: :func:`apply_context_parallel` (attention through transformers' AttentionInterface).
- :mod:`.inputs`: :func:`shard_inputs`, :func:`context_parallel_loss`, label and position helpers.
"""

from .convert import apply_context_parallel
from .inputs import (IGNORE_INDEX, ShardedInputs, context_parallel_loss, packed_position_ids, shard_inputs,
                     shift_labels)

__all__ = ["IGNORE_INDEX", "ShardedInputs", "apply_context_parallel", "context_parallel_loss",
           "packed_position_ids", "shard_inputs", "shift_labels"]
