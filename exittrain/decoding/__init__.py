"""Decoding: tree speculative decoding, the autoregressive baseline and oracle trees."""

from .oracle import oracle_generate
from .speculative import STAGES, GenerationResult, RoundStats, SpeculativeDecoder, autoregressive_generate

__all__ = [
    "STAGES",
    "GenerationResult",
    "RoundStats",
    "SpeculativeDecoder",
    "autoregressive_generate",
    "oracle_generate",
]
