"""Decoding: tree speculative decoding, the autoregressive baseline and oracle trees."""

from .oracle import oracle_generate
from .speculative import ROUND_PARTS, GenerationResult, RoundStats, SpeculativeDecoder, autoregressive_generate

__all__ = [
    "ROUND_PARTS",
    "GenerationResult",
    "RoundStats",
    "SpeculativeDecoder",
    "autoregressive_generate",
    "oracle_generate",
]
