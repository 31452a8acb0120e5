"""The draft vocabulary: the tokens the drafter's LM head scores while decoding.

Shape legend: K drafter positions, V the target's vocabulary, S the draft vocabulary's size.

Why: on a CPU, one decoding round streams the target's LM head twice, once for the drafter's K
rows and once for the tree's rows, and each pass reads the whole (V, H) weight from memory
(49152 x 576 fp32 = 113 MB for SmolLM2; docs/notebook/2026-12-01-lm-head-layout-and-speed.md).
The target's pass must score every token (the verifiers are exact), the drafter's need not: a
self-distilled answer uses few distinct tokens, so the drafter's head restricted to the S most
frequent answer tokens reads S / V of the weight. Tokens outside the draft vocabulary get
``q = 0`` (the copy branch still proposes them, since it mixes its tokens in after the head), so
decoding stays lossless and only the tree's proposals change. The idea of a frequency-ranked
draft head follows FR-Spec (Zhao et al., 2025, arXiv 2502.14856).

**The file.** ``draft_vocab.json`` in a drafter folder, written by ``fit`` from the training
answers (loss-masked tokens of the regenerated rows), never from evaluation prompts:
``{"ids": [...], "counts": [...], "rows": R, "tokens": N, "source": "..."}`` with ``ids`` every
answer token in decreasing frequency (ties: lower id first). :func:`draft_vocabulary` takes the
first S of them, fills up with the lowest unseen ids when fewer were seen, and always adds the
target's stop tokens. ``python -m exittrain.cpu_decode.draft_vocab CACHE_ENTRY DRAFTER_DIR``
writes the file for a drafter trained before ``fit`` wrote it.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from exittrain.atomic import atomic_open

__all__ = [
    "FILE_NAME",
    "count_answer_tokens",
    "draft_vocabulary",
    "load_draft_vocabulary",
    "load_token_counts",
    "save_token_counts",
]

FILE_NAME = "draft_vocab.json"


def count_answer_tokens(rows: Iterable[tuple[Sequence[int], Sequence[int]]]) -> dict:
    """The ``draft_vocab.json`` record of ``(input_ids, loss_mask)`` rows: answer tokens by frequency."""
    counts: Counter[int] = Counter()
    n_rows = 0
    for ids, mask in rows:
        if len(ids) != len(mask):
            raise ValueError(f"row {n_rows}: input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
        counts.update(int(t) for t, m in zip(ids, mask) if m)
        n_rows += 1
    if not counts:
        raise ValueError(f"no answer token in {n_rows} rows (every loss_mask is 0): nothing to rank")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return {"ids": [t for t, _ in ranked], "counts": [c for _, c in ranked], "rows": n_rows,
            "tokens": sum(counts.values())}


def save_token_counts(folder: str | Path, record: dict, source: str) -> Path:
    path = Path(folder) / FILE_NAME
    with atomic_open(path, "w") as f:
        json.dump({**record, "source": source}, f)
    return path


def load_token_counts(folder: str | Path) -> dict | None:
    """The folder's ``draft_vocab.json`` record, or None when it has none."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        ids = [int(t) for t in record["ids"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a draft vocabulary ({err}); delete it or rewrite it with "
                         "python -m exittrain.cpu_decode.draft_vocab") from err
    return {**record, "ids": ids}


def draft_vocabulary(record: dict, size: int, vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """(S,) sorted long ids: the ``size`` most frequent answer tokens of ``record``, the lowest unseen
    ids after them when fewer were seen, and the ``always`` ids (the stop tokens) on top."""
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be an integer in 1..{vocab_size} (the target's vocabulary), "
                         f"got {size!r}")
    ids = [t for t in record["ids"] if 0 <= t < vocab_size]
    if len(ids) != len(record["ids"]):
        raise ValueError(f"the draft vocabulary holds ids outside 0..{vocab_size - 1}: it was counted for another "
                         "target's tokenizer; rewrite it for this one")
    chosen = set(ids[:size])
    fill = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(fill))
    chosen.update(int(t) for t in always if 0 <= int(t) < vocab_size)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def load_draft_vocabulary(folder: str | Path | None, size: int, target) -> torch.Tensor | None:
    """The draft vocabulary of ``size`` tokens for ``target`` from a drafter folder's file (None for
    size 0), ready for ``SpeculativeDecoder(draft_vocab=...)``; ValueError naming the fix without one."""
    if size == 0:
        return None
    record = load_token_counts(folder) if folder else None
    if record is None:
        raise ValueError(
            f"a draft vocabulary of {size} tokens: the drafter folder {str(folder)!r} has no {FILE_NAME} (fit writes "
            "it); for a drafter trained before, run python -m exittrain.cpu_decode.draft_vocab CACHE_ENTRY DRAFTER_DIR"
        )
    return draft_vocabulary(record, size, target.vocab_size, target.eos_token_ids)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write draft_vocab.json into a drafter folder from the "
                                     "regenerated training rows it was trained on.")
    parser.add_argument("cache_entry", help="a regeneration cache entry (a datasets folder with input_ids, loss_mask)")
    parser.add_argument("drafter_dir")
    args = parser.parse_args(argv)
    import datasets

    ds = datasets.load_from_disk(args.cache_entry)
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ValueError(f"{args.cache_entry} has no column {sorted(missing)}: pass a regeneration cache entry")
    record = count_answer_tokens(zip(ds["input_ids"], ds["loss_mask"]))
    path = save_token_counts(args.drafter_dir, record, source=str(Path(args.cache_entry).resolve()))
    print(f"wrote {path}: {len(record['ids'])} distinct answer tokens in {record['rows']} rows")


if __name__ == "__main__":
    main()
