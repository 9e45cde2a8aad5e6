"""``seqpar train``: a transformers decoder trained with context parallelism on packed real text.

- :mod:`.trainer`: the command and one rank's loop; :mod:`.config`: flags and validation;
  :mod:`.data`: documents and packing; :mod:`.step`: one step's loss and backward;
  :mod:`.ckpt`: checkpoints and resume; :mod:`.log`: records and plots; :mod:`.adaptive`: ``--adaptive``.
"""

from .trainer import TrainResult, main, run, train

__all__ = ["TrainResult", "main", "run", "train"]
