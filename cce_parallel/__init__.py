"""cce_parallel: Cut Cross-Entropy as a vocab-parallel loss layer for Megatron-style pretraining."""

from cce_parallel.ops import IMPLS, REDUCTIONS, UpstreamState
from cce_parallel.parallel import LinearCrossEntropy, linear_cross_entropy

__version__ = "0.1.0"

__all__ = ["IMPLS", "REDUCTIONS", "LinearCrossEntropy", "UpstreamState", "linear_cross_entropy", "__version__"]
