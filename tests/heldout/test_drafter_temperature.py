"""eval.drafter_temperature (t_d): every drafter tree is built from log_softmax(logits / t_d).

- t_d = 1 builds the trees the evaluator built before the option (no division);
- the walked tree at t_d is the tree ``exittrain.core.shaped_tree`` builds from the divided log-probabilities,
  and at t_d far from 1 it differs from the tree at 1 and accepts otherwise somewhere (a negative control
  that fails if the option were ignored); the greedy chain is the same at every t_d;
- the evaluator records t_d in every row, keeps the chain track's rows unchanged, and its live decode at
  t_d agrees with its walk (the decoder builds the same trees);
- a t_d that is not a finite number > 0, or one != 1 with eval.decode=auto, is a ValueError naming the key.

The walk against real decodes at t_d != 1, prompt for prompt, is in test_round_walk.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from exittrain.decoding import SpeculativeDecoder, autoregressive_generate
from exittrain.heldout.decode_eval import evaluate_prompts, format_table
from exittrain.heldout.evaluator import HeldOutEvaluator
from exittrain.heldout.round_walk import anchor_trees, walked_rounds
from tests.heldout.helpers import trained_drafter

NEW_TOKENS = 24
BUDGET = 6
SETTINGS = dict(budgets=[BUDGET], temperatures=[0.0, 0.6], max_new_tokens=NEW_TOKENS, verifier="tev", baseline=True,
                oracle=False, seed=0, decode="fixed", drafter_temperature=1.0)


@pytest.fixture(scope="module")
def answers(target, prompts):
    torch.set_num_threads(1)
    return [autoregressive_generate(target, p, NEW_TOKENS).tokens for p in prompts]


@pytest.fixture(scope="module")
def drafter(target, prompts, answers):
    """Briefly fitted (15 steps): its distributions are spread, neither one-hot nor flat, so a tree's
    shape depends on how sharp they are."""
    torch.set_num_threads(1)
    return trained_drafter(target, prompts, answers, new_tokens=NEW_TOKENS, steps=15)


def _anchor_inputs(target, drafter, prompt, answer):
    """The (1, T, F) features, (1, T) ids, (A,) anchors (the prompt's last token and every answer position
    a round can be rooted at) and (A, K) labels of one answer."""
    K = drafter.config.num_draft_tokens
    ids_T = torch.tensor(prompt + answer)
    features_1TF = target.sequence_features(ids_T[None], list(drafter.config.target_layer_ids)).float()
    anchors_A = torch.arange(len(prompt) - 1, len(ids_T) - 1)
    labels_AK = torch.cat([ids_T, ids_T.new_full((K,), -1)]).unfold(0, K, 1)[anchors_A + 1]
    return features_1TF, ids_T[None], anchors_A, labels_AK


def _same_tree(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "depths", "valid"))


@pytest.mark.parametrize("drafter_temperature", [0.3, 3.0])
def test_the_walked_tree_at_t_d_is_shaped_tree_of_the_divided_logprobs(one_thread, target, drafter, prompts,
                                                                       answers, drafter_temperature):
    from exittrain.core import followed_depth, shaped_tree

    trees = changed_trees = changed_acceptance = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        features_1TF, ids_1T, anchors_A, labels_AK = _anchor_inputs(target, drafter, prompt, answer)
        logits_AKV = drafter.forward_anchors(features_1TF, ids_1T, anchors_A[None]).float()
        at_t = anchor_trees(drafter, features_1TF, ids_1T, anchors_A, BUDGET, "ddtree", drafter_temperature)
        assert _same_tree(at_t, shaped_tree(torch.log_softmax(logits_AKV / drafter_temperature, -1), BUDGET))
        # t_d = 1: the tree the walk built before the option, from the undivided log-probabilities
        trained = anchor_trees(drafter, features_1TF, ids_1T, anchors_A, BUDGET)
        assert _same_tree(trained, shaped_tree(torch.log_softmax(logits_AKV, -1), BUDGET))
        # the chain is each depth's argmax: the same at every t_d
        chains = [anchor_trees(drafter, features_1TF, ids_1T, anchors_A, BUDGET, "chain", t)
                  for t in (1.0, drafter_temperature)]
        assert _same_tree(*chains)
        trees += len(anchors_A)
        changed_trees += int(((at_t.tokens != trained.tokens) | (at_t.depths != trained.depths)).any(1).sum())
        changed_acceptance += int((followed_depth(at_t, labels_AK) != followed_depth(trained, labels_AK)).sum())
    # the negative control: a walk that ignored t_d would build the trees of t_d = 1 and accept as they do
    assert changed_trees >= trees // 4 and changed_acceptance >= 1, (changed_trees, trees, changed_acceptance)


def test_the_evaluator_records_t_d_keeps_the_chain_and_changes_the_tree(one_thread, target, drafter, prompts):
    """One evaluator, the same answers: the drafter at t_d = 1 (the settings'), 3 and 0.3 (measure's
    argument). Every row records its t_d; the chain rows are equal; tree rows differ; the live decode
    at t_d equals its walk; the settings' t_d measures what measure's argument does."""
    evaluator = HeldOutEvaluator(target, prompts, SETTINGS, reference="t1")
    measured = {"t1": evaluator.measure(drafter, "t1")}
    for label, t_d in (("t3", 3.0), ("t03", 0.3)):
        measured[label] = evaluator.measure(drafter, label, drafter_temperature=t_d)
    expected = {"t1": 1.0, "t3": 3.0, "t03": 0.3}
    (table1, rows1, chain1) = measured["t1"]
    for label, (table, rows, chain) in measured.items():
        assert {r["drafter_temperature"] for r in table + rows + chain} == {expected[label]}
        assert [set(r) for r in rows] == [set(r) for r in rows1] and [set(r) for r in chain] == [set(r) for r in chain1]
        assert [r["block_lengths"] for r in chain] == [r["block_lengths"] for r in chain1]
        assert [r["chain_tau"] for r in table] == [r["chain_tau"] for r in table1]
        greedy = next(r for r in table if r["temperature"] == 0)
        assert greedy["walk_exact"] and greedy["lossless"] and greedy["chain_walk_exact"]  # the live decode at t_d
        if label != "t1":
            assert all(r["chain_tau_vs_t1"]["delta"] == 0 for r in table)
            # the negative control: the tree rows move with t_d at both temperatures
            for T in SETTINGS["temperatures"]:
                assert [r["block_lengths"] for r in rows if r["temperature"] == T] != \
                    [r["block_lengths"] for r in rows1 if r["temperature"] == T], (label, T)
    settings_t3 = HeldOutEvaluator(target, prompts, {**SETTINGS, "drafter_temperature": 3.0}, reference=None)
    _, rows3, _ = settings_t3.measure(drafter, "t3")
    assert [r["block_lengths"] for r in rows3] == [r["block_lengths"] for r in measured["t3"][1]]
    # the table says t_d where some row's is not 1, and looks as before where every row's is
    assert "| t_d |" in format_table(measured["t1"][0] + measured["t3"][0])
    assert "t_d" not in format_table(table1)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, "hot", True])
def test_a_bad_drafter_temperature_is_refused_naming_the_key(target, drafter, prompts, answers, bad):
    with pytest.raises(ValueError, match="drafter_temperature=.*finite number > 0"):
        walked_rounds(target, drafter, prompts[0][:-1], prompts[0][-1:] + answers[0], max_new_tokens=NEW_TOKENS + 1,
                      shape="ddtree", budget=BUDGET, drafter_temperature=bad)
    with pytest.raises(ValueError, match="drafter_temperature=.*finite number > 0"):
        SpeculativeDecoder(target, drafter, budget=BUDGET, drafter_temperature=bad)
    with pytest.raises(ValueError, match="eval.drafter_temperature=.*finite number > 0"):
        evaluate_prompts(target, drafter, prompts[:1], budgets=[BUDGET], progress=False, drafter_temperature=bad)


def test_decode_auto_takes_the_drafter_as_trained_only(target, drafter, prompts):
    """The CPU's decode probe (eval.decode=auto) drafts from the drafter as trained: t_d != 1 is refused
    before the probe runs, naming both keys and the fix."""
    def probe(*_):
        raise AssertionError("the probe ran before the drafter temperature was checked")

    with pytest.raises(ValueError, match=r"eval.decode=auto with eval.drafter_temperature=0.5: .*eval.decode=fixed"):
        evaluate_prompts(target, drafter, prompts[:1], budgets=[BUDGET], progress=False, auto=probe,
                         drafter_temperature=0.5)
    evaluator = HeldOutEvaluator(target, prompts[:1], {**SETTINGS, "decode": "auto"}, auto=probe)
    with pytest.raises(ValueError, match="eval.decode=auto with eval.drafter_temperature=2.0"):
        evaluator.measure(drafter, "x", drafter_temperature=2.0)
    with pytest.raises(ValueError, match=r"evaluator settings lack \['drafter_temperature'\]"):
        HeldOutEvaluator(target, prompts[:1], {k: v for k, v in SETTINGS.items() if k != "drafter_temperature"})
