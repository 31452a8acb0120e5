"""Answered conversations: the spec kinds, each file shape, counted and refused rows, and the
rendering of turns into token ids and a loss mask with the embedded SmolLM2 chat template."""

from __future__ import annotations

import gzip
import json

import pytest

from exittrain.data import chat_prompt_ids
from exittrain.data.conversations import (
    Conversation,
    conversation_row,
    load_conversation_set,
    load_conversations,
    render_conversation,
)
from exittrain.data.prompts.prompt_plan import PromptPlan, answered_sources
from exittrain.data.prompts.prompt_sets import load_prompts
from exittrain.data.prompts.source_spec import PromptSource
from exittrain.data.regen_cache import FEATURES

OPENAI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
]
SHAREGPT = [
    {"from": "human", "value": "Name a colour."},
    {"from": "gpt", "value": "Blue."},
    {"from": "human", "value": "Another?"},
    {"from": "gpt", "value": "Red."},
    {"from": "human", "value": "A trailing question is dropped."},
]
EOS = [2]  # SmolLM2's <|im_end|>


def _jsonl(path, rows, *, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


# ----------------------------------------------------------------------------------------------
# the spec


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("chat-json:/d/x.jsonl", PromptSource("chat-json", "/d/x.jsonl")),
        ("chat-jsonl:/d/x.jsonl:turns", PromptSource("chat-json", "/d/x.jsonl", field="turns")),
        ("chat-json:rel/x.json.gz?limit=5&seed=2", PromptSource("chat-json", "rel/x.json.gz", limit=5, seed=2)),
        ("chat-hf:HuggingFaceH4/ultrachat_200k:train_sft", PromptSource("chat-hf", "HuggingFaceH4/ultrachat_200k",
                                                                         split="train_sft")),
        ("chat-hf:org/set:train:messages", PromptSource("chat-hf", "org/set", split="train", field="messages")),
        ("chat-hf:org/set:cfg:train:conv", PromptSource("chat-hf", "org/set", name="cfg", split="train", field="conv")),
    ],
)
def test_chat_specs_parse_and_round_trip(spec, expected):
    src = PromptSource.parse(spec)
    assert src == expected and src.answered
    assert PromptSource.parse(str(src)) == src
    assert not PromptSource.parse("json:/d/x.jsonl:text").answered
    assert PromptSource("json", "x.jsonl").field == "prompt", "prompt kinds keep their default field"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("chat-hf:repo", "must be chat-hf:REPO:SPLIT"),
        ("chat-hf:a:b:c:d:e", "must be chat-hf:REPO:SPLIT"),
        ({"kind": "chat-hf", "path": "r", "name": "cfg"}, "needs its column"),
        ({"kind": "chat-json", "path": "x.jsonl", "field": "a.b"}, "must be a top-level key"),
    ],
)
def test_bad_chat_specs_name_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        PromptSource.parse(spec)


def test_conversations_are_training_data_only(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": OPENAI}])
    with pytest.raises(ValueError, match="answered rows, not of prompts"):
        load_prompts(f"chat-json:{path}")
    with pytest.raises(ValueError, match="is a prompt source"):
        load_conversations(f"json:{path}:text")
    assert answered_sources([f"chat-json:{path}"]) and not answered_sources(None)
    with pytest.raises(ValueError, match="mixes answered conversations .* with prompt sources"):
        PromptPlan("custom", train_sources=[f"chat-json:{path}", f"json:{path}:text"], eval_sources=["pkg:mt_bench"])


# ----------------------------------------------------------------------------------------------
# reading


def test_each_file_shape_reads_the_same_turns(tmp_path):
    expected = (("system", "Be brief."), ("user", "Name a prime."), ("assistant", "Seven."))
    shapes = {
        "messages": _jsonl(tmp_path / "m.jsonl", [{"messages": OPENAI, "id": 1}]),
        "conversations": _jsonl(tmp_path / "c.jsonl", [{"conversations": OPENAI}]),
        "column": _jsonl(tmp_path / "k.jsonl", [{"dialogue": OPENAI}]),
    }
    gz = tmp_path / "a.json.gz"
    with gzip.open(gz, "wt") as f:
        json.dump([{"messages": OPENAI}], f)
    specs = [f"chat-json:{shapes['messages']}", f"chat-json:{shapes['conversations']}",
             f"chat-json:{shapes['column']}:dialogue", f"chat-json:{gz}"]
    for spec in specs:
        convs, stats = load_conversations(spec)
        assert [c.turns for c in convs] == [expected], spec
        assert (stats.rows, stats.kept) == (1, 1)
    sharegpt, _ = load_conversations(f"chat-json:{_jsonl(tmp_path / 's.jsonl', [{'conversations': SHAREGPT}])}")
    assert sharegpt[0].turns == (("user", "Name a colour."), ("assistant", "Blue."), ("user", "Another?"),
                                 ("assistant", "Red.")), "roles mapped, the turn after the last answer dropped"
    assert sharegpt[0].prompt == "Name a colour." and convs[0].prompt == "Name a prime."


def test_unreadable_rows_are_counted_and_limit_samples(tmp_path):
    rows = [{"messages": OPENAI[:2] + [{"role": "assistant", "content": f"answer {i}"}]} for i in range(6)]
    path = _jsonl(tmp_path / "c.jsonl", rows + [rows[0], {"other": 1}, [1, 2]],
                  extra_lines=["\n", "{not json\n"])
    convs, stats = load_conversations(f"chat-json:{path}")
    assert len(convs) == 6 and stats.rows == 11
    assert {k: v for k, v in stats.rejected.items() if v} == {
        "duplicate": 1, "missing_field": 1, "malformed": 2, "blank_line": 1}
    assert stats.example_rows["duplicate"] == [7] and stats.example_rows["blank_line"] == [10]
    some, stats = load_conversations(f"chat-json:{path}?limit=3&seed=1")
    assert len(some) == 3 and stats.dropped_by_limit == 3
    assert [c.row for c in some] == sorted(c.row for c in some)
    both, _, repeats = load_conversation_set([f"chat-json:{path}", f"chat-json:{path}?limit=3&seed=1"])
    assert len(both) == 6 and repeats == 3


def test_a_file_without_the_column_names_it(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"dialogue": OPENAI}])
    with pytest.raises(ValueError, match=r"no row has a conversation column \['messages', 'conversations'\].*dialogue"):
        load_conversations(f"chat-json:{path}")


@pytest.mark.parametrize(
    "turns, message",
    [
        ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}],
         r"row 2: turn 1 has the unknown role 'tool'; use one of"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
         r"row 2: turn 1 \(assistant\) has a 'content' of type NoneType, not a string; flatten it"),
        ([{"from": "human", "value": ["a", "b"]}, {"from": "gpt", "value": "y"}],
         r"row 2: turn 0 \(human\) has a 'value' of type list"),
        ([{"role": "user", "content": "only a question"}], r"row 2: the conversation has no assistant turn"),
        ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"},
          {"role": "assistant", "content": "c"}],
         r"row 2: the conversation starts with an assistant turn"),
        ([{"speaker": "user", "text": "hi"}], r"row 2: turn 0 has neither 'role'/'content'"),
        ("just text", r"row 2: the conversation is a str, not a list of turns"),
    ],
)
def test_a_row_that_is_no_conversation_raises_naming_the_file_and_row(tmp_path, turns, message):
    path = _jsonl(tmp_path / "bad.jsonl", [{"messages": OPENAI}, {"messages": turns}])
    with pytest.raises(ValueError, match=f"bad.jsonl {message}"):
        load_conversations(f"chat-json:{path}")


# ----------------------------------------------------------------------------------------------
# rendering


def _conv(turns) -> Conversation:
    return Conversation(tuple(turns), "test", 0)


def test_one_turn_renders_as_the_target_prompt_and_its_answer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = _conv([("user", "Name a prime."), ("assistant", "Seven.")])
    r = render_conversation(tok, conv, EOS)
    prompt = chat_prompt_ids(tok, "Name a prime.")
    answer = tok("Seven.", add_special_tokens=False)["input_ids"] + EOS
    assert r.input_ids == prompt + answer, "the prompt ids the target answers from, then the answer and <|im_end|>"
    assert r.n_prompt_tokens == len(prompt) and r.finished
    assert r.loss_mask == [0] * len(prompt) + [1] * len(answer)
    row = conversation_row(5, conv, r, tok)
    assert set(row) == set(FEATURES) and row["prompt_index"] == 5 and row["prompt"] == "Name a prime."
    assert row["response"] == "Seven." and row["n_response_tokens"] == len(answer)


def test_multi_turn_masks_every_assistant_turn_and_no_other_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turns = [("system", "Be brief."), ("user", "Name a colour."), ("assistant", "\nBlue, or green."),
             ("user", "Another?"), ("assistant", "Red.")]
    r = render_conversation(tok, _conv(turns), EOS)
    assert len(r.input_ids) == len(r.loss_mask)
    assert tok.decode(r.input_ids) == tok.apply_chat_template([{"role": a, "content": b} for a, b in turns],
                                                              tokenize=False).removesuffix("\n")
    spans, start = [], None  # the masked runs of tokens
    for j, m in enumerate([*r.loss_mask, 0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            spans.append((start, j))
            start = None
    assert [tok.decode(r.input_ids[a:b]) for a, b in spans] == ["\nBlue, or green.<|im_end|>", "Red.<|im_end|>"]
    # the answer starts where the last turn's content starts: the ids before it are the prompt of that turn
    assert r.n_prompt_tokens == spans[-1][0] and r.finished
    before = tok.apply_chat_template([{"role": a, "content": b} for a, b in turns[:-1]], tokenize=False,
                                     add_generation_prompt=True)
    assert tok.decode(r.input_ids[: r.n_prompt_tokens]) == before
    # the first answer's leading newline is its own token, never merged with the header's
    first = tok("\nBlue, or green.", add_special_tokens=False)["input_ids"]
    assert r.input_ids[spans[0][0]: spans[0][1]] == first + EOS


def test_an_answer_without_an_end_of_turn_id_is_unfinished(smollm2_tokenizer):
    tok = smollm2_tokenizer
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% if m.role != 'assistant' %}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    r = render_conversation(WithTemplate(tok, template), _conv([("user", "Hi"), ("assistant", "Hello")]), EOS)
    assert not r.finished and r.input_ids[r.n_prompt_tokens:] == tok("Hello", add_special_tokens=False)["input_ids"]


class WithTemplate:
    """A tokenizer with another chat template (the session's SmolLM2 tokenizer is shared: not mutated)."""

    def __init__(self, tok, template):
        self.tok, self.chat_template = tok, template

    def apply_chat_template(self, messages, **kwargs):
        return self.tok.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)


def test_a_template_that_rewrites_earlier_turns_or_fails_raises_naming_the_row(smollm2_tokenizer):
    # like a reasoning model's template that drops the thinking of every assistant turn but the last
    drops_earlier = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                     "{% if m.role == 'assistant' and not loop.last %}(earlier answer)"
                     "{% else %}{{ m.content }}{% endif %}"
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    turns = [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]
    conv = Conversation(tuple(turns), "chat-json:x.jsonl", 7)
    with pytest.raises(ValueError, match=r"chat-json:x.jsonl row 7: the target's chat template does not render this "
                                         r"conversation prefix-consistently"):
        render_conversation(WithTemplate(smollm2_tokenizer, drops_earlier), conv, EOS)
    assert render_conversation(WithTemplate(smollm2_tokenizer, drops_earlier), _conv(turns[:2]), EOS).finished
    refuses = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match=r"row 7: the target's chat template cannot render .*roles must alternate"):
        render_conversation(WithTemplate(smollm2_tokenizer, refuses), conv, EOS)
