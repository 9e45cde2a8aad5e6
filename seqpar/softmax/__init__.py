"""Sequence-parallel softmax attention: one schedule executor, the methods are plans.

Public entry point: :func:`seqpar.attention` (:mod:`.api`). Families: the ring family
(:mod:`.plans`, :mod:`.token_ring`, :mod:`.lightseq`, run by :mod:`.executor`), Ulysses
(:mod:`.ulysses`) and USP (:mod:`.usp`); packed input (:mod:`.packed`); rematerialisation-aware
checkpointing (:mod:`.checkpoint`). Methods are declared in :mod:`seqpar.methods`.
"""

from .api import SequenceParallelAttention, attention
from .plans import Block, RingPlan, Schedule

__all__ = ["Block", "RingPlan", "Schedule", "SequenceParallelAttention", "attention"]
