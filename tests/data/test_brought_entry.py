"""A brought entry end to end: answered conversations -> the cache entry (rows, one teacher-forced pass,
metadata) -> the DataModule's setup and batches -> finite training losses of a tiny drafter, the
earlier assistant turns of a multi-turn row trained on their hard tokens."""

from __future__ import annotations

import json

import pytest
import torch

from exittrain.core import anchor_generator
from exittrain.data.datamodule import ExitTrainDataModule
from exittrain.data.regen_cache import read_meta
from exittrain.data.teacher_forced import teacher_forced_reference
from exittrain.models.target_model import TargetModel
from tests.data.helpers import CountingTarget, tiny_llama
from tests.lit.helpers import make_module

EVAL = ["Tell me a story about a dragon.", "What is a prime number?", "Name three rivers."]
SINGLE = [
    ("Describe the sea in one sentence.", "The sea is a wide, restless plain of salt water under the sky."),
    ("Give me a tip for sleeping well.", "Keep the same bedtime every night and leave screens out of the bedroom."),
    ("Why is the sky blue?", "Air scatters short blue wavelengths of sunlight more than the long red ones."),
    ("What does a compiler do?", "It translates the source code of a program into instructions a machine runs."),
    ("Suggest a name for a cat.", "Call her Pepper, a short name that is easy to shout across a garden."),
]
MULTI_OPENAI = [
    {"role": "system", "content": "You answer in full sentences."},
    {"role": "user", "content": "How many legs does a spider have?"},
    {"role": "assistant", "content": "A spider has eight legs, four on each side of its body."},
    {"role": "user", "content": "And an insect?"},
    {"role": "assistant", "content": "An insect has six legs, three pairs attached to its thorax."},
]
MULTI_SHAREGPT = [
    {"from": "human", "value": "Say hello in French."},
    {"from": "gpt", "value": "Bonjour is the usual way to say hello in French."},
    {"from": "human", "value": "And in Spanish?"},
    {"from": "gpt", "value": "In Spanish you say hola, which is friendly and common."},
    {"from": "human", "value": "Thanks!"},  # after the last answer: dropped
]
OVERLAP = [{"role": "user", "content": "what is a  PRIME number?"}, {"role": "assistant", "content": "One."}]
TOP_K = 4


@pytest.fixture()
def files(tmp_path):
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in SINGLE]
    rows += [{"messages": MULTI_OPENAI}, {"conversations": MULTI_SHAREGPT}, {"messages": OVERLAP}]
    conversations, evals = tmp_path / "answered.jsonl", tmp_path / "eval.jsonl"
    conversations.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + "\n"
                             + "".join(json.dumps(r) + "\n" for r in rows[3:]))
    evals.write_text("".join(json.dumps({"text": p}) + "\n" for p in EVAL))
    return conversations, evals


@pytest.fixture()
def target(smollm2_tokenizer):
    """The tiny Llama over SmolLM2's vocabulary, as the data step's provider and as the training target."""
    model = tiny_llama(smollm2_tokenizer, seed=0)
    return CountingTarget(model, smollm2_tokenizer), TargetModel(model, smollm2_tokenizer, name="tiny")


def _datamodule(tmp_path, files, provider, layers, **kwargs):
    conversations, evals = files
    args = dict(domain="custom", train_sources=[f"chat-json:{conversations}"], eval_sources=[f"jsonl:{evals}:text"],
                target_name="tiny", target=provider, cache_dir=tmp_path / "cache", max_length=96, batch_size=8,
                val_fraction=0.2, seed=0, progress=False, feature_layers=layers, top_logprobs=TOP_K)
    args.update(kwargs)
    return ExitTrainDataModule(**args)


def test_brought_entry_is_written_once_and_served_with_soft_labels_over_the_answer(tmp_path, files, target):
    provider, tm = target
    layers = [0, 1]
    dm = _datamodule(tmp_path, files, provider, layers)
    assert dm.plan.answered and dm.cache_path.name.startswith("tiny-brought-")
    dm.prepare_data()
    assert provider.provided == 1 and provider.generate_calls == 0, "nothing is generated"
    meta = read_meta(dm.cache_path)
    assert meta["brought"] is True and meta["rows"] == meta["n_prompts"] == 7
    assert meta["rows_read"] == 9 and meta["rejected"]["blank_line"] == 1
    assert meta["removed"]["overlap_removed"] == 1 and meta["multi_turn_rows"] == 2
    assert meta["feature_layers"] == layers and meta["top_logprobs"] == TOP_K and meta["unfinished"] == 0
    assert meta["sources"][0]["source"] == f"chat-json:{files[0]}"

    # the same settings find the entry: the target is not built again
    again = CountingTarget(provider.model, provider.tokenizer)
    dm2 = _datamodule(tmp_path, files, again, layers)
    assert dm2.cache_path == dm.cache_path
    dm2.prepare_data()
    assert again.provided == 0
    reports = []  # what `prepare` prints from
    dm2.plan.regenerate(again, progress=False, feature_layers=layers, top_logprobs=TOP_K, report_to=reports.append)
    assert again.provided == 0 and reports[0].cache_hit and reports[0].meta["brought"] is True

    dm.setup("fit")
    assert (dm.stats["train_rows"], dm.stats["val_rows"]) == (6, 1)
    assert dm.stats["regeneration"]["rows"] == 7 and dm.stats["eval_prompts"] == 3
    assert dm.eval_prompt_texts() == EVAL
    batch = next(iter(dm.train_dataloader()))
    L, T = batch["input_ids"].shape
    assert batch["features"].shape == (L, T, 2 * 32) and batch["top_ids"].shape == (L, T, TOP_K)
    positions = torch.arange(T).expand(L, T)
    answer = (positions >= batch["n_prompt_tokens"][:, None]) & (positions < batch["lengths"][:, None])
    # soft labels exactly over the answer; the loss mask also covers the earlier assistant turns
    assert torch.equal(torch.isfinite(batch["top_logprobs"]).all(-1), answer)
    earlier = batch["loss_mask"] & ~answer
    multi = earlier.any(1)
    assert int(multi.sum()) >= 1 and torch.equal(batch["loss_mask"] & answer, answer)

    # what the entry keeps is the target's teacher-forced pass, row by row (the slow twin)
    for i in range(L):
        n, p = int(batch["lengths"][i]), int(batch["n_prompt_tokens"][i])
        ref = teacher_forced_reference(provider.model, [(batch["input_ids"][i, :n].tolist(), p)],
                                       feature_layers=layers, top_logprobs=TOP_K)[0]
        torch.testing.assert_close(batch["top_logprobs"][i, p:n], ref.top_logprobs, atol=1e-4, rtol=1e-4)
        assert torch.equal(batch["top_ids"][i, p:n, 0], ref.top_ids[:, 0])  # the argmax; ties below it may swap
        torch.testing.assert_close(batch["features"][i, :n].float(), ref.features.float(), atol=2e-2, rtol=2e-2)
    assert tm.model is provider.model


def test_multi_turn_rows_train_with_finite_losses_and_hard_labels_on_earlier_turns(tmp_path, files, target):
    provider, tm = target
    module = make_module(tm, stage="exittrain", soft_label_weight=1.0, soft_label_top_k=TOP_K, feature_cache=True)
    dm = _datamodule(tmp_path, files, provider, list(module.drafter.config.target_layer_ids), val_fraction=0.0)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))

    def losses(b, *, soft, exit_loss=False):
        with torch.no_grad():
            values, _ = module.compute_losses(b, anchor_generator(0, 0), exit_loss=exit_loss, metrics=exit_loss,
                                              soft_labels=soft)
        return values

    full = losses(batch, soft=True, exit_loss=True)
    assert torch.isfinite(full["loss_tok"]) and torch.isfinite(full["loss_exit"]) and float(full["anchors"]) > 0
    # anchors only inside the earlier assistant turns: no soft label there, so the soft loss is the hard one
    T = batch["input_ids"].shape[1]
    earlier = batch["loss_mask"] & (torch.arange(T)[None, :] < batch["n_prompt_tokens"][:, None])
    only_earlier = {**batch, "loss_mask": earlier}
    soft, hard = losses(only_earlier, soft=True), losses(only_earlier, soft=False)
    assert float(soft["anchors"]) > 0 and torch.isfinite(soft["loss_tok"])
    assert float(soft["loss_tok"]) == pytest.approx(float(hard["loss_tok"]), rel=1e-6)
    # over the answers the soft labels do take part
    answers = {**batch, "loss_mask": batch["loss_mask"] & ~earlier}
    assert abs(float(losses(answers, soft=True)["loss_tok"]) - float(losses(answers, soft=False)["loss_tok"])) > 1e-4
