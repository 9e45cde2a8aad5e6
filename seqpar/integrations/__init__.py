"""Integrations of seqpar with other libraries, applied from the edge: models stay unaware.

- :mod:`seqpar.integrations.hf`: Hugging Face transformers (``apply_context_parallel``,
  ``shard_inputs``, ``context_parallel_loss``); needs ``transformers``.
- :mod:`seqpar.integrations.train`: the ``seqpar train`` command (a transformers decoder trained
  with context parallelism on packed real text).

Nothing is imported here eagerly, so ``import seqpar`` never needs transformers.
"""
