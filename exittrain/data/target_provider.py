"""The frozen target as the data layer sees it: built only when it must answer, its tokenizer without it.

The regeneration builds the target only for a cache entry that is missing, and the evaluation
prompts need only its tokenizer: :class:`LazyTarget` holds the provider and the tokenizer (or a
callable returning it) and calls each at most when asked. Lightning-free.
"""

from __future__ import annotations

from typing import Any

from exittrain.data.regenerate import TargetProvider

__all__ = ["LazyTarget", "default_target_provider"]


def default_target_provider(target_name: str | None) -> TargetProvider:
    """A provider that builds the target with ``exittrain.models.target_loading.load_target`` when called."""

    def provide() -> tuple[Any, Any]:
        from exittrain.models.target_loading import load_target

        target = load_target(target_name)
        return target.model, target.tokenizer

    return provide


class LazyTarget:
    """The target's provider and tokenizer.

    Args:
        target_name: the target's hub id or path, or None for the embedded target: what the default provider loads.
        target: callable returning ``(model, tokenizer)``; default ``load_target(target_name)``.
        tokenizer: the target's tokenizer, or a callable returning it: :meth:`tokenizer` then never builds the model.
    """

    def __init__(self, target_name: str | None, target: TargetProvider | None = None, tokenizer: Any = None) -> None:
        self._provider = target if target is not None else default_target_provider(target_name)
        self._tokenizer_arg = tokenizer
        self._tokenizer: Any = None

    def provide(self) -> tuple[Any, Any]:
        """``(model, tokenizer)`` from the provider (called every time); its tokenizer is kept when none was given."""
        model, tokenizer = self._provider()
        if self._tokenizer is None and self._tokenizer_arg is None:
            self._tokenizer = tokenizer
        return model, tokenizer

    def tokenizer(self) -> Any:
        """The ``tokenizer`` argument (called once if it is a callable), else the provider's (built once)."""
        if self._tokenizer is None:
            arg = self._tokenizer_arg
            if arg is None:
                self._tokenizer = self.provide()[1]
            else:
                self._tokenizer = arg() if callable(arg) and not hasattr(arg, "apply_chat_template") else arg
        return self._tokenizer
