"""`python -m exittrain report` on fake fit / eval / sweep run directories (files only, no model)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from exittrain.report import run_report as report
from exittrain.run_dir import RunDir
from tests.report.helpers import assert_png, make_eval_run, make_fit_run, write_json


def test_fit_and_eval_runs(tmp_path, capsys):
    fit = make_fit_run(tmp_path / "fit_run", recipe="code")
    ev = make_eval_run(tmp_path / "eval_run", recipe="math")
    out = tmp_path / "out"
    rep = report.main([str(fit), str(ev), "--out", str(out)])

    for name in ("report.md", "report.json"):
        assert (out / name).is_file()
    expected = {"tau_vs_budget_code.png", "block_lengths_code.png", "exit_mass_code.png",
                "training_curves_code.png", "tree_fit_run.png", "tau_vs_budget_math.png", "block_lengths_math.png"}
    assert expected == set(rep["plots"])
    for png in expected:
        assert_png(out / png)
    skipped = " ".join(rep["skipped"])
    assert "exit_mass_math.png" in skipped and "training_curves_math.png" in skipped  # eval runs have no training

    # the table carries every summary row with its numbers
    md = (out / "report.md").read_text()
    fit_tables = json.loads((fit / "metrics.json").read_text())["tables"]
    eval_summary = json.loads((ev / "results.json").read_text())["summary"]
    assert len(rep["rows"]) == sum(map(len, fit_tables.values())) + len(eval_summary)
    for label, table in fit_tables.items():
        for row in table:
            line = next(l for l in md.splitlines() if l.startswith(f"| fit_run | {label} | {row['budget']} |"))
            assert f"| {row['tau']:.2f} |" in line
            assert f"{row['ci95'][0]:.2f}-{row['ci95'][1]:.2f}" in line
            assert f"| {row['tau_oracle']:.2f} | {row['efficiency']:.2f} |" in line
            assert f"| {row['speedup']:.2f}x |" in line
    assert "## recipe: code" in md and "## recipe: math" in md
    math_lines = [l for l in md.splitlines() if l.startswith("| eval_run | math |")]
    assert len(math_lines) == len(eval_summary) == 6  # 3 budgets x 2 temperatures
    # training table from metrics_<stage>.json
    assert "| fit_run | pretrain | 30 | 1.750 |" in md and "| fit_run | exittrain | 30 | 2.250 |" in md

    saved = json.loads((out / "report.json").read_text())
    assert {r["recipe"] for r in saved["rows"]} == {"code", "math"}
    assert {r["kind"] for r in saved["runs"]} == {"fit", "eval"}
    printed = capsys.readouterr().out
    assert "| run | label | B | T |" in printed and str(out / "tau_vs_budget_code.png") in printed


def test_default_out_and_rerun(tmp_path):
    fit = make_fit_run(tmp_path / "run", tree=False)
    rep = report.main([str(fit)])
    assert rep["out"] == str(fit / "report")
    assert any("tree_example.json" in s for s in rep["skipped"])
    rep2 = report.main([str(fit)])  # the report folder is not read as a run
    assert len(rep2["runs"]) == 1 and rep2["rows"] == rep["rows"]


def test_sweep_directory(tmp_path, monkeypatch):
    sweep = tmp_path / "multirun" / "2026-01-01" / "12-00-00"
    for i in range(2):
        make_fit_run(sweep / str(i), recipe="code", tree=i == 0)
    write_json(sweep / "multirun.yaml", {})
    monkeypatch.chdir(tmp_path)
    rep = report.main([str(tmp_path / "multirun")])
    assert sorted(r["name"] for r in rep["runs"]) == [f"multirun/2026-01-01/12-00-00/{i}" for i in range(2)]
    assert len({r["run"] for r in rep["rows"]}) == 2
    assert "tree_multirun_2026-01-01_12-00-00_0.png" in rep["plots"]
    assert_png(tmp_path / "multirun" / "report" / "exit_mass_code.png")


CALLBACK_METRICS = {"global_step": 6, "epoch": 2, "best": [],
                    "final": {"train/exit_mass_d0": 0.9, "train/exit_mass_d1": 0.1,
                              "train/analytic_block_length": 1.1},
                    "decode_eval": {"best": {"step": 3.0, "block_length": 1.0},
                                    "history": [{"step": 3.0, "block_length": 1.0}]}}


def test_a_callback_metrics_file_alone_is_a_run(tmp_path):
    """A run directory of MetricsFileCallback(dir, "train") only (a custom trainer, no `fit` summary)."""
    run = tmp_path / "smoke"
    RunDir(run).write_stage_metrics("train", CALLBACK_METRICS)
    rep = report.main([str(run), "--out", str(tmp_path / "o")])
    assert rep["runs"][0]["recipe"] == "smoke" and rep["runs"][0]["files"] == ["metrics_train.json"]
    assert {"exit_mass_smoke.png", "training_curves_smoke.png"} <= set(rep["plots"])
    assert rep["training"][0]["stage"] == "train" and rep["training"][0]["train/analytic_block_length"] == 1.1


def test_a_metrics_json_that_is_no_fit_summary_names_the_file(tmp_path):
    """metrics.json has one layout, the fit summary: the callbacks' layout there is refused, not guessed."""
    run = tmp_path / "smoke"
    write_json(run / "metrics.json", CALLBACK_METRICS)
    with pytest.raises(ValueError, match=r"smoke/metrics\.json is not a fit summary \(missing keys \['recipe', "
                                         r"'stages', 'tables'\].*rename a callback file to metrics_<stage>\.json"):
        report.main([str(run), "--out", str(tmp_path / "o")])


def test_bad_run_dirs(tmp_path):
    with pytest.raises(ValueError, match="nope.*does not exist"):
        report.main([str(tmp_path / "nope")])
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"empty.*metrics\.json.*results\.json"):
        report.main([str(tmp_path / "empty")])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match="results.json"):
        report.main([str(bad)])
    write_json(bad / "results.json", {"rows": {"x": 1}})
    with pytest.raises(ValueError, match="rows must be a list"):
        report.main([str(bad)])


def test_cli_entry(tmp_path, capsys):
    from exittrain.__main__ import main as cli_main

    ev = make_eval_run(tmp_path / "ev", budgets=(16,))
    cli_main(["report", str(ev), "--out", str(tmp_path / "o")])
    assert "Files written:" in capsys.readouterr().out
    assert_png(tmp_path / "o" / "tau_vs_budget_math.png")


class FakeWandb(types.ModuleType):
    def __init__(self, fail: bool = False):
        super().__init__("wandb")
        self.calls, self.fail = [], fail

    def init(self, **kw):
        self.calls.append(("init", kw))
        return self

    def Image(self, path):  # noqa: N802 - the wandb API name
        self.calls.append(("image", path))
        return path

    def Table(self, columns, data):  # noqa: N802
        return {"columns": columns, "data": data}

    def log(self, data):
        if self.fail:
            raise RuntimeError("log failed")
        self.calls.append(("log", sorted(data)))

    def finish(self):
        self.calls.append(("finish", None))


def test_wandb_logging(tmp_path, monkeypatch):
    ev = make_eval_run(tmp_path / "ev", budgets=(8,))
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    rep = report.main([str(ev), "--out", str(tmp_path / "o")])
    assert fake.calls == []  # neither the flag nor WANDB_MODE: no wandb
    monkeypatch.setenv("WANDB_MODE", "offline")
    rep = report.main([str(ev), "--out", str(tmp_path / "o")])
    kinds = [c[0] for c in fake.calls]
    assert kinds[0] == "init" and fake.calls[0][1]["mode"] == "offline" and kinds[-1] == "finish"
    assert kinds.count("image") == len(rep["plots"])
    monkeypatch.setenv("WANDB_MODE", "disabled")
    fake.calls.clear()
    report.main([str(ev), "--out", str(tmp_path / "o"), "--wandb"])
    assert fake.calls == []
    monkeypatch.delenv("WANDB_MODE")
    failing = FakeWandb(fail=True)
    monkeypatch.setitem(sys.modules, "wandb", failing)
    with pytest.raises(RuntimeError):
        report.main([str(ev), "--out", str(tmp_path / "o"), "--wandb"])
    assert failing.calls[-1][0] == "finish" and failing.calls[0][1]["mode"] == "offline"


def test_the_expected_tau_at_temperature_shows_beside_the_decoded_one(tmp_path):
    fit = make_fit_run(tmp_path / "fit_run", tree=False)
    metrics = json.loads((fit / "metrics.json").read_text())
    metrics["tables"]["exittrain"][0]["analytic"] = {
        "0.6": {"tau": 2.314, "ci95": [2.1, 2.5], "anchors": 64},
        "1": {"tau": 1.987, "ci95": [1.8, 2.2], "anchors": 64}}
    write_json(fit / "metrics.json", metrics)
    report.main([str(fit), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "report.md").read_text()
    line = next(l for l in md.splitlines() if l.startswith("| fit_run | exittrain |"))
    assert "| 0.6: 2.31, 1: 1.99 |" in line
    warm = next(l for l in md.splitlines() if l.startswith("| fit_run | warm_start |"))
    assert "| - |" in warm


def test_the_serving_track_and_the_cheap_curve_reach_the_report(tmp_path, monkeypatch):
    """chain tau and vLLM's acceptance (a mismatch flagged) in the decoding table; the frequent held-out
    measures of metrics_<stage>.json drawn beside the decode check's tau, stage after stage."""
    fit = make_fit_run(tmp_path / "fit_run", tree=False)
    metrics = json.loads((fit / "metrics.json").read_text())
    metrics["tables"]["exittrain"][0].update(chain_tau=2.104, chain_K=7,
                                             vllm={"vllm_tau": 2.05, "vllm_matches_plain": False})
    write_json(fit / "metrics.json", metrics)
    files = RunDir(fit)
    for stage, base in (("pretrain", 1.2), ("exittrain", 1.9)):
        data = json.loads(files.stage_metrics_path(stage).read_text())
        data["heldout_block_length"] = {"history": [
            {"step": s, "heldout/chain_block_length": base + 0.01 * s, "heldout/tree_block_length": base + 0.5,
             "anchors": 8} for s in (5, 10, 15, 20, 25, 30)]}
        files.write_stage_metrics(stage, data)
    drawn = {}

    def capture(history, path, **kwargs):
        drawn.update(history)
        path.write_bytes(b"png")
        return path

    monkeypatch.setattr(report.plots, "plot_training_curves", capture)
    report.main([str(fit), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| chain tau (K) | tree tau | 95% CI | vLLM tau |" in md
    line = next(l for l in md.splitlines() if l.startswith("| fit_run | exittrain |"))
    assert "| 2.10 (7) | 2.27 | 2.10-2.50 | 2.05 MISMATCH |" in line
    chain = drawn["exittrain greedy chain (fixed val rows)"]
    assert [p["step"] for p in chain] == [35.0, 40.0, 45.0, 50.0, 55.0, 60.0]  # after pretrain's 30 steps
    assert len(drawn["warm_start greedy tree (fixed val rows)"]) == 6 and "warm_start" in drawn


def test_an_eval_run_takes_its_recipe_from_the_saved_hydra_config(tmp_path):
    """recipe_name is ${data.domain} in the configs: the saved, unresolved .hydra/config.yaml resolves it;
    an older run's plain name reads as it is."""
    from exittrain.report.run_loading import load_run

    for saved, expected in [("recipe_name: ${data.domain}\ndata:\n  domain: dialogue\n", "dialogue"),
                            ("recipe_name: math\n", "math")]:
        run_dir = make_eval_run(tmp_path / expected, recipe="rows")
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(saved)
        assert load_run(run_dir).recipe == expected
