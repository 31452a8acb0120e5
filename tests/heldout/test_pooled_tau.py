"""The held-out tau is what a decode delivers: tokens / rounds, pooled over every round of every prompt.

- At T > 0 the rounds walked along the target's own samples are distributed as a real decode's: the
  walked pooled tau lies inside the interval of real TEV decodes (fixed seeds).
- The evaluator reports the pooled tau of its walked rows, which is not the mean over answer positions
  (the per-anchor statistic, which weights a position by 1 rather than by 1 / its block): on a drafter
  that accepts, the two differ, so these tests can fail.
- Two drafters of one evaluator walk the same answers, so their rows pair; the DFlash export of a drafter
  without the copy branch has the drafter's own rows, round for round.
"""

from __future__ import annotations

import pytest
import torch

from exittrain.core import bootstrap_ci, pooled
from exittrain.decoding import SpeculativeDecoder, autoregressive_generate
from exittrain.heldout.answers import answer_sets
from exittrain.heldout.evaluator import HeldOutEvaluator, format_report
from exittrain.heldout.round_walk import walked_rounds
from tests.heldout.helpers import trained_drafter

NEW_TOKENS = 24
SETTINGS = dict(budgets=[4], temperatures=[0.0, 0.6], max_new_tokens=NEW_TOKENS, verifier="tev", baseline=True,
                oracle=False, seed=0, decode="fixed", drafter_temperature=1.0)


def _trained_drafter(target, prompts, steps: int = 80, seed: int = 0, layer_ids=None):
    answers = [autoregressive_generate(target, p, NEW_TOKENS).tokens for p in prompts]
    return trained_drafter(target, prompts, answers, new_tokens=NEW_TOKENS, steps=steps, seed=seed,
                           layer_ids=layer_ids)


@pytest.fixture(scope="module")
def drafter(target, prompts):
    torch.set_num_threads(1)
    return _trained_drafter(target, prompts)


@pytest.mark.parametrize("shape, drafter_temperature", [("ddtree", 1.0), ("chain", 1.0), ("ddtree", 3.0)])
def test_walked_rounds_at_temperature_lie_inside_the_real_decodes_interval(one_thread, target, drafter, prompts,
                                                                          shape, drafter_temperature):
    """T = 0.6: real TEV decodes of every prompt under 6 seeds (of the recipe's tree of B = 4 nodes, and of
    the chain of K nodes a serving engine verifies, exact at T like an engine's rejection sampling) against
    walks along 24 target samples a prompt. The walk's pooled tau is inside the decodes' 95% interval; the
    tree's T = 0 walk is outside it (a walk that ignored the temperature would show). At a drafter
    temperature t_d both build the tree from log_softmax(logits / t_d): the TEV decoder reads no drafter
    probability, so the walk along the target's draws stays exact in distribution."""
    from exittrain.decoding.chain_decoder import ChainDecoder

    T, budget = 0.6, 4
    decoder = (SpeculativeDecoder(target, drafter, budget=budget, verifier="tev",
                                  drafter_temperature=drafter_temperature) if shape == "ddtree"
               else ChainDecoder(target, drafter, verifier="tev"))
    decoded = [[r.block_length for r in decoder.generate(p, NEW_TOKENS, temperature=T, seed=100 * s + i).rounds]
               for s in range(6) for i, p in enumerate(prompts)]
    walked = []
    for s in range(24):
        for i, (ids, n, _) in enumerate(answer_sets(target, prompts, [T], NEW_TOKENS, seed=1000 + s)[T]):
            prompt, answer = prompts[i], ids[n:].tolist()
            walked.append(walked_rounds(target, drafter, prompt[:-1], prompt[-1:] + answer,
                                        max_new_tokens=NEW_TOKENS + 1, shape=shape, budget=budget,
                                        temperature=T, seed=s, drafter_temperature=drafter_temperature))
    low, high = bootstrap_ci(decoded)
    assert low <= pooled(walked) <= high, (pooled(walked), low, high)
    assert pooled(decoded) > 1.3  # the drafter accepts at T: the comparison has something to compare
    if shape == "ddtree":
        greedy = [walked_rounds(target, drafter, p[:-1], p[-1:] + autoregressive_generate(target, p, NEW_TOKENS).tokens,
                                max_new_tokens=NEW_TOKENS + 1, shape="ddtree", budget=budget,
                                drafter_temperature=drafter_temperature) for p in prompts]
        assert not low <= pooled(greedy) <= high  # the negative control: T = 0's rounds are another law


def test_the_evaluator_reports_pooled_tau_not_the_mean_over_positions(one_thread, target, prompts):
    """Every tau of the table is tokens / rounds of its rows; the mean block length over every answer
    position (1 + what a round rooted there accepts: the per-anchor statistic) is larger for a drafter
    whose acceptance varies from position to position (briefly trained): a decode skips the positions
    inside a long block, so it weights each position by about 1 / its block."""
    from exittrain.core import followed_depth
    from exittrain.heldout.round_walk import anchor_trees
    from exittrain.heldout.sequence_passes import SequencePasses

    drafter = _trained_drafter(target, prompts, steps=15)
    evaluator = HeldOutEvaluator(target, prompts, SETTINGS, reference=None)
    table, rows, chain = evaluator.measure(drafter, "d")
    assert [(r["budget"], r["temperature"]) for r in table] == [(4, 0.0), (4, 0.6)]
    for row in table:
        mine = [r["block_lengths"] for r in rows if r["temperature"] == row["temperature"]]
        assert row["tau"] == pytest.approx(pooled(mine))
        chains = [r["block_lengths"] for r in chain if r["temperature"] == row["temperature"]]
        assert row["chain_tau"] == pytest.approx(pooled(chains)) and row["chain_K"] == 4
        assert row["ci95"][0] <= row["tau"] <= row["ci95"][1]
    assert table[0]["lossless"] and table[0]["walk_exact"] and table[0]["chain_walk_exact"]
    # the per-position mean on the same greedy answers
    passes, per_position = SequencePasses(target), []
    for i, prompt in enumerate(prompts):
        answer = evaluator.ar_cache[(0.0, i)].tokens
        ids = torch.tensor(prompt + answer)
        K = drafter.config.num_draft_tokens
        anchors = torch.arange(len(prompt) - 1, len(ids) - 1)
        labels = torch.cat([ids, ids.new_full((K,), -1)]).unfold(0, K, 1)[anchors + 1]
        trees = anchor_trees(drafter, passes.prefix(ids, drafter.config.target_layer_ids).features, ids[None],
                             anchors, 4)
        per_position += (followed_depth(trees, labels) + 1).tolist()
    mean_over_positions = sum(per_position) / len(per_position)
    assert mean_over_positions - table[0]["tau"] > 0.1, (mean_over_positions, table[0]["tau"])


def test_two_drafters_walk_the_same_answers_and_pair(one_thread, target, drafter, prompts):
    weak = _trained_drafter(target, prompts, steps=5, seed=1)
    evaluator = HeldOutEvaluator(target, prompts, SETTINGS, reference="weak")
    weak_table, weak_rows, _ = evaluator.measure(weak, "weak")
    table, rows, chain = evaluator.measure(drafter, "strong")
    assert [r["new_tokens"] for r in rows] == [r["new_tokens"] for r in weak_rows]  # the same answers
    assert "tau_vs_weak" not in weak_table[0]
    for row in table:
        pair = row["tau_vs_weak"]
        assert pair["delta"] == pytest.approx(row["tau"] - weak_table[table.index(row)]["tau"])
        assert pair["prompts"] == len(prompts) and pair["ci95"][0] <= pair["delta"] <= pair["ci95"][1]
        assert row["chain_tau_vs_weak"]["prompts"] == len(prompts)
    assert table[0]["tau_vs_weak"]["ci95"][0] > 0  # the trained drafter accepts more, paired on the same answers
    report = format_report(weak_table + table, reference="weak")
    assert "strong - weak, chain tau at K=4 T=0.6" in report and "strong - weak, tree tau at B=4 T=0" in report
    assert "chain tau (K)" in report.splitlines()[0] and report.splitlines()[0].index("chain tau") < \
        report.splitlines()[0].index("tree tau")  # the table leads with what an engine verifies


def test_the_dflash_export_of_a_drafter_without_the_copy_branch_has_its_rows(one_thread, target, prompts, tmp_path):
    """What fit's default serves is the drafter itself: its DFlash export, loaded back, walks every answer
    to the same rounds, chain and tree, at T = 0 and T = 0.6."""
    from exittrain.models.dflash_format import export_dflash, load_dflash

    drafter = _trained_drafter(target, prompts, steps=30, layer_ids=[0, 1])  # the format reads no last layer
    report = export_dflash(drafter, tmp_path / "dflash", mask_token_id=15)
    assert report["dropped"] == []
    served = load_dflash(tmp_path / "dflash", target)
    evaluator = HeldOutEvaluator(target, prompts, SETTINGS, reference="exittrain")
    _, rows, chain = evaluator.measure(drafter, "exittrain")
    table, served_rows, served_chain = evaluator.measure(served, "served")
    assert [r["block_lengths"] for r in served_chain] == [r["block_lengths"] for r in chain]
    assert [r["block_lengths"] for r in served_rows] == [r["block_lengths"] for r in rows]
    assert all(row["chain_tau_vs_exittrain"]["delta"] == 0 for row in table)


@pytest.mark.real_model
@pytest.mark.slow  # minutes on a 2-core host (9 min when shared): 24 TEV decodes of 32 tokens, 48 walks on SmolLM2
def test_on_the_embedded_target_the_walk_is_exact_at_zero_and_inside_the_decodes_interval_at_temperature(
        one_thread):
    """SmolLM2-135M with a drafter of the code recipe's shape and the copy branch (drafter=copy_branch:
    random otherwise, it accepts where the branch finds the text). At T = 0 the evaluator's pooled tree and
    chain tau equal the real decodes' exactly; at T = 0.6 the walked pooled tree tau lies inside the 95%
    interval of real TEV decodes of the same prompts."""
    from exittrain.data import chat_prompt_ids, load_domain
    from exittrain.decoding.chain_decoder import ChainDecoder, decode_after_prefill
    from exittrain.models import load_target, new_drafter

    target = load_target(None)
    drafter = new_drafter(target, block_size=8, num_layers=2, init_from_layers="auto", copy_ngrams=[3, 2],
                          copy_gate_init=0.7, seed=0)
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in load_domain("code").eval[:3]]
    settings = dict(budgets=[16], temperatures=[0.0], max_new_tokens=32, verifier="tev", baseline=True,
                    oracle=False, seed=0, decode="fixed", drafter_temperature=1.0)
    table, _, _ = HeldOutEvaluator(target, prompts, settings, reference=None).measure(drafter, "d")
    tree, chain = [], []
    for p in prompts:
        answer = autoregressive_generate(target, p, 32).tokens
        tree.append([r.block_length for r in SpeculativeDecoder(target, drafter, budget=16).generate(p, 32).rounds])
        chain.append([r.block_length for r in decode_after_prefill(ChainDecoder(target, drafter, verifier="greedy"),
                                                                    p, answer[0], 32, target.eos_token_ids)[1]])
    assert table[0]["tau"] == pooled(tree) and table[0]["chain_tau"] == pooled(chain)
    assert pooled(tree) > 1.1  # some drafts accepted: the equality compares something
    T = 0.6
    decoded = [[r.block_length for r in SpeculativeDecoder(target, drafter, budget=16).generate(
        p, 32, temperature=T, seed=s).rounds] for s in range(8) for p in prompts]
    walked = []
    for s in range(16):
        for i, (ids, n, _) in enumerate(answer_sets(target, prompts, [T], 32, seed=50 + s)[T]):
            walked.append(walked_rounds(target, drafter, prompts[i][:-1], prompts[i][-1:] + ids[n:].tolist(),
                                        max_new_tokens=33, shape="ddtree", budget=16, temperature=T, seed=s))
    low, high = bootstrap_ci(decoded)
    assert low <= pooled(walked) <= high, (pooled(walked), low, high)
