"""`python -m exittrain fit +recipe=code debug=smoke` end to end on the embedded SmolLM2 target."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_model


def test_fit_smoke_on_the_embedded_target(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "exittrain", "fit", "+recipe=code", "debug=smoke", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stages"] == ["pretrain", "exittrain"]
    for label in ("warm_start", "exittrain"):
        (row,) = metrics["tables"][label]
        assert row["tau"] >= 1.0 and row["budget"] == 8 and row["lossless"] is True
    for stage in ("pretrain", "exittrain"):
        assert metrics[f"{stage}_metrics"]["train/loss_tok"] > 0
    assert metrics["exittrain_metrics"]["train/analytic_block_length"] >= 1.0
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    assert (run_dir / "drafter" / "config.json").is_file()
    assert list((run_dir / "checkpoints").rglob("*.ckpt"))
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert "Held-out decoding" in proc.stdout
