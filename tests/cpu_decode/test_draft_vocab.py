"""The draft vocabulary: answer tokens ranked by frequency, the chosen ids, the file and its
command, and decoding with it stays greedy's."""

from __future__ import annotations

import json

import pytest
import torch

from exittrain.cpu_decode import draft_vocab as dv
from exittrain.decoding import SpeculativeDecoder
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target


def test_answer_tokens_are_ranked_by_frequency_and_only_the_answer_counts():
    rows = [([1, 2, 3, 3, 9], [0, 0, 1, 1, 1]), ([2, 9, 7, 7], [0, 1, 1, 1])]
    record = dv.count_answer_tokens(rows)
    assert record["ids"] == [3, 7, 9] and record["counts"] == [2, 2, 2]  # ties: lower id first
    assert record["rows"] == 2 and record["tokens"] == 6
    rows = [([4, 4, 4, 5, 6, 6], [1, 1, 1, 1, 1, 1])]
    assert dv.count_answer_tokens(rows)["ids"] == [4, 6, 5]
    with pytest.raises(ValueError, match="row 0"):
        dv.count_answer_tokens([([1, 2], [1])])
    with pytest.raises(ValueError, match="no answer token"):
        dv.count_answer_tokens([([1, 2], [0, 0])])


def test_vocabulary_takes_the_most_frequent_fills_up_and_keeps_the_stop_tokens():
    record = {"ids": [9, 4, 7, 1]}
    assert dv.draft_vocabulary(record, 2, 12).tolist() == [4, 9]
    assert dv.draft_vocabulary(record, 2, 12, always=[11]).tolist() == [4, 9, 11]
    assert dv.draft_vocabulary(record, 6, 12).tolist() == [0, 1, 2, 4, 7, 9]  # lowest unseen ids fill up
    with pytest.raises(ValueError, match="1..12"):
        dv.draft_vocabulary(record, 0, 12)
    with pytest.raises(ValueError, match="another target"):
        dv.draft_vocabulary({"ids": [3, 40]}, 2, 12)


def test_file_round_trip_and_a_broken_file(tmp_path):
    record = dv.count_answer_tokens([([5, 5, 6], [1, 1, 1])])
    path = dv.save_token_counts(tmp_path, record, source="rows")
    assert path.name == dv.FILE_NAME
    loaded = dv.load_token_counts(tmp_path)
    assert loaded["ids"] == [5, 6] and loaded["source"] == "rows"
    assert dv.load_token_counts(tmp_path / "elsewhere") is None
    path.write_text(json.dumps({"counts": [1]}))
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        dv.load_token_counts(tmp_path)


def test_command_writes_the_file_from_a_cache_entry(tmp_path, capsys):
    import datasets

    entry = tmp_path / "entry"
    datasets.Dataset.from_dict({"input_ids": [[1, 8, 8], [2, 3]], "loss_mask": [[0, 1, 1], [0, 1]]}).save_to_disk(entry)
    dv.main([str(entry), str(tmp_path / "drafter")])
    assert dv.load_token_counts(tmp_path / "drafter")["ids"] == [8, 3]
    assert "2 distinct answer tokens in 2 rows" in capsys.readouterr().out
    bad = tmp_path / "bad"
    datasets.Dataset.from_dict({"text": ["x"]}).save_to_disk(bad)
    with pytest.raises(ValueError, match="loss_mask"):
        dv.main([str(bad), str(tmp_path / "drafter")])


def test_a_drafter_folder_gives_the_decoder_its_vocabulary(tmp_path):
    target = tiny_target("llama")
    assert dv.load_draft_vocabulary(None, 0, target) is None
    with pytest.raises(ValueError, match="no draft_vocab.json"):
        dv.load_draft_vocabulary(tmp_path, 8, target)
    dv.save_token_counts(tmp_path, dv.count_answer_tokens([([7, 7, 3, 9], [1, 1, 1, 1])]), source="rows")
    vocab = dv.load_draft_vocabulary(tmp_path, 5, target)
    # 7, 3, 9 by frequency, the lowest unseen ids after them, and the stop tokens
    assert {0, 1, 3, 7, 9} <= set(vocab.tolist()) and set(target.eos_token_ids) <= set(vocab.tolist())
    assert vocab.tolist() == sorted(vocab.tolist())


@pytest.fixture(scope="module")
def target():
    t = tiny_target("llama", seed=3)
    t.eos_token_ids = []  # decode the full length
    return t


@pytest.mark.parametrize("verifier", ["tev", "greedy", "sequential"])
@pytest.mark.parametrize("cached", [True, False])
def test_decoding_with_a_draft_vocabulary_equals_greedy(target, verifier, cached):
    from tests.decoding.test_speculative import REPEATING, hf_greedy

    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0, copy_ngrams=[2, 1])
    vocab = torch.arange(0, target.vocab_size, 3)
    decoder = SpeculativeDecoder(target, drafter, budget=4, verifier=verifier, drafter_cache=cached,
                                 draft_vocab=vocab, copy_tail=3)
    assert decoder.generate(REPEATING, 25, seed=0).tokens == hf_greedy(target, REPEATING, 25)


def test_bad_draft_vocabularies(target):
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0)
    for bad in (torch.tensor([1, 2]), torch.tensor([1, 1, 2, 3]), torch.tensor([0, 1, 2, 64]),
                torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([[0, 1, 2, 3]])):
        with pytest.raises(ValueError, match="draft_vocab"):
            SpeculativeDecoder(target, drafter, budget=4, draft_vocab=bad)
    decoder = SpeculativeDecoder(target, drafter, budget=2, draft_vocab=torch.tensor([9, 3, 5]))
    assert decoder.draft_vocab.tolist() == [3, 5, 9]
