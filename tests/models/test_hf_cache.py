"""The cache's argument name follows the installed transformers (5.17 takes ``past_key_values``, 5.2x ``cache``)."""

from __future__ import annotations

import pytest
import torch

from exittrain.models.hf_cache import cache_argument, cache_kwargs, output_cache
from tests.models.helpers import TARGET_KINDS, tiny_target


@pytest.mark.parametrize("kind", TARGET_KINDS)
def test_a_forward_given_the_cache_fills_it_and_returns_it(kind):
    target = tiny_target(kind)
    ids_1T = torch.arange(2, 9).view(1, 7)
    cache = target.new_cache()
    out = target.model(input_ids=ids_1T, use_cache=True, **cache_kwargs(cache))
    assert cache.get_seq_length() == 7
    assert output_cache(out) is cache
    # the next token through the filled cache equals the same position of one full forward
    step = target.model(input_ids=torch.tensor([[9]]), use_cache=True, **cache_kwargs(cache)).logits[0, -1]
    full = target.model(input_ids=torch.arange(2, 10).view(1, 8), use_cache=False).logits[0, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-5)


def test_the_other_name_is_what_the_helpers_guard_against():
    """Negative control: on a release whose forward has no ``cache`` argument, ``cache=`` is swallowed by
    its ``**kwargs`` and the cache stays empty, with no error (why every call goes through the helpers).
    On a release that renamed it, the old name still works and warns."""
    target = tiny_target("llama")
    cache = target.new_cache()
    other = "past_key_values" if cache_argument() == "cache" else "cache"
    target.model(input_ids=torch.arange(2, 9).view(1, 7), use_cache=True, **{other: cache})
    assert cache.get_seq_length() == (7 if other == "past_key_values" else 0)
