"""Pieces of the crash-safety tests: a tiny target on disk, prompt files, the `fit` command, a step recorder.

The `fit` subprocesses of tests/lit/test_crash_safety.py import :class:`StepRecorder` from here (they
run from the repository root, so ``tests`` is importable), through a Hydra override:
``+callbacks.record._target_=tests.lit.crash_helpers.StepRecorder``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import lightning.pytorch as pl

from tests.models.helpers import VOCAB, tiny_target

REPO_ROOT = Path(__file__).resolve().parents[2]

# Chat template of the tiny word-level tokenizer: w2 = user turn start, w3 = end, w4 = assistant header.
CHAT_TEMPLATE = (
    "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
)


def write_tiny_target(folder: Path) -> Path:
    """Save ``tiny_target("llama")`` with a word-level tokenizer that has a chat template, for ``load_target``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    target = tiny_target("llama")
    target.model.generation_config.eos_token_id = 1
    target.model.save_pretrained(folder)
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


def write_prompts(path: Path, n: int, *, seed: int) -> Path:
    """``n`` JSON Lines rows ``{"text": "w.. w.."}`` of 4 to 8 random words."""
    rng = random.Random(seed)
    rows = [" ".join(f"w{rng.randrange(5, VOCAB)}" for _ in range(rng.randrange(4, 9))) for _ in range(n)]
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return path


def tiny_run_overrides(workdir: Path, cache: Path | None = None) -> list[str]:
    """The overrides of a fit on the tiny target and prompts in ``workdir`` (the model in
    ``workdir/target``, prompts from :func:`write_prompts`): data, drafter and tree sizes that make a
    run take seconds. ``cache``: the regeneration cache (default ``workdir/cache``)."""
    return [
        f"target.name_or_path={workdir / 'target'}",
        f"data.train_sources=[jsonl:{workdir / 'train.jsonl'}:text]",
        f"data.eval_sources=[jsonl:{workdir / 'eval.jsonl'}:text]",
        f"data.cache_dir={cache or workdir / 'cache'}",
        "data.max_train_prompts=null",
        "data.batch_size=2",
        "data.max_length=64",
        "data.generation.max_new_tokens=12",
        "data.generation.batch_size=4",
        "drafter.block_size=4",
        "drafter.num_layers=1",
        "tree.budget_train=4",
        "eval.budgets=[4]",  # the decode check decodes at its largest too
        "objective.anchors_per_seq=4",
        "stages.exittrain.anchors_per_seq=4",
    ]


def fit_command(
    workdir: Path, run_dir: Path, record: Path, *overrides: str, cache: Path | None = None, sleep_s: float = 0.0
) -> list[str]:
    """``python -m exittrain fit`` on the tiny target in ``workdir`` (see :func:`prepare_workdir`).

    Both stages run (pretrain 10 steps over 3 epochs of 4 batches, then exittrain 4 steps), with a
    checkpoint after every step (the default ``ModelCheckpoint`` on ``val/block_length``, whose
    ``every_n_train_steps`` follows ``decode_eval.every_n_steps``) and :class:`StepRecorder`
    writing every trained batch to ``record``. ``cache``: the regeneration cache (default
    ``workdir/cache``); processes that run at the same time need their own.
    """
    return [
        sys.executable,
        "-m",
        "exittrain",
        "fit",
        f"hydra.run.dir={run_dir}",
        *tiny_run_overrides(workdir, cache),
        "stages.pretrain.max_steps=10",
        "stages.pretrain.eval_every=null",  # the callbacks' every step below, not the default run's interval
        "stages.exittrain.max_steps=4",
        "callbacks.decode_eval.every_n_steps=1",
        "callbacks.decode_eval.num_prompts=1",
        "callbacks.decode_eval.max_new_tokens=4",
        "eval.num_prompts=1",
        "eval.max_new_tokens=4",
        "logger=csv",
        "+trainer.enable_progress_bar=false",
        "+callbacks.record._target_=tests.lit.crash_helpers.StepRecorder",
        f"+callbacks.record.path={record}",
        f"+callbacks.record.sleep_s={sleep_s}",
        *overrides,
    ]


def prepare_workdir(workdir: Path) -> Path:
    """The tiny target, 9 training prompts (8 train rows + 1 validation row) and 2 evaluation prompts."""
    write_tiny_target(workdir / "target")
    write_prompts(workdir / "train.jsonl", 9, seed=0)
    write_prompts(workdir / "eval.jsonl", 2, seed=1)
    return workdir


def subprocess_env() -> dict[str, str]:
    """One thread per process (2 shared cores), offline W&B, the repository importable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


class StepRecorder(pl.Callback):
    """Appends one JSON line per trained batch to ``path``: stage, step, epoch, row ids, loss.

    ``step`` is the global step the batch trained (before its update). Each line is flushed at once,
    so the lines of a process killed with SIGKILL are all complete except perhaps the last one
    (:func:`read_records` drops a torn last line). ``sleep_s`` paces a run that a test kills.
    """

    def __init__(self, path: str, sleep_s: float = 0.0) -> None:
        self.path = Path(path)
        self.sleep_s = float(sleep_s)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        line = {
            "stage": pl_module.hparams.stage,
            "step": trainer.global_step - 1,
            "epoch": trainer.current_epoch,
            "rows": [int(r) for r in batch["row_id"].tolist()],
            "loss": float(outputs["loss"]),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.sleep_s:
            time.sleep(self.sleep_s)


def read_records(path: Path) -> list[dict]:
    """The complete lines written by :class:`StepRecorder` (a torn last line is dropped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
