"""A training sampler whose order survives a kill: a pure function of (seed, epoch), resumable mid-epoch.

Why not ``DataLoader(shuffle=True, generator=...)``: a ``RandomSampler`` draws each epoch's order from
a generator that advances every epoch and lives only in the process. A run resumed from a checkpoint
builds a fresh generator, so it replays epoch 0's order whatever epoch it resumes in, and Lightning
(2.6) restarts a plain DataLoader at the start of its order even when the checkpoint was taken in
the middle of an epoch (it only shortens the epoch, see ``_TrainingEpochLoop.on_run_start``): the
resumed run trains on some rows twice and never on others.

:class:`ResumableSampler` fixes both: epoch ``e`` is ``torch.randperm(n)`` under ``seed + e`` (the
order of :class:`torch.utils.data.DistributedSampler`, which it subclasses), and :meth:`resume`
makes the next pass over epoch ``e`` start after the indices already trained on. Being a
``DistributedSampler``, Lightning neither replaces nor wraps it under DDP. Each rank gets its own
shard (``rank::num_replicas`` of the permutation, padded to equal length as ``DistributedSampler``
does).

Which epoch a pass is: with ``epoch_fn`` (``ExitTrainDataModule`` passes the trainer's
``current_epoch``), the value it returns when the pass starts; without it, the last ``set_epoch``.
Lightning's own ``set_epoch`` argument is not used under a trainer because it is off by one for
the rest of a run resumed from a checkpoint written at an epoch end (Lightning 2.6 passes
``epoch_progress.current.processed``, which such a restore leaves one ahead of ``current_epoch``).

The caller supplies the position to resume from (``ExitTrainDataModule`` records it in the
checkpoint from Lightning's own batch counters); the sampler cannot count it itself, because data
loaders and Lightning prefetch batches before they are trained on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

from torch.utils.data import DistributedSampler

__all__ = ["ResumableSampler", "resume_point"]

logger = logging.getLogger(__name__)


def resume_point(order: Mapping[str, Any], **now: int) -> tuple[int, int]:
    """``(epoch, batches done)`` to resume a checkpoint's ``train_order`` from (``epoch``, ``batches_done``
    and the settings that fix the order). With ``now`` (``seed``, ``batch_size``, ``world_size``)
    differing from the saved ones the order cannot continue: the checkpoint's epoch restarts from its
    first batch, with a warning."""
    saved = {k: order.get(k) for k in now}
    if saved != now:
        logger.warning(
            "the checkpoint's data order (%s) differs from this run's (%s): epoch %d restarts from its first batch",
            saved,
            now,
            order["epoch"],
        )
        return int(order["epoch"]), 0
    return int(order["epoch"]), int(order["batches_done"])


class ResumableSampler(DistributedSampler):
    """Shuffled indices of ``dataset`` for epoch ``self.epoch``; see the module docstring.

    Args:
        dataset: anything with ``len``.
        seed: epoch ``e`` is the permutation drawn under ``seed + e``.
        num_replicas, rank: the data-parallel world size and this process's rank (1 and 0 alone).
        epoch_fn: returns the epoch of a pass when it starts (e.g. ``lambda: trainer.current_epoch``);
            None = the last ``set_epoch`` value.

    ``len(sampler)`` is always the full per-rank epoch (``num_samples``), also while resuming:
    Lightning counts the batches trained before the checkpoint into the epoch itself.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        epoch_fn: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self._epoch_fn = epoch_fn
        self._resume_epoch: int | None = None
        self._resume_skip = 0

    def resume(self, epoch: int, skip: int) -> None:
        """Make the next pass epoch ``epoch`` without this rank's first ``skip`` indices of it.

        Applies to one pass, whatever ``epoch_fn`` or ``set_epoch`` say (the loop's epoch counters
        may not be restored yet when a loader builds its first iterator); the passes after it are
        whole epochs again. ``skip >= num_samples`` means epoch ``epoch`` is done: the next pass is
        epoch ``epoch + 1`` from its start.
        """
        if epoch < 0 or skip < 0:
            raise ValueError(f"resume(epoch={epoch}, skip={skip}): both must be >= 0")
        if skip >= self.num_samples:
            epoch, skip = epoch + 1, 0
        self.set_epoch(epoch)
        self._resume_epoch, self._resume_skip = epoch, skip

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self._resume_epoch is not None:
            self.epoch, skip = self._resume_epoch, self._resume_skip
            self._resume_epoch, self._resume_skip = None, 0
        elif self._epoch_fn is not None:
            self.epoch = int(self._epoch_fn())
        return iter(list(super().__iter__())[skip:])
