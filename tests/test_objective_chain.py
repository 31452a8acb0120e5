"""ExitTrain on the chain a serving engine verifies (``tree.shape=chain``): the objective's trees, losses and
metrics against the loop twins of core on the drafter's greedy chain, and ``ddtree`` left as it was."""

from __future__ import annotations

import pytest
import torch

import tests.objective_helpers as helpers
from exittrain.core import TREE_SHAPES, anchor_generator, build_tree, chain_tree, chain_tree_reference
from exittrain.lit import ExitTrainModule
from exittrain.models import new_drafter
from exittrain.objective import ObjectiveSettings, compute_losses
from tests.lit.helpers import ListLogger, StepLosses, batch_of, loader, make_module, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(scope="module")
def target(tiny_llama_target):
    return tiny_llama_target


def drafter_of(target, seed: int = 0):
    return new_drafter(target, block_size=4, num_layers=1, hidden_size=32, num_heads=4, seed=seed)  # K = 3


def scored_trees(target, monkeypatch) -> list:
    """The trees the objective hands to the target's scoring, in call order."""
    seen, score = [], target.score_trees

    def spy(input_ids, anchors, trees, **kwargs):
        seen.append(trees)
        return score(input_ids, anchors, trees, **kwargs)

    monkeypatch.setattr(target, "score_trees", spy)
    return seen


@pytest.mark.parametrize("weight_type", ["flow", "missing"])
@pytest.mark.parametrize("budget", [2, 8])  # below K, and above it: a chain has min(budget, K) nodes
def test_chain_objective_matches_the_loop_twins_on_the_chain(target, weight_type, budget, monkeypatch):
    drafter = drafter_of(target)
    K = drafter.config.num_draft_tokens
    settings = ObjectiveSettings(weight_type=weight_type, alpha=0.05, lambda_tok=0.5, lambda_exit=2.0,
                                 anchors_per_seq=10, budget=budget, feature_cache=False, gamma=None,
                                 tree_shape="chain")
    batch = batch_of(3, seed=4)
    seen = scored_trees(target, monkeypatch)
    with torch.no_grad():
        out = compute_losses(drafter, target, batch, settings, anchor_generator(0, 0), exit_loss=True, metrics=True)
        # the twin builds its trees with build_tree: give it the chain's slow twin instead
        monkeypatch.setattr(helpers, "build_tree", lambda lp, B: chain_tree_reference(lp, min(B, lp.shape[1])))
        ref_tok, ref_exit, ref_tau, ref_greedy = helpers.reference_losses(
            drafter, target, settings, batch, anchor_generator(0, 0))
    (trees,) = seen[:1]
    B = min(budget, K)
    assert trees.tokens.shape[1] == B and trees.max_depth == K
    assert torch.equal(trees.parents[0], torch.arange(B)) and bool(trees.valid.all())  # a chain, every node valid
    values = out.values
    assert float(values["loss_tok"]) == pytest.approx(ref_tok, rel=1e-5)
    assert float(values["loss_exit"]) == pytest.approx(ref_exit, rel=1e-5)
    assert float(values["analytic_block_length"]) == pytest.approx(float(ref_tau), rel=1e-5)
    assert float(values["greedy_block_length"]) == pytest.approx(ref_greedy, rel=1e-6)
    assert 1.0 <= float(values["analytic_block_length"]) <= 1.0 + B
    assert set(k for k in values if k.startswith("exit_mass_d")) == {f"exit_mass_d{d}" for d in range(K + 1)}


def test_each_shape_scores_its_own_trees_and_ddtree_is_build_tree(target, monkeypatch):
    """``ddtree`` (the default) scores ``build_tree``'s trees as before; ``chain`` the greedy chain, on the same
    drafter log-probabilities; the chain's node loss still has gradients into the drafter."""
    drafter = drafter_of(target, seed=2)
    batch = batch_of(2, seed=1)
    seen = scored_trees(target, monkeypatch)
    logits = []
    forward = drafter.forward_anchors
    monkeypatch.setattr(drafter, "forward_anchors", lambda *a, **k: (logits.append(forward(*a, **k)) or logits[-1]))
    results = {}
    for shape in TREE_SHAPES:
        settings = ObjectiveSettings(anchors_per_seq=6, budget=5, feature_cache=False, tree_shape=shape)
        results[shape] = compute_losses(drafter, target, batch, settings, anchor_generator(0, 0), exit_loss=True,
                                        metrics=True)
    assert ObjectiveSettings().tree_shape == "ddtree"
    logq = [torch.log_softmax(out[0].detach().float(), -1) for out in logits]
    want = {"ddtree": build_tree(logq[0], 5), "chain": chain_tree(logq[1], 3)}
    for shape, trees in zip(TREE_SHAPES, seen):
        for name in ("tokens", "parents", "depths", "valid"):
            assert torch.equal(getattr(trees, name), getattr(want[shape], name)), (shape, name)
    chain = results["chain"].values
    chain["loss"].backward()
    grads = [p.grad for p in drafter.parameters() if p.requires_grad]
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_tree_shape_is_checked_and_reaches_the_module(target):
    with pytest.raises(ValueError, match=r"tree_shape='path': tree.shape must be one of \('ddtree', 'chain'\)"):
        ObjectiveSettings(tree_shape="path")
    module = ExitTrainModule(drafter_of(target), target, tree_shape="chain", anchors_per_seq=2)
    assert module.objective.tree_shape == "chain" and module.hparams["tree_shape"] == "chain"


def test_a_lightning_fit_trains_on_the_chain_and_logs_its_metrics(target):
    """Two ExitTrain steps with ``tree_shape="chain"``: the loss of step 0 is the function's on the first batch,
    the chain's tree metrics are logged, the drafter moves and the target does not."""
    module = make_module(target, tree_shape="chain", budget=8, lambda_exit=1.0)
    drafter_before = {k: v.clone() for k, v in module.drafter.state_dict().items()}
    target_before = {k: v.clone() for k, v in target.model.state_dict().items()}
    batches = loader(4, seed=5)
    first = next(iter(batches))
    with torch.no_grad():
        module.drafter.train()
        want = compute_losses(module.drafter, target, first, module.objective, anchor_generator(0, 0, 0, stream=0),
                              exit_loss=True, metrics=True)
    logger, losses = ListLogger(), StepLosses()
    trainer(2, logger=logger, callbacks=[losses]).fit(module, batches)
    assert losses.losses[0] == pytest.approx(float(want.values["loss"]), rel=1e-6)
    tau = logger.values("train/analytic_block_length")
    assert len(tau) == 2 and all(1.0 <= t <= 1.0 + 3 for t in tau)  # a chain of K = 3 nodes
    assert len(logger.values("train/loss_exit")) == 2
    assert any(not torch.equal(v, drafter_before[k]) for k, v in module.drafter.state_dict().items())
    assert all(torch.equal(v, target_before[k]) for k, v in target.model.state_dict().items())
