"""Integrations of seqpar with other libraries, applied from the edge: models stay unaware.

- :mod:`seqpar.integrations.hf`: Hugging Face transformers (``apply_context_parallel``,
  ``shard_inputs``, ``context_parallel_loss``); needs ``transformers``.
- :func:`seqpar.integrations.parallelize`: context-parallel attention, activation checkpointing,
  per-layer compile and FSDP2 over the ``dp x cp`` ranks of a mesh, for a user's own training loop.
- :mod:`seqpar.integrations.train`: the ``seqpar train`` command (a transformers decoder trained
  with context parallelism on packed real text).

Nothing here imports transformers (``parallelize`` only when called), and ``import seqpar`` does not
import this package.
"""

from .parallelize import context_parallel_group, parallelize

__all__ = ["context_parallel_group", "parallelize"]
