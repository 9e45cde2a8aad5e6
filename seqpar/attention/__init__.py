"""Sequence-parallel softmax attention: one module per family, one shared ring loop."""

from .api import SequenceParallelAttention, attention
from .plans import Block, RingPlan
from .registry import LINEAR_METHODS, METHODS, MethodSpec, method_spec

__all__ = ["Block", "LINEAR_METHODS", "METHODS", "MethodSpec", "RingPlan", "SequenceParallelAttention",
           "attention", "method_spec"]
