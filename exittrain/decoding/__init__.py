"""Decoding: tree speculative decoding, the autoregressive baseline, oracle trees, and the probe of
the fastest setting on this host (``decode: auto``)."""

from .auto_settings import AutoChoice, DecodeSetting, auto_decoder, probe_decode_settings
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
    "AutoChoice",
    "DecodeSetting",
    "ROUND_KINDS",
    "ROUND_PARTS",
    "GenerationResult",
    "GreedyDecoder",
    "RoundStats",
    "SpeculativeDecoder",
    "auto_decoder",
    "autoregressive_generate",
    "oracle_generate",
    "probe_decode_settings",
]
