"""Decoding: tree speculative decoding with plain products, the autoregressive baseline and oracle
trees. What makes a decode fast on a CPU (``decode: auto``), rounds that skip the drafter (copy-led
rounds, steps after a miss) included, lives in :mod:`exittrain.cpu_decode`."""

from .oracle import oracle_generate
from .speculative import (
    ROUND_KINDS,
    ROUND_PARTS,
    GenerationResult,
    GreedyDecoder,
    RoundStats,
    SpeculativeDecoder,
    autoregressive_generate,
)

__all__ = [
    "ROUND_KINDS",
    "ROUND_PARTS",
    "GenerationResult",
    "GreedyDecoder",
    "RoundStats",
    "SpeculativeDecoder",
    "autoregressive_generate",
    "oracle_generate",
]
