"""The regeneration cache key."""

from __future__ import annotations

from exittrain.data.generation import GenerationConfig
from exittrain.data.regen_cache import cache_key


def test_fields_at_their_former_behaviour_keep_the_cache_keys_written_before_them():
    # the key this configuration had before GenerationConfig.dtype and share_prefix existed
    before = GenerationConfig(max_new_tokens=8, batch_size=2, share_prefix=False)
    assert cache_key("tiny", "set", ["a", "b"], before) == "d5bbcb241b86b3f91f2a"
    for changed in ({"dtype": "bfloat16"}, {"share_prefix": True}):
        other = GenerationConfig(max_new_tokens=8, batch_size=2, **{"share_prefix": False, **changed})
        assert cache_key("tiny", "set", ["a", "b"], other) != "d5bbcb241b86b3f91f2a"
