"""Source readers: every bad row of a JSON Lines, JSON array or Parquet file is rejected and counted;
unreadable files and missing fields are errors."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exittrain.data.prompts.prompt_sets import (
    load_prompts,
)
from exittrain.data.prompts.source_spec import PromptSource


def test_jsonl_bad_rows_are_rejected_and_counted(tmp_path, caplog):
    lines = [
        json.dumps({"text": "a good prompt"}).encode(),  # 1 kept
        b'{"text": "broken json',  # 2 malformed
        json.dumps([1, 2]).encode(),  # 3 malformed (not an object)
        json.dumps({"other": "x"}).encode(),  # 4 missing_field
        json.dumps({"text": 123}).encode(),  # 5 not_string
        json.dumps({"text": "   "}).encode(),  # 6 empty
        b'{"text": "caf\xe9"}',  # 7 non_utf8 (latin-1 byte)
        json.dumps({"text": "x" * 101}).encode(),  # 8 too_long
        json.dumps({"text": "A good   prompt"}).encode(),  # 9 duplicate after normalization
        b"   ",  # 10 blank_line
        json.dumps({"text": "another good prompt"}).encode(),  # 11 kept
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    prompts, stats = load_prompts(f"jsonl:{path}:text", max_chars=100)
    assert prompts == ["a good prompt", "another good prompt"]
    assert stats.rows == 11 and stats.kept == 2
    assert stats.rejected == {
        "blank_line": 1,
        "non_utf8": 1,
        "malformed": 2,
        "missing_field": 1,
        "not_string": 1,
        "empty": 1,
        "too_long": 1,
        "duplicate": 1,
    }
    assert stats.example_rows["malformed"] == [2, 3] and stats.example_rows["non_utf8"] == [7]
    assert "malformed=2" in caplog.text  # the summary is logged


def test_gzipped_jsonl_and_json_array_and_templates(tmp_path):
    rows = [{"q": {"turns": ["first", "second"]}, "tag": "t"}, {"q": {"turns": []}, "tag": "u"}]
    gz = tmp_path / "rows.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    prompts, stats = load_prompts(f"json:{gz}:q.turns.0")
    assert prompts == ["first"] and stats.rejected["missing_field"] == 1
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(rows))
    src = PromptSource(kind="json", path=str(array), field="[{tag}] {q.turns.0}")
    prompts, stats = load_prompts(src)
    assert prompts == ["[t] first"] and stats.rows == 2


def test_parquet_bad_rows_are_rejected_and_counted(tmp_path):
    path = tmp_path / "prompts.parquet"
    texts = ["a good prompt", None, "", "y" * 101, "a GOOD prompt", "second good prompt"]
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), path)
    prompts, stats = load_prompts(f"parquet:{path}:text", max_chars=100)
    assert prompts == ["a good prompt", "second good prompt"]
    assert stats.rows == 6
    assert {k: v for k, v in stats.rejected.items() if v} == {
        "not_string": 1,
        "empty": 1,
        "too_long": 1,
        "duplicate": 1,
    }

    raw = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"text": pa.array([b"fine bytes", b"\xff\xfe bad"], type=pa.binary())}), raw)
    prompts, stats = load_prompts(f"parquet:{raw}:text")
    assert prompts == ["fine bytes"] and stats.rejected["non_utf8"] == 1


def test_parquet_missing_column_names_file_and_columns(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["q1"]}), path)
    with pytest.raises(ValueError, match=r"p\.parquet has no column 'text' \(columns: \['question'\]\)"):
        load_prompts(f"parquet:{path}:text")


def test_field_missing_everywhere_is_an_error(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "a"}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"field 'prompt' is missing from every row.*\['question'\].*fix the FIELD"):
        load_prompts(f"jsonl:{path}:prompt")


def test_no_usable_row_and_missing_file_are_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="yielded no usable prompt.*empty=1"):
        load_prompts(f"jsonl:{path}:prompt")
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(f"jsonl:{tmp_path / 'nope.jsonl'}:prompt")
    broken = tmp_path / "a.json"
    broken.write_text('[{"prompt": "x"}, ')
    with pytest.raises(ValueError, match="a.json starts with '\\[' but is not a valid"):
        load_prompts(f"json:{broken}:prompt")
