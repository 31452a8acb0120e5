"""Callbacks of drafter training: decoding evaluation, drafter export, the stage's metrics file.

- :class:`DecodeEvalCallback` decodes held-out prompts with :class:`~exittrain.decoding.SpeculativeDecoder`
  and logs ``val/block_length`` (tau) and ``val/tokens_per_s`` through ``pl_module.log``, so
  ``ModelCheckpoint(monitor="val/block_length", mode="max")`` can select on it.
- :class:`ExportDrafterCallback` saves the drafter in Hugging Face format at fit end, atomically.
- :class:`MetricsFileCallback` writes the stage's final (and best) metrics as ``metrics_<stage>.json``
  of the run directory (:class:`~exittrain.run_dir.RunDir`) at fit end, atomically.
- :class:`~exittrain.lit.heldout_callback.HeldOutBlockLengthCallback` (its own module) logs cheap
  held-out measures often: one drafter pass over a fixed few validation rows, no decoding.

The progress bar and progress lines are in :mod:`exittrain.lit.progress_callbacks`.

How callback-logged metrics reach ``trainer.callback_metrics`` (lightning 2.6): ``pl_module.log``
is allowed in ``on_train_batch_end`` (on_step) and ``on_validation_epoch_end`` (on_epoch), see
``trainer/connectors/logger_connector/fx_validator.py``. The logger connector copies the step's
results into ``callback_metrics`` in ``on_batch_end`` / at the end of the validation epoch, and
``callback_metrics`` keeps a key until the next fit. ``ModelCheckpoint`` always runs after the
other callbacks (``_CallbackConnector._reorder_callbacks``) and reads ``callback_metrics`` live,
so it sees the value logged in the same hook. ``on_train_end`` / ``on_fit_end`` may not log:
the fit-end evaluation writes ``trainer.callback_metrics`` and the loggers directly.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from exittrain.atomic import write_folder_atomic
from exittrain.core import TREE_SHAPES, VERIFIERS
from exittrain.heldout.decode_eval import decode_check
from exittrain.lit.heldout_callback import HeldOutBlockLengthCallback
from exittrain.lit.sharding import drafter_and_target, full_drafter
from exittrain.progress import Heartbeat
from exittrain.run_dir import RunDir

log = logging.getLogger(__name__)

__all__ = [
    "DecodeEvalCallback",
    "ExportDrafterCallback",
    "MetricsFileCallback",
    "save_drafter",
]

Prompts = Sequence[Sequence[int]]


# ----------------------------------------------------------------------------------------------
# atomic export


def save_drafter(drafter, path: str | os.PathLike) -> Path:
    """``drafter.save_pretrained`` (config + safetensors) into ``path``, atomically
    (:func:`exittrain.atomic.write_folder_atomic`: a crash leaves the old complete folder or the new
    one, never a half-written one; the files are fsynced; leftovers of killed exports are removed).

    Only one process may export to a given ``path`` at a time (rank 0 does). A failure of the file
    system (a full disk) raises :class:`exittrain.atomic.WriteError` naming ``path``, the bytes the
    weights need, the free space and the fix.
    """

    def write(tmp: Path) -> None:
        drafter.save_pretrained(tmp)
        if not (tmp / "config.json").is_file() or not any(tmp.glob("*.safetensors")):
            raise RuntimeError(f"save_pretrained wrote no config.json or safetensors into {tmp}")

    needed = sum(t.nbytes for t in drafter.state_dict().values())
    write_folder_atomic(path, write, what="drafter export", fix=DRAFTER_WRITE_FIX, needed=needed)
    return Path(path)


# a failed export leaves the previous one in place; the run's checkpoints still hold the drafter
DRAFTER_WRITE_FIX = (
    "point hydra.run.dir at a disk with room; the stage's checkpoints hold the trained drafter "
    "(exittrain.lit.ExitTrainModule.drafter_from_checkpoint, or fit ckpt_path=RUN_DIR/checkpoints/<stage>/last.ckpt)"
)


def scalar_float(value: Any) -> float | None:
    """A one-element tensor or a real number as a float; None for anything else (bools included)."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _json_number(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# ----------------------------------------------------------------------------------------------
# decoding evaluation


class DecodeEvalCallback(Callback):
    """Decode held-out prompts with the current drafter and log tau and throughput.

    Args:
        prompts: chat-templated prompt ids (``list[list[int]]``), or a callable returning them
            (called once, at fit start; e.g. ``datamodule.eval_prompts``).
        every_n_steps: evaluate after every this many optimizer steps (0 = only at validation
            epochs and at fit end).
        budget, max_new_tokens, temperature, verifier: :class:`SpeculativeDecoder` settings.
        shape: ``ddtree`` (the decoder's best-first tree of ``budget`` nodes) or ``chain`` (the
            drafter's greedy chain of its K tokens, :class:`~exittrain.decoding.chain_decoder.ChainDecoder`, what
            a serving engine verifies; ``budget`` does not apply): ``tree.shape``, so that under
            ``+serve=dflash`` the best checkpoint is the one whose chain decodes longest.
        on_validation: also evaluate at the end of every validation epoch (skipped during the
            sanity check), so a ``ModelCheckpoint`` on ``val/block_length`` always finds the key
            when it runs after validation.
        seed: decoding seed (prompt i uses ``seed + i``); matters only at temperature > 0.

    Metrics: ``val/block_length`` is the rounds-weighted mean tau over all prompts, i.e. total
    tokens over total rounds (a prompt that runs more rounds counts more); a round's length is
    accepted tokens + bonus, before the cut at EOS or ``max_new_tokens``. ``val/tokens_per_s`` is
    total new tokens over total decoding seconds. Logged on_step from ``on_train_batch_end`` and
    on_epoch from ``on_validation_epoch_end``; at fit end written into
    ``trainer.callback_metrics`` and the loggers directly. The decoding runs on global rank 0
    and its result is broadcast, so every rank logs the same values. The drafter is put in eval
    mode for decoding and back into its previous mode after. Under ``trainer=fsdp`` every rank
    first takes part in gathering the sharded drafter into a full copy on rank 0
    (:func:`~exittrain.lit.sharding.full_drafter`), which rank 0 decodes; unsharded, rank 0
    decodes the drafter itself.

    :attr:`history` lists ``{"step", "block_length", "tokens_per_s", "rounds", "tokens", "seconds"}``
    per evaluation; it is saved in checkpoints (``state_dict``) and restored on resume.
    """

    def __init__(
        self,
        prompts: Prompts | Callable[[], Prompts],
        every_n_steps: int = 150,
        budget: int = 16,
        max_new_tokens: int = 48,
        temperature: float = 0.0,
        verifier: str = "tev",
        *,
        shape: str = "ddtree",
        on_validation: bool = False,
        seed: int = 0,
    ) -> None:
        if not (isinstance(every_n_steps, int) and not isinstance(every_n_steps, bool) and every_n_steps >= 0):
            raise ValueError(f"every_n_steps={every_n_steps!r}: need an int >= 0 (0 = validation and fit end only)")
        if not (isinstance(budget, int) and budget >= 1):
            raise ValueError(f"budget={budget!r}: need an int >= 1 (draft nodes per round)")
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: need an int >= 1")
        if not (isinstance(temperature, (int, float)) and temperature >= 0):
            raise ValueError(f"temperature={temperature!r}: need a number >= 0 (0 = greedy)")
        if verifier not in VERIFIERS:
            raise ValueError(f"verifier={verifier!r}: use one of {sorted(VERIFIERS)}")
        if shape not in TREE_SHAPES:
            raise ValueError(f"shape={shape!r}: the decode check's draft shape must be one of {TREE_SHAPES}")
        if not callable(prompts):
            prompts = self._check_prompts(prompts)
        self._prompts_arg = prompts
        self.shape = shape
        self._prompts: list[list[int]] | None = None if callable(prompts) else prompts
        self.every_n_steps = every_n_steps
        self.budget = budget
        self.max_new_tokens = max_new_tokens
        self.temperature = float(temperature)
        self.verifier = verifier
        self.on_validation = on_validation
        self.seed = int(seed)
        self.history: list[dict[str, float]] = []

    @staticmethod
    def _check_prompts(prompts: Prompts) -> list[list[int]]:
        out = [[int(t) for t in p] for p in prompts]
        if not out or any(len(p) < 2 for p in out):
            raise ValueError("prompts must be a non-empty list of token-id lists of at least 2 tokens each")
        return out

    @property
    def prompts(self) -> list[list[int]]:
        if self._prompts is None:
            self._prompts = self._check_prompts(self._prompts_arg())
        return self._prompts

    @property
    def last_step(self) -> int | None:
        return int(self.history[-1]["step"]) if self.history else None

    def best(self) -> dict[str, float] | None:
        """The history entry with the highest block length, or None before any evaluation."""
        return max(self.history, key=lambda h: h["block_length"]) if self.history else None

    # -- evaluation -------------------------------------------------------------------------------

    def evaluate(self, drafter, target) -> dict[str, float]:
        """Decode every prompt once; returns the pooled statistics (no logging, no history)."""
        was_training = drafter.training
        drafter.eval()
        try:
            return decode_check(target, drafter, self.prompts, budget=self.budget, shape=self.shape,
                                verifier=self.verifier, temperature=self.temperature,
                                max_new_tokens=self.max_new_tokens, seed=self.seed)
        finally:
            drafter.train(was_training)

    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Evaluate on rank 0, broadcast, record in the history (once per global step)."""
        if self.history and self.last_step == trainer.global_step:
            return self.history[-1]
        stats = None
        drafter, target = drafter_and_target(pl_module)
        drafter = full_drafter(drafter, target)  # sharded: a collective, the full copy on rank 0 only
        if trainer.is_global_zero:
            # tens of seconds on a CPU between two step lines: say so at once, then beat while it decodes
            what = "the chain" if self.shape == "chain" else f"trees of {self.budget}"
            log.info("decode check at step %d: %d held-out prompts, %s", trainer.global_step, len(self.prompts), what)
            with Heartbeat(f"decode check at step {trainer.global_step}"):
                stats = self.evaluate(drafter, target)
        stats = trainer.strategy.broadcast(stats, src=0)
        entry = {"step": float(trainer.global_step), **stats}
        self.history.append(entry)
        return entry

    @staticmethod
    def _metrics(entry: dict[str, float]) -> dict[str, float]:
        return {"val/block_length": entry["block_length"], "val/tokens_per_s": entry["tokens_per_s"]}

    # -- hooks ------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drafter_and_target(pl_module)
        _ = self.prompts  # resolve a callable early, so a bad prompt source fails before training

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0 and trainer.global_step > 0:
            entry = self._run(trainer, pl_module)
            pl_module.log_dict(self._metrics(entry), on_step=True, on_epoch=False, batch_size=1)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.on_validation or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        entry = self._run(trainer, pl_module)
        pl_module.log_dict(self._metrics(entry), on_step=False, on_epoch=True, batch_size=1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        entry = self._run(trainer, pl_module)
        metrics = self._metrics(entry)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(h) for h in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(h) for h in state_dict.get("history", [])]


# ----------------------------------------------------------------------------------------------
# export


class ExportDrafterCallback(Callback):
    """Save the drafter in Hugging Face format (config.json + model.safetensors) at fit end.

    ``dirpath/name`` receives the final drafter. With ``export_best=True`` and a
    ``ModelCheckpoint`` that tracked a best checkpoint, ``dirpath/{name}-best`` receives the
    drafter rebuilt from that checkpoint (:meth:`ExitTrainModule.drafter_from_checkpoint`).
    Every write is atomic (:func:`save_drafter`) and happens on global rank 0 only; the
    other ranks wait at a barrier. Under ``trainer=fsdp`` every rank first takes part in
    gathering the sharded drafter (:func:`~exittrain.lit.sharding.full_drafter`), and rank 0 saves
    that full copy. The target's weights are never saved. :attr:`exported` lists the folders written.
    """

    def __init__(self, dirpath: str | os.PathLike, name: str = "drafter", *, export_best: bool = False) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"name={name!r}: need a plain folder name (no '/', not hidden)")
        self.dirpath = Path(dirpath)
        self.name = name
        self.export_best = export_best
        self.exported: list[Path] = []

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drafter, target = drafter_and_target(pl_module)
        drafter = full_drafter(drafter, target)  # sharded: a collective, the full copy on rank 0 only
        if trainer.is_global_zero:
            self.exported.append(save_drafter(drafter, self.dirpath / self.name))
            best = self._best_checkpoint(trainer)
            if self.export_best and best:
                from exittrain.lit.module import ExitTrainModule

                best_drafter = ExitTrainModule.drafter_from_checkpoint(best, target)
                self.exported.append(save_drafter(best_drafter, self.dirpath / f"{self.name}-best"))
        trainer.strategy.barrier("ExportDrafterCallback")

    @staticmethod
    def _best_checkpoint(trainer: pl.Trainer) -> str | None:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.monitor is not None and cb.best_model_path:
                return cb.best_model_path
        return None


# ----------------------------------------------------------------------------------------------
# metrics file


class MetricsFileCallback(Callback):
    """Write ``metrics_<stage>.json`` into the run directory ``dirpath`` at fit end (global rank 0, atomically).

    Content (:meth:`RunDir.write_stage_metrics`): ``global_step``, ``epoch``, ``final`` (every
    scalar in ``trainer.callback_metrics`` at fit end; non-finite values become null), ``best``
    (per ``ModelCheckpoint`` with a monitor: monitor, mode, best score, checkpoint path) and, if
    a :class:`DecodeEvalCallback` is present, ``decode_eval`` with its best entry and history; when a
    :class:`HeldOutBlockLengthCallback` is, ``heldout_block_length`` with its history.
    Its place in the callback list does not matter: it runs at ``on_fit_end``, after every
    ``on_train_end`` (where the ``DecodeEvalCallback`` makes its fit-end evaluation).
    """

    def __init__(self, dirpath: str | os.PathLike, stage: str) -> None:
        self.run_dir = RunDir(dirpath)
        self.stage = stage
        self.path = self.run_dir.stage_metrics_path(stage)  # a bad stage name fails here, not at fit end

    def collect(self, trainer: pl.Trainer) -> dict[str, Any]:
        final = {}
        for key, value in sorted(trainer.callback_metrics.items()):
            number = scalar_float(value)
            if number is not None:
                final[key] = _json_number(number)
        best = []
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.monitor is not None:
                score = scalar_float(cb.best_model_score) if cb.best_model_score is not None else None
                best.append(
                    {
                        "monitor": cb.monitor,
                        "mode": cb.mode,
                        "score": _json_number(score),
                        "path": cb.best_model_path or None,
                    }
                )
        out: dict[str, Any] = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "final": final,
            "best": best,
        }
        decode = [cb for cb in trainer.callbacks if isinstance(cb, DecodeEvalCallback)]
        if decode:
            out["decode_eval"] = {"best": decode[0].best(), "history": decode[0].history}
        heldout = [cb for cb in trainer.callbacks if isinstance(cb, HeldOutBlockLengthCallback)]
        if heldout:
            out["heldout_block_length"] = {"history": heldout[0].history}
        return out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.run_dir.write_stage_metrics(self.stage, self.collect(trainer))
        trainer.strategy.barrier("MetricsFileCallback")
