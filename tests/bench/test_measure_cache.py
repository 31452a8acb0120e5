"""Measurements kept on disk: reused under the same settings, weights and measuring code, and only then."""

import pytest
import torch
from safetensors.torch import save_file

from exittrain.bench.measure_cache import MEASURING_CODE, MeasureCache, code_version


def _drafter_dir(path, value: float):
    path.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.full((3,), value)}, path / "model.safetensors")
    return path


def test_a_measurement_comes_back_under_the_same_settings_weights_and_code_only(tmp_path):
    measured = {"rows": [{"prompt_index": 0, "block_lengths": [3, 1, 2]}], "chain": [], "table": []}
    arm = _drafter_dir(tmp_path / "arm", 1.0)
    cache = MeasureCache(tmp_path / "measured", {"prompts": 4, "seed": 0}, code="v1")
    assert cache.load("arm", arm) is None
    cache.save("arm", measured, arm)
    same = MeasureCache(tmp_path / "measured", {"seed": 0, "prompts": 4}, code="v1")  # key order is free
    assert same.load("arm", arm) == measured
    assert MeasureCache(tmp_path / "measured", {"prompts": 8, "seed": 0}, code="v1").load("arm", arm) is None
    assert MeasureCache(tmp_path / "measured", {"prompts": 4, "seed": 0}, code="v2").load("arm", arm) is None
    _drafter_dir(arm, 2.0)  # the arm retrained: its old numbers are stale
    assert cache.load("arm", arm) is None
    # a drafter-free entry, and a name with a space
    cache.save("warm start", measured)
    assert cache.load("warm start") == measured
    assert (tmp_path / "measured" / "warm_start.json").is_file()


def test_a_broken_kept_file_names_itself_and_the_fix(tmp_path):
    cache = MeasureCache(tmp_path, {}, code="v1")
    cache.path("arm").write_text("{not json")
    with pytest.raises(ValueError, match=r"arm\.json is not valid JSON .*delete .*arm\.json"):
        cache.load("arm")


def test_the_code_version_follows_the_measuring_source(tmp_path):
    for package in MEASURING_CODE:
        (tmp_path / package).mkdir()
        (tmp_path / package / "a.py").write_text("x = 1\n")
    before = code_version(root=tmp_path)
    assert code_version(root=tmp_path) == before
    (tmp_path / "heldout" / "a.py").write_text("x = 2\n")  # a changed file
    changed = code_version(root=tmp_path)
    assert changed != before
    (tmp_path / "decoding" / "b.py").write_text("")  # an added one
    added = code_version(root=tmp_path)
    assert added != changed
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "c.py").write_text("")  # outside the measuring code: the same version
    assert code_version(root=tmp_path) == added
    assert len(code_version()) == 64  # the package's own source
