"""Fit :class:`ExitTrainModule` on the tiny target, single-process or DDP on CPU; record what each rank did.

``python -m tests.lit.ddp_driver --out DIR --devices 2 --batch-size 2`` (run from the repository
root) fits with ``strategy="ddp"`` on ``devices`` CPU processes (gloo). Lightning's subprocess
launcher re-runs this same command for ranks 1.., so everything here runs on every rank.
``--devices 1`` is the single-process reference (also callable in-process: :func:`train`).

Run directory ``DIR/run``: a CSV logger, ``ModelCheckpoint`` (``save_last``), the drafter export,
``metrics_exittrain.json`` and a one-prompt decoding evaluation (decoded on rank 0, broadcast), i.e. every
writer of a real ``fit``. Results ``DIR/rank{r}.json`` and ``DIR/rank{r}.pt``, per rank:

- ``row_ids``: the rows each training step saw on this rank (the dataset carries its index);
- ``losses`` and ``anchors``: this rank's training loss and valid anchors per step;
- ``val_loss_tok``: the epoch's validation loss as logged (``sync_dist``: the same on every rank);
- ``writes``: every file or folder this process created, opened for writing or renamed under the
  run directory, seen through a ``sys.audit`` hook (``open``, ``os.mkdir``, ``os.rename``;
  ``os.replace`` raises ``os.rename`` too), so it catches any writer, not only the ones we know;
- ``rank{r}.pt``: the drafter's final state and its gradients at every step, taken in
  ``on_before_optimizer_step`` (after DDP's all-reduce, before clipping and the update).

The data are built so that the DDP run and a single-process run with the same global batch
compute the same thing; see ``tests/lit/test_ddp.py`` for why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

SEQ_LEN = 24  # every row has this length: no padding, the same anchor candidates in every row
STEPS = 3
GLOBAL_BATCH = 4
VAL_ROWS = 4
VOCAB_LOW = 2  # ids 0 (pad) and 1 (eos) never appear
PROMPTS = [[5, 6, 7, 8, 9, 10]]
# Every row's loss mask covers positions SEQ_LEN // 2 .. SEQ_LEN - 1; with K = 3 the anchors a with
# labels a+1..a+3 inside it and a + 3 < SEQ_LEN are a = 11..20: exactly 10 candidates per row.
ANCHOR_CANDIDATES = 10


class IndexedRows(torch.utils.data.Dataset):
    """Random fixed-length rows ``(ids, loss_mask, index)``; the index becomes the batch's ``row_id``."""

    def __init__(self, n: int, vocab: int, *, seed: int, offset: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(VOCAB_LOW, vocab, (n, SEQ_LEN), generator=g)
        self.offset = offset

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int):
        return self.ids[i], torch.arange(SEQ_LEN) >= SEQ_LEN // 2, self.offset + i


def collate_indexed(rows) -> dict[str, torch.Tensor]:
    from tests.lit.helpers import collate

    batch = collate([(ids, mask) for ids, mask, _ in rows])
    batch["row_id"] = torch.tensor([i for _, _, i in rows], dtype=torch.long)
    return batch


class WriteJournal:
    """Paths under ``root`` that this process writes, from ``sys.audit`` events (hooks cannot be removed)."""

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def __init__(self, root: Path):
        self.root = str(root.resolve())
        self.writes: list[list[str]] = []
        sys.addaudithook(self._hook)

    def _rel(self, path) -> str | None:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, (str, os.PathLike)):
            return None  # a file descriptor (os.fdopen): its os.open was recorded already
        path = os.path.abspath(os.fspath(path))
        return os.path.relpath(path, self.root) if path.startswith(self.root) else None

    def _hook(self, event: str, args) -> None:
        if event == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & self.WRITE_FLAGS)
            if writing and (rel := self._rel(path)) is not None:
                self.writes.append(["open", rel])
        elif event == "os.mkdir" and (rel := self._rel(args[0])) is not None:
            self.writes.append([event, rel])
        elif event == "os.rename":  # args: src, dst, ...; the destination is what appears
            rel = self._rel(args[1]) or self._rel(args[0])
            if rel is not None:
                self.writes.append([event, rel])


def train(
    devices: int, batch_size: int, out: Path, *, order: list[int] | None = None, journal: WriteJournal | None = None
) -> dict:
    """Fit for :data:`STEPS` steps on ``devices`` CPU processes; returns this rank's record (also saved).

    ``order``: the training rows in the order to visit them (single process only; default 0, 1, ...).
    Under DDP Lightning always puts a ``DistributedSampler(shuffle=True)`` on the training loader
    (lightning 2.6 treats every training loader as shuffled), so the rows come in its seeded order.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from exittrain.lit import DecodeEvalCallback, ExportDrafterCallback, MetricsFileCallback
    from tests.lit.helpers import make_module
    from tests.models.helpers import tiny_target

    torch.set_num_threads(1)
    target = tiny_target("llama")
    # anchors_per_seq = every candidate: the anchor set no longer depends on the (seed, step, rank) draw
    module = make_module(target, anchors_per_seq=ANCHOR_CANDIDATES, lr=1e-2, warmup_ratio=0.0)
    rows = IndexedRows(STEPS * GLOBAL_BATCH, target.vocab_size, seed=1)
    val_rows = IndexedRows(VAL_ROWS, target.vocab_size, seed=2, offset=len(rows))
    train_loader = DataLoader(rows, batch_size=batch_size, sampler=order, collate_fn=collate_indexed)
    val_loader = DataLoader(val_rows, batch_size=batch_size, shuffle=False, collate_fn=collate_indexed)

    class Record(pl.Callback):
        def __init__(self):
            self.row_ids, self.losses, self.anchors, self.grads = [], [], [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.row_ids.append(batch["row_id"].tolist())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.drafter.named_parameters()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            self.anchors.append(int(trainer.callback_metrics["train/anchors"]))  # valid anchors of this rank

    run = out / "run"
    record = Record()
    callbacks = [
        record,
        DecodeEvalCallback(PROMPTS, every_n_steps=0, budget=4, max_new_tokens=4, on_validation=False),
        ModelCheckpoint(dirpath=run / "ckpt", save_last=True),
        ExportDrafterCallback(run / "export"),
        MetricsFileCallback(run, "exittrain"),
    ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        precision="32-true",
        max_steps=STEPS,
        logger=CSVLogger(run / "logs", name="csv"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_loader, val_loader)

    rank, metrics = trainer.global_rank, trainer.callback_metrics
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "row_ids": record.row_ids,
        "losses": record.losses,
        "anchors": record.anchors,
        "val_loss_tok": float(metrics["val/loss_tok"]) if "val/loss_tok" in metrics else None,
        "writes": journal.writes if journal is not None else None,
    }
    state = {k: v.detach().clone() for k, v in module.drafter.state_dict().items()}
    write_rank_record(out, rank, result, {"state": state, "grads": record.grads}, trainer.strategy)
    return result


def write_rank_record(out: Path, rank: int, result: dict, tensors: dict, strategy) -> None:
    """``rank{rank}.json`` (``result``) and ``rank{rank}.pt`` (``tensors``) under ``out``, then a barrier:
    rank 0 (the launching process) exits only after every rank has written its record."""
    torch.save(tensors, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    strategy.barrier("rank_records")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=GLOBAL_BATCH // 2)
    parser.add_argument("--order", type=lambda s: [int(i) for i in s.split(",")], default=None)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    journal = WriteJournal(args.out / "run")
    train(args.devices, args.batch_size, args.out, order=args.order, journal=journal)


if __name__ == "__main__":
    main()
