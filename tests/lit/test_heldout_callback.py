"""The cheap held-out measures: chain block length against its twin, cadence, fixed rows, learning."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import chain_tree, followed_depth
from exittrain.heldout.round_walk import chain_block_lengths
from exittrain.lit.heldout_callback import HeldOutBlockLengthCallback
from tests.lit.helpers import BLOCK, ListLogger, loader, make_module
from tests.lit.helpers import trainer as make_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]

K = BLOCK - 1


def test_chain_block_lengths_equal_the_chain_tree_twin():
    g = torch.Generator().manual_seed(0)
    N, V = 64, 11
    logits = torch.randn(N, K, V, generator=g)
    labels = torch.randint(0, V, (N, K), generator=g)
    follow = torch.rand(N, K, generator=g) < 0.6  # plant matches so every length 0..K occurs
    labels = torch.where(follow, logits.argmax(-1), labels)
    fast = chain_block_lengths(logits, labels)
    twin = 1.0 + followed_depth(chain_tree(torch.log_softmax(logits, -1)), labels).float()
    assert torch.equal(fast, twin)
    assert set(fast.tolist()) == {float(d) for d in range(1, K + 2)}


@pytest.mark.parametrize(("key", "value"), [("every_n_steps", 0), ("num_rows", 0), ("anchors_per_row", True),
                                            ("budget", 0)])
def test_bad_settings_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        HeldOutBlockLengthCallback(**{key: value})


def test_logged_at_the_configured_cadence_on_fixed_rows(target):
    """7 steps every 2: steps 2, 4, 6; the measure reads the same rows and anchors every time, so it
    changes only when the drafter does."""
    module = make_module(target, stage="pretrain", analytic_every=0)
    logger = ListLogger()
    heldout = HeldOutBlockLengthCallback(every_n_steps=2, num_rows=3, anchors_per_row=4, budget=8)
    trainer = make_trainer(7, callbacks=[heldout], logger=logger, limit_val_batches=0)
    trainer.fit(module, loader(8), loader(4, seed=1))
    assert [h["step"] for h in heldout.history] == [2, 4, 6]
    for name in (HeldOutBlockLengthCallback.CHAIN, HeldOutBlockLengthCallback.TREE):
        values = logger.values(name)
        assert len(values) == 3 and all(1.0 <= v <= K + 1 for v in values), (name, values)
    assert all(h["anchors"] == 3 * 4 for h in heldout.history)  # 3 rows x 4 anchors, every time
    # the tree of 8 nodes holds the chain's path and more: never shorter
    assert all(h[heldout.TREE] >= h[heldout.CHAIN] for h in heldout.history)
    module.drafter.train()
    again = heldout.measure(trainer, module)
    assert module.drafter.training  # measured in eval mode, then put back
    assert again == heldout.measure(trainer, module) and again[heldout.CHAIN] == heldout.history[-1][heldout.CHAIN]


def test_the_chain_measure_rises_as_the_drafter_learns(target):
    """On the target's own greedy answers (self-distilled rows) the chain block length goes up with training."""
    from torch.utils.data import DataLoader

    from tests.lit.helpers import DistilledSequences, collate

    train = DataLoader(DistilledSequences(target, 128, seed=0), batch_size=8, collate_fn=collate)
    val = DataLoader(DistilledSequences(target, 16, seed=1), batch_size=8, collate_fn=collate)
    module = make_module(target, stage="pretrain", lr=1e-2, warmup_ratio=0.1, analytic_every=0)
    heldout = HeldOutBlockLengthCallback(every_n_steps=6, num_rows=16, anchors_per_row=12, budget=None)
    trainer = make_trainer(48, callbacks=[heldout], limit_val_batches=0)
    assert heldout.measure(trainer, module) == {}  # no loaders before fit: nothing measured, nothing fixed
    trainer.fit(module, train, val)
    curve = [h[heldout.CHAIN] for h in heldout.history]
    assert [h["step"] for h in heldout.history] == list(range(6, 49, 6)) and heldout.TREE not in heldout.history[0]
    untrained = heldout.measure(trainer, make_module(target, stage="pretrain"))[heldout.CHAIN]  # the same anchors
    assert curve[-1] > untrained + 0.1, (untrained, curve)


def test_history_survives_a_checkpoint():
    cb = HeldOutBlockLengthCallback()
    cb.history = [{"step": 25, HeldOutBlockLengthCallback.CHAIN: 1.5, "anchors": 8}]
    resumed = HeldOutBlockLengthCallback()
    resumed.load_state_dict(cb.state_dict())
    assert resumed.history == cb.history and resumed._last_step == 25
