"""The target's features and soft labels of rows whose answers are already written: one teacher-forced pass.

Whoever wrote the answer (vLLM, a brought conversation, Hugging Face ``generate``), the target
reads each row ``prompt + answer`` once and :func:`teacher_forced` keeps what training needs:

- ``features``: the outputs of the target layers ``feature_layers`` at every position of the
  row, concatenated in the order given, ``(n, F)`` bf16 on the CPU (the layout
  :func:`~exittrain.data.generation.generate_batch` keeps while it answers);
- ``top_ids`` / ``top_logprobs``: at every answer position j (token ``n_prompt + j``), the S
  most likely tokens of the target's next-token distribution given the tokens before it, and
  their log-probabilities, ``(r, S)`` int32 / float32, r = n - n_prompt, sorted descending.

Rows are left-padded into batches with explicit positions (``cumsum(mask) - 1``), so every real
token sits where it sits alone and the numbers differ from a row-by-row pass by float rounding
only (:func:`teacher_forced_reference` is that row-by-row twin). The logits are kept only for the
last ``max r + 1`` positions of a batch (``logits_to_keep``): a batch's memory is
``batch_size * (max r + 1) * V`` floats, so long answers want a smaller ``batch_size``.

The model is used as it is (device, dtype): pass the copy that answered
(:func:`~exittrain.data.generation.answering_model`) for labels of the same precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from exittrain.models.target_model import layer_output_hooks

__all__ = ["TeacherForced", "teacher_forced", "teacher_forced_reference"]

# Shapes: N = rows in a batch, T = the batch's longest row, R = the longest answer + 1, S = soft-label width.


class TeacherForced(NamedTuple):
    """What the target keeps of one row: ``features`` (n, F) bf16, ``top_ids`` (r, S) int32 and
    ``top_logprobs`` (r, S) float32; None for what was not asked."""

    features: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def _check_rows(rows: Sequence[tuple[Sequence[int], int]], top_logprobs: int, batch_size: int) -> None:
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs={top_logprobs!r} must be an int >= 0 (0 keeps none)")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 (rows per target forward)")
    for i, (ids, n_prompt) in enumerate(rows):
        if not 1 <= int(n_prompt) <= len(ids):
            raise ValueError(
                f"row {i}: n_prompt_tokens={n_prompt} must be in [1, {len(ids)}] (its length): a row needs a "
                "prompt token before its first answer token"
            )


def _sink(kept: dict[int, torch.Tensor]):
    """A layer-output sink that keeps each layer's output in ``kept``, bf16 on the CPU."""

    def keep(layer_id: int, output: torch.Tensor) -> None:
        kept[layer_id] = output.to("cpu", torch.bfloat16)

    return keep


def _keep_top(logits_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.log_softmax(logits_RV.float(), dim=-1).topk(k, dim=-1)
    return ids.to("cpu", torch.int32), values.cpu()


@torch.inference_mode()
def teacher_forced(
    model: Any,
    rows: Sequence[tuple[Sequence[int], int]],
    *,
    feature_layers: Sequence[int] = (),
    top_logprobs: int = 0,
    batch_size: int = 8,
) -> list[TeacherForced]:
    """One :class:`TeacherForced` per row of ``rows`` (``(input_ids, n_prompt_tokens)`` pairs), in order.

    ``feature_layers``: target layer ids (the convention of :mod:`exittrain.models.target_model`);
    ``top_logprobs``: S > 0 keeps the top-S next-token log-probabilities of every answer token.
    Rows are batched in the order given (sort them by length first for less padding).
    """
    _check_rows(rows, top_logprobs, batch_size)
    layers = [int(x) for x in feature_layers]  # concatenated in the order given, as generate_batch keeps them
    if len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers={list(feature_layers)} repeats a layer id; give each target layer once")
    device = next(model.parameters()).device
    pad = 0  # any id: padded positions are masked out and never kept
    out: list[TeacherForced] = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        N, T = len(batch), max(len(ids) for ids, _ in batch)
        R = max(len(ids) - int(n) for ids, n in batch) + 1  # logits of the last prompt token onwards
        input_ids_NT = torch.full((N, T), pad, dtype=torch.long)
        mask_NT = torch.zeros((N, T), dtype=torch.long)
        for i, (ids, _) in enumerate(batch):
            input_ids_NT[i, T - len(ids) :] = torch.as_tensor(list(ids), dtype=torch.long)
            mask_NT[i, T - len(ids) :] = 1
        positions_NT = (mask_NT.cumsum(1) - 1).clamp(min=0)
        kept: dict[int, torch.Tensor] = {}  # layer -> (N, T, H)
        with layer_output_hooks(model, layers, _sink(kept)):
            logits_NRV = model(
                input_ids=input_ids_NT.to(device),
                attention_mask=mask_NT.to(device),
                position_ids=positions_NT.to(device),
                use_cache=False,
                logits_to_keep=R if top_logprobs > 0 else 1,
            ).logits
        features_NTF = torch.cat([kept[layer] for layer in layers], dim=-1) if layers else None
        for i, (ids, n_prompt) in enumerate(batch):
            n, r = len(ids), len(ids) - int(n_prompt)
            features = features_NTF[i, T - n :].clone() if features_NTF is not None else None
            top_ids = top_logp = None
            if top_logprobs > 0:
                # logits column c holds position T - R + c; answer token j is predicted at T - r - 1 + j
                top_ids, top_logp = _keep_top(logits_NRV[i, R - r - 1 : R - 1], top_logprobs)
            out.append(TeacherForced(features, top_ids, top_logp))
    return out


@torch.inference_mode()
def teacher_forced_reference(
    model: Any,
    rows: Sequence[tuple[Sequence[int], int]],
    *,
    feature_layers: Sequence[int] = (),
    top_logprobs: int = 0,
) -> list[TeacherForced]:
    """:func:`teacher_forced`'s slow twin: one unpadded forward per row, full logits."""
    _check_rows(rows, top_logprobs, 1)
    layers = [int(x) for x in feature_layers]
    device = next(model.parameters()).device
    out = []
    for ids, n_prompt in rows:
        kept: dict[int, torch.Tensor] = {}
        with layer_output_hooks(model, layers, _sink(kept)):
            logits_1TV = model(input_ids=torch.as_tensor([list(ids)], device=device), use_cache=False).logits
        features = torch.cat([kept[layer][0] for layer in layers], dim=-1) if layers else None
        top = _keep_top(logits_1TV[0, int(n_prompt) - 1 : len(ids) - 1], top_logprobs) if top_logprobs else (None, None)
        out.append(TeacherForced(features, *top))
    return out
