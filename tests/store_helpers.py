"""A cache entry's feature and soft-label files written from a tiny target, for the feature-store tests.

The files have the regeneration's layout (exittrain.data.regenerate: ``features-<layers>.safetensors``,
``top-logprobs-<k>.safetensors``), computed with one target forward per row.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from exittrain.data.feature_store import RowLayout, token_fingerprint
from exittrain.data.regen_cache import features_file, top_logprobs_file


def synthetic_rows(n: int, *, seed: int = 0, vocab: int = 64, min_len: int = 12, max_len: int = 20):
    """``{row_id: (ids (n,) long, n_prompt)}`` of random rows, ids from 10 on, prompts of 3..6 tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = {}
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        rows[10 + i] = (torch.randint(2, vocab, (length,), generator=g), int(torch.randint(3, 7, (1,), generator=g)))
    return rows


@torch.no_grad()
def write_entry(path: Path, target, rows, layers, k: int) -> dict:
    """Write the entry's files for ``rows``; returns ``{row_id: (features (n, F) bf16, top ids, top logp)}``."""
    path.mkdir(parents=True, exist_ok=True)
    feats, top, kept = {}, {}, {}
    for r, (ids, n_prompt) in rows.items():
        f = target.sequence_features(ids[None], layers)[0].bfloat16()
        top_ids, top_logp = target.token_top_logprobs(ids[None], k)
        top_ids, top_logp = top_ids[0, n_prompt:].contiguous(), top_logp[0, n_prompt:].contiguous()
        feats[str(r)] = f.contiguous()
        top[f"{r}.ids"], top[f"{r}.logp"] = top_ids, top_logp
        kept[r] = (f, top_ids, top_logp)
    save_file(feats, str(path / features_file(layers)))
    save_file(top, str(path / top_logprobs_file(k)))
    return kept


def layouts(rows, max_length: int) -> dict[int, RowLayout]:
    return {
        r: RowLayout(len(ids), p, min(len(ids), max_length), token_fingerprint(ids.tolist()))
        for r, (ids, p) in rows.items()
    }


def dataset_rows(rows) -> list[dict]:
    """The rows as the regenerated dataset holds them (the Collator's input)."""
    return [
        {
            "input_ids": ids.tolist(),
            "loss_mask": [0] * p + [1] * (len(ids) - p),
            "n_prompt_tokens": p,
            "prompt_index": r,
        }
        for r, (ids, p) in rows.items()
    ]
