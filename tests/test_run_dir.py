"""exittrain.run_dir: one layout per file of a run directory, written and read back."""

import csv
import json

import pytest

from exittrain.run_dir import RunDir, write_json_atomic

SUMMARY = {"recipe": "code", "stages": ["pretrain"], "target": "t", "tables": {"warm_start": [{"budget": 8}]}}


def test_fit_summary_round_trip_and_schema(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.read_fit_summary() is None and not (tmp_path / "run").exists()
    run.write_fit_summary(SUMMARY)
    assert run.read_fit_summary() == SUMMARY and run.has_run_files()
    with pytest.raises(ValueError, match=r"needs the keys \['recipe', 'stages', 'tables'\]; \['tables'\] missing"):
        run.write_fit_summary({"recipe": "code", "stages": []})


def test_a_metrics_json_of_another_layout_is_refused_naming_the_file(tmp_path):
    write_json_atomic(tmp_path / "metrics.json", {"final": {}, "global_step": 3})
    with pytest.raises(ValueError, match=r"metrics\.json is not a fit summary \(missing keys"):
        RunDir(tmp_path).read_fit_summary()
    write_json_atomic(tmp_path / "metrics.json", {**SUMMARY, "tables": {"x": {"budget": 8}}})
    with pytest.raises(ValueError, match=r"tables\['x'\] must be a list of objects"):
        RunDir(tmp_path).read_fit_summary()


def test_stage_metrics_eval_rows_and_tree_example(tmp_path):
    run = RunDir(tmp_path)
    run.write_stage_metrics("pretrain", {"final": {"train/loss": 1.0}, "global_step": 2})
    run.write_eval_rows("warm_start", [{"tau": 1.5}])
    assert run.read_stage_metrics() == {"pretrain": {"final": {"train/loss": 1.0}, "global_step": 2}}
    assert run.read_eval_rows() == {"warm_start": [{"tau": 1.5}]}
    assert run.read_tree_example() is None
    with pytest.raises(ValueError, match="stage metrics need a 'final' mapping"):
        run.write_stage_metrics("x", {"global_step": 1})
    with pytest.raises(ValueError, match=r"stage='\.\./x': need a plain name"):
        run.stage_metrics_path("../x")
    (tmp_path / "tree_example.json").write_text('{"tokens": []}')
    with pytest.raises(ValueError, match="not a tree example"):
        run.read_tree_example()


def test_eval_results_json_and_csv(tmp_path):
    run = RunDir(tmp_path)
    rows = [{"budget": 8, "tau": 2.0, "block_lengths": [2, 2]}, {"budget": 16, "tau": 2.5, "block_lengths": [3, 2]}]
    paths = run.write_results(rows, [{"budget": 8, "tau": 2.0}], tmp_path / "drafter")
    assert [p.name for p in paths] == ["results.json", "results.csv"]
    back = run.read_results()
    assert back["rows"] == rows and back["drafter"] == str(tmp_path / "drafter")
    with open(paths[1], newline="") as f:
        table = list(csv.DictReader(f))
    assert table == [{"budget": "8", "tau": "2.0"}, {"budget": "16", "tau": "2.5"}]  # list columns left out
    (tmp_path / "results.json").write_text(json.dumps({"rows": {"x": 1}}))
    with pytest.raises(ValueError, match="rows must be a list of objects"):
        run.read_results()
