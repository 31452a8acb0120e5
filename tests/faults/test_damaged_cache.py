"""A damaged cache is refused on load, naming the entry, the file and how to regenerate it: a changed
byte (checksums), a file cut short, a token id outside the target's vocabulary, a damaged batch shard."""

from __future__ import annotations

import struct

import datasets
import pytest
import torch

from exittrain.data.cache_integrity import CHECKSUM_FILE, verify_entry, write_checksums
from exittrain.data.regen_cache import FEATURES, features_file, read_batch_record, safetensors_files, save_atomic

VOCAB = 64


def _rows(n: int = 6) -> list[dict]:
    rows = []
    for i in range(n):
        ids = [(7 * i + j) % VOCAB for j in range(5 + i)]
        rows.append({"prompt_index": i, "prompt": f"p{i}", "response": "r", "input_ids": ids,
                     "loss_mask": [0, 0] + [1] * (len(ids) - 2), "n_prompt_tokens": 2,
                     "n_response_tokens": len(ids) - 2, "finished": True})
    return rows


def _entry(folder, rows=None):
    rows = rows or _rows()
    features = {r["prompt_index"]: torch.full((len(r["input_ids"]), 4), 0.5, dtype=torch.bfloat16) for r in rows}
    save_atomic(datasets.Dataset.from_list(rows, features=FEATURES), folder, {"rows": len(rows)},
                tensor_files=safetensors_files(features, [1], None, 0))
    return folder


def _replace_token(file, row: list[int], at: int, new: int) -> None:
    """Write ``new`` over token ``at`` of ``row`` in the Arrow file's bytes (int32, little-endian)."""
    raw = bytearray(file.read_bytes())
    where = raw.find(struct.pack(f"<{len(row)}i", *row))
    assert where >= 0, "the row's ids lie in the file as written"
    raw[where + 4 * at : where + 4 * at + 4] = struct.pack("<i", new)
    file.write_bytes(bytes(raw))


def test_an_intact_entry_passes_and_each_damage_is_named_with_the_fix(tmp_path):
    entry = _entry(tmp_path / "tiny-0123")
    verify_entry(entry, vocab_size=VOCAB)  # the negative control: as written, it loads
    arrow = next(entry.glob("data-*.arrow"))
    # a token id of row 5 changed in place, still inside the vocabulary: a run would train on a wrong row
    row = _rows()[5]["input_ids"]
    _replace_token(arrow, row, 2, 12)
    changed = datasets.load_from_disk(str(entry))["input_ids"][5]
    assert changed[2] == 12 != row[2] and max(changed) < VOCAB
    with pytest.raises(ValueError) as err:
        verify_entry(entry, vocab_size=VOCAB)
    text = str(err.value)
    assert str(entry) in text and arrow.name in text and "does not match the checksum" in text
    assert f"delete the cache entry folder {entry}" in text and "regenerates it" in text

    entry = _entry(tmp_path / "tiny-4567")
    features = entry / features_file([1])
    features.write_bytes(features.read_bytes()[:-64])  # a copy cut short
    with pytest.raises(ValueError, match=rf"{features.name} holds \d+ bytes, \d+ when written .*delete the cache"):
        verify_entry(entry)
    (entry / CHECKSUM_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="checksum list .* is damaged"):
        verify_entry(entry)


def test_a_token_id_outside_the_vocabulary_is_refused_naming_the_row(tmp_path, caplog):
    rows = _rows()
    rows[3]["input_ids"][2] = VOCAB + 5  # an entry of another target, or damage its checksums were sealed over
    entry = _entry(tmp_path / "tiny-89ab", rows)
    verify_entry(entry)  # no vocabulary given: the checksums alone, which hold
    with pytest.raises(ValueError) as err:
        verify_entry(entry, vocab_size=VOCAB)
    text = str(err.value)
    assert f"token id {VOCAB + 5}" in text and "prompt_index 3" in text and f"[0, {VOCAB})" in text
    assert "data-00000-of-00001.arrow" in text and f"delete the cache entry folder {entry}" in text

    (entry / CHECKSUM_FILE).unlink()  # an entry written before checksums: read with a warning, range still checked
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        verify_entry(entry, vocab_size=VOCAB)
    assert "has no exittrain_checksums.json" in caplog.text


def test_a_damaged_batch_shard_is_refused_before_it_is_merged(tmp_path):
    (tmp_path / "tiny-cdef.partial").mkdir()
    shard = _entry(tmp_path / "tiny-cdef.partial" / "shard_00001")
    read_batch_record(shard)  # intact: read
    _replace_token(next(shard.glob("data-*.arrow")), _rows()[1]["input_ids"], 0, 9)
    with pytest.raises(ValueError) as err:
        read_batch_record(shard)
    assert f"batch shard {shard}" in str(err.value) and f"delete {shard}" in str(err.value)
    write_checksums(shard)  # sealed again (as if written so): the shard reads
    read_batch_record(shard)
