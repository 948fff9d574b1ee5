"""Vocab-parallel and sequence-parallel CCE over a tensor-parallel ProcessGroup; builds on ops/."""

from cce_parallel.parallel.api import LinearCrossEntropy, linear_cross_entropy
from cce_parallel.parallel.vocab import VocabLayout

__all__ = ["LinearCrossEntropy", "VocabLayout", "linear_cross_entropy"]
