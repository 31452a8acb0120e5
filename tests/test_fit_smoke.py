"""`python -m exittrain fit +recipe=code debug=smoke` end to end on the embedded SmolLM2 target.

Slow tier (a subprocess fit of both stages, 1-3 min on 2 cores): tests/decoding/test_real_model.py
is the fast tier's real-model test.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from safetensors.torch import load_file

from exittrain.configs import CONF_DIR, register_recipes

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
OVERRIDES = ["+recipe=code", "debug=smoke"]


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, bool]:
    assert set(after) == set(before)
    return {k: not torch.equal(before[k].float(), after[k].float()) for k in before}


def test_fit_smoke_on_the_embedded_target(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "exittrain", "fit", *OVERRIDES, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("fit", overrides=OVERRIDES)  # what the run composed: its steps, budgets, block size
    block_size, max_new = cfg.drafter.block_size, cfg.eval.max_new_tokens
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stages"] == ["pretrain", "exittrain"]

    # every stage ran all its steps, with an in-training decode check every callbacks.decode_eval.every_n_steps
    for stage in metrics["stages"]:
        stage_file = json.loads((run_dir / f"metrics_{stage}.json").read_text())
        max_steps = cfg.stages[stage].max_steps
        assert stage_file["global_step"] == max_steps, stage
        steps = [h["step"] for h in stage_file["decode_eval"]["history"]]
        every = cfg.callbacks.decode_eval.every_n_steps
        assert steps == sorted(set(steps)) and steps[-1] == max_steps, (stage, steps)
        assert set(range(every, max_steps + 1, every)) <= set(steps), (stage, steps)
        for h in stage_file["decode_eval"]["history"]:
            assert h["tokens"] == cfg.callbacks.decode_eval.max_new_tokens and 1 <= h["block_length"] <= block_size

    # the drafter learned: an untrained one scores about 15 nats a token (its layers copy the target's
    # last layer), a uniform guess log(V); after the warm start it beats the uniform guess
    vocab = json.loads((run_dir / "drafter" / "config.json").read_text())["target_vocab_size"]
    for stage in metrics["stages"]:
        loss = metrics[f"{stage}_metrics"]["train/loss_tok"]
        assert math.isfinite(loss) and 0 < loss < math.log(vocab), (stage, loss)
    assert 1.0 <= metrics["exittrain_metrics"]["train/analytic_block_length"] <= block_size

    # and every weight moved in each stage: the fresh drafter -> the warm start -> the ExitTrain drafter
    target = instantiate(cfg.target)
    fresh = {k: v.detach() for k, v in instantiate(cfg.drafter)(target).state_dict().items()}
    warm = load_file(run_dir / "warmstart_drafter" / "model.safetensors")
    final = load_file(run_dir / "drafter" / "model.safetensors")
    for before, after, stage in ((fresh, warm, "pretrain"), (warm, final, "exittrain")):
        changed = _changed(before, after)
        assert all(changed.values()), (stage, sorted(k for k, c in changed.items() if not c))

    # held-out tables: tau is tokens per round, between 1 and K + 1 = block_size; the rounds add up
    for label in ("warm_start", "exittrain"):
        (row,) = metrics["tables"][label]
        assert row["budget"] == 8 and row["lossless"] is True and row["prompts"] == cfg.eval.num_prompts
        assert 1.0 <= row["tau"] <= block_size
        rows = json.loads((run_dir / f"eval_{label}.json").read_text())
        assert len(rows) == cfg.eval.num_prompts
        for r in rows:
            lengths = r["block_lengths"]
            assert r["rounds"] == len(lengths) and all(1 <= n <= block_size for n in lengths)
            assert 0 < r["new_tokens"] <= max_new
            # the last round may overshoot the token cap, no earlier round reaches it
            assert sum(lengths[:-1]) < r["new_tokens"] <= sum(lengths), (label, r["new_tokens"], lengths)
        pooled = [n for r in rows for n in r["block_lengths"]]
        assert row["tau"] == pytest.approx(sum(pooled) / len(pooled))

    assert (run_dir / "drafter" / "config.json").is_file()
    assert list((run_dir / "checkpoints").rglob("*.ckpt"))
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert "Held-out decoding" in proc.stdout
