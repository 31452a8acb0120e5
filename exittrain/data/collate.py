"""Batching regenerated rows for drafter training.

Shapes: L = sequences in a batch, T = the longest (truncated) sequence in the batch.

A batch is a dict of tensors, right-padded:

- ``input_ids`` (L, T) long: prompt + response ids, ``pad_token_id`` after the end;
- ``loss_mask`` (L, T) bool: True on response tokens (the positions the drafter learns);
- ``attention_mask`` (L, T) long: 1 on real tokens, 0 on padding;
- ``n_prompt_tokens`` (L,) long: where each response starts;
- ``lengths`` (L,) long: real tokens per row after truncation;
- ``row_id`` (L,) long, when the rows carry ``prompt_index``: a stable identity of each row (its
  prompt's position in the regenerated prompt list), the same every epoch and unique across the
  train and validation splits of one dataset. It keys the target-feature cache of
  :class:`exittrain.lit.ExitTrainModule` (``feature_cache=True``).

Rows longer than ``max_length`` are cut to ``max_length``; :func:`truncation_stats` counts them
ahead of training so the counts do not depend on which worker process collated what.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Collator:
    """Pads rows with ``input_ids`` and ``loss_mask`` (and ``n_prompt_tokens``) into a batch.

    Rows that carry ``prompt_index`` (all of them, or none) also give ``row_id``. Picklable, so it
    works with ``num_workers > 0``.
    """

    pad_token_id: int
    max_length: int

    def __post_init__(self) -> None:
        if self.max_length <= 1:
            raise ValueError(f"max_length={self.max_length} must be at least 2")

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        lengths = [min(len(r["input_ids"]), self.max_length) for r in rows]
        width = max(lengths)
        input_ids_LT = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        loss_mask_LT = torch.zeros((len(rows), width), dtype=torch.bool)
        attention_mask_LT = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            if len(row["loss_mask"]) != len(row["input_ids"]):
                raise ValueError(f"row {i}: loss_mask and input_ids differ in length; regenerate the cache")
            input_ids_LT[i, :n] = torch.as_tensor(row["input_ids"][:n], dtype=torch.long)
            loss_mask_LT[i, :n] = torch.as_tensor(row["loss_mask"][:n], dtype=torch.bool)
            attention_mask_LT[i, :n] = 1
        n_prompt_L = torch.tensor([min(int(r["n_prompt_tokens"]), n) for r, n in zip(rows, lengths)])
        batch = {
            "input_ids": input_ids_LT,
            "loss_mask": loss_mask_LT,
            "attention_mask": attention_mask_LT,
            "n_prompt_tokens": n_prompt_L,
            "lengths": torch.tensor(lengths, dtype=torch.long),
        }
        has_index = ["prompt_index" in r for r in rows]
        if all(has_index):
            batch["row_id"] = torch.tensor([int(r["prompt_index"]) for r in rows], dtype=torch.long)
        elif any(has_index):
            raise ValueError("some rows carry prompt_index and some do not; cannot give every row a row_id")
        return batch


@dataclass(frozen=True)
class TruncationStats:
    """How ``max_length`` affects a dataset: rows cut short, and rows left with no response token."""

    rows: int
    truncated: int
    no_response: int


def truncation_stats(n_prompt_tokens: Sequence[int], n_tokens: Sequence[int], max_length: int) -> TruncationStats:
    """Count rows longer than ``max_length`` and rows whose prompt alone fills ``max_length``."""
    truncated = sum(1 for n in n_tokens if n > max_length)
    no_response = sum(1 for p in n_prompt_tokens if p >= max_length)
    return TruncationStats(rows=len(n_tokens), truncated=truncated, no_response=no_response)
