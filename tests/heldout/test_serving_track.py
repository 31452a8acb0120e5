"""The serving track of fit's final table: the chain tau, the vLLM switch, the columns, and (slow) a
tiny `+serve=dflash` fit, with vLLM itself where `.venv-vllm` exists."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from exittrain.heldout.decode_eval import format_table
from exittrain.heldout.serving_track import (
    attach_chain,
    chain_rows,
    summarize_chain,
    vllm_enabled,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:The '.*_dataloader' does not have many workers"),
]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("EXITTRAIN_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def test_vllm_switch(tmp_path):
    missing = tmp_path / "nope" / "python"
    assert vllm_enabled("false", sys.executable) is False
    assert vllm_enabled("auto", sys.executable) is True and vllm_enabled("auto", missing) is False
    assert vllm_enabled(True, sys.executable) is True  # YAML true arrives as a bool
    with pytest.raises(ValueError, match="make vllm-setup"):
        vllm_enabled("true", missing)
    with pytest.raises(ValueError, match="eval.vllm='sometimes'"):
        vllm_enabled("sometimes", sys.executable)


def test_chain_summary_pools_rounds_and_flags_a_loss():
    rows = [{"budget": 3, "block_lengths": [4, 1, 2], "matches_target": True},
            {"budget": 3, "block_lengths": [1], "matches_target": True}]
    chain = summarize_chain(rows)[0.0]  # rows without a temperature are T = 0's
    assert chain["chain_tau"] == pytest.approx(8 / 4) and chain["chain_K"] == 3 and chain["chain_lossless"]
    assert chain["chain_ci95"][0] <= chain["chain_tau"] <= chain["chain_ci95"][1]
    assert not summarize_chain([{**rows[0], "matches_target": False}])[0.0]["chain_lossless"]
    both = summarize_chain([*rows, {"budget": 3, "temperature": 0.6, "block_lengths": [1, 1], "decoded": False}])
    assert both[0.6]["chain_tau"] == 1.0 and "chain_lossless" not in both[0.6] and both[0.0] == chain
    with pytest.raises(ValueError, match="no chain rows"):
        summarize_chain([])


def _row(label: str, **extra) -> dict:
    return {"label": label, "budget": 16, "temperature": 0.0, "prompts": 4, "tau": 3.0, "ci95": (2.5, 3.5),
            "tokens_per_s": 10.0, **extra}


def test_table_shows_both_tracks_and_a_vllm_mismatch_loudly():
    table = [_row("warm_start"), _row("exittrain"), _row("served")]
    attach_chain(table[:1], {0.0: {"chain_tau": 2.25, "chain_K": 7}})
    attach_chain(table[1:], {0.0: {"chain_tau": 2.5, "chain_K": 7}, 0.6: {"chain_tau": 9.0, "chain_K": 7}})
    table[2]["vllm"] = {"vllm_tau": 2.41, "vllm_matches_plain": True}
    text = format_table(table)
    header = text.splitlines()[0]
    assert "chain tau (K)" in header and "vLLM tau" in header
    assert "| 2.25 (7) |" in text and "| 2.41 |" in text and "MISMATCH" not in text and "9.00" not in text
    assert header.index("chain tau") < header.index("tree tau")  # led by what an engine verifies
    table[2]["vllm"]["vllm_matches_plain"] = False
    assert "2.41 MISMATCH" in format_table(table)
    table[2]["vllm"]["vllm_ci95"] = [2.2, 2.6]  # measured per prompt: its interval over prompts
    assert "| 2.41 (2.20-2.60) MISMATCH |" in format_table(table)
    assert "chain tau" not in format_table([_row("warm_start")])  # no serving track: the tree's columns


def test_chain_differences_print_once_per_drafter_and_temperature():
    from exittrain.heldout.evaluator import format_differences

    pair = {"delta": 0.125, "ci95": [0.05, 0.2], "prompts": 16}
    table = [_row("warm_start", chain_tau=2.0, chain_K=7),
             _row("exittrain", chain_tau=2.1, chain_K=7, chain_tau_vs_warm_start=pair, tau_vs_warm_start=pair),
             _row("exittrain", budget=32, chain_tau=2.1, chain_K=7, chain_tau_vs_warm_start=pair,
                  tau_vs_warm_start=pair)]
    lines = format_differences(table)
    chain_lines = [line for line in lines if "chain" in line]
    assert len(chain_lines) == 1 and len(lines) == 3  # the chain once, the tree at each budget
    assert chain_lines[0].startswith("exittrain - warm_start, chain tau at K=7 T=0: +0.125")
    assert "16 prompts, paired, pooled" in chain_lines[0]
    assert lines[2].startswith("exittrain - warm_start, tree tau at B=32 T=0")


def test_chain_rows_decode_losslessly_and_share_the_baselines(one_thread, tiny_llama_target):
    from exittrain.models import new_drafter

    target = tiny_llama_target
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, num_heads=4, seed=0)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
    cache: dict = {}
    rows = chain_rows(target, drafter, prompts, max_new_tokens=12, label="x", ar_cache=cache)
    assert set(cache) == {(0.0, 0), (0.0, 1)}
    assert all(r["budget"] == 3 for r in rows) and rows[0]["matches_target"] and rows[0]["walk_matches_decode"]
    assert [r["decoded"] for r in rows] == [True, False]  # the first prompt decoded live, the other walked
    assert all(1 <= b <= 4 for r in rows for b in r["block_lengths"])
    assert sum(r["new_tokens"] for r in rows) == sum(len(cache[k].tokens) for k in cache)
    again = chain_rows(target, drafter, prompts, max_new_tokens=12, label="x", ar_cache=cache)
    assert again == rows


# ----------------------------------------------------------------------------------------------
# a tiny +serve=dflash fit


def _vllm_sized_target(folder: Path) -> None:
    """Replace the tiny target's weights by a model of the same vocabulary with 32-wide heads: vLLM's CPU
    attention has no kernel for the tiny target's 8-wide ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.helpers import VOCAB

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=1)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(folder)


def _serve_fit(tmp_path: Path, *extra: str, vllm_sized: bool = False) -> tuple[Path, dict]:
    from exittrain.fit import fit
    from tests.lit.crash_helpers import prepare_workdir, tiny_run_overrides
    from tests.test_configs import compose_config

    workdir = prepare_workdir(tmp_path / "work")
    if vllm_sized:
        _vllm_sized_target(workdir / "target")
    run_dir = tmp_path / "run"
    cfg = compose_config(
        "fit", "+serve=dflash", "target=hub", *tiny_run_overrides(workdir),
        "serve.num_speculative_tokens=3",  # tiny_run_overrides' block of 4
        "drafter.layer_ids=[0,1]",  # the default [2, L/2, L-2] holds the tiny target's last layer: refused
        "target.dtype=float32", "target.device=cpu", "trainer.accelerator=cpu", "trainer.devices=1",
        f"paths.output_dir={run_dir}", "logger=csv", "+trainer.enable_progress_bar=false",
        "stages.pretrain.max_steps=6", "stages.pretrain.eval_every=null", "stages.exittrain.max_steps=4",
        "stages.exittrain.eval_every=null", "callbacks.decode_eval.every_n_steps=3",
        "callbacks.decode_eval.num_prompts=1", "callbacks.decode_eval.max_new_tokens=4",
        "callbacks.heldout_block_length.every_n_steps=2", "eval.num_prompts=2", "eval.max_new_tokens=8",
        "eval.budgets=[4]", "eval.temperatures=[0.0]", *extra,
    )
    return run_dir, fit(cfg)


def _logged_steps(run_dir: Path, name: str) -> list[list[int]]:
    """Per stage's CSV log (in run order), the steps at which ``name`` was logged."""
    out = []
    for path in sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime):
        with open(path) as f:
            rows = list(csv.DictReader(f))
        if rows and name in rows[0]:
            out.append([int(r["step"]) for r in rows if r.get(name)])
    return out


def test_a_layer_the_format_refuses_fails_before_training(one_thread, tmp_path):
    with pytest.raises(ValueError, match=r"\+serve=dflash trains a drafter .*drafter.target_layer_ids"):
        _serve_fit(tmp_path, "++eval.vllm=false", "drafter.layer_ids=[0,2]")


@pytest.mark.slow
def test_a_serve_dflash_fit_exports_everything_and_logs_the_curve(one_thread, tmp_path, monkeypatch):
    """Also the failure path of eval.vllm=auto: an interpreter without vLLM fails its worker, and the run
    still ends with its summary, the error recorded in it."""
    monkeypatch.setenv("EXITTRAIN_VLLM_PYTHON", sys.executable)
    run_dir, summary = _serve_fit(tmp_path, "++eval.vllm=auto")
    assert "No module named 'vllm'" in summary["vllm_error"]
    exported = summary["drafter_dflash"]
    assert exported["path"] and exported["dropped"] == []  # nothing the format cannot hold was trained
    config = json.loads((Path(exported["path"]) / "config.json").read_text())
    assert config["block_size"] == 4 and config["exittrain"]["dropped"] == []
    assert (Path(exported["path"]) / "mask_embedding.pt").is_file()  # the learned mask, under a spare id
    assert summary["primary_drafter"] == {"format": "dflash", "path": exported["path"], "label": "exittrain"}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["primary_drafter"]["format"] == "dflash" and metrics["serve"]["num_speculative_tokens"] == 3
    assert set(metrics["tables"]) == {"warm_start", "exittrain"}  # nothing dropped: no separate served row
    for label, table in metrics["tables"].items():
        for row in table:
            assert row["chain_K"] == 3 and 1.0 <= row["chain_tau"] <= 4.0 and row["chain_lossless"], label
            assert row["chain_walk_exact"] and row["chain_live"] == 1, label  # the walk checked live
            assert "vllm" not in row
    assert (run_dir / "chain_exittrain.json").is_file() and not list(run_dir.glob("eval_*chain*"))
    # the cheap held-out curve: pretrain 6 steps and ExitTrain 4, every 2 steps
    assert _logged_steps(run_dir, "heldout/chain_block_length") == [[2, 4, 6], [2, 4]]
    assert _logged_steps(run_dir, "heldout/tree_block_length") == [[2, 4, 6], [2, 4]]


@pytest.mark.slow
@pytest.mark.skipif(
    not VLLM_PYTHON.is_file(),
    reason=f"needs vLLM's own venv at {VLLM_PYTHON} (build it with `make vllm-setup`) or EXITTRAIN_VLLM_PYTHON",
)
def test_fit_measures_vllm_acceptance_of_the_export(one_thread, tmp_path, monkeypatch):
    """eval.vllm=true: vLLM serves the tiny target with the run's DFlash export; its greedy outputs with
    speculation equal those without, and its acceptance length sits in the table beside our chain tau of the
    same export on the same prompts, within 3% pooled: what we report is what the engine delivers."""
    monkeypatch.setenv("EXITTRAIN_VLLM_PYTHON", str(VLLM_PYTHON))
    run_dir, summary = _serve_fit(tmp_path, "++eval.vllm=true", "eval.num_prompts=6", "eval.max_new_tokens=32",
                                  "stages.pretrain.max_steps=60", vllm_sized=True)  # a drafter that accepts
    row = summary["tables"]["exittrain"][0]
    assert row["temperature"] == 0 and summary["served"]["label"] == "exittrain"  # the export is these weights
    vllm = row["vllm"]
    assert vllm["vllm_matches_plain"], vllm
    assert vllm["num_speculative_tokens"] == 3 and vllm["drafts"] > 0
    assert 1.0 <= vllm["vllm_tau"] <= 4.0
    assert row["chain_tau"] > 1.0  # the export accepts drafts: the agreement below compares something
    assert abs(vllm["vllm_tau"] / row["chain_tau"] - 1) <= 0.03, (vllm["vllm_tau"], row["chain_tau"])
    assert "vllm" not in summary["tables"]["warm_start"][0]
    assert (run_dir / "vllm" / "vllm_dflash.log").is_file()


def test_the_warm_start_is_not_paired_with_itself(one_thread, tiny_llama_target):
    """fit printed "warm_start - warm_start ... +0.000" for the chain: the reference gets no pair, and an
    evaluator without a reference (eval of one drafter) pairs nothing."""
    from exittrain.heldout.evaluator import HeldOutEvaluator
    from exittrain.models import new_drafter

    drafter = new_drafter(tiny_llama_target, block_size=4, num_layers=1, hidden_size=32, num_heads=4, seed=0)
    settings = dict(budgets=[3], temperatures=[0.0], max_new_tokens=6, verifier="tev", baseline=True,
                    oracle=False, seed=0, decode="fixed", drafter_temperature=1.0)
    evaluator = HeldOutEvaluator(tiny_llama_target, [[5, 6, 7, 8]], settings)
    warm, _, _ = evaluator.measure(drafter, "warm_start")
    later, _, _ = evaluator.measure(drafter, "exittrain")
    assert not any(k.endswith("_vs_warm_start") for k in warm[0])
    assert later[0]["chain_tau_vs_warm_start"]["delta"] == 0.0 and later[0]["tau_vs_warm_start"]["delta"] == 0.0
    alone = HeldOutEvaluator(tiny_llama_target, [[5, 6, 7, 8]], settings, reference=None)
    alone.measure(drafter, "a")
    table, _, _ = alone.measure(drafter, "b")
    assert not any("_vs_" in k for k in table[0])
