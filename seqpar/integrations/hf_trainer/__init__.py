"""transformers' ``Trainer`` with context parallelism: :class:`ContextParallelTrainer` (a subclass used
exactly like ``Trainer``, plus ``context_parallel_size``, ``cp_method`` and ``cp_options``).

- :mod:`.trainer`: the subclass (mesh, DataLoader per data-parallel group, loss scaling);
- :mod:`.batches`: packing a collated batch into documents, and the per-step label count;
- :mod:`.checkpoints`: resumable checkpoints, written atomically (FSDP2's shards through DCP).
"""

from .batches import agree_label_count, count_labels, pack_batch
from .trainer import ContextParallelTrainer

__all__ = ["ContextParallelTrainer", "agree_label_count", "count_labels", "pack_batch"]
