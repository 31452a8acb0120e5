"""``trainer=ddp`` and ``trainer=fsdp`` with one device under torchrun: a whole ``python -m exittrain fit``.

``python -m torch.distributed.run --standalone --nproc_per_node=1 -m exittrain fit`` (torchrun) on the
tiny target of tests/lit/crash_helpers.py (loaded from disk with ``target=hub``: ``target.device: auto``,
``target.dtype: auto``), both stages for a few steps, with the trainer group's own accelerator and
precision (``gpu``, ``auto``). Lightning reads torchrun's environment, makes the process group (NCCL on
CUDA) and trains; ``target.device: auto`` must resolve to ``cuda:LOCAL_RANK``, where the strategy puts
the drafter. :class:`tests.gpu.fit_probe.FitProbe` records what each stage trained with. Under
``EXITTRAIN_GPU_TESTS_ON=cpu`` the same runs use the CPU overrides (``trainer.accelerator=cpu``, gloo,
``trainer.precision=32-true``). Each run takes ~10 s on one CPU core.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from exittrain.precision import target_dtype, trainer_precision
from tests.lit.crash_helpers import prepare_workdir, tiny_run_overrides
from tests.lit.launch_helpers import run_group

pytestmark = pytest.mark.gpu

TIMEOUT_S = 300
STEPS = {"pretrain": 3, "exittrain": 2}
STRATEGIES = {"ddp": "DDPStrategy", "fsdp": "DrafterFSDPStrategy"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return prepare_workdir(tmp_path_factory.mktemp("work"))


def fit_command(trainer: str, workdir: Path, run_dir: Path, probe: Path, device: torch.device) -> list[str]:
    on_cpu = ["trainer.accelerator=cpu", "trainer.precision=32-true"] if device.type == "cpu" else []
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "-m", "exittrain", "fit",
        f"hydra.run.dir={run_dir}",
        "target=hub",
        f"trainer={trainer}",
        "trainer.devices=1",
        *on_cpu,
        *tiny_run_overrides(workdir, run_dir.parent / "cache"),
        f"stages.pretrain.max_steps={STEPS['pretrain']}",
        "stages.pretrain.eval_every=null",
        f"stages.exittrain.max_steps={STEPS['exittrain']}",
        "stages.exittrain.eval_every=null",
        "callbacks.decode_eval.every_n_steps=0",  # the decode check runs once, at each stage's end
        "callbacks.decode_eval.num_prompts=1",
        "callbacks.decode_eval.max_new_tokens=4",
        "eval.num_prompts=1",
        "eval.max_new_tokens=4",
        "eval.oracle=false",
        "eval.temperatures=[0.0,0.6]",
        "logger=csv",
        "+trainer.enable_progress_bar=false",
        "+callbacks.probe._target_=tests.gpu.fit_probe.FitProbe",
        f"+callbacks.probe.path={probe}",
    ]


def run(cmd: list[str], cwd: Path) -> str:
    """Run ``cmd`` in its own process group (torchrun and its worker); returns its output."""
    return run_group(cmd, cwd, "torchrun fit", TIMEOUT_S, tail=6000)


@pytest.mark.parametrize("trainer", list(STRATEGIES))
def test_a_fit_under_torchrun_with_one_device(trainer, workdir, tmp_path, device):
    run_dir, probe = tmp_path / "run", tmp_path / "probe.jsonl"
    log = run(fit_command(trainer, workdir, run_dir, probe, device), cwd=tmp_path)

    cuda = device.type == "cuda"
    backend, where = ("nccl", "cuda:0") if cuda else ("gloo", "cpu")
    assert f"distributed_backend={backend}" in log and "Starting with 1 processes" in log
    if cuda:  # the rank's own GPU, from torchrun's LOCAL_RANK
        assert "target.device auto -> cuda:0 (CUDA with" in log and "local rank 0 from LOCAL_RANK" in log, log[-4000:]
    else:
        assert "target.device auto -> cpu" in log
    precision = trainer_precision("auto", "gpu") if cuda else "32-true"
    dtype = f"torch.{target_dtype('auto', where)}"

    records = [json.loads(line) for line in probe.read_text().splitlines()]
    starts = [r for r in records if r["event"] == "start"]
    assert [r["stage"] for r in starts] == list(STEPS)
    for r in starts:
        assert r["strategy"] == STRATEGIES[trainer] and r["sharded"] == (trainer == "fsdp"), r
        assert (r["backend"], r["world_size"], r["local_rank_env"]) == (backend, 1, "0"), r
        assert r["root_device"] == r["module_device"] == r["target_device"] == where, r
        assert (r["precision"], r["target_dtype"]) == (precision, dtype), r
    for stage, steps in STEPS.items():
        done = [r for r in records if r["event"] == "step" and r["stage"] == stage]
        assert [r["step"] for r in done] == list(range(steps)), (stage, done)
        for r in done:
            assert r["loss_finite"] and r["grads"] > 0 and r["grads_finite"] and r["grads_nonzero"], r
            assert r["target_grads"] == 0, r

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stages"] == list(STEPS) and set(metrics["tables"]) == {"warm_start", "exittrain"}
    for stage, steps in STEPS.items():
        assert json.loads((run_dir / f"metrics_{stage}.json").read_text())["global_step"] == steps, stage
    for name in ("eval_warm_start.json", "eval_exittrain.json", "tree_example.json", "drafter/model.safetensors",
                 "warmstart_drafter/model.safetensors"):
        assert (run_dir / name).is_file(), name
