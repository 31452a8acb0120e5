"""ExitTrainModule without a full run: anchors, config checks, losses against a reference, gradients."""

from __future__ import annotations

import math

import pytest
import torch

import exittrain.objective as objective
from exittrain.core import anchor_generator
from exittrain.lit import ExitTrainModule
from exittrain.models import new_drafter
from tests.lit.helpers import BLOCK, batch_of, collate, loader, make_module, trainer
from tests.objective_helpers import reference_losses as reference_twin
from tests.objective_helpers import reference_soft_block_ce as reference_soft_twin

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]

K = BLOCK - 1

# ----------------------------------------------------------------------------------------------
# configuration


@pytest.mark.parametrize(
    "key, value",
    [
        ("stage", "finetune"),
        ("anchors_per_seq", 0),
        ("budget", 0),
        ("budget", True),
        ("weight_type", "reach"),
        ("alpha", 1.5),
        ("alpha", -1e-3),
        ("lambda_tok", -1.0),
        ("lambda_exit", -0.1),
        ("lambda_exit", float("nan")),
        ("gamma", 0.0),
        ("gamma", 7.0),
        ("scoring", "approx"),
        ("window", 0),
        ("score_chunk_size", 0),
        ("context_window", 0),
        ("lr", 0.0),
        ("weight_decay", -1.0),
        ("warmup_ratio", 1.0),
        ("min_lr_ratio", 1.5),
        ("analytic_every", -1),
        ("seed", 1.5),
        ("vocab_sample", 0),
        ("vocab_sample", 2.5),
        ("law_temperature", -1.0),
        ("law_temperature", float("inf")),
        ("feature_cache", "yes"),
    ],
)
def test_bad_config_raises_naming_the_key(target, key, value):
    drafter = new_drafter(target, block_size=BLOCK, num_layers=1, seed=0)
    with pytest.raises(ValueError, match=f"^{key}="):
        ExitTrainModule(drafter, target, **{key: value})


def test_config_combinations_that_train_nothing_are_rejected(target):
    drafter = new_drafter(target, block_size=BLOCK, num_layers=1, seed=0)
    with pytest.raises(ValueError, match="lambda_tok"):
        ExitTrainModule(drafter, target, stage="pretrain", lambda_tok=0.0)
    with pytest.raises(ValueError, match="lambda_exit"):
        ExitTrainModule(drafter, target, stage="exittrain", lambda_tok=0.0, lambda_exit=0.0)
    with pytest.raises(ValueError, match="BlockDrafter"):
        ExitTrainModule(torch.nn.Linear(2, 2), target)


def test_hparams_are_plain_and_only_the_drafter_is_a_submodule(target):
    module = make_module(target, gamma=0.8)
    assert "drafter" not in module.hparams and "target" not in module.hparams
    plain = (str, int, float, bool, type(None))
    assert all(isinstance(v, plain) for v in module.hparams.values()), dict(module.hparams)
    assert module.hparams.gamma == 0.8 and module.hparams.stage == "exittrain"
    assert [name for name, _ in module.named_children()] == ["drafter"]
    assert {id(p) for p in module.parameters()} == {id(p) for p in module.drafter.parameters()}
    assert all(k.startswith("drafter.") for k in module.state_dict())


def test_checkpoint_of_another_target_is_refused(target):
    module = make_module(target)
    with pytest.raises(ValueError, match="other-target"):
        module.on_load_checkpoint({"exittrain": {"target_name": "other-target"}})


# ----------------------------------------------------------------------------------------------
# losses and gradients


def reference_losses(module, batch, generator):
    return reference_twin(module.drafter, module.target, module.hparams, batch, generator)


def reference_soft_block_ce(module, batch, generator, weight):
    return reference_soft_twin(module.drafter, module.target, module.hparams, batch, generator, weight)


@pytest.mark.parametrize(
    "weight_type, copy_ngrams", [("flow", None), ("exit", None), ("missing", None), ("flow", [2, 1]), ("missing", [1])]
)
def test_losses_match_the_reference_twins(target, weight_type, copy_ngrams):
    # 12 anchors per sequence: more than some sequences have, so padded anchors are in play
    module = make_module(
        target,
        weight_type=weight_type,
        alpha=0.05,
        lambda_tok=0.5,
        lambda_exit=2.0,
        anchors_per_seq=12,
        copy_ngrams=copy_ngrams,
    )
    batch = batch_of(3, seed=4)
    with torch.no_grad():
        values, times = module.compute_losses(batch, anchor_generator(0, 0), exit_loss=True, metrics=True)
        ref_tok, ref_exit, ref_tau, ref_greedy = reference_losses(module, batch, anchor_generator(0, 0))
    assert 0 < int(values["anchors"]) < 3 * 12
    assert float(values["loss_tok"]) == pytest.approx(ref_tok, rel=1e-5)
    assert float(values["loss_exit"]) == pytest.approx(ref_exit, rel=1e-5)
    assert float(values["loss"]) == pytest.approx(0.5 * ref_tok + 2.0 * ref_exit, rel=1e-5)
    assert float(values["analytic_block_length"]) == pytest.approx(float(ref_tau), rel=1e-5)
    assert float(values["greedy_block_length"]) == pytest.approx(ref_greedy, rel=1e-6)
    exit_mass = sum(float(values[f"exit_mass_d{d}"]) for d in range(K + 1))
    assert exit_mass == pytest.approx(1.0, abs=1e-5)
    assert float(values["coverage"]) == pytest.approx(float(values["analytic_block_length"]) - 1, abs=1e-6)
    assert set(times) == {"features", "draft", "tree", "score", "exit"} and all(t >= 0 for t in times.values())


@pytest.mark.parametrize("weight_type, law_temperature", [("flow", 0.0), ("missing", 0.0), ("exit", 0.5)])
def test_node_loss_reads_the_law_at_law_temperature(target, weight_type, law_temperature):
    common = dict(weight_type=weight_type, alpha=0.05, anchors_per_seq=6)
    module = make_module(target, law_temperature=law_temperature, **common)
    raw = make_module(target, **common)
    batch = batch_of(3, seed=5)
    with torch.no_grad():
        values, _ = module.compute_losses(batch, anchor_generator(0, 0), exit_loss=True, metrics=True)
        values_raw, _ = raw.compute_losses(batch, anchor_generator(0, 0), exit_loss=True, metrics=True)
        ref_tok, ref_exit, ref_tau, _ = reference_losses(module, batch, anchor_generator(0, 0))
    assert float(values["loss_exit"]) == pytest.approx(ref_exit, rel=1e-5)
    assert float(values["loss_exit"]) != pytest.approx(float(values_raw["loss_exit"]), rel=1e-3)
    # the block CE and the logged tree metrics keep the raw law
    assert float(values["loss_tok"]) == pytest.approx(float(values_raw["loss_tok"]), rel=1e-6)
    assert float(values["analytic_block_length"]) == pytest.approx(float(ref_tau), rel=1e-5)


def test_padded_anchors_do_not_change_the_losses(target):
    """A sequence without candidates adds only masked anchors: the losses equal those of the good one alone."""
    module = make_module(target)
    good = batch_of(1, seed=5)
    T = good["input_ids"].shape[1]
    bad_row = (torch.randint(2, 64, (T,), generator=torch.Generator().manual_seed(1)), torch.zeros(T, dtype=torch.bool))
    both = collate([(good["input_ids"][0], good["loss_mask"][0]), bad_row])
    with torch.no_grad():
        alone, _ = module.compute_losses(good, anchor_generator(0, 0), exit_loss=True, metrics=True)
        mixed, _ = module.compute_losses(both, anchor_generator(0, 0), exit_loss=True, metrics=True)
    assert int(mixed["anchors"]) == int(alone["anchors"]) == module.hparams.anchors_per_seq
    for key in ("loss_tok", "loss_exit", "analytic_block_length", "acc_d1"):
        assert float(mixed[key]) == pytest.approx(float(alone[key]), rel=1e-5, abs=1e-7), key


def test_vocab_sample_covering_the_vocabulary_equals_the_full_block_ce(target):
    """With m >= V every token is a candidate: the sampled loss, its gradients and the metrics are exact."""
    full = make_module(target, stage="pretrain", gamma=0.9)
    sampled = make_module(target, stage="pretrain", gamma=0.9, vocab_sample=10_000)
    batch = batch_of(2, seed=3)
    ref, _ = full.compute_losses(batch, anchor_generator(0, 0), exit_loss=False, metrics=True)
    got, _ = sampled.compute_losses(
        batch, anchor_generator(0, 0), exit_loss=False, metrics=True, vocab_sample=sampled.hparams.vocab_sample
    )
    ref["loss"].backward()
    got["loss"].backward()
    assert float(got["loss_tok"].detach()) == pytest.approx(float(ref["loss_tok"].detach()), rel=1e-5)
    for key in ("acc_d1", "analytic_block_length", "coverage"):
        assert float(got[key]) == pytest.approx(float(ref[key]), rel=1e-5), key
    for (name, p), q in zip(full.drafter.named_parameters(), sampled.drafter.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_vocab_sample_skips_the_full_head_without_metrics_and_is_ignored_by_exittrain(target):
    module = make_module(target, stage="pretrain", vocab_sample=8)
    values, _ = module.compute_losses(
        batch_of(2), anchor_generator(0, 0), exit_loss=False, metrics=False, vocab_sample=8
    )
    assert "acc_d1" not in values and "analytic_block_length" not in values
    assert math.isfinite(float(values["loss_tok"].detach()))
    values["loss"].backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.drafter.parameters())
    # exittrain needs the full logits with gradients: the block CE stays exact
    ex = make_module(target, stage="exittrain")
    a, _ = ex.compute_losses(batch_of(2), anchor_generator(0, 0), exit_loss=True, metrics=True, vocab_sample=8)
    b, _ = ex.compute_losses(batch_of(2), anchor_generator(0, 0), exit_loss=True, metrics=True)
    assert float(a["loss"].detach()) == pytest.approx(float(b["loss"].detach()), rel=1e-6)


def test_fit_with_vocab_sample_logs_the_sampled_loss(target):
    from tests.lit.helpers import ListLogger

    logger = ListLogger()
    module = make_module(target, stage="pretrain", vocab_sample=16, analytic_every=2)
    trainer(4, logger=logger).fit(module, loader(8))
    assert len(logger.values("train/loss_tok")) == 4
    assert all(math.isfinite(v) for v in logger.values("train/loss_tok"))
    assert len(logger.values("train/acc_d1")) >= 2  # on the analytic steps


def test_a_drafter_loaded_in_eval_mode_trains_in_train_mode(target):
    module = make_module(target, stage="pretrain", analytic_every=0)
    module.drafter.eval()  # as load_drafter (from_pretrained) returns it
    modes = []
    step = module.training_step

    def recording_step(batch, batch_idx):
        modes.append(all(m.training for m in module.drafter.modules()))
        return step(batch, batch_idx)

    module.training_step = recording_step
    trainer(2).fit(module, loader(4))
    assert modes == [True, True]


@pytest.mark.parametrize("weight_type", ["flow", "exit", "missing"])
def test_exit_loss_alone_trains_every_drafter_parameter_and_nothing_else(target, weight_type):
    module = make_module(target, weight_type=weight_type, lambda_tok=0.0, lambda_exit=1.0)
    values, _ = module.compute_losses(batch_of(2), anchor_generator(0, 0), exit_loss=True, metrics=False)
    values["loss"].backward()
    for name, p in module.drafter.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert sum(float(p.grad.abs().sum()) for p in module.drafter.parameters()) > 0
    for p in target.model.parameters():
        assert p.grad is None and not p.requires_grad


def test_no_valid_anchor_gives_zero_loss_not_nan(target):
    module = make_module(target)
    batch = batch_of(2)
    batch["loss_mask"][:] = False
    values, _ = module.compute_losses(batch, anchor_generator(0, 0), exit_loss=True, metrics=True)
    assert int(values["anchors"]) == 0
    assert float(values["loss"].detach()) == 0.0 and "analytic_block_length" not in values
    values["loss"].backward()  # the graph is intact


# ----------------------------------------------------------------------------------------------
# NaN guard


def test_nan_loss_raises_naming_step_and_batch(target, monkeypatch):
    real = objective.block_cross_entropy
    calls = []

    def poisoned(*args, **kwargs):
        calls.append(1)
        out = real(*args, **kwargs)
        return out * math.nan if len(calls) == 3 else out

    monkeypatch.setattr(objective, "block_cross_entropy", poisoned)
    module = make_module(target, stage="pretrain", analytic_every=0)
    weights = [p.detach().clone() for p in module.drafter.parameters()]
    with pytest.raises(RuntimeError, match=r"global step 2, batch index 2"):
        trainer(5).fit(module, loader(8))
    assert len(calls) == 3
    # two good steps happened, the poisoned one did not update the drafter with NaN
    assert all(torch.isfinite(p).all() for p in module.drafter.parameters())
    assert any(not torch.equal(w, p) for w, p in zip(weights, module.drafter.parameters()))


def test_nan_drafter_logits_in_exittrain_raise_at_step_zero(target, monkeypatch):
    module = make_module(target, stage="exittrain")
    real = module.drafter.forward_anchors

    def nan_logits(*args, **kwargs):
        out = real(*args, **kwargs)
        return (out[0] * math.nan, out[1]) if kwargs.get("with_copy_terms") else out * math.nan

    monkeypatch.setattr(module.drafter, "forward_anchors", nan_logits)
    with pytest.raises(RuntimeError, match=r"global step 0, batch index 0"):
        trainer(2).fit(module, loader(4))


# soft labels


def soft_block_ce(module, batch) -> float:
    values, _ = module.compute_losses(batch, anchor_generator(0, 0), exit_loss=False, metrics=False, soft_labels=True)
    return float(values["loss_tok"])


@pytest.mark.parametrize("copy_ngrams", [None, [2, 1]], ids=["plain", "copy"])
@pytest.mark.parametrize("vocab_sample", [None, 10_000])
def test_soft_labels_match_the_reference_from_a_plain_forward(target, vocab_sample, copy_ngrams):
    # with the copy branch: the sampled loss over hidden states against the drafter's mixed log-probabilities
    module = make_module(
        target, stage="pretrain", soft_label_weight=0.7, soft_label_top_k=5, gamma=0.8, copy_ngrams=copy_ngrams
    )
    batch = batch_of(3, seed=6)
    with torch.no_grad():
        values, _ = module.compute_losses(
            batch, anchor_generator(0, 0), exit_loss=False, metrics=False, vocab_sample=vocab_sample, soft_labels=True
        )
        hard, _ = module.compute_losses(
            batch, anchor_generator(0, 0), exit_loss=False, metrics=False, vocab_sample=vocab_sample
        )
    ref = reference_soft_block_ce(module, batch, anchor_generator(0, 0), 0.7)
    assert float(values["loss_tok"]) == pytest.approx(ref, rel=1e-5)
    assert abs(float(hard["loss_tok"]) - ref) > 1e-3  # the soft labels changed the loss
    if copy_ngrams:  # the branch takes part: a gate near 1 changes the loss
        with torch.no_grad():
            module.drafter.copy_gate.bias.fill_(5.0)
            gated, _ = module.compute_losses(
                batch, anchor_generator(0, 0), exit_loss=False, metrics=False, vocab_sample=vocab_sample,
                soft_labels=True,
            )
        assert abs(float(gated["loss_tok"]) - float(values["loss_tok"])) > 1e-3


def with_top_logprobs(target, batch, k, *, from_response=False):
    """``batch`` plus ``top_ids`` / ``top_logprobs`` as the feature store's collator gives them: the
    target's top-k at every real position, or (``from_response``) over the response only, as the
    regeneration keeps them."""
    ids, logp = target.token_top_logprobs(batch["input_ids"], k)
    pad = torch.arange(ids.shape[1]).unsqueeze(0) >= batch["lengths"].unsqueeze(1)  # (L, T)
    if from_response:
        pad |= ~batch["loss_mask"]
    return {**batch, "top_ids": ids.masked_fill(pad.unsqueeze(-1), 0),
            "top_logprobs": logp.masked_fill(pad.unsqueeze(-1), -torch.inf)}


def test_soft_labels_from_the_batch_need_no_forward_and_match_the_target(target, monkeypatch):
    module = make_module(target, stage="pretrain", soft_label_weight=1.0, soft_label_top_k=4)
    batch = batch_of(2, seed=7)
    with torch.no_grad():
        first = soft_block_ce(module, batch)  # no soft labels in the batch: one target forward
    full, response = with_top_logprobs(target, batch, 4), with_top_logprobs(target, batch, 4, from_response=True)
    other_width = with_top_logprobs(target, batch, 3)
    calls = []
    real = target.token_top_logprobs

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "token_top_logprobs", counting)
    with torch.no_grad():
        again, from_response = soft_block_ce(module, full), soft_block_ce(module, response)
    assert calls == [], "the target ran over a batch that carried its soft labels"
    assert again == pytest.approx(first, rel=1e-6)
    # kept from the response on (as the regeneration keeps them): the same loss, prompts are never labels
    assert from_response == pytest.approx(first, rel=1e-6)
    # soft labels of another width than soft_label_top_k are not used: the target computes its own
    with torch.no_grad():
        assert soft_block_ce(module, other_width) == pytest.approx(first, rel=1e-6)
    assert calls == [1]


def test_token_top_logprobs_are_the_shifted_distributions(target):
    ids = batch_of(2, seed=8)["input_ids"]
    top_ids, top_logp = target.token_top_logprobs(ids, 3)
    assert top_ids.shape == top_logp.shape == (*ids.shape, 3) and bool(torch.isneginf(top_logp[:, 0]).all())
    with torch.no_grad():
        logp = target.model(input_ids=ids).logits.float().log_softmax(-1)
    values, index = logp[:, :-1].topk(3, -1)
    torch.testing.assert_close(top_logp[:, 1:], values, atol=1e-5, rtol=1e-5)
    assert torch.equal(top_ids[:, 1:].long(), index)
    with pytest.raises(ValueError, match="k="):
        target.token_top_logprobs(ids, 0)
