"""Answered conversations brought from elsewhere: reading them, rendering them with the target's chat
template, and the training rows they become.

Shape legend: n a row's tokens.

**Reading** (:func:`load_conversations`, :func:`load_conversation_set`). A source of answered
conversations (``chat-json:`` or ``chat-hf:``, :mod:`exittrain.data.prompts.source_spec`) holds one
conversation per row: a list of turns under the source's column, else under ``messages``, else
under ``conversations``. A turn is OpenAI's ``{"role", "content"}`` or ShareGPT's ``{"from",
"value"}``; the roles are ``system``, ``user`` (ShareGPT ``human``) and ``assistant`` (ShareGPT
``gpt``). The last assistant turn is the answer; turns after it are dropped. A corpus source
(``corpus:NAME``) is read as one-turn conversations: the prompt its builtin prompt set gives a row,
then the row's reference answer (:func:`load_conversations`).

Like prompt sources, a row that cannot be read is counted, under the reasons of
:class:`~exittrain.data.prompts.prompt_sets.LoadStats`: ``blank_line``, ``non_utf8``, ``malformed`` (not JSON,
or not an object), ``missing_field`` (no conversation column) and ``duplicate`` (the same turns as
an earlier conversation). A row that reads but is not a conversation this module can render raises
``ValueError`` naming the source, the row and the fix: turns that are not a list of objects, a turn
with neither ``role``/``content`` nor ``from``/``value``, an unknown role, a content that is not a
string, no assistant turn, or an assistant turn before any other turn (it has no prompt).

**Rendering** (:func:`render_conversation`). The conversation is rendered as text with the target's
chat template (``tokenizer.apply_chat_template(tokenize=False)``), and every assistant turn i is
located by rendering two prefixes: turns ``[0, i)`` with the generation prompt (the text before the
turn's content) and turns ``[0, i]`` (the text through its end). Each must be a prefix of the next
rendering and of the whole conversation's; a template that renders a conversation's prefixes
otherwise (one that drops an earlier turn's reasoning, say) raises ``ValueError``. The text is cut
at those boundaries and each piece tokenized on its own (``add_special_tokens=False``): the prompt
of the answer becomes exactly the ids the target answers from (those of
:func:`~exittrain.data.generation.chat_prompt_ids` for a one-turn conversation), and each answer the
ids the target would have produced after it, with no token merged across a boundary.

**Rows** (:func:`conversation_row`): a row of :data:`exittrain.data.regen_cache.FEATURES` whose
``input_ids`` end with the answer's last end-of-turn id (the template's text after it is cut), with
``loss_mask`` 1 on every assistant turn's tokens up to and including its last EOS / end-of-turn id
(:func:`~exittrain.data.generation.eos_token_ids`), 0 elsewhere; ``n_prompt_tokens`` the tokens
before the answer's content (so earlier assistant turns lie in the masked part of the "prompt");
``finished`` whether the answer ends with such an id; ``prompt`` the first user turn's text
(:attr:`Conversation.prompt`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exittrain.data.prompts.prompt_sets import LoadStats, normalize_prompt
from exittrain.data.prompts.source_reading import read_texts, source_rows
from exittrain.data.prompts.source_spec import BUILTIN_SOURCES, CHAT_COLUMNS, CORPUS_SOURCES, PromptSource
from exittrain.data.regen_cache import make_row

__all__ = [
    "ROLES",
    "Conversation",
    "RenderedConversation",
    "conversation_row",
    "conversations_digest",
    "load_conversation_set",
    "load_conversations",
    "parse_turns",
    "render_conversation",
]

logger = logging.getLogger(__name__)

ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
"""Role names a turn may carry (OpenAI's and ShareGPT's) -> the role the chat template is given."""


@dataclass(frozen=True)
class Conversation:
    """One answered conversation: ``turns`` are ``(role, content)`` up to and including the last
    assistant turn (the answer); ``source`` and ``row`` say where it was read (for error messages)."""

    turns: tuple[tuple[str, str], ...]
    source: str
    row: int

    @property
    def where(self) -> str:
        return f"{self.source} row {self.row}"

    @property
    def prompt(self) -> str:
        """The first user turn's text (without one, the first turn's): the row's ``prompt`` and its task key."""
        return next((content for role, content in self.turns if role == "user"), self.turns[0][1])

    @property
    def key(self) -> str:
        """The identity of the turns: duplicates share it, and the cache key hashes it."""
        return json.dumps(self.turns, ensure_ascii=False)

    def asks_any(self, normalized: Collection[str]) -> bool:
        """Whether a user turn's normalized text (:func:`~exittrain.data.prompts.prompt_sets.normalize_prompt`)
        is one of ``normalized`` (the evaluation prompts' a row must not ask)."""
        return any(role == "user" and normalize_prompt(text) in normalized for role, text in self.turns)

    def messages(self, end: int | None = None) -> list[dict[str, str]]:
        """Turns ``[0, end)`` as chat-template messages."""
        return [{"role": role, "content": content} for role, content in self.turns[:end]]


def conversations_digest(conversations: Sequence[Conversation]) -> str:
    """sha256 of the conversations' turns, in order."""
    h = hashlib.sha256()
    for c in conversations:
        h.update(c.key.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def _turn(turn: Any, where: str, t: int) -> tuple[str, str]:
    if not isinstance(turn, Mapping):
        raise ValueError(f"{where}: turn {t} is a {type(turn).__name__}, not an object; fix the row")
    if "role" in turn:
        role, content, keys = turn["role"], turn.get("content"), ("role", "content")
    elif "from" in turn:
        role, content, keys = turn["from"], turn.get("value"), ("from", "value")
    else:
        raise ValueError(
            f"{where}: turn {t} has neither 'role'/'content' (OpenAI messages) nor 'from'/'value' (ShareGPT) "
            f"(keys: {sorted(turn)}); fix the row or convert the file to one of these shapes"
        )
    if role not in ROLES:
        raise ValueError(
            f"{where}: turn {t} has the unknown role {role!r}; use one of {sorted(ROLES)}, or drop the turn "
            "(tool and function turns cannot be rendered here)"
        )
    if not isinstance(content, str):
        raise ValueError(
            f"{where}: turn {t} ({role}) has a {keys[1]!r} of type {type(content).__name__}, not a string; "
            "flatten it to text (a list of content parts, or a tool call, is not rendered here)"
        )
    return ROLES[role], content


def parse_turns(turns: Any, where: str) -> tuple[tuple[str, str], ...]:
    """The ``(role, content)`` turns of a conversation up to its last assistant turn (module docstring).

    ``where`` names the source and row in the ValueError of a conversation that cannot be rendered."""
    if not isinstance(turns, list | tuple):
        raise ValueError(f"{where}: the conversation is a {type(turns).__name__}, not a list of turns; fix the row")
    parsed = [_turn(turn, where, t) for t, turn in enumerate(turns)]
    last = max((t for t, (role, _) in enumerate(parsed) if role == "assistant"), default=None)
    if last is None:
        raise ValueError(
            f"{where}: the conversation has no assistant turn, so no answer to learn; drop the row, or bring "
            "prompts without answers as a prompt source (json:PATH:FIELD) for the target to answer"
        )
    if parsed[0][0] == "assistant":
        raise ValueError(
            f"{where}: the conversation starts with an assistant turn, which has no prompt; drop that turn "
            "or start the conversation with a system or user turn"
        )
    return tuple(parsed[: last + 1])


def _chat_conversations(src: PromptSource, stats: LoadStats) -> list[Conversation]:
    """The conversations of a ``chat-json:`` / ``chat-hf:`` source (module docstring), rejections counted."""
    rows, column = source_rows(src)
    columns = (column,) if column else CHAT_COLUMNS
    conversations: list[Conversation] = []
    seen: set[str] = set()
    first_keys: list[str] | None = None
    for row_no, row in stats.mapping_rows(rows):
        if first_keys is None:
            first_keys = list(row)
        name = next((c for c in columns if c in row), None)
        if name is None:
            stats.reject("missing_field", row_no)
            continue
        conv = Conversation(parse_turns(row[name], f"{src} row {row_no}"), str(src), row_no)
        if conv.key in seen:
            stats.reject("duplicate", row_no)
            continue
        seen.add(conv.key)
        conversations.append(conv)
    if not conversations and stats.rows and stats.rejected["missing_field"] == stats.rows:
        raise ValueError(
            f"{src}: no row has a conversation column {list(columns)} (first row's keys: {first_keys}); name "
            "the column that holds the turns, e.g. chat-json:PATH:COLUMN"
        )
    return conversations


def _corpus_conversations(src: PromptSource, stats: LoadStats) -> list[Conversation]:
    """The rows of a ``corpus:`` source as one-turn conversations: the prompt its builtin prompt set gives a
    row, then the row's reference answer (:data:`~exittrain.data.prompts.source_spec.CORPUS_SOURCES`).

    Rows are cleaned as :func:`~exittrain.data.prompts.prompt_sets.load_prompts` cleans that prompt set
    (``missing_field``, ``not_string``, ``non_utf8``, ``empty`` for a prompt or an answer; ``duplicate``
    for a prompt whose normalized text an earlier row had), so a corpus keeps the rows its prompt set
    keeps, and each row of a task set is keyed ``"<task set>:<row>"`` in ``stats.task_keys``, as the
    prompt set keys it."""
    corpus = CORPUS_SOURCES[src.path]
    task_set = BUILTIN_SOURCES[corpus.prompt_set].task_set
    rows, fld = source_rows(src)
    conversations: list[Conversation] = []
    seen: set[str] = set()
    for row_no, row in stats.mapping_rows(rows):
        got = read_texts(row, (fld, corpus.answer))
        if isinstance(got, str):  # a rejection reason
            stats.reject(got, row_no)
            continue
        prompt, answer = got
        key = normalize_prompt(prompt)
        if key in seen:
            stats.reject("duplicate", row_no)
            continue
        seen.add(key)
        conversations.append(Conversation((("user", prompt), ("assistant", answer)), str(src), row_no))
        if task_set is not None:
            stats.task_keys[prompt] = f"{task_set}:{row_no}"
    return conversations


def load_conversations(source: str | PromptSource | Mapping[str, Any]) -> tuple[list[Conversation], LoadStats]:
    """Read one source of answered conversations or corpus rows (module docstring), then keep ``limit`` of
    them (a seeded sample, in file order; for ``corpus:gsm_symbolic`` the limit is the problems generated).

    Returns ``(conversations, stats)``. Raises ValueError for a prompt source, a missing file or
    column, a row that is not a conversation (naming it), or a source that yields none."""
    src = PromptSource.parse(source)
    if not src.answered:
        raise ValueError(
            f"{src} is a prompt source, not one of answered conversations; use chat-json:PATH[:COLUMN], "
            "chat-hf:REPO:SPLIT[:COLUMN] or corpus:NAME (exittrain.data.prompts.source_spec)"
        )
    stats = LoadStats(source=str(src))
    conversations = _corpus_conversations(src, stats) if src.kind == "corpus" else _chat_conversations(src, stats)
    if not conversations:
        raise ValueError(f"{src} yielded no conversation: {stats.summary()}; fix the file")
    generated = src.kind == "corpus" and CORPUS_SOURCES[src.path].prompt_set == "gsm_symbolic"
    if src.limit is not None and len(conversations) > src.limit and not generated:
        keep = sorted(random.Random(src.seed).sample(range(len(conversations)), src.limit))
        stats.dropped_by_limit = len(conversations) - src.limit
        conversations = [conversations[i] for i in keep]
        stats.task_keys = {c.prompt: stats.task_keys[c.prompt] for c in conversations if c.prompt in stats.task_keys}
    stats.kept = len(conversations)
    log = logger.warning if stats.n_rejected - stats.rejected["duplicate"] else logger.info
    log("conversation source %s", stats.summary())
    return conversations, stats


def load_conversation_set(
    sources: Sequence[str | PromptSource | Mapping[str, Any]],
) -> tuple[list[Conversation], list[LoadStats], int]:
    """Several sources of answered conversations, concatenated in order. Returns ``(conversations,
    per-source stats, number dropped because an earlier source had the same turns)``."""
    if not sources:
        raise ValueError("empty list of conversation sources; give at least one chat-json: or chat-hf: spec")
    conversations: list[Conversation] = []
    all_stats: list[LoadStats] = []
    seen: set[str] = set()
    repeats = 0
    for source in sources:
        got, stats = load_conversations(source)
        all_stats.append(stats)
        for conv in got:
            if conv.key in seen:
                repeats += 1
                continue
            seen.add(conv.key)
            conversations.append(conv)
    if repeats:
        logger.info("%d conversations repeated an earlier source and were dropped", repeats)
    return conversations, all_stats, repeats


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RenderedConversation:
    """A conversation as token ids: ``input_ids`` (n,), ``loss_mask`` (n,) 1 on the assistant turns'
    tokens, ``n_prompt_tokens`` before the answer's content, ``finished`` (the answer ends with an
    EOS / end-of-turn id)."""

    input_ids: list[int]
    loss_mask: list[int]
    n_prompt_tokens: int
    finished: bool


def _render(tokenizer: Any, conv: Conversation, end: int, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            conv.messages(end), tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as e:  # jinja's TemplateError and the template's own raise_exception: name the row
        raise ValueError(
            f"{conv.where}: the target's chat template cannot render turns [0, {end}) ({e}); fix the conversation "
            "(e.g. the role order the template requires) or drop the row"
        ) from e


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _through_last_eos(ids: list[int], eos: set[int]) -> int:
    """How many of ``ids`` to keep so that they end with their last EOS id; all of them without one."""
    return next((j + 1 for j in range(len(ids) - 1, -1, -1) if ids[j] in eos), len(ids))


def render_conversation(tokenizer: Any, conv: Conversation, eos_ids: Sequence[int]) -> RenderedConversation:
    """The token ids and loss mask of ``conv`` under ``tokenizer``'s chat template (module docstring).

    Raises ValueError, naming the source and row, when the tokenizer has no chat template, the
    template fails on the conversation, or it does not render the conversation's prefixes as
    prefixes of the whole."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{conv.where}: tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no "
            "chat template to render conversations with; use an instruct/chat target or set tokenizer.chat_template"
        )
    full = _render(tokenizer, conv, len(conv.turns), False)
    spans: list[tuple[int, int]] = []  # (start, end) in characters of `full`, one per assistant turn
    for i, (role, _) in enumerate(conv.turns):
        if role != "assistant":
            continue
        before = _render(tokenizer, conv, i, True)
        through = _render(tokenizer, conv, i + 1, False)
        if not (through.startswith(before) and full.startswith(through)) or (spans and len(before) < spans[-1][1]):
            raise ValueError(
                f"{conv.where}: the target's chat template does not render this conversation prefix-consistently "
                f"(turns [0, {i}) with the generation prompt, then turn {i}, are not a prefix of the whole), so the "
                "assistant turns cannot be located; keep only the turns up to the first assistant turn, or render the "
                "conversations with a template that keeps earlier turns as they are"
            )
        spans.append((len(before), len(through)))
    eos = {int(x) for x in eos_ids}
    input_ids: list[int] = []
    loss_mask: list[int] = []
    pos = 0
    for k, (start, end) in enumerate(spans):
        head = _ids(tokenizer, full[pos:start])
        input_ids += head
        loss_mask += [0] * len(head)
        n_prompt = len(input_ids)
        turn = _ids(tokenizer, full[start:end])
        keep = _through_last_eos(turn, eos)
        if k == len(spans) - 1:
            turn = turn[:keep]  # the answer ends with its end-of-turn id, like the target's own answers
        input_ids += turn
        loss_mask += [1] * keep + [0] * (len(turn) - keep)  # the template's text after the end-of-turn id
        pos = end
    finished = bool(input_ids) and input_ids[-1] in eos
    return RenderedConversation(input_ids, loss_mask, n_prompt, finished)


def conversation_row(
    prompt_index: int, conv: Conversation, rendered: RenderedConversation, tokenizer: Any
) -> dict[str, Any]:
    """The cache row of a rendered conversation (:func:`~exittrain.data.regen_cache.make_row`, with the
    loss mask over every assistant turn)."""
    p = rendered.n_prompt_tokens
    row = make_row(
        prompt_index, conv.prompt, rendered.input_ids[:p], rendered.input_ids[p:], rendered.finished, tokenizer
    )
    row["loss_mask"] = list(rendered.loss_mask)
    return row
