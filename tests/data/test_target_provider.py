"""The data layer's view of the target: built only when asked, its tokenizer without it."""

from __future__ import annotations

from exittrain.data.target_provider import LazyTarget


class _Provider:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return "model", "provider tokenizer"


def test_a_given_tokenizer_never_builds_the_target():
    provider = _Provider()
    lazy = LazyTarget("tiny", provider, tokenizer="tokenizer")
    assert lazy.tokenizer() == "tokenizer" and provider.calls == 0
    assert lazy.provide() == ("model", "provider tokenizer") and lazy.tokenizer() == "tokenizer"
    made = []
    lazy = LazyTarget("tiny", provider, tokenizer=lambda: made.append(1) or "made")
    assert lazy.tokenizer() == lazy.tokenizer() == "made" and made == [1] and provider.calls == 1


def test_without_a_tokenizer_the_providers_is_kept():
    provider = _Provider()
    lazy = LazyTarget("tiny", provider)
    assert lazy.tokenizer() == lazy.tokenizer() == "provider tokenizer" and provider.calls == 1
    lazy = LazyTarget("tiny", provider)
    lazy.provide()  # the regeneration built the target: its tokenizer is the one
    assert lazy.tokenizer() == "provider tokenizer" and provider.calls == 2
    assert lazy.provide() == ("model", "provider tokenizer") and provider.calls == 3, "each provide() calls it"
