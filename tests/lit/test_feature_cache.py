"""ExitTrainModule(feature_cache=True): per-row target features computed once, reused, equal to the uncached ones."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from exittrain.lit import anchor_generator
from tests.lit.helpers import ListLogger, SyntheticSequences, collate, make_module, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]


class IndexedSequences(Dataset):
    """SyntheticSequences rows with a stable id (``first_id + index``), like the regenerated rows' prompt_index."""

    def __init__(self, n: int, *, seed: int = 0, first_id: int = 0):
        self.rows = SyntheticSequences(n, seed=seed).rows
        self.first_id = first_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i], self.first_id + i


def collate_ids(items) -> dict[str, torch.Tensor]:
    batch = collate([row for row, _ in items])
    batch["row_id"] = torch.tensor([i for _, i in items], dtype=torch.long)
    return batch


def batch_with_ids(data: IndexedSequences, indices) -> dict[str, torch.Tensor]:
    return collate_ids([data[i] for i in indices])


@pytest.fixture()
def calls(target, monkeypatch):
    """Rows (as lists of input ids) of every target.sequence_features call during the test."""
    seen: list[torch.Tensor] = []
    original = target.sequence_features

    def counting(input_ids_LT, layers, *args, **kwargs):
        seen.append(input_ids_LT.detach().clone())
        return original(input_ids_LT, layers, *args, **kwargs)

    monkeypatch.setattr(target, "sequence_features", counting)
    return seen


def test_feature_cache_is_validated_and_needs_row_ids(target):
    with pytest.raises(ValueError, match="feature_cache='yes'"):
        make_module(target, feature_cache="yes")
    module = make_module(target, feature_cache=True)
    with pytest.raises(ValueError, match="needs a 'row_id'"):
        module.target_features(collate([SyntheticSequences(2)[i] for i in range(2)]))


def test_cached_features_equal_the_uncached_ones_up_to_bf16(target, calls):
    data = IndexedSequences(3)
    batch = batch_with_ids(data, [0, 1, 2])
    plain = make_module(target, feature_cache=False)
    cached = make_module(target, feature_cache=True)
    ref = plain.target_features(batch)
    first = cached.target_features(batch)
    second = cached.target_features(batch)
    assert first.dtype == ref.dtype == torch.float32 and first.shape == ref.shape
    assert torch.equal(first, second), "a row's features are the same on every visit"
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(first[real], ref[real].bfloat16().float(), rtol=1e-2, atol=1e-2)
    assert first[~real].eq(0).all(), "padding is zero (no anchor sees it)"
    assert len(calls) == 2 and cached.feature_cache_rows == 3  # plain once, cached once


@pytest.mark.parametrize("stage", ["pretrain", "exittrain"])
def test_cached_losses_match_the_uncached_path_on_first_and_second_visit(target, calls, stage):
    batch = batch_with_ids(IndexedSequences(2), [0, 1])
    plain = make_module(target, stage=stage, feature_cache=False)
    cached = make_module(target, stage=stage, feature_cache=True)
    exit_loss = stage == "exittrain"

    def losses(module):
        values, times = module.compute_losses(batch, anchor_generator(0, 0), exit_loss=exit_loss, metrics=exit_loss)
        assert times["features"] >= 0
        return values

    ref = losses(plain)
    first = losses(cached)
    n_calls = len(calls)
    second = losses(cached)
    assert len(calls) == n_calls, "the second visit reads every row from the cache"
    assert cached._feature_rows_computed == 0
    for key in ("loss_tok", "loss") + (("loss_exit",) if exit_loss else ()):
        assert float(first[key].detach()) == float(second[key].detach())
        assert float(first[key].detach()) == pytest.approx(float(ref[key].detach()), rel=2e-2, abs=1e-3)


def test_a_mixed_batch_computes_only_its_new_rows(target, calls):
    data = IndexedSequences(5)
    module = make_module(target, feature_cache=True)
    module.target_features(batch_with_ids(data, [0, 1]))
    assert len(calls) == 1 and calls[0].shape[0] == 2
    mixed = batch_with_ids(data, [3, 1, 4, 0])
    features = module.target_features(mixed)
    assert len(calls) == 2 and module._feature_rows_computed == 2
    new_rows = calls[1]
    lengths = mixed["lengths"]
    assert new_rows.shape == (2, int(max(lengths[0], lengths[2])))  # rows 3 and 4, cut to their longest
    assert torch.equal(new_rows[0, : lengths[0]], mixed["input_ids"][0, : lengths[0]])
    assert torch.equal(new_rows[1, : lengths[2]], mixed["input_ids"][2, : lengths[2]])
    assert module.feature_cache_rows == 4
    # the same rows, in another order and padding, give the same features per row
    again = module.target_features(batch_with_ids(data, [4, 0]))
    assert len(calls) == 2
    for row, i in ((0, 2), (1, 3)):
        n = int(lengths[i])
        assert torch.equal(again[row, :n], features[i, :n])
    module.clear_feature_cache()
    assert module.feature_cache_rows == 0


def test_a_reused_row_id_with_other_tokens_is_refused(target):
    module = make_module(target, feature_cache=True)
    module.target_features(batch_with_ids(IndexedSequences(2, seed=0), [0]))
    with pytest.raises(ValueError, match="row_id 0 was cached with other tokens"):
        module.target_features(batch_with_ids(IndexedSequences(2, seed=1), [0]))


def test_fit_with_feature_cache_computes_each_row_once(target, calls):
    train = DataLoader(IndexedSequences(4), batch_size=2, shuffle=True, collate_fn=collate_ids)
    val = DataLoader(IndexedSequences(2, seed=1, first_id=100), batch_size=2, collate_fn=collate_ids)
    module = make_module(target, stage="pretrain", analytic_every=0, feature_cache=True)
    logger = ListLogger()
    run = trainer(-1, max_epochs=2, logger=logger)
    run.fit(module, train, val)
    assert run.global_step == 4
    assert sum(c.shape[0] for c in calls) == 4 + 2, "each train and val row once, over 2 epochs"
    assert module.feature_cache_rows == 6
    assert logger.values("train/feature_rows_computed") == [2.0, 2.0, 0.0, 0.0]
    assert logger.values("train/feature_cache_rows") == [2.0, 4.0, 6.0, 6.0]  # validation cached 2 after epoch 1
    assert len(logger.values("train/time_features_ms")) == 4
    assert not any(k.startswith("_feature") for k in module.state_dict()), "the cache is never checkpointed"
