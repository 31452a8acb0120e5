"""Data layer: prompt choice (the subpackage prompts/, whose __init__ maps its modules), target
self-distillation, batching, the DataModule.

Importing it imports no Lightning: :class:`ExitTrainDataModule` (the one Lightning piece) is loaded
on first access, so a command that only prepares the data (:class:`PromptPlan`) never pays for it.
"""

from typing import TYPE_CHECKING, Any

from exittrain.data.collate import Collator, TruncationStats, truncation_stats
from exittrain.data.generation import GenerationConfig, chat_prompt_ids, split_response
from exittrain.data.prompts.domain_sources import DOMAIN_SOURCES, HUB_SOURCES
from exittrain.data.prompts.prompt_plan import PromptPlan
from exittrain.data.prompts.prompt_sets import (
    DomainPrompts,
    LoadStats,
    find_overlap,
    load_domain,
    load_prompt_set,
    load_prompts,
    normalize_prompt,
    remove_overlap,
)
from exittrain.data.prompts.source_spec import BUILTIN_SOURCES, PromptSource
from exittrain.data.regen_cache import cache_key, cache_path, read_meta
from exittrain.data.regenerate import regenerate
from exittrain.data.target_provider import default_target_provider

if TYPE_CHECKING:
    from exittrain.data.datamodule import ExitTrainDataModule

__all__ = [
    "BUILTIN_SOURCES",
    "DOMAIN_SOURCES",
    "HUB_SOURCES",
    "Collator",
    "DomainPrompts",
    "ExitTrainDataModule",
    "GenerationConfig",
    "LoadStats",
    "PromptPlan",
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


def __getattr__(name: str) -> Any:
    if name == "ExitTrainDataModule":
        from exittrain.data.datamodule import ExitTrainDataModule

        return ExitTrainDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
