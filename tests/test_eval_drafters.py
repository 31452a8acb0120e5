"""`eval` with several drafters: `drafter=[A,B]` composes, every folder is checked before the target
loads, and one evaluator measures them all on the same answers, each later drafter paired against
the first (the job `bench heldout` did)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from exittrain import evaluate
from exittrain.__main__ import _hydra_argv
from exittrain.configs import CONF_DIR, register_recipes
from exittrain.core import pooled
from exittrain.models import new_drafter
from tests.models.helpers import random_context

pytestmark = pytest.mark.usefixtures("one_thread")


def compose_eval(*overrides: str):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("eval", overrides=["+recipe=code", *overrides])


def no_target():
    raise AssertionError("eval loaded the target before checking every drafter folder")


def _saved(path, target, seed: int):
    new_drafter(target, block_size=4, num_layers=1, seed=seed).save_pretrained(path)
    return path


def test_drafter_takes_one_path_or_a_list_on_the_command_line():
    assert _hydra_argv(["eval", "drafter=[a/drafter,b/drafter]"])[1] == "drafter_path=[a/drafter,b/drafter]"
    assert compose_eval("drafter_path=[a/drafter,b/drafter]").drafter_path == ["a/drafter", "b/drafter"]
    assert compose_eval("drafter_path=a/drafter").drafter_path == "a/drafter"  # one path, as before


def test_every_drafter_folder_is_checked_before_the_target_loads(tmp_path, tiny_llama_target):
    good = _saved(tmp_path / "good", tiny_llama_target, 0)
    missing = tmp_path / "missing"
    cfg = compose_eval(f"drafter_path=[{good},{missing}]", f"paths.output_dir={tmp_path / 'out'}")
    with pytest.raises(ValueError, match=rf"^drafter\[1\]={missing} does not exist: pass saved drafter folders"):
        evaluate.run_eval(cfg, target=no_target)
    (tmp_path / "empty").mkdir()
    cfg = compose_eval(f"drafter_path=[{tmp_path / 'empty'}]", f"paths.output_dir={tmp_path / 'out'}")
    with pytest.raises(ValueError, match=r"drafter\[0\]=.*empty is not a saved drafter folder \(no config.json"):
        evaluate.run_eval(cfg, target=no_target)
    cfg = compose_eval("drafter_path=[]", f"paths.output_dir={tmp_path / 'out'}")
    with pytest.raises(ValueError, match=r"drafter=\[\]: name at least one saved drafter folder"):
        evaluate.run_eval(cfg, target=no_target)


def test_labels_are_the_folder_names_made_distinct(tmp_path):
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    assert evaluate.drafter_labels([a / "warmstart_drafter", a / "drafter"]) == ["warmstart_drafter", "drafter"]
    assert evaluate.drafter_labels([a / "drafter", b / "drafter", a / "warmstart_drafter"]) == [
        "run_a/drafter", "run_b/drafter", "warmstart_drafter"]
    assert evaluate.drafter_labels([a / "drafter", a / "drafter"]) == ["run_a/drafter", "run_a/drafter#2"]


def test_one_evaluator_measures_every_drafter_and_pairs_each_with_the_first(tmp_path, tiny_llama_target,
                                                                            monkeypatch, capsys):
    target = tiny_llama_target
    first = _saved(tmp_path / "run" / "warmstart_drafter", target, 0)
    second = _saved(tmp_path / "run" / "drafter", target, 1)
    prompts = [random_context(s, 6) for s in range(3)]
    monkeypatch.setattr(evaluate, "_eval_prompts", lambda cfg, target: prompts)
    out = tmp_path / "out"
    cfg = compose_eval(f"drafter_path=[{first},{second}]", f"paths.output_dir={out}", "logger=csv",
                       "eval.num_prompts=3", "eval.max_new_tokens=8", "eval.budgets=[4]",
                       "eval.temperatures=[0.0,0.6]", "eval.oracle=false", "eval.vllm=false")
    result = evaluate.run_eval(cfg, target=target)
    assert result["drafters"] == {"warmstart_drafter": str(first), "drafter": str(second)}
    table = {(r["label"], r["temperature"]): r for r in result["summary"]}
    assert set(table) == {(label, T) for label in ("warmstart_drafter", "drafter") for T in (0.0, 0.6)}
    def blocks(label: str, T: float) -> list[list[int]]:
        rows = sorted((r for r in result["rows"] if r["label"] == label and r["temperature"] == T),
                      key=lambda r: r["prompt_index"])
        return [r["block_lengths"] for r in rows]

    for T in (0.0, 0.6):  # the reference carries no pair; the other its paired pooled difference, from the rows
        assert "tau_vs_warmstart_drafter" not in table["warmstart_drafter", T]
        pair = table["drafter", T]["tau_vs_warmstart_drafter"]
        assert pair["prompts"] == 3
        assert pair["delta"] == pytest.approx(pooled(blocks("drafter", T)) - pooled(blocks("warmstart_drafter", T)))
        assert table["drafter", T]["tau"] == pytest.approx(pooled(blocks("drafter", T)))
    assert {r["label"] for r in result["chain"]} == {"warmstart_drafter", "drafter"}
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["rows"]) == 2 * 3 * 2 and len(saved["summary"]) == 4  # drafters x prompts x T; drafters x T
    assert len(json.loads((out / "chain.json").read_text())) == 2 * 3 * 2
    printed = capsys.readouterr().out
    assert f"warmstart_drafter: {first}" in printed and f"drafter: {second}" in printed
    assert "drafter - warmstart_drafter, tree tau at B=4 T=0.6" in printed  # one table, paired to the first
