"""The per-row data the regeneration keeps beside the answers: target features and soft labels.

Shape legend: n a row's tokens after the ``max_length`` cut, F target feature width, r a row's
kept response tokens, S tokens per position of the soft labels.

A :class:`FeatureStore` serves, keyed by row id (the row's ``prompt_index``), what one cache entry
of :func:`exittrain.data.regenerate.regenerate` holds beside its dataset:

- ``features(row_id)``: the target's hidden states of ``feature_layers`` at the row's positions
  ``[0, n)``, (n, F) bf16 (``features-<layers>.safetensors``);
- ``top_logprobs(row_id)``: ``(start, ids (r, S) int32, log-probabilities (r, S) float32)``, the
  target's top-S next-token distribution of tokens ``start .. start + r - 1`` (the response: a
  prompt is never a label), ``start + r = n`` (``top-logprobs-<S>.safetensors``).

Both are cut to the training sequence (``max_length``) like the rows. The collator
(:class:`exittrain.data.collate.Collator`) puts them in every batch, so training never runs the
target over a row whose features and soft labels the regeneration kept.

Two modes (``mode``):

- ``"memory"``: every row is read at :meth:`FeatureStore.open` and copied into host memory (each
  process holds all rows: rows x n x F x 2 bytes for the features); training reads no file.
- ``"disk"``: only the files' headers are read at open; each batch reads its own rows from the
  files (safetensors slices, memory-mapped), so a process holds what its batches need and the page
  cache the rest. Each process (DataLoader workers included) opens the files itself.

Both modes check at open that every row's stored length matches its tokens (from the headers
alone on disk) and raise ``ValueError`` naming the row and the file to delete otherwise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exittrain.data.regen_cache import features_file, top_logprobs_file
from exittrain.safe_io import check_safetensors

__all__ = ["STORE_MODES", "FeatureStore", "RowLayout", "check_store_settings", "open_entry_store", "token_fingerprint"]

logger = logging.getLogger(__name__)

STORE_MODES = ("memory", "disk")
MAPPED_BYTES = 64 << 20
"""Memory mode reads at most this many bytes through one mapping of a file before closing it (see
:meth:`FeatureStore.open`): the mapped pages count as resident memory while the file is open."""


@dataclass(frozen=True)
class RowLayout:
    """A row of the cache entry: ``tokens`` stored, ``prompt`` tokens of them, ``kept`` after the ``max_length``
    cut, and optionally the :func:`token_fingerprint` of its ids, checked against every row the collator serves."""

    tokens: int
    prompt: int
    kept: int
    fingerprint: int | None = None


def token_fingerprint(ids: Sequence[int]) -> int:
    """A cheap identity of a row's token ids (the same in every process: ints hash without a random seed)."""
    return hash(tuple(int(x) for x in ids))


class FeatureStore:
    """Target features and top-k log-probabilities of one cache entry's rows (see the module docstring).

    Build it with :meth:`open`. Picklable: the ``disk`` mode drops its open files when pickled
    and each process reopens them on first use.
    """

    def __init__(
        self,
        path: Path,
        rows: Mapping[int, RowLayout],
        *,
        mode: str,
        feature_layers: list[int] | None,
        top_k: int,
        features: dict[int, torch.Tensor] | None,
        top: dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> None:
        self.path = Path(path)
        self.rows = dict(rows)
        self.mode = mode
        self.feature_layers = feature_layers  # None: no features kept
        self.top_k = top_k  # 0: no top log-probabilities kept
        self._features = features  # memory mode: row_id -> (n, F) bf16
        self._top = top  # memory mode: row_id -> (ids (r, S) int32, logp (r, S) float32)
        self._handles: dict[str, Any] = {}  # disk mode: file name -> safe_open handle of this process

    # -- building --------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        rows: Mapping[int, RowLayout],
        *,
        feature_layers: Sequence[int] | None = None,
        top_k: int = 0,
        mode: str = "memory",
    ) -> FeatureStore:
        """The store of the cache entry at ``path`` for ``rows`` (row id -> :class:`RowLayout`).

        ``feature_layers``: serve the features of these target layers when the entry holds them
        (None: none); ``top_k``: serve the top-``top_k`` log-probabilities when the entry holds
        them (0: none). What the entry lacks is simply not served (:attr:`has_features`,
        :attr:`has_top_logprobs`). A row whose stored length differs from its tokens raises ValueError.
        """
        if mode not in STORE_MODES:
            raise ValueError(f"feature_store={mode!r}: must be one of {STORE_MODES} (host memory, or read per batch)")
        path = Path(path)
        layers = [int(x) for x in feature_layers] if feature_layers else None
        if layers is not None and not (path / features_file(layers)).is_file():
            layers = None
        k = int(top_k) if top_k and (path / top_logprobs_file(top_k)).is_file() else 0
        store = cls(path, rows, mode=mode, feature_layers=layers, top_k=k, features=None, top=None)
        store._check_headers()
        if mode == "memory":
            store._read_into_memory()
        return store

    def _read_into_memory(self) -> None:
        """Memory mode: copy every row's kept part into its own memory, row by row.

        The rows are the only copy the process holds: reading the whole file first held every row
        twice while the store filled, and so do the pages of a file mapping, which count as the
        process's resident memory while mapped. So the files are closed (unmapped) after every
        :data:`MAPPED_BYTES` read, and for good at the end: training reads no file."""
        features: dict[int, torch.Tensor] | None = {} if self.has_features else None
        top: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if self.has_top_logprobs else None
        mapped = 0
        for r in self.rows:
            if features is not None:
                features[r] = self.features(r).clone()
                mapped += features[r].nbytes
            if top is not None:
                top[r] = tuple(t.clone() for t in self.top_logprobs(r)[1:])
                mapped += sum(t.nbytes for t in top[r])
            if mapped >= MAPPED_BYTES:
                self._handles, mapped = {}, 0
        self._handles = {}
        self._features, self._top = features, top

    def _check_headers(self) -> None:
        """Disk mode: every row's stored lengths, from the files' headers (no tensor data read)."""
        if self.feature_layers is not None:
            handle = self._handle(features_file(self.feature_layers))
            names = set(handle.keys())
            for r, layout in self.rows.items():
                n = handle.get_slice(str(r)).get_shape()[0] if str(r) in names else None
                _check_features(self.path, self.feature_layers, r, n, layout)
        if self.top_k:
            handle = self._handle(top_logprobs_file(self.top_k))
            names = set(handle.keys())
            for r, layout in self.rows.items():
                n = handle.get_slice(f"{r}.ids").get_shape()[0] if f"{r}.ids" in names else None
                _check_top(self.path, self.top_k, r, n, layout)

    def _handle(self, name: str):
        handle = self._handles.get(name)
        if handle is None:
            from safetensors import safe_open

            file = self.path / name
            check_safetensors(
                file, what="feature store file", fix=f"delete the cache entry folder {self.path} to regenerate it"
            )
            handle = self._handles[name] = safe_open(str(file), framework="pt")
        return handle

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"] = {}  # open files stay with their process
        return state

    # -- reading ---------------------------------------------------------------------------------

    @property
    def has_features(self) -> bool:
        return self.feature_layers is not None

    @property
    def has_top_logprobs(self) -> bool:
        return self.top_k > 0

    def __len__(self) -> int:
        return len(self.rows)

    def summary(self) -> dict[str, Any]:
        """What the store serves: ``mode``, ``feature_layers`` (None: none), ``top_logprobs`` (0: none)."""
        return {"mode": self.mode, "feature_layers": self.feature_layers, "top_logprobs": self.top_k}

    def _layout(self, row_id: int) -> RowLayout:
        layout = self.rows.get(int(row_id))
        if layout is None:
            raise ValueError(
                f"row_id {row_id} is not a row of the cache entry {self.path}; row ids are the rows' prompt_index "
                "and must come from the same regenerated dataset"
            )
        return layout

    def check_tokens(self, row_id: int, ids: Sequence[int]) -> None:
        """ValueError when ``ids`` are not the tokens of the stored row ``row_id`` (if its layout has a fingerprint)."""
        layout = self._layout(row_id)
        if layout.fingerprint is None:
            return
        if len(ids) != layout.tokens or token_fingerprint(ids) != layout.fingerprint:
            raise ValueError(
                f"row_id {row_id}: its {len(ids)} tokens are not those of the row the store keeps under that id "
                f"({self.path}); row ids must be stable and unique across the train and validation data"
            )

    def features(self, row_id: int) -> torch.Tensor:
        """(n, F) bf16 features of the row's kept tokens; ValueError without features or for an unknown row."""
        if not self.has_features:
            raise ValueError(f"the cache entry {self.path} keeps no target features for this store")
        layout = self._layout(row_id)
        if self._features is not None:
            return self._features[int(row_id)]
        return self._handle(features_file(self.feature_layers)).get_slice(str(int(row_id)))[: layout.kept]

    def top_logprobs(self, row_id: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(start, ids (r, S) int32, log-probabilities (r, S) float32)`` of the row's kept response tokens."""
        if not self.has_top_logprobs:
            raise ValueError(f"the cache entry {self.path} keeps no top log-probabilities for this store")
        layout = self._layout(row_id)
        if self._top is not None:
            ids, logp = self._top[int(row_id)]
        else:
            kept = max(0, layout.kept - layout.prompt)
            handle = self._handle(top_logprobs_file(self.top_k))
            ids = handle.get_slice(f"{int(row_id)}.ids")[:kept]
            logp = handle.get_slice(f"{int(row_id)}.logp")[:kept]
        return layout.prompt, ids, logp


def _check_features(path: Path, layers: list[int], row_id: int, n: int | None, layout: RowLayout) -> None:
    if n != layout.tokens:
        raise ValueError(
            f"{path}: stored features of row {row_id} cover {n} positions for {layout.tokens} tokens; delete "
            f"{features_file(layers)} from the entry to recompute them"
        )


def _check_top(path: Path, k: int, row_id: int, n: int | None, layout: RowLayout) -> None:
    if n != layout.tokens - layout.prompt:
        raise ValueError(
            f"{path}: stored top-{k} log-probabilities of row {row_id} cover {n} positions for "
            f"{layout.tokens - layout.prompt} response tokens; delete {top_logprobs_file(k)} from the entry "
            "(training then asks the target for them) or the entry itself to regenerate it"
        )


def check_store_settings(top_logprobs: int, feature_store: str) -> None:
    """Raise ValueError, naming the setting, for a ``top_logprobs`` that is not an int >= 0 or a
    ``feature_store`` that is not one of :data:`STORE_MODES` (the DataModule's arguments)."""
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs={top_logprobs!r} must be an int >= 0 (0 keeps none)")
    if feature_store not in STORE_MODES:
        raise ValueError(
            f"feature_store={feature_store!r}: must be one of {STORE_MODES} (host memory, or read per batch "
            "from the cache entry)"
        )


def open_entry_store(
    path: Path,
    rows: Iterable[tuple[int, Sequence[int], int]],
    *,
    max_length: int,
    feature_layers: Sequence[int] | None,
    top_k: int,
    mode: str,
) -> FeatureStore | None:
    """The :class:`FeatureStore` of the cache entry at ``path`` for ``rows`` (``(prompt_index, input_ids,
    n_prompt_tokens)`` of every row a run reads, cut at ``max_length``); None when neither
    ``feature_layers`` nor ``top_k`` asks for one. Warns about what the entry lacks (training then computes it)."""
    if not feature_layers and not top_k:
        return None
    layouts = {
        int(r): RowLayout(len(ids), int(p), min(len(ids), max_length), token_fingerprint(ids)) for r, ids, p in rows
    }
    store = FeatureStore.open(path, layouts, feature_layers=feature_layers, top_k=top_k, mode=mode)
    if feature_layers and not store.has_features:
        logger.warning(
            "the cache entry %s keeps no target features of layers %s (written without them): training computes "
            "them every step; delete the entry to regenerate it with them",
            path,
            feature_layers,
        )
    if top_k and not store.has_top_logprobs:
        logger.warning(
            "the cache entry %s keeps no top-%d log-probabilities: training asks the target for the soft labels "
            "every step; delete the entry to regenerate it with them",
            path,
            top_k,
        )
    logger.info(
        "feature store (%s): %d rows, features of layers %s, top-%d log-probabilities (%s)",
        store.mode,
        len(store),
        store.feature_layers,
        store.top_k,
        path,
    )
    return store
