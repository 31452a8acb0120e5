"""docs/metrics.md names every logged metric: a small fit of both stages with every training callback,
and a held-out table with every measure, log nothing the glossary does not name."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from exittrain.heldout.evaluator import HeldOutEvaluator
from exittrain.lit import DecodeEvalCallback
from exittrain.lit.heldout_callback import HeldOutBlockLengthCallback
from exittrain.lit.run_logging import log_table
from tests.lit.helpers import ListLogger, loader, make_module
from tests.lit.helpers import trainer as make_trainer

GLOSSARY = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
# what a placeholder of the glossary's keys stands for; any other <name> is one path segment
PLACEHOLDERS = {"table": r"(?:final/[^/]+|eval)"}
LIGHTNING_KEYS = {"epoch"}  # Lightning's own bookkeeping, logged beside ours


def glossary_patterns(text: str) -> list[re.Pattern]:
    """One pattern per key of the glossary tables' "W&B key" column (``<name>`` placeholders)."""
    patterns = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[2] in ("W&B key", "---", "-"):
            continue
        for key in re.findall(r"`([^`]+)`", cells[2]):
            parts = re.split(r"<(\w+)>", key)
            regex = "".join(re.escape(p) if i % 2 == 0 else PLACEHOLDERS.get(p, r"[^/]+")
                            for i, p in enumerate(parts))
            patterns.append(re.compile(regex))
    return patterns


def unnamed(keys, patterns) -> list[str]:
    """The keys no pattern matches in full."""
    return sorted(k for k in set(keys) - LIGHTNING_KEYS if not any(p.fullmatch(k) for p in patterns))


def test_the_glossary_is_read_and_flags_an_unnamed_key():
    """Negative control: the parser finds the keys, and a key the page does not name is flagged."""
    patterns = glossary_patterns(GLOSSARY.read_text())
    assert len(patterns) >= 30
    named = ["train/exit_mass_d3", "final/exittrain/B16_T0.6/chain_tau_vs_warm_start", "eval/B8_T0/tau",
             "val/block_length", "lr"]
    assert unnamed(named, patterns) == []
    assert unnamed(["train/exit_mass", "val/block_len", "final/B16_T0/tau", "mystery"], patterns) == [
        "final/B16_T0/tau", "mystery", "train/exit_mass", "val/block_len"]
    without_coverage = glossary_patterns(GLOSSARY.read_text().replace("`train/coverage`, ", ""))
    assert unnamed(["train/coverage"], without_coverage) == ["train/coverage"]


@pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated")
def test_every_metric_a_fit_logs_is_named_in_the_glossary(tiny_llama_target, monkeypatch):
    target = tiny_llama_target
    monkeypatch.setattr(target, "tokenizer", SimpleNamespace(eos_token_id=1, pad_token_id=0))  # answers at T
    logger = ListLogger()
    for stage in ("pretrain", "exittrain"):
        module = make_module(target, stage=stage)
        callbacks = [DecodeEvalCallback(lambda: [[5, 6, 7, 8, 9]], every_n_steps=2, budget=4, max_new_tokens=4,
                                        on_validation=True),
                     HeldOutBlockLengthCallback(every_n_steps=2, num_rows=2, anchors_per_row=2, budget=4, seed=0)]
        make_trainer(3, callbacks=callbacks, logger=logger, val_check_interval=2).fit(module, loader(4),
                                                                                      loader(2, seed=1))
    logged = set(logger.history)
    assert {"train/loss_exit", "val/block_length", "heldout/chain_block_length", "lr"} <= logged  # all kinds ran

    # the held-out table with every measure: tree and chain at T = 0 and 0.6, oracle, speed, paired gains, vLLM
    settings = dict(budgets=[4], temperatures=[0.0, 0.6], max_new_tokens=6, verifier="tev", baseline=True,
                    oracle=True, seed=0, decode="fixed", drafter_temperature=1.0)
    evaluator = HeldOutEvaluator(target, [[5, 6, 7, 8, 9]], settings)
    evaluator.speed = True  # as on a CUDA target
    for label in ("warm_start", "exittrain"):
        table, _, _ = evaluator.measure(module.drafter, label)
        for row in table:
            row["vllm"] = {"vllm_tau": 1.5, "vllm_matches_plain": True}
        log_table(logger, f"final/{label}", table)
    log_table(logger, "eval", table)
    final = {k for k in logger.history if k.startswith(("final/", "eval/"))}
    assert any(k.endswith("/tau_vs_warm_start") for k in final) and any(k.endswith("/chain_tau") for k in final)
    assert any(k.endswith("/chain_tau_vs_warm_start") for k in final) and any("_T0.6/" in k for k in final)
    assert any(k.endswith("/speedup") for k in final) and any(k.endswith("/tau_oracle") for k in final)

    missing = unnamed(logger.history, glossary_patterns(GLOSSARY.read_text()))
    assert not missing, f"logged but not named in docs/metrics.md: {missing}; add each with its definition"
