"""Corpus rows (exittrain/data/corpus.py): text the packages ship with its reference answer, labelled by one
teacher-forced target pass. Each data path is checked where it can go wrong: the row's ids are the chat
prompt followed by the reference answer, the loss mask covers exactly the answer, the stored top-k
log-probabilities are a direct target forward's, the held-out tasks never reach a training row, and a
run that mixes corpus rows with the target's own answers trains on both kinds, each served from its own
entry."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from exittrain.data.conversations import conversation_row, load_conversations, render_conversation
from exittrain.data.corpus import CorpusPlan, check_corpus_settings
from exittrain.data.datamodule import ExitTrainDataModule
from exittrain.data.generation import GenerationConfig, chat_prompt_ids, eos_token_ids
from exittrain.data.prompts.prompt_plan import PromptPlan
from exittrain.data.prompts.prompt_sets import load_prompts
from exittrain.data.prompts.source_spec import PromptSource
from exittrain.data.regen_cache import read_meta
from exittrain.data.teacher_forced import teacher_forced_reference
from tests.data.helpers import CountingTarget, tiny_llama

TOP_K = 4
LAYERS = [0, 1]
GEN = GenerationConfig(max_new_tokens=6, batch_size=8)


@pytest.fixture()
def tiny(smollm2_tokenizer):
    model = tiny_llama(smollm2_tokenizer, seed=0)
    return CountingTarget(model, smollm2_tokenizer)


def _direct_top(model, ids: list[int], start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k next-token log-probabilities of tokens ``start..`` of ``ids`` from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    values, top = torch.log_softmax(logits[start - 1 : len(ids) - 1], -1).topk(k, -1)
    return top, values


# -- the spec ------------------------------------------------------------------------------------


def test_corpus_spec_round_trips_and_bad_specs_name_the_fix():
    src = PromptSource.parse("corpus:gsm_symbolic?limit=20&seed=3")
    assert src.answered and (src.kind, src.path, src.limit, src.seed) == ("corpus", "gsm_symbolic", 20, 3)
    assert PromptSource.parse(str(src)) == src
    with pytest.raises(ValueError, match="unknown corpus corpus:mbpp; the corpora are"):
        PromptSource.parse("corpus:mbpp")
    with pytest.raises(ValueError, match="takes no field"):
        PromptSource(kind="corpus", path="codeio", field="x")
    with pytest.raises(ValueError, match="corpus_sources: pkg:codeio is a prompt source"):
        check_corpus_settings(["pkg:codeio"], None)
    with pytest.raises(ValueError, match="max_corpus_rows=0 must be a positive integer"):
        check_corpus_settings(["corpus:codeio"], 0)
    with pytest.raises(ValueError, match="without corpus_sources"):
        check_corpus_settings(None, 5)
    with pytest.raises(ValueError, match="data.corpus_sources"):
        load_prompts("corpus:codeio")  # a corpus is never a prompt source


# -- rows: ids, loss mask, task keys -----------------------------------------------------------------


@pytest.mark.parametrize("spec", ["corpus:codeio?limit=3&seed=1", "corpus:gsm_symbolic?limit=3&seed=1"])
def test_a_corpus_row_is_the_chat_prompt_then_the_reference_answer_with_the_mask_on_the_answer(
    spec, smollm2_tokenizer
):
    tok = smollm2_tokenizer
    eos = eos_token_ids(None, tok)  # the tokenizer's EOS: SmolLM2's end of turn
    conversations, stats = load_conversations(spec)
    assert len(conversations) == 3 and stats.kept == 3
    for conv in conversations:
        prompt, answer = conv.turns[0][1], conv.turns[1][1]
        row = conversation_row(0, conv, render_conversation(tok, conv, eos), tok)
        p = row["n_prompt_tokens"]
        # the prompt is exactly what the target answers from; the rest is the reference answer and its end of turn
        assert row["input_ids"][:p] == chat_prompt_ids(tok, prompt)
        assert tok.decode(row["input_ids"][p:-1]) == answer and row["input_ids"][-1] in eos
        assert row["loss_mask"] == [0] * p + [1] * (len(row["input_ids"]) - p)
        assert row["response"] == answer and row["finished"]
    # the answer is the source's own: CodeI/O's reference code, GSM-Symbolic's worked answer
    if "codeio" in spec:
        assert conversations[0].turns[1][1].startswith("```python\n") and "def main_solution(" in answer
        assert stats.task_keys[conversations[0].prompt].startswith("codeio:")
    else:
        assert answer.rstrip().endswith(f"#### {answer.rsplit('#### ', 1)[-1]}") and not stats.task_keys


def test_corpus_rows_pose_the_prompts_and_tasks_of_their_prompt_set():
    """corpus:NAME keeps the rows pkg:NAME keeps, with the same prompts and task keys, so any exclusion by
    text or by task that applies to the prompts applies to the corpus rows."""
    prompts, p_stats = load_prompts("pkg:codeio_stub?limit=40&seed=5")
    rows, c_stats = load_conversations("corpus:codeio_stub?limit=40&seed=5")
    assert [c.prompt for c in rows] == prompts and c_stats.task_keys == p_stats.task_keys
    gsm, _ = load_prompts("pkg:gsm_symbolic?limit=30&seed=1")
    assert [c.prompt for c in load_conversations("corpus:gsm_symbolic?limit=30&seed=1")[0]] == gsm


# -- held-out tasks ----------------------------------------------------------------------------------


def _code_plan(tmp_path, **kwargs) -> PromptPlan:
    args = dict(domain="code", target_name="tiny", cache_dir=tmp_path, generation=GEN, max_train_prompts=8, seed=0)
    return PromptPlan(**{**args, **kwargs})


def test_the_tasks_exclude_seed_holds_out_reach_no_corpus_row(tmp_path):
    """384 held-out CodeI/O tasks (exclude_seed's sample) are in no regenerated prompt and no corpus row, in
    either prompt form; without the exclusion they are among the corpus rows (the control)."""
    plan = _code_plan(tmp_path, exclude_seed=7, exclude_size=420)
    held = plan.held_out_tasks()
    assert len(held) >= 384 and all(t.startswith("codeio:") for t in held)
    assert not held & set(plan.prompts().train_tasks())
    for spec in ("corpus:codeio", "corpus:codeio_stub"):
        corpus = CorpusPlan(plan, [spec])
        tasks = corpus.tasks()
        assert not held & set(tasks) and len(tasks) == 3000 - len(held)
    # the control: every held-out task is a corpus row before the exclusion
    _, stats = load_conversations("corpus:codeio")
    assert held <= set(stats.task_keys.values())


def test_evaluation_tasks_are_held_out_of_prompts_and_corpus_rows_in_every_form(tmp_path):
    """Evaluating on CodeI/O stubs holds their tasks out of the description-form prompts and corpus rows too."""
    plan = _code_plan(tmp_path, eval_sources=["pkg:codeio_stub?limit=50&seed=3"], max_train_prompts=None)
    eval_tasks = plan.prompts().eval_tasks()
    assert len(eval_tasks) == 50 and eval_tasks <= plan.held_out_tasks()
    assert not eval_tasks & set(plan.prompts().train_tasks())
    assert len(plan.train) == 2 * (3000 - 50)  # both forms of every other task
    corpus = CorpusPlan(plan, ["corpus:codeio"], max_rows=None)
    assert not eval_tasks & set(corpus.tasks()) and len(corpus.tasks()) == 3000 - 50


# -- entries: labels of one teacher-forced pass ---------------------------------------------------------


def _datamodule(tmp_path, provider, **kwargs):
    args = dict(domain="math", target_name="tiny", target=provider, cache_dir=tmp_path / "cache", generation=GEN,
                max_length=512, batch_size=4, val_fraction=0.0, seed=0, progress=False, feature_layers=LAYERS,
                top_logprobs=TOP_K, eval_sources=["pkg:gsm_symbolic?limit=20&seed=1000000"])
    return ExitTrainDataModule(**{**args, **kwargs})


def _check_labels(batch, model, i: int) -> None:
    """Row i of ``batch``: the stored top-k log-probabilities over its answer are a direct forward's, the
    features the reference pass's, and the loss mask covers exactly the answer."""
    n, p = int(batch["lengths"][i]), int(batch["n_prompt_tokens"][i])
    ids = batch["input_ids"][i, :n].tolist()
    top, logp = _direct_top(model, ids, p, TOP_K)
    torch.testing.assert_close(batch["top_logprobs"][i, p:n], logp, atol=1e-4, rtol=1e-4)
    assert torch.equal(batch["top_ids"][i, p:n, 0], top[:, 0].to(torch.int32))
    # the control: the same forward one position off does not match, so the check above can fail
    _, shifted = _direct_top(model, ids, p + 1, TOP_K)
    assert not torch.allclose(batch["top_logprobs"][i, p : n - 1], shifted, atol=1e-3)
    assert not torch.isfinite(batch["top_logprobs"][i, :p]).any()
    assert torch.isfinite(batch["top_logprobs"][i, p:n]).all()
    assert batch["loss_mask"][i, :p].sum() == 0 and bool(batch["loss_mask"][i, p:n].all())
    ref = teacher_forced_reference(model, [(ids, p)], feature_layers=LAYERS)[0]
    torch.testing.assert_close(batch["features"][i, :n].float(), ref.features.float(), atol=2e-2, rtol=2e-2)


def test_gsm_corpus_rows_alone_are_labelled_by_one_pass_and_nothing_is_generated(tmp_path, tiny):
    dm = _datamodule(tmp_path, tiny, train_sources=["corpus:gsm_symbolic?limit=6&seed=1"])
    assert dm.plan.answered and dm.corpus is None
    dm.prepare_data()
    assert tiny.provided == 1 and tiny.generate_calls == 0
    meta = read_meta(dm.cache_path)
    assert meta["brought"] is True and meta["rows"] == 6 and meta["top_logprobs"] == TOP_K
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader() or dm._loader(dm.train_set, shuffle=False)))
    questions, _ = load_prompts("pkg:gsm_symbolic?limit=6&seed=1")
    worked = [c.turns[1][1] for c in load_conversations("corpus:gsm_symbolic?limit=6&seed=1")[0]]
    for i in range(batch["input_ids"].shape[0]):
        n, p = int(batch["lengths"][i]), int(batch["n_prompt_tokens"][i])
        row = int(batch["row_id"][i])
        assert batch["input_ids"][i, :p].tolist() == chat_prompt_ids(tiny.tokenizer, questions[row])
        assert tiny.tokenizer.decode(batch["input_ids"][i, p : n - 1].tolist()) == worked[row]
        _check_labels(batch, tiny.model, i)


def test_a_run_mixes_its_answers_with_corpus_rows_each_served_from_its_entry(tmp_path, tiny, caplog):
    """Regenerated answers to 8 GSM questions beside corpus rows of the same generator: both kinds train and
    are counted, every row's labels come from its own entry, and a corpus row of a validation task is left
    out (the same questions: a validation task's worked answer would leak it)."""
    kinds = dict(train_sources=["pkg:gsm_symbolic?limit=8&seed=1"], max_train_prompts=8, val_fraction=0.25,
                 corpus_sources=["corpus:gsm_symbolic?limit=12&seed=1"], max_corpus_rows=10)
    dm = _datamodule(tmp_path, tiny, **kinds)
    dm.prepare_data()
    assert tiny.generate_calls >= 1 and dm.corpus_cache_path.is_dir() and dm.cache_path.is_dir()
    corpus_meta = read_meta(dm.corpus_cache_path)
    assert corpus_meta["brought"] is True and corpus_meta["rows"] == 10
    assert corpus_meta["removed"]["left_out_by_sample"] == 2
    with caplog.at_level("INFO", logger="exittrain.data.datamodule"):
        dm.setup("fit")
    rows = dm.stats["rows"]
    assert rows["answers"] == 6 and dm.stats["val_rows"] == 2
    val_questions = {dm.prompts().train[i] for i in dm.val_set["prompt_index"]}
    corpus_questions = [c.prompt for c in dm.corpus.conversations()]
    leaked = sum(q in val_questions for q in corpus_questions)
    assert leaked >= 1 and rows["corpus"] == 10 - leaked == dm.stats["corpus"]["train_rows"]
    assert len(dm.train_set) == rows["answers"] + rows["corpus"] == dm.stats["train_rows"]
    assert f"{rows['answers']} answers of the target, {rows['corpus']} corpus rows" in caplog.text

    shift = rows["row_id_shift"]
    seen: set[int] = set()
    for batch in dm._loader(dm.train_set, shuffle=False):
        for i, r in enumerate(batch["row_id"].tolist()):
            seen.add(r)
            _check_labels(batch, tiny.model, i)
            p, n = int(batch["n_prompt_tokens"][i]), int(batch["lengths"][i])
            if r >= shift:  # a corpus row: its question, then its worked answer
                conv = dm.corpus.conversations()[r - shift]
                assert conv.prompt not in val_questions
                assert batch["input_ids"][i, :p].tolist() == chat_prompt_ids(tiny.tokenizer, conv.prompt)
                assert tiny.tokenizer.decode(batch["input_ids"][i, p : n - 1].tolist()) == conv.turns[1][1]
    assert sum(r >= shift for r in seen) == rows["corpus"] and sum(r < shift for r in seen) == rows["answers"]
    assert dm.stats["feature_store"]["corpus_rows"] == rows["corpus"]

    # the same settings find both entries: nothing is labelled or generated again
    again = CountingTarget(tiny.model, tiny.tokenizer)
    dm2 = _datamodule(tmp_path, again, **kinds)
    dm2.prepare_data()
    assert again.provided == 0 and dm2.corpus_cache_path == dm.corpus_cache_path


def test_without_corpus_sources_the_run_reads_its_answers_alone(tmp_path, tiny):
    dm = _datamodule(tmp_path, tiny, train_sources=["pkg:gsm_symbolic?limit=4&seed=1"], max_train_prompts=4)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.corpus is None and dm.corpus_cache_path is None
    assert dm.stats["rows"] == {"answers": 4, "corpus": 0} and len(dm.train_set) == 4
    assert not any(p.name.startswith("tiny-brought-") for p in (tmp_path / "cache").iterdir())


def test_corpus_rows_train_with_finite_losses(tmp_path, tiny, smollm2_tokenizer):
    from exittrain.core import anchor_generator
    from exittrain.models.target_model import TargetModel
    from tests.lit.helpers import make_module

    tm = TargetModel(tiny.model, smollm2_tokenizer, name="tiny")
    module = make_module(tm, stage="pretrain", soft_label_weight=1.0, soft_label_top_k=TOP_K, feature_cache=True)
    dm = _datamodule(tmp_path, tiny, train_sources=["pkg:gsm_symbolic?limit=4&seed=1"], max_train_prompts=4,
                     corpus_sources=["corpus:gsm_symbolic?limit=4&seed=2"],
                     feature_layers=list(module.drafter.config.target_layer_ids))
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm._loader(dm._corpus_train, shuffle=False)))
    with torch.no_grad():
        values, _ = module.compute_losses(batch, anchor_generator(0, 0), exit_loss=False, metrics=False,
                                          soft_labels=True)
    assert torch.isfinite(values["loss_tok"]) and float(values["anchors"]) > 0


def test_a_corpus_row_file_is_read_as_conversations(tmp_path, smollm2_tokenizer):
    """chat-json conversations are corpus rows too (data.corpus_sources takes every answered kind)."""
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Add 2 and 3."},
                                             {"role": "assistant", "content": "2 + 3 = 5."}]}) + "\n")
    plan = PromptPlan("math", target_name="tiny", cache_dir=tmp_path, generation=GEN,
                      train_sources=["pkg:gsm_symbolic?limit=4&seed=1"],
                      eval_sources=["pkg:gsm_symbolic?limit=4&seed=1000000"])
    corpus = CorpusPlan(plan, [f"chat-json:{path}"])
    assert [c.turns for c in corpus.conversations()] == [(("user", "Add 2 and 3."), ("assistant", "2 + 3 = 5."))]
    assert corpus.tasks() == ["Add 2 and 3."] and corpus.cache_path.name.startswith("tiny-brought-")


def test_corpus_rows_are_cut_to_max_length_before_they_are_labelled(tmp_path, tiny):
    """Training reads no token past max_length, so the pass labels none: every stored row is at most
    max_length tokens, a cut row is unfinished, its labels are a direct forward's over what is kept, and the
    cut is part of the entry's key. The control: the same rows at a larger max_length keep more tokens."""
    M = 224  # the gsm prompts are 100-170 tokens after the template; prompt and worked answer up to ~400
    kinds = dict(train_sources=["pkg:gsm_symbolic?limit=4&seed=1"], max_train_prompts=4,
                 corpus_sources=["corpus:gsm_symbolic?limit=6&seed=1"])
    short, long = _datamodule(tmp_path, tiny, max_length=M, **kinds), _datamodule(tmp_path, tiny, **kinds)
    for dm in (short, long):
        dm.prepare_data()
    assert short.corpus_cache_path != long.corpus_cache_path
    cut, whole = (datasets.load_from_disk(str(dm.corpus_cache_path)) for dm in (short, long))
    n_whole = [len(r["input_ids"]) for r in whole]
    assert sum(n > M for n in n_whole) >= 2 and max(len(r["input_ids"]) for r in cut) <= M
    assert read_meta(short.corpus_cache_path)["cut_rows"] == sum(n > M for n in n_whole)
    for a, b, n in zip(cut, whole, n_whole, strict=True):
        assert a["n_prompt_tokens"] == b["n_prompt_tokens"] < M  # every prompt leaves answer tokens here
        assert a["input_ids"] == b["input_ids"][: len(a["input_ids"])] and len(a["input_ids"]) == min(n, M)
        assert a["finished"] == (b["finished"] and n <= M)
    short.setup("fit")
    batch = next(iter(short._loader(short.train_set, shuffle=False)))
    for i in range(batch["input_ids"].shape[0]):
        _check_labels(batch, tiny.model, i)
