"""Hugging Face transformers: one call makes a decoder model context-parallel.

- :mod:`.convert`: :func:`apply_context_parallel` (attention through transformers' AttentionInterface).
- ``make_usp_groups``: USP's Ulysses and ring subgroups of a plain group, built once.
- :mod:`.cache`: :class:`ShardedCache`, a transformers ``Cache`` sharded over the group (``generate()``).
- :mod:`.inputs`: :func:`shard_inputs`, :func:`context_parallel_loss`, label and position helpers.
"""

from ...comm.usp_groups import USPGroups, make_usp_groups
from .cache import ShardedCache
from .convert import apply_context_parallel, verify_context_parallel
from .inputs import (IGNORE_INDEX, ShardedInputs, context_parallel_loss, packed_position_ids, shard_inputs,
                     shift_labels)

__all__ = ["IGNORE_INDEX", "ShardedCache", "ShardedInputs", "apply_context_parallel", "context_parallel_loss",
           "make_usp_groups", "packed_position_ids", "shard_inputs", "shift_labels", "USPGroups", "verify_context_parallel"]
