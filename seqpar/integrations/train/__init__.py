"""``seqpar train``: a transformers decoder trained with context parallelism on packed real text,
sharded with FSDP2 over all ranks.

- :mod:`.trainer`: the command and one rank's loop; :mod:`.config`: flags and validation;
  :mod:`.build`: the mesh and the model (meta device, ``parallelize``, shards filled);
  :mod:`.model_io`: model folders in and out; :mod:`.data`, :mod:`.tokens`: documents and packing;
  :mod:`.step`: one step's loss, backward and clipping; :mod:`.flops`: model FLOPs and MFU;
  :mod:`.ckpt`: checkpoints and resume; :mod:`.log`: records and plots; :mod:`.adaptive`: ``--adaptive``.
"""

from .trainer import TrainResult, main, run, train

__all__ = ["TrainResult", "main", "run", "train"]
