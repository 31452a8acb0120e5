"""`python -m exittrain fit +recipe=code debug=smoke` end to end on the embedded SmolLM2 target.

Slow tier (a subprocess fit of both stages each): tests/decoding/test_real_model.py is the fast
tier's real-model test. The second test runs the same fit from a non-editable install of the
wheel in a fresh virtual environment, outside any checkout.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from safetensors.torch import load_file

from exittrain.configs import CONF_DIR, register_recipes
from exittrain.vllm_interpreter import default_vllm_python
from tests.test_packaging import REPO, copy_sources

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

    # held-out tables: one row per temperature; tau is tokens per round, between 1 and K + 1 = block_size,
    # pooled over the rounds of every prompt
    for label in ("warm_start", "exittrain"):
        table = metrics["tables"][label]
        assert [row["temperature"] for row in table] == list(cfg.eval.temperatures)
        rows = json.loads((run_dir / f"eval_{label}.json").read_text())
        assert len(rows) == cfg.eval.num_prompts * len(cfg.eval.temperatures)
        for row in table:
            assert row["budget"] == 8 and row["prompts"] == cfg.eval.num_prompts
            assert 1.0 <= row["tau"] <= block_size and 1.0 <= row["chain_tau"] <= block_size
            assert row["chain_K"] == block_size - 1
            mine = [r for r in rows if r["temperature"] == row["temperature"]]
            assert row["tau"] == pytest.approx(sum(sum(r["block_lengths"]) for r in mine)
                                               / sum(len(r["block_lengths"]) for r in mine))
            assert ("tau_vs_warm_start" in row) == (label != "warm_start")
        assert table[0]["lossless"] is True and table[0]["chain_lossless"] is True  # T = 0's live decodes
        for r in rows:
            lengths = r["block_lengths"]
            assert r["rounds"] == len(lengths) and all(1 <= n <= block_size for n in lengths)
            assert 0 < r["new_tokens"] <= max_new
            # the last round may overshoot the token cap, no earlier round reaches it
            assert sum(lengths[:-1]) < r["new_tokens"] <= sum(lengths), (label, r["new_tokens"], lengths)

    assert (run_dir / "drafter" / "config.json").is_file()
    # the served format beside it: at the default nothing is dropped (no copy branch), so the drafter's own
    # rows are what an engine serves, and metrics.json's `served` block names them
    served = json.loads((run_dir / "drafter_dflash" / "config.json").read_text())
    assert served["architectures"] == ["DFlashDraftModel"] and metrics["drafter_dflash"]["dropped"] == []
    assert metrics["served"]["label"] == "exittrain" and metrics["served"]["dropped"] == []
    assert "served" not in metrics["tables"]
    lead = metrics["served"]["by_temperature"]["0.6"]
    assert lead["chain_tau"] == metrics["tables"]["exittrain"][1]["chain_tau"] and "8" in lead["tree"]
    assert list((run_dir / "checkpoints").rglob("*.ckpt"))
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert "Held-out decoding, pooled" in proc.stdout and "first row: exittrain" in proc.stdout
    assert "exittrain - warm_start, chain tau at K=7 T=0.6" in proc.stdout
    assert "exittrain - warm_start, tree tau at B=8 T=0" in proc.stdout
    if Path(default_vllm_python()).is_file():
        vllm = metrics["tables"]["exittrain"][0]["vllm"]
        assert vllm["vllm_matches_plain"] is True and 1.0 <= vllm["vllm_tau"] <= block_size, vllm
        assert "vLLM tau" in proc.stdout


def test_the_installed_wheel_runs_the_smoke_fit_without_a_checkout(tmp_path):
    """`pip install .` (not editable) into a fresh venv, then the smoke fit from a folder outside the checkout.

    Offline: the venv has no packages of its own but this one (the dependencies come from the running
    environment through a .pth file, which processes no .pth of its own, so its editable exittrain stays
    out), and pip builds with the running environment's setuptools (no build isolation)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "running-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    src = copy_sources(tmp_path / "src")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                              str(src)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    shutil.rmtree(src)  # nothing of the sources is left to find

    away = tmp_path / "elsewhere"
    away.mkdir()
    where = subprocess.run([python, "-c", "import exittrain, exittrain.configs as c; print(exittrain.__file__); "
                            "print(c.CONF_DIR)"], capture_output=True, text=True, cwd=away, check=True)
    package, conf = map(Path, where.stdout.split())
    assert package.is_relative_to(site) and conf == package.parent / "conf", where.stdout

    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
           "EXITTRAIN_CACHE": str(REPO / "data" / "cache")}  # the other smoke test's regeneration, when it ran
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([python, "-m", "exittrain", "fit", *OVERRIDES, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=away)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stages"] == ["pretrain", "exittrain"]
    assert set(metrics["tables"]) == {"warm_start", "exittrain"} and metrics["served"]["label"] == "exittrain"
    assert (run_dir / "drafter" / "config.json").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    assert not list(away.iterdir()), "the run wrote into the working folder instead of its run directory"
