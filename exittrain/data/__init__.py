"""Data layer: prompt sources per domain, target self-distillation, batching, the DataModule."""

from exittrain.data.collate import Collator, TruncationStats, truncation_stats
from exittrain.data.datamodule import EMBEDDED_TARGET_NAME, ExitTrainDataModule, default_target_provider
from exittrain.data.regenerate import (
    GenerationConfig,
    cache_key,
    cache_path,
    chat_prompt_ids,
    read_meta,
    regenerate,
    split_response,
)
from exittrain.data.sources import (
    BUILTIN_SOURCES,
    DOMAIN_SOURCES,
    HUB_SOURCES,
    DomainPrompts,
    LoadStats,
    PromptSource,
    find_overlap,
    load_domain,
    load_prompt_set,
    load_prompts,
    normalize_prompt,
    remove_overlap,
)

__all__ = [
    "BUILTIN_SOURCES",
    "DOMAIN_SOURCES",
    "EMBEDDED_TARGET_NAME",
    "HUB_SOURCES",
    "Collator",
    "DomainPrompts",
    "ExitTrainDataModule",
    "GenerationConfig",
    "LoadStats",
    "PromptSource",
    "TruncationStats",
    "cache_key",
    "cache_path",
    "chat_prompt_ids",
    "default_target_provider",
    "find_overlap",
    "load_domain",
    "load_prompt_set",
    "load_prompts",
    "normalize_prompt",
    "read_meta",
    "regenerate",
    "remove_overlap",
    "split_response",
    "truncation_stats",
]
