"""``seqpar generate``: context-parallel generation from a local transformers folder.

    seqpar generate --model DIR --prompt-file F --nproc 4 --method zigzag_ring --max-new-tokens 64
    torchrun --nproc-per-node 8 -m seqpar generate --model DIR --prompt-file F ...

Every rank loads the model, converts it with ``apply_context_parallel`` and runs
``model.generate(input_ids, cache=ShardedCache(group))`` on the whole prompt (:mod:`.run`; several
``--prompt`` flags: one batch padded on the left); rank 0 prints the text, the prefill time, the
decode rate and the K,V bytes each rank holds.
"""

from .run import GenerateConfig, GenerateResult, generate_main, parse_args, run

__all__ = ["GenerateConfig", "GenerateResult", "generate_main", "parse_args", "run"]
