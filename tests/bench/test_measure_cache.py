"""Measurements kept on disk: reused under the same settings and weights, and only then."""

import torch
from safetensors.torch import save_file

from exittrain.bench.measure_cache import MeasureCache


def _drafter_dir(path, value: float):
    path.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.full((3,), value)}, path / "model.safetensors")
    return path


def test_entries_come_back_under_the_same_settings_and_weights_only(tmp_path):
    entries = {"16/1": [torch.tensor([1.5, 2.0]), torch.tensor([3.0])]}
    arm = _drafter_dir(tmp_path / "arm", 1.0)
    cache = MeasureCache(tmp_path / "measured", {"prompts": 4, "seed": 0})
    assert cache.load("arm", arm) == {}
    cache.save("arm", entries, arm)
    got = MeasureCache(tmp_path / "measured", {"seed": 0, "prompts": 4}).load("arm", arm)  # key order is free
    assert list(got) == ["16/1"] and all(torch.equal(a, b) for a, b in zip(got["16/1"], entries["16/1"]))
    assert MeasureCache(tmp_path / "measured", {"prompts": 8, "seed": 0}).load("arm", arm) == {}  # other settings
    _drafter_dir(arm, 2.0)  # the arm retrained: its old numbers are stale
    assert cache.load("arm", arm) == {}
    # a drafter-free entry set (the oracle), and a name with a space
    cache.save("warm start", entries)
    assert cache.load("warm start")["16/1"][1].tolist() == [3.0]
    assert (tmp_path / "measured" / "warm_start.pt").is_file()
