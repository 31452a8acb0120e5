"""Batching regenerated rows for drafter training.

Shapes: L = sequences in a batch, T = the longest (truncated) sequence in the batch, F = target
feature width, S = soft-label tokens per position.

A batch is a dict of tensors, right-padded:

- ``input_ids`` (L, T) long: prompt + response ids, ``pad_token_id`` after the end;
- ``loss_mask`` (L, T) bool: True on response tokens (the positions the drafter learns);
- ``attention_mask`` (L, T) long: 1 on real tokens, 0 on padding;
- ``n_prompt_tokens`` (L,) long: where each response starts;
- ``lengths`` (L,) long: real tokens per row after truncation;
- ``row_id`` (L,) long, when the rows carry ``prompt_index``: a stable identity of each row (its
  prompt's position in the regenerated prompt list), the same every epoch and unique across the
  train and validation splits of one dataset. It keys the :class:`~exittrain.data.feature_store.FeatureStore`.

With a ``store`` that keeps them (:class:`~exittrain.data.feature_store.FeatureStore`), also:

- ``features`` (L, T, F) bf16: the target features of each row's tokens, 0 on padding, and
  ``feature_layers`` (n_layers,) long: the target layers they are of;
- ``top_ids`` (L, T, S) int32 and ``top_logprobs`` (L, T, S) float32: the target's top-S
  distribution of each response token given the tokens before it; id 0 and ``-inf`` elsewhere
  (the prompt, padding).

Rows longer than ``max_length`` are cut to ``max_length``; :func:`truncation_stats` counts them
ahead of training so the counts do not depend on which worker process collated what.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exittrain.data.feature_store import FeatureStore


@dataclass(frozen=True)
class Collator:
    """Pads rows with ``input_ids`` and ``loss_mask`` (and ``n_prompt_tokens``) into a batch.

    Rows that carry ``prompt_index`` (all of them, or none) also give ``row_id``; with a ``store``,
    every row must carry it, and the batch gets what the store keeps of each row. Picklable, so it
    works with ``num_workers > 0``.
    """

    pad_token_id: int
    max_length: int
    store: FeatureStore | None = None

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
        store = self.store
        if store is not None and (store.has_features or store.has_top_logprobs):
            if "row_id" not in batch:
                raise ValueError(
                    "a Collator with a feature store needs rows that carry prompt_index (the store's row ids)"
                )
            for r, row in zip(batch["row_id"].tolist(), rows):
                store.check_tokens(r, row["input_ids"])
            batch.update(_stored(store, batch["row_id"].tolist(), lengths))
        return batch


def _stored(store: FeatureStore, row_ids: list[int], lengths: list[int]) -> dict[str, torch.Tensor]:
    """The store's tensors of one batch (see the module docstring)."""
    L, T = len(row_ids), max(lengths)
    out: dict[str, torch.Tensor] = {}
    if store.has_features:
        rows = [store.features(r) for r in row_ids]
        features_LTF = torch.zeros(L, T, rows[0].shape[-1], dtype=torch.bfloat16)
        for i, (r, feats, n) in enumerate(zip(row_ids, rows, lengths)):
            if feats.shape[0] != n:
                raise ValueError(f"row_id {r}: the store keeps features of {feats.shape[0]} tokens for a row of {n}")
            features_LTF[i, :n] = feats
        out["features"] = features_LTF
        out["feature_layers"] = torch.tensor(store.feature_layers, dtype=torch.long)
    if store.has_top_logprobs:
        S = store.top_k
        top_ids_LTS = torch.zeros(L, T, S, dtype=torch.int32)
        top_logp_LTS = torch.full((L, T, S), -torch.inf)
        for i, (r, n) in enumerate(zip(row_ids, lengths)):
            start, ids, logp = store.top_logprobs(r)
            end = start + ids.shape[0]
            if end != n:
                raise ValueError(
                    f"row_id {r}: its kept top log-probabilities end at token {end} of a row of {n} tokens; "
                    "row ids must be stable and unique across the train and validation data"
                )
            top_ids_LTS[i, start:end], top_logp_LTS[i, start:end] = ids, logp
        out["top_ids"], out["top_logprobs"] = top_ids_LTS, top_logp_LTS
    return out


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
