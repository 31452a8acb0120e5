"""Collation and the DataModule lifecycle: prepare_data -> setup -> dataloaders -> eval prompts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from exittrain.data import chat_prompt_ids
from exittrain.data.cache_integrity import write_checksums
from exittrain.data.collate import Collator, truncation_stats
from exittrain.data.datamodule import ExitTrainDataModule
from exittrain.data.prompts.prompt_sets import normalize_prompt
from exittrain.data.prompts.selection import split_by_task
from tests.data.helpers import CountingTarget, tiny_llama
from tests.lit.helpers import trainer as lit_trainer

TRAIN = [f"Question number {i}: what is {i} plus {i}?" for i in range(10)] + ["Shared prompt"]
EVAL = ["shared   PROMPT", "Tell me a story.", "What is a prime number?"]


def test_collator_pads_right_truncates_and_masks():
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1], "n_prompt_tokens": 2},
        {"input_ids": [3, 4, 1], "loss_mask": [0, 1, 1], "n_prompt_tokens": 1},
    ]
    batch = Collator(pad_token_id=0, max_length=4)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [3, 4, 1, 0]]
    assert batch["input_ids"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["loss_mask"].tolist() == [[False, False, True, True], [False, True, True, False]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["lengths"].tolist() == [4, 3] and batch["n_prompt_tokens"].tolist() == [2, 1]
    assert "row_id" not in batch, "rows without prompt_index get no row_id"
    stats = truncation_stats([2, 1, 6], [5, 3, 9], max_length=4)
    assert (stats.rows, stats.truncated, stats.no_response) == (3, 2, 1)


def test_collator_gives_row_ids_from_prompt_index():
    rows = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "n_prompt_tokens": 1, "prompt_index": 7},
        {"input_ids": [3, 4], "loss_mask": [0, 1], "n_prompt_tokens": 1, "prompt_index": 2},
    ]
    batch = Collator(pad_token_id=0, max_length=8)(rows)
    assert batch["row_id"].tolist() == [7, 2] and batch["row_id"].dtype == torch.long
    assert set(batch) == {"input_ids", "loss_mask", "attention_mask", "n_prompt_tokens", "lengths", "row_id"}
    with pytest.raises(ValueError, match="some rows carry prompt_index"):
        Collator(pad_token_id=0, max_length=8)([rows[0], {k: v for k, v in rows[1].items() if k != "prompt_index"}])


@pytest.fixture()
def sources(tmp_path):
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"text": p}) + "\n" for p in TRAIN))
    evals.write_text("".join(json.dumps({"text": p}) + "\n" for p in EVAL))
    return [f"jsonl:{train}:text"], [f"jsonl:{evals}:text"]


def _datamodule(tmp_path, sources, target, **kwargs):
    train, evals = sources
    args = dict(
        domain="custom",
        train_sources=train,
        eval_sources=evals,
        target_name="tiny",
        target=target,
        cache_dir=tmp_path / "cache",
        max_length=40,
        batch_size=4,
        val_fraction=0.2,
        seed=0,
        generation={"max_new_tokens": 4, "batch_size": 8},
        progress=False,
    )
    args.update(kwargs)
    return ExitTrainDataModule(**args)


def test_datamodule_prepares_once_and_yields_padded_batches(tmp_path, sources, smollm2_tokenizer, monkeypatch):
    tok = smollm2_tokenizer
    target = CountingTarget(tiny_llama(tok, seed=0), tok)
    prompt_len = max(len(chat_prompt_ids(tok, p)) for p in TRAIN)
    max_length = prompt_len + 2  # every answer (4 tokens, no EOS from this model) is cut to 2 tokens
    dm = _datamodule(tmp_path, sources, target, max_length=max_length)
    dm.prepare_data()
    assert target.provided == 1 and target.generate_calls == 2  # 10 train prompts in batches of 8
    dm.setup("fit")

    # the training prompt equal to an evaluation prompt was dropped; 2 of 10 rows held out
    assert dm.stats["prompts"]["overlap_removed"] == 1
    assert (dm.stats["train_rows"], dm.stats["val_rows"]) == (8, 2)
    assert dm.stats["truncation"] == {"rows": 10, "truncated": 10, "dropped_no_response": 0}

    batches = list(dm.train_dataloader())
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4]
    assert dm.train_dataloader().pin_memory is False  # no trainer, or one on the CPU: nothing pinned
    on_gpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    monkeypatch.setattr(dm, "trainer", on_gpu)  # built, not iterated: no CUDA is touched
    assert dm.val_dataloader().pin_memory is True
    monkeypatch.setattr(dm, "trainer", SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"))))
    assert dm.val_dataloader().pin_memory is False
    monkeypatch.undo()
    for b in batches:
        L, T = b["input_ids"].shape
        assert T <= max_length
        assert b["loss_mask"].shape == b["attention_mask"].shape == (L, T)
        assert b["input_ids"].dtype == torch.long and b["loss_mask"].dtype == torch.bool
        positions = torch.arange(T).expand(L, T)
        expected = (positions >= b["n_prompt_tokens"][:, None]) & (positions < b["lengths"][:, None])
        assert torch.equal(b["loss_mask"], expected)
        assert torch.equal(b["attention_mask"].bool(), positions < b["lengths"][:, None])
    val = list(dm.val_dataloader())
    assert sum(b["input_ids"].shape[0] for b in val) == 2
    # row ids: the rows' prompt_index, unique across both splits and the same every epoch
    train_ids = sorted(i for b in batches for i in b["row_id"].tolist())
    val_ids = sorted(i for b in val for i in b["row_id"].tolist())
    assert len(set(train_ids + val_ids)) == 10 and sorted(train_ids + val_ids) == list(range(10))
    assert sorted(i for b in dm.train_dataloader() for i in b["row_id"].tolist()) == train_ids

    ids = dm.eval_prompts(2)
    assert ids == [chat_prompt_ids(tok, EVAL[0]), chat_prompt_ids(tok, EVAL[1])]
    assert {normalize_prompt(p) for p in dm.eval_prompt_texts()}.isdisjoint(
        normalize_prompt(p) for p in dm.prompts().train
    )

    # a fresh DataModule with the same settings reuses the cache: the target is never built
    again = CountingTarget(tiny_llama(tok, seed=1), tok)
    dm2 = _datamodule(tmp_path, sources, again, tokenizer=tok, max_length=max_length)
    dm2.prepare_data()
    dm2.setup("fit")
    assert again.provided == 0 and again.generate_calls == 0
    assert dm2.eval_prompts(1) == ids[:1] and again.provided == 0
    first, second = next(iter(dm.train_dataloader())), next(iter(dm2.train_dataloader()))
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_setup_without_prepare_data_names_the_fix(tmp_path, sources, smollm2_tokenizer):
    dm = _datamodule(tmp_path, sources, CountingTarget(tiny_llama(smollm2_tokenizer), smollm2_tokenizer))
    with pytest.raises(ValueError, match="call prepare_data\\(\\) first"):
        dm.setup("fit")


def test_datamodule_rejects_bad_arguments(tmp_path, sources):
    with pytest.raises(ValueError, match="val_fraction=1.0 must be in"):
        _datamodule(tmp_path, sources, None, val_fraction=1.0)
    with pytest.raises(ValueError, match="max_train_prompts=0"):
        _datamodule(tmp_path, sources, None, max_train_prompts=0)
    with pytest.raises(ValueError, match="unknown domain 'poetry'"):
        ExitTrainDataModule("poetry", target_name="tiny").prompts()
    # the prompt plan's checks (tests/data/test_prompt_plan.py), raised by the constructor
    with pytest.raises(ValueError, match="exclude_seed=0.*set max_train_prompts"):
        _datamodule(tmp_path, sources, None, seed=1, exclude_seed=0)


@pytest.mark.slow
@pytest.mark.real_model
def test_embedded_target_answers_math_prompts(tmp_path):
    """The default provider (exittrain.models.target_loading.load_target) regenerates with the real SmolLM2."""
    dm = ExitTrainDataModule(
        "math",
        train_sources=["pkg:gsm_symbolic?limit=4&seed=1"],
        cache_dir=tmp_path,
        max_length=256,
        batch_size=2,
        val_fraction=0.0,
        generation={"max_new_tokens": 24, "batch_size": 4},
        progress=False,
    )
    dm.prepare_data()
    dm.setup("fit")
    rows = list(__import__("datasets").load_from_disk(str(dm.cache_path)))
    assert len(rows) == 4
    assert all(len(r["response"].split()) >= 3 for r in rows)  # real words, not noise
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 2 and batch["loss_mask"].any()
    assert dm.eval_prompts(1)[0][-3:] == batch["input_ids"][0, : batch["n_prompt_tokens"][0]].tolist()[-3:]


# the disk mode is checked fast in tests/data/test_feature_store.py; here end to end, in the slow tier
@pytest.mark.parametrize("mode", ["memory", pytest.param("disk", marks=pytest.mark.slow)])
def test_kept_features_reach_the_batches_and_the_module_never_computes_them(
    tmp_path, sources, smollm2_tokenizer, monkeypatch, mode
):
    from safetensors.torch import load_file, save_file

    from exittrain.data.regen_cache import features_file, load_features
    from exittrain.lit import ExitTrainModule
    from exittrain.models import TargetModel, new_drafter

    tok = smollm2_tokenizer
    model = tiny_llama(tok, seed=0)
    prompt_len = max(len(chat_prompt_ids(tok, p)) for p in TRAIN)
    max_length = prompt_len + 2  # every row is cut: the kept features must be cut with it
    dm = _datamodule(
        tmp_path, sources, CountingTarget(model, tok), max_length=max_length, feature_layers=[1, 0], feature_store=mode
    )
    dm.prepare_data()
    dm.setup("fit")
    store = dm.store
    splits = [*dm.train_set, *dm.val_set]
    assert store.mode == mode and store.has_features and not store.has_top_logprobs
    assert sorted(store.rows) == sorted(r["prompt_index"] for r in splits) and len(store) == 10
    stored = load_features(dm.cache_path, [1, 0])
    for r in splits:
        feats = store.features(r["prompt_index"])
        assert feats.shape == (max_length, 2 * 32) and torch.equal(feats, stored[r["prompt_index"]][:max_length])
    assert dm.stats["feature_store"] == {"mode": mode, "feature_layers": [1, 0], "top_logprobs": 0}
    batch = next(iter(dm.train_dataloader()))
    assert batch["features"].shape == (*batch["input_ids"].shape, 2 * 32) and batch["feature_layers"].tolist() == [1, 0]
    # kept for [1, 0] only: a DataModule asking for [0, 1] serves none (the module then computes its own)
    other = _datamodule(tmp_path, sources, CountingTarget(model, tok), max_length=max_length, feature_layers=[0, 1])
    other.setup("fit")
    assert not other.store.has_features and "features" not in next(iter(other.train_dataloader()))

    # the module reads them from the batches and never runs the target over a row
    target = TargetModel(model, tok, name="tiny")
    drafter = new_drafter(target, block_size=3, num_layers=1, hidden_size=32, num_heads=4, layer_ids=[1, 0], seed=0)
    module = ExitTrainModule(drafter, target, stage="pretrain", anchors_per_seq=2, feature_cache=True, seed=0)

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran over a row whose features the regeneration kept")

    monkeypatch.setattr(target, "sequence_features", no_forward)
    trainer = lit_trainer(2, limit_val_batches=1)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2 and trainer.callback_metrics["train/feature_rows_computed"] == 0

    # once no stage trains any more the store goes, with the trainer whose loaders hold it; the rows stay,
    # and a later setup opens the store again
    if mode == "memory":
        import weakref

        row = weakref.ref(store.features(splits[0]["prompt_index"]))
        del store, feats, trainer, module  # what fit's stage drops when it returns
        locals()  # refresh the snapshot of this frame's locals that Lightning's save_hyperparameters took
        dm.release_store()
        assert row() is None, "a released store's rows are freed"
        assert dm.store is None and dm.trainer is None
        assert len(list(dm.answer_token_rows())) == 10 and dm.store is None, "counting the tokens opens no store"
        dm.setup("fit")
        assert torch.equal(dm.store.features(splits[0]["prompt_index"]), stored[splits[0]["prompt_index"]][:max_length])

    # a stored row that does not cover its tokens is refused, naming the row and the file to delete
    file = dm.cache_path / features_file([1, 0])
    stored = load_file(str(file))
    first = sorted(stored, key=int)[0]
    stored[first] = stored[first][:-1].contiguous()
    save_file(stored, str(file))
    with pytest.raises(ValueError, match="features-1_0.safetensors holds .* bytes, .* when written"):
        _datamodule(tmp_path, sources, CountingTarget(model, tok), max_length=max_length, feature_layers=[1, 0],
                    feature_store=mode).setup("fit")  # the entry's checksums see the change first
    write_checksums(dm.cache_path)  # sealed as if written so: the row-length check still holds on its own
    fresh = _datamodule(
        tmp_path, sources, CountingTarget(model, tok), max_length=max_length, feature_layers=[1, 0], feature_store=mode
    )
    with pytest.raises(ValueError, match=f"features of row {first} cover .* delete features-1_0.safetensors"):
        fresh.setup("fit")
    with pytest.raises(ValueError, match="feature_store='ram'"):
        _datamodule(tmp_path, sources, CountingTarget(model, tok), feature_store="ram")


# the disk mode is checked fast in tests/data/test_feature_store.py; here end to end, in the slow tier
@pytest.mark.parametrize("mode", ["memory", pytest.param("disk", marks=pytest.mark.slow)])
def test_kept_top_logprobs_are_aligned_with_the_rows_and_are_the_modules_soft_labels(
    tmp_path, sources, smollm2_tokenizer, monkeypatch, mode
):
    from safetensors.torch import load_file, save_file

    from exittrain.data.regen_cache import load_top_logprobs, top_logprobs_file
    from exittrain.lit import ExitTrainModule
    from exittrain.models import TargetModel, new_drafter

    tok = smollm2_tokenizer
    model = tiny_llama(tok, seed=0)
    prompt_len = max(len(chat_prompt_ids(tok, p)) for p in TRAIN)
    max_length = prompt_len + 2  # every row is cut: the log-probabilities must be cut with it
    dm = _datamodule(
        tmp_path, sources, CountingTarget(model, tok), max_length=max_length, top_logprobs=3, feature_store=mode
    )
    dm.prepare_data()
    dm.setup("fit")
    store = dm.store
    stored = load_top_logprobs(dm.cache_path, 3)
    splits = [*dm.train_set, *dm.val_set]
    assert sorted(store.rows) == sorted(r["prompt_index"] for r in splits) and len(store) == 10
    assert store.has_top_logprobs and not store.has_features
    for r in splits:
        start, top_ids, top_logp = store.top_logprobs(r["prompt_index"])
        n, n_p = min(len(r["input_ids"]), max_length), r["n_prompt_tokens"]
        assert start == n_p and top_ids.shape == top_logp.shape == (n - n_p, 3)  # the response, cut with the row
        kept_ids, kept_logp = stored[r["prompt_index"]]
        assert torch.equal(top_ids, kept_ids[: n - n_p]) and torch.equal(top_logp, kept_logp[: n - n_p])
        assert top_ids[:, 0].tolist() == r["input_ids"][n_p:n]  # greedy answers: the top-1 is the token

    # the module reads them from the batches and never asks the target for them
    target = TargetModel(model, tok, name="tiny")
    drafter = new_drafter(target, block_size=3, num_layers=1, hidden_size=32, num_heads=4, seed=0)
    module = ExitTrainModule(
        drafter, target, stage="pretrain", anchors_per_seq=2, seed=0, soft_label_weight=1.0, soft_label_top_k=3
    )

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran over a row whose top log-probabilities the regeneration kept")

    monkeypatch.setattr(target, "token_top_logprobs", no_forward)
    trainer = lit_trainer(2, limit_val_batches=1)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2

    # a stored row that does not cover its response is refused, naming the row and the file
    file = dm.cache_path / top_logprobs_file(3)
    tensors = load_file(str(file))
    first = sorted(k for k in tensors if k.endswith(".ids"))[0]
    tensors[first] = tensors[first][:-1].contiguous()
    tensors[first.replace(".ids", ".logp")] = tensors[first.replace(".ids", ".logp")][:-1].contiguous()
    save_file(tensors, str(file))
    write_checksums(dm.cache_path)  # sealed as if written so (the checksums alone refuse the change): the row check
    fresh = _datamodule(
        tmp_path, sources, CountingTarget(model, tok), max_length=max_length, top_logprobs=3, feature_store=mode
    )
    with pytest.raises(ValueError, match=f"row {first[:-4]} cover .* delete top-logprobs-3.safetensors"):
        fresh.setup("fit")
    with pytest.raises(ValueError, match="top_logprobs"):
        _datamodule(tmp_path, sources, CountingTarget(model, tok), top_logprobs=-2)


def test_split_by_task_keeps_each_task_on_one_side():
    order = [5, 0, 3, 1, 4, 2, 6]
    singles = [str(i) for i in range(7)]
    assert split_by_task(order, singles, 3) == ([5, 0, 3], [1, 4, 2, 6])  # the plain row split
    tasks = ["a", "b", "a", "c", "d", "b", "e"]  # rows 0 and 2 share task a, rows 1 and 5 task b
    val, train = split_by_task(order, tasks, 3)
    assert val == [5, 0, 1, 2] and train == [3, 4, 6]  # b (rows 5, 1) then a (rows 0, 2): 4 rows
    assert not {tasks[i] for i in val} & {tasks[i] for i in train}
    assert split_by_task(order, tasks, 0) == ([], order)


def test_both_forms_of_a_codeio_task_land_on_one_side_of_the_split(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    # the same seed and limit over the same 3,000 rows pick the same 6 tasks in both forms
    train = ["pkg:codeio?limit=6&seed=3", "pkg:codeio_stub?limit=6&seed=3"]
    target = CountingTarget(tiny_llama(tok, seed=0), tok)
    dm = _datamodule(tmp_path, (train, ["pkg:humaneval"]), target, max_length=640, val_fraction=0.25)
    dm.prepare_data()
    dm.setup("fit")
    tasks = dm.prompts().train_tasks()
    assert len(set(tasks)) == 6 and all(t.startswith("codeio:") for t in tasks)
    side = {}
    for name, split in (("val", dm.val_set), ("train", dm.train_set)):
        for i in split["prompt_index"]:
            assert side.setdefault(tasks[i], name) == name, f"task {tasks[i]} sits in both splits"
    val_tasks = [tasks[i] for i in dm.val_set["prompt_index"]]
    assert len(val_tasks) >= 3  # round(0.25 * 12) rows asked, whole tasks given
    assert any(val_tasks.count(t) == 2 for t in val_tasks)  # a description and its stub, together
