"""bench curve: recipes side by side, the served tau against training CPU-seconds and tokens, the data step on the axis.

The end-to-end tests train real drafters on the tiny word-level target of tests/test_fit_ranks.py, from
its jsonl prompts (8 training, 2 held out), and measure them with the real evaluator."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from exittrain.bench import curve
from tests.test_fit_ranks import _sources, _word_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py's: tiny models run fastest on one thread


TINY = ["data.generation.max_new_tokens=8", "data.max_length=32", "data.batch_size=2", "data.max_train_prompts=4",
        "stages.pretrain.max_steps=3", "stages.exittrain.max_steps=1", "tree.budget_train=4", "drafter.block_size=3",
        "data_wait_s=0"]


def _args(tmp_path: Path, *extra: str):
    overrides = [a for o in (*_sources(tmp_path), *TINY) for a in ("--override", o)]
    return curve.parse_args(["--smoke", "--skip", "0", "--prompts", "2", "--max-new-tokens", "4", "--budget", "4",
                             "--every", "2", "--out", str(tmp_path / "out"), *overrides, *extra])


def test_recipe_options_split_overrides_outside_brackets():
    r = curve.parse_recipe("corpus=data.corpus_sources=[pkg:codeio,pkg:gsm],data.max_train_prompts=720")
    assert r == curve.Recipe("corpus", ("data.corpus_sources=[pkg:codeio,pkg:gsm]", "data.max_train_prompts=720"))
    assert curve.parse_recipe("plain=") == curve.Recipe("plain", ())
    for bad in ("noequals", "=a=1", "x=justaword"):
        with pytest.raises(ValueError, match="--recipe"):
            curve.parse_recipe(bad)
    assert curve.schedule([6, 4], 4) == [0, 4, 6, 8, 10]  # every 4 across both stages, and each stage's end


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_clock_counts_only_while_running_and_not_while_paused():
    clock = curve.TrainClock()
    _spin(0.05)  # before running: not counted
    with clock.running():
        t0 = time.perf_counter()
        _spin(0.2)
        t1 = time.perf_counter()
        with clock.paused():
            _spin(0.3)  # a point's measurement: not counted
        paused_wall = time.perf_counter() - t1
        t2 = time.perf_counter()
    _spin(0.05)
    cpu, wall = clock.read()
    assert 0.18 <= cpu <= 0.28, cpu
    assert (t1 - t0) <= wall <= (t2 - t0) - paused_wall + 0.05, (wall, t2 - t0, paused_wall)
    clock.charge(10.0, 5.0)
    assert clock.read() == (pytest.approx(cpu + 10.0), pytest.approx(wall + 5.0))


EXTRA_DATA_CPU_S = 0.6


def test_a_curve_of_three_recipes_is_monotone_plotted_and_charges_every_data_step(tmp_path, monkeypatch):
    from exittrain.data import ExitTrainDataModule

    real_prepare = ExitTrainDataModule.prepare_data

    def prepare_data(self):  # the 2x-prompts recipe's data step costs a known extra CPU time (its 8 prompts)
        if self.plan.max_train_prompts == 8 and not self.cache_path.is_dir():
            _spin(EXTRA_DATA_CPU_S)
        real_prepare(self)

    monkeypatch.setattr(ExitTrainDataModule, "prepare_data", prepare_data)
    args = _args(tmp_path, "--only", "default", "2x-prompts", "2x-pretrain")
    result = curve.run(args, target=_word_target())
    saved = json.loads((tmp_path / "out" / "curve.json").read_text())
    assert saved["points"] == json.loads(json.dumps(result["points"]))
    assert (tmp_path / "out" / "curve.png").stat().st_size > 5000
    assert "chain tau K=2" in (tmp_path / "out" / "curve.md").read_text()

    recipes = {r["name"]: r for r in saved["recipes"]}
    assert list(recipes) == ["default", "2x-prompts", "2x-pretrain"]
    by = {name: [p for p in saved["points"] if p["recipe"] == name] for name in recipes}
    # the schedule: step 0, every 2 steps and each stage's end (pretrain 3 or 6 steps, then 1 ExitTrain step)
    assert [p["step"] for p in by["default"]] == [0, 2, 3, 4]
    assert [p["step"] for p in by["2x-pretrain"]] == [0, 2, 4, 6, 7]
    assert [p["stage"] for p in by["default"]] == [None, "pretrain", "pretrain", "exittrain"]
    for name, points in by.items():
        for key in ("cpu_s", "wall_s", "train_tokens"):
            values = [p[key] for p in points]
            assert values == sorted(values) and values[-1] > values[0], (name, key, values)
        for p in points:
            assert p["chain_ci95"][0] <= p["chain_tau"] <= p["chain_ci95"][1] and p["chain_K"] == 2
            assert p["tree_ci95"][0] <= p["tree_tau"] <= p["tree_ci95"][1] and p["budget"] == 4
            assert p["cpu_model"] and p["cpu_capability"]
        assert points[0]["train_tokens"] == 0
        # the data step is on the axis: the first point starts where the data step left the clock
        data = recipes[name]["data"]
        assert data["cpu_s"] > 0 and points[0]["cpu_s"] >= data["cpu_s"] > 0.5 * points[0]["cpu_s"]
    # default made its rows; 2x-pretrain read the same entry and is charged what making it cost
    assert recipes["default"]["data"]["made"] == recipes["default"]["data"]["entries"]
    assert not recipes["2x-pretrain"]["data"]["made"]
    assert recipes["2x-pretrain"]["data"]["entries"] == recipes["default"]["data"]["entries"]
    assert [g["recipe"] for g in recipes["2x-pretrain"]["data"]["charged"]] == ["default"]
    assert by["2x-pretrain"][0]["cpu_s"] >= recipes["default"]["data"]["cpu_s"]
    # twice the prompts: more rows, and a data step that costs EXTRA_DATA_CPU_S more CPU: its curve starts
    # that much to the right (it would not, were the data step's CPU time left off the axis)
    assert recipes["2x-prompts"]["data"]["made"]
    assert recipes["2x-prompts"]["data"]["rows"] > recipes["default"]["data"]["rows"]
    assert recipes["2x-prompts"]["data"]["cpu_s"] >= EXTRA_DATA_CPU_S
    assert by["2x-prompts"][0]["cpu_s"] >= by["default"][0]["cpu_s"] + 0.8 * EXTRA_DATA_CPU_S
    # one batch of 2 rows a step, each row's real tokens counted: pretrain's 3 steps read 3 batches
    assert by["default"][2]["train_tokens"] > by["default"][1]["train_tokens"] > 0

    # --resume measures nothing again: the recipes' records are reused as they were
    again = curve.run(_args(tmp_path, "--only", "default", "2x-pretrain", "--resume"), target=_word_target())
    assert [r["reused"] for r in again["recipes"]] == [True, True]
    assert again["points"] == [p for p in saved["points"] if p["recipe"] in ("default", "2x-pretrain")]


def test_a_recipe_is_charged_each_group_of_entries_it_reads_once_and_an_unrecorded_entry_is_refused(tmp_path):
    costs = curve.DataCosts(tmp_path / "costs.json", tmp_path / "cache")
    answers, corpus, other = (tmp_path / "cache" / "regen" / name for name in ("answers", "corpus", "other"))
    with pytest.raises(ValueError, match="never recorded"):
        costs.recorded([answers])
    costs.record([answers, corpus], 3.0, 4.0, "default")  # one prepare_data made both
    costs.record([other], 1.0, 1.0, "more")
    kept = curve.DataCosts(tmp_path / "costs.json", tmp_path / "cache")  # read back from its file
    assert [g["cpu_s"] for g in kept.recorded([answers, corpus])] == [3.0]  # the group once, not per entry
    assert [g["cpu_s"] for g in kept.recorded([corpus, other])] == [3.0, 1.0]


def test_bad_options_name_the_option(tmp_path):
    with pytest.raises(SystemExit):
        curve.parse_args(["--recipe", "bad"])
    with pytest.raises(SystemExit):
        curve.parse_args(["--every", "0"])
    args = _args(tmp_path, "--only", "nosuch")
    with pytest.raises(ValueError, match="--only nosuch"):
        curve.run(args, target=_word_target())


def test_a_points_measurement_leaves_the_random_generators_as_it_found_them():
    import random

    import numpy as np

    def draws() -> tuple:
        return torch.rand(2).tolist(), random.random(), float(np.random.rand())

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    plain = draws()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    with curve._kept_random_state():
        draws()  # what a measurement might draw
    assert draws() == plain
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    draws()
    assert draws() != plain  # the control: without it, the next draws move on
