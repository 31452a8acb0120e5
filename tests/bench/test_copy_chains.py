"""bench copy: each chain rule's score is the tokens of its chain the answer goes on with."""

from __future__ import annotations

import pytest
import torch

from exittrain.bench.copy_chains import RULES, agreed, chain_scores, run, summary, to_markdown
from exittrain.core.copy_tail import copy_chain


def test_agreed_counts_the_leading_equal_tokens():
    assert agreed([1, 2, 3], [1, 2, 4, 5]) == 2
    assert agreed([], [1]) == 0 and agreed([1, 2], [1]) == 1 and agreed([9], [1]) == 0


def test_scores_prefer_the_earliest_chain_where_the_answer_restates_its_prompt():
    # prompt: 5 6 7 8 9 | answer: 5 6 1 5 6 7 8 9. At the answer's second "5 6", the latest
    # (5, 6) continues with 1 (the answer's own phrase), the earliest with 7 8 9 (the prompt).
    prompt, answer = [5, 6, 7, 8, 9], [5, 6, 1, 5, 6, 7, 8, 9]
    ids = prompt + answer
    scores = chain_scores(ids, len(prompt), length=20)
    assert set(scores) == set(RULES)
    assert all(len(v) == len(answer) for v in scores.values())
    root = len(prompt) + 4  # the answer's second 6
    i = root - (len(prompt) - 1)
    assert copy_chain(torch.tensor(ids[: root + 1]), [3, 2], 20)[:1] == [1]
    assert scores["latest"][i] == 0 and scores["earliest"][i] == 3 and scores["both"][i] == 3
    assert scores["prompt lookup"][i] == 3
    # both is the better of the two at every root
    assert all(b == max(x, y) for b, x, y in zip(scores["both"], scores["latest"], scores["earliest"]))


def test_prompt_lookup_chains_stop_at_ten_tokens():
    span = list(range(100, 130))
    ids = span + [1] + span[:2]  # the root closes the span's first 2-gram: 28 tokens follow it
    scores = chain_scores(ids + span[2:], len(ids), length=20)
    assert scores["prompt lookup"][0] == 10 and scores["earliest"][0] == 20 and scores["latest"][0] == 20


def test_summary_and_table():
    s = summary({rule: [0, 1, 5, 10] for rule in RULES})
    assert s["latest"] == {"mean": 4.0, "at_least_1": 0.75, "at_least_5": 0.5, "at_least_10": 0.25}
    table = to_markdown({"length": 20, "new_tokens": 96, "sets": [{"name": "code", "prompts": 1, "positions": 4,
                                                                   "rules": s}]})
    assert "| code | 1 | 4 | both | 4.00 | 0.75 | 0.50 | 0.25 |" in table


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="n_prompt"):
        chain_scores([1, 2], 0, 5)
    with pytest.raises(ValueError, match="--length"):
        chain_scores([1, 2], 1, 0)
    with pytest.raises(ValueError, match="--new-tokens"):
        summary({"latest": []})
    with pytest.raises(ValueError, match="--sets"):  # checked before the target loads
        run(["poetry"], 1, 0, 4, 5)
