"""The key/value cache's name in transformers' model calls, across the supported range (5.17 to 5.x).

transformers 5.2x renamed a model's ``past_key_values`` argument and output field to ``cache`` (the
old argument name is kept, with a warning, until 5.40). Releases before the rename take only
``past_key_values`` and, worse, accept ``cache=`` into their ``**kwargs`` without reading it: the
forward then runs with no cache and no error. So every call that hands a model a cache, or reads one
back, goes through :func:`cache_kwargs` and :func:`output_cache`, which use the installed release's
name (read once from the signature of a reference model's ``forward``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["cache_argument", "cache_kwargs", "output_cache"]


@functools.cache
def cache_argument() -> str:
    """``"cache"`` where the installed transformers names the argument so, else ``"past_key_values"``."""
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for a model's forward or ``generate`` under the installed release's name."""
    return {cache_argument(): cache}


def output_cache(output: Any) -> Any:
    """The cache a model's forward or ``generate`` returned (its ``cache`` or ``past_key_values`` field)."""
    return getattr(output, cache_argument())
