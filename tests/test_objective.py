"""The objective as a plain function (exittrain.objective), called without Lightning.

Against the loop twins of core (the fast path and its reference), against the LightningModule's own
training step, and with the target features and soft labels that the feature store puts in the batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from exittrain import objective
from exittrain.core import anchor_generator, build_tree, select_trees, warp_probs
from exittrain.core.exit_law import edge_probabilities
from exittrain.data.collate import Collator
from exittrain.data.feature_store import FeatureStore
from exittrain.lit import ExitTrainModule
from exittrain.models import new_drafter
from exittrain.objective import ObjectiveSettings, batch_features, compute_losses
from tests.lit.helpers import ListLogger, StepLosses, batch_of, trainer
from tests.objective_helpers import reference_losses
from tests.store_helpers import dataset_rows, layouts, synthetic_rows, write_entry

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.usefixtures("one_thread"),
]

K_TOP, MAX_LENGTH = 4, 18


@pytest.fixture(scope="module")
def target(tiny_llama_target):
    return tiny_llama_target


def drafter_of(target, seed: int = 0):
    return new_drafter(target, block_size=4, num_layers=1, hidden_size=32, num_heads=4, seed=seed)


@pytest.fixture(scope="module")
def store_rows(target, tmp_path_factory):
    """``(rows, store)``: synthetic rows and a host-memory store of their features (the drafter's layers) and top-4."""
    rows = synthetic_rows(6, seed=3)
    path = tmp_path_factory.mktemp("entry")
    write_entry(path, target, rows, drafter_of(target).config.target_layer_ids, K_TOP)
    layers = drafter_of(target).config.target_layer_ids
    return rows, FeatureStore.open(path, layouts(rows, MAX_LENGTH), feature_layers=layers, top_k=K_TOP)


def store_batch(store_rows, indices=(0, 1, 2)):
    rows, store = store_rows
    data = dataset_rows(rows)
    return Collator(pad_token_id=0, max_length=MAX_LENGTH, store=store)([data[i] for i in indices])


@pytest.mark.parametrize("feature_cache", [False, True])
@pytest.mark.parametrize("weight_type", ["flow", "missing"])
def test_the_function_matches_the_reference_twins_without_lightning(target, weight_type, feature_cache):
    drafter = drafter_of(target)
    # gamma=None: the twin's block CE has no depth decay (the decay is checked against its twin below)
    settings = ObjectiveSettings(weight_type=weight_type, alpha=0.05, lambda_tok=0.5, lambda_exit=2.0,
                                 anchors_per_seq=12, budget=8, feature_cache=feature_cache, gamma=None)
    batch = batch_of(3, seed=4)  # no stored features: computed (bf16-rounded with feature_cache)
    with torch.no_grad():
        out = compute_losses(drafter, target, batch, settings, anchor_generator(0, 0), exit_loss=True, metrics=True)
        ref = reference_losses(drafter, target, settings, batch, anchor_generator(0, 0))
    ref_tok, ref_exit, ref_tau, ref_greedy = ref
    values = out.values
    assert out.feature_rows_computed == 3 and set(out.times_ms) == {"features", "draft", "tree", "score", "exit"}
    assert float(values["loss_tok"]) == pytest.approx(ref_tok, rel=1e-5)
    assert float(values["loss_exit"]) == pytest.approx(ref_exit, rel=1e-5)
    assert float(values["loss"]) == pytest.approx(0.5 * ref_tok + 2.0 * ref_exit, rel=1e-5)
    assert float(values["analytic_block_length"]) == pytest.approx(float(ref_tau), rel=1e-5)
    assert float(values["greedy_block_length"]) == pytest.approx(ref_greedy, rel=1e-6)


@pytest.mark.parametrize("stage", ["pretrain", "exittrain"])
def test_the_function_gives_the_modules_training_step_loss(target, store_rows, stage):
    """Step 0 of a Lightning fit on store-served batches, and the function on the same batch and weights."""
    drafter = drafter_of(target)
    before = copy.deepcopy(drafter)
    args = dict(stage=stage, anchors_per_seq=4, budget=6, seed=3, feature_cache=True, soft_label_weight=0.5,
                soft_label_top_k=K_TOP, gamma=0.8, vocab_sample=16 if stage == "pretrain" else None, analytic_every=1)
    module = ExitTrainModule(drafter, target, **args)
    rows, store = store_rows
    loader = DataLoader(dataset_rows(rows), batch_size=3, shuffle=False,
                        collate_fn=Collator(pad_token_id=0, max_length=MAX_LENGTH, store=store))
    losses = StepLosses()
    trainer(1, callbacks=[losses]).fit(module, loader)
    batch = next(iter(loader))
    before.train()  # as the module trains it
    out = compute_losses(before, target, batch, module.objective, anchor_generator(3, 0, 0, stream=0),
                         exit_loss=stage == "exittrain", metrics=True, vocab_sample=args["vocab_sample"],
                         soft_labels=True)
    assert out.feature_rows_computed == 0
    assert float(out.values["loss"].detach()) == pytest.approx(losses.losses[0], rel=1e-6)


def test_stored_features_are_read_from_the_batch_not_computed(target, store_rows, monkeypatch):
    batch = store_batch(store_rows)
    drafter = drafter_of(target)
    ref, computed = batch_features(drafter, target, batch, ObjectiveSettings(feature_cache=False))
    assert computed == 3

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran over rows whose features the batch carried")

    monkeypatch.setattr(target, "sequence_features", no_forward)
    stored, computed = batch_features(drafter, target, batch, ObjectiveSettings(feature_cache=True))
    assert computed == 0 and stored.dtype == ref.dtype == torch.float32 and stored.shape == ref.shape
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(stored[real], ref[real].bfloat16().float(), rtol=1e-2, atol=1e-2)
    assert stored[~real].eq(0).all(), "padding is zero (no anchor sees it)"
    wrong = {**batch, "feature_layers": batch["feature_layers"].flip(0)}
    with pytest.raises(ValueError, match="drafter reads layers"):
        batch_features(drafter, target, wrong, ObjectiveSettings(feature_cache=True))


@pytest.mark.parametrize("stage", ["pretrain", "exittrain"])
def test_losses_on_stored_features_match_the_computed_ones(target, store_rows, stage):
    batch = store_batch(store_rows, (3, 4))
    drafter = drafter_of(target)
    exit_loss = stage == "exittrain"

    def losses(feature_cache):
        settings = ObjectiveSettings(stage=stage, anchors_per_seq=4, budget=6, feature_cache=feature_cache)
        return compute_losses(drafter, target, batch, settings, anchor_generator(0, 0), exit_loss=exit_loss,
                              metrics=exit_loss)

    with torch.no_grad():
        ref, first, second = losses(False), losses(True), losses(True)
    assert first.feature_rows_computed == 0 and ref.feature_rows_computed == 2 and first.times_ms["features"] >= 0
    first, second, ref = first.values, second.values, ref.values
    for key in ("loss_tok", "loss") + (("loss_exit",) if exit_loss else ()):
        assert float(first[key]) == float(second[key]), "a row gives the same loss on every visit"
        assert float(first[key]) == pytest.approx(float(ref[key]), rel=2e-2, abs=1e-3)


def test_a_fit_on_store_batches_never_runs_the_target_over_a_row(target, store_rows, monkeypatch):
    rows, store = store_rows
    data = dataset_rows(rows)
    collate = Collator(pad_token_id=0, max_length=MAX_LENGTH, store=store)
    train = DataLoader(data[:4], batch_size=2, shuffle=True, collate_fn=collate)
    val = DataLoader(data[4:], batch_size=2, collate_fn=collate)

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran over a row whose features and soft labels the store keeps")

    monkeypatch.setattr(target, "sequence_features", no_forward)
    monkeypatch.setattr(target, "token_top_logprobs", no_forward)
    module = ExitTrainModule(drafter_of(target), target, stage="pretrain", anchors_per_seq=4, analytic_every=0,
                             feature_cache=True, soft_label_weight=1.0, soft_label_top_k=K_TOP, seed=0)
    logger = ListLogger()
    run = trainer(-1, max_epochs=2, logger=logger)
    run.fit(module, train, val)
    assert run.global_step == 4
    assert logger.values("train/feature_rows_computed") == [0.0, 0.0, 0.0, 0.0]
    assert len(logger.values("train/time_features_ms")) == 4 and len(logger.values("val/loss_tok")) == 2
    assert all(k.startswith("drafter.") for k in module.state_dict()), "the store is data, never checkpointed"
    monkeypatch.undo()
    # without feature_cache the target computes every row of every step, whatever the batch carries
    plain = ExitTrainModule(drafter_of(target), target, stage="pretrain", anchors_per_seq=4, analytic_every=0,
                            feature_cache=False, seed=0)
    logger = ListLogger()
    trainer(2, logger=logger).fit(plain, train)
    assert logger.values("train/feature_rows_computed") == [2.0, 2.0]


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_tree_edges_equal_the_edges_of_the_whole_distribution(temperature, monkeypatch):
    """A few trees at a time, the edges are exactly those of the whole (n, B+1, V) distribution."""
    torch.manual_seed(0)
    N, K, V, B = 9, 3, 50, 6
    trees = build_tree(torch.randn(N, K, V).log_softmax(-1), B)
    logits = torch.randn(N, B + 1, V) * 3
    index = torch.tensor([0, 2, 3, 5, 6, 8])
    probs = torch.softmax(logits[index], -1) if temperature == 1.0 else warp_probs(logits[index], temperature)
    whole = edge_probabilities(select_trees(trees, index), probs)
    monkeypatch.setattr(objective, "EDGE_CHUNK_ELEMENTS", 2 * (B + 1) * V)  # 3 chunks of 2 trees
    assert torch.equal(objective.tree_edges(trees, logits, index, temperature), whole)


@pytest.mark.parametrize("exit_loss", [False, True])
def test_the_tree_law_never_holds_every_trees_distribution(target, exit_loss, monkeypatch):
    """The tree metrics and the node loss's law take the softmax of one chunk of trees at a time, never of
    every tree's (B+1, V) rows at once (with the validation's 256 trees of SmolLM2 that tensor and its
    indexed copy held 1.7 GB), and give exactly the values of one whole chunk."""
    settings = ObjectiveSettings(anchors_per_seq=6, budget=5, law_temperature=0.7)
    batch = batch_of(3, seed=4)
    drafter = drafter_of(target)

    def losses():
        with torch.no_grad():
            return compute_losses(drafter, target, batch, settings, anchor_generator(0, 0), exit_loss=exit_loss,
                                  metrics=True).values

    whole = losses()  # the default chunk holds every tree of this tiny batch
    rows = []
    softmax = torch.softmax

    def spy(x, *args, **kwargs):
        rows.append(tuple(x.shape))
        return softmax(x, *args, **kwargs)

    monkeypatch.setattr(objective, "EDGE_CHUNK_ELEMENTS", (settings.budget + 1) * target.vocab_size)  # 1 tree
    monkeypatch.setattr(torch, "softmax", spy)
    chunked = losses()
    tree_rows = [shape for shape in rows if shape[1:] == (settings.budget + 1, target.vocab_size)]
    assert tree_rows and all(shape[0] == 1 for shape in tree_rows), tree_rows
    assert whole.keys() == chunked.keys()
    for key, value in whole.items():
        assert torch.equal(value, chunked[key]), key


def test_the_objective_imports_no_lightning():
    import subprocess
    import sys

    code = "import sys, exittrain.objective; sys.exit(int(any(m.split('.')[0] == 'lightning' for m in sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
