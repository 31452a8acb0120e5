"""The FeatureStore's two modes (host memory, read per batch from disk) and the collator that serves it."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from exittrain.data.collate import Collator
from exittrain.data.feature_store import FeatureStore, RowLayout, check_store_settings, open_entry_store
from exittrain.data.regen_cache import features_file, top_logprobs_file
from tests.models.helpers import tiny_target
from tests.store_helpers import dataset_rows, layouts, synthetic_rows, write_entry

LAYERS, K, MAX_LENGTH = [2, 0], 4, 16


@pytest.fixture(scope="module")
def entry(tmp_path_factory):
    target = tiny_target("llama")
    rows = synthetic_rows(4)
    path = tmp_path_factory.mktemp("entry")
    return path, rows, write_entry(path, target, rows, LAYERS, K)


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_both_modes_serve_every_row_cut_to_max_length(entry, mode):
    path, rows, kept = entry
    store = FeatureStore.open(path, layouts(rows, MAX_LENGTH), feature_layers=LAYERS, top_k=K, mode=mode)
    assert store.has_features and store.has_top_logprobs and len(store) == 4 and store.mode == mode
    assert (store._features is None) == (mode == "disk"), "disk mode reads nothing at open"
    assert any(len(ids) > MAX_LENGTH for ids, _ in rows.values()), "some rows are cut"
    for copy in (store, pickle.loads(pickle.dumps(store))):  # a DataLoader worker gets a pickled copy
        for r, (ids, n_prompt) in rows.items():
            n = min(len(ids), MAX_LENGTH)
            feats, top_ids, top_logp = kept[r]
            assert torch.equal(copy.features(r), feats[:n]) and copy.features(r).dtype == torch.bfloat16
            start, got_ids, got_logp = copy.top_logprobs(r)
            assert start == n_prompt and got_ids.shape == (n - n_prompt, K)
            assert torch.equal(got_ids, top_ids[: n - n_prompt]) and torch.equal(got_logp, top_logp[: n - n_prompt])
    with pytest.raises(ValueError, match="row_id 99 is not a row"):
        store.features(99)


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_what_the_entry_lacks_is_not_served(entry, mode):
    path, rows, _ = entry
    other = FeatureStore.open(path, layouts(rows, MAX_LENGTH), feature_layers=[0, 2], top_k=3, mode=mode)
    assert not other.has_features and not other.has_top_logprobs  # kept for layers [2, 0] and k = 4 only
    batch = Collator(pad_token_id=0, max_length=MAX_LENGTH, store=other)(dataset_rows(rows))
    assert "features" not in batch and "top_ids" not in batch
    with pytest.raises(ValueError, match="keeps no target features"):
        other.features(10)
    with pytest.raises(ValueError, match="feature_store='ram'"):
        FeatureStore.open(path, layouts(rows, MAX_LENGTH), feature_layers=LAYERS, mode="ram")


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_collator_puts_the_stored_rows_in_the_batch(entry, mode):
    path, rows, kept = entry
    store = FeatureStore.open(path, layouts(rows, MAX_LENGTH), feature_layers=LAYERS, top_k=K, mode=mode)
    batch = Collator(pad_token_id=0, max_length=MAX_LENGTH, store=store)(dataset_rows(rows))
    L, T = batch["input_ids"].shape
    assert batch["features"].shape == (L, T, 2 * 32) and batch["features"].dtype == torch.bfloat16
    assert batch["feature_layers"].tolist() == LAYERS
    assert batch["top_ids"].shape == batch["top_logprobs"].shape == (L, T, K)
    for i, r in enumerate(batch["row_id"].tolist()):
        n, p = int(batch["lengths"][i]), int(batch["n_prompt_tokens"][i])
        feats, top_ids, top_logp = kept[r]
        assert torch.equal(batch["features"][i, :n], feats[:n]) and batch["features"][i, n:].eq(0).all()
        assert torch.equal(batch["top_ids"][i, p:n], top_ids[: n - p])
        assert torch.equal(batch["top_logprobs"][i, p:n], top_logp[: n - p])
        outside = torch.ones(T, dtype=torch.bool)
        outside[p:n] = False
        assert torch.isneginf(batch["top_logprobs"][i, outside]).all() and batch["top_ids"][i, outside].eq(0).all()


def test_collator_with_a_store_needs_row_ids_and_rows_of_the_stored_length(entry):
    path, rows, _ = entry
    store = FeatureStore.open(path, layouts(rows, MAX_LENGTH), feature_layers=LAYERS, top_k=K)
    collate = Collator(pad_token_id=0, max_length=MAX_LENGTH, store=store)
    plain = [{k: v for k, v in row.items() if k != "prompt_index"} for row in dataset_rows(rows)]
    with pytest.raises(ValueError, match="needs rows that carry prompt_index"):
        collate(plain)
    # a row whose tokens are not the stored row's (another dataset, reused ids): refused, naming it
    short = dataset_rows(rows)[:1]
    short[0] = {**short[0], "input_ids": short[0]["input_ids"][:8], "loss_mask": short[0]["loss_mask"][:8]}
    with pytest.raises(ValueError, match="row_id 10"):
        collate(short)
    other = dataset_rows(rows)[:1]  # the same length, other tokens
    other[0] = {**other[0], "input_ids": [x + 1 for x in other[0]["input_ids"]]}
    with pytest.raises(ValueError, match="row_id 10: its .* tokens are not those of the row the store keeps"):
        collate(other)
    # without fingerprints only the lengths are checked: the collator's own check catches a shorter row
    bare = {r: RowLayout(v.tokens, v.prompt, v.kept) for r, v in layouts(rows, MAX_LENGTH).items()}
    unchecked = Collator(pad_token_id=0, max_length=MAX_LENGTH, store=FeatureStore.open(path, bare, top_k=K))
    with pytest.raises(ValueError, match="row_id 10: its kept top log-probabilities end at token"):
        unchecked(short)


@pytest.mark.parametrize("mode", ["memory", "disk"])
@pytest.mark.parametrize("kind", ["features", "top_logprobs"])
def test_a_stored_row_of_the_wrong_length_is_refused_at_open(entry, tmp_path, mode, kind):
    path, rows, _ = entry
    for name in (features_file(LAYERS), top_logprobs_file(K)):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    name = features_file(LAYERS) if kind == "features" else top_logprobs_file(K)
    tensors = load_file(str(tmp_path / name))
    keys = ["11"] if kind == "features" else ["11.ids", "11.logp"]
    for key in keys:
        tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(tmp_path / name))
    with pytest.raises(ValueError, match=f"of row 11 cover .* delete {name}"):
        FeatureStore.open(tmp_path, layouts(rows, MAX_LENGTH), feature_layers=LAYERS, top_k=K, mode=mode)


def test_open_entry_store_opens_only_when_asked_and_warns_about_what_the_entry_lacks(entry, caplog):
    path, rows, kept = entry
    triples = [(r, ids.tolist(), p) for r, (ids, p) in rows.items()]
    assert open_entry_store(path, triples, max_length=MAX_LENGTH, feature_layers=None, top_k=0, mode="memory") is None
    store = open_entry_store(path, triples, max_length=MAX_LENGTH, feature_layers=LAYERS, top_k=K, mode="disk")
    assert store.summary() == {"mode": "disk", "feature_layers": LAYERS, "top_logprobs": K}
    assert store.rows == layouts(rows, MAX_LENGTH) and "keeps no" not in caplog.text
    other = open_entry_store(path, triples, max_length=MAX_LENGTH, feature_layers=[0, 2], top_k=3, mode="memory")
    assert other.summary() == {"mode": "memory", "feature_layers": None, "top_logprobs": 0}
    assert "keeps no target features of layers [0, 2]" in caplog.text
    assert "keeps no top-3 log-probabilities" in caplog.text


def test_bad_store_settings_raise_naming_the_setting():
    check_store_settings(0, "memory")
    check_store_settings(4, "disk")
    with pytest.raises(ValueError, match="top_logprobs=-2 must be an int >= 0"):
        check_store_settings(-2, "memory")
    with pytest.raises(ValueError, match="top_logprobs=1.5"):
        check_store_settings(1.5, "memory")
    with pytest.raises(ValueError, match="feature_store='ram': must be one of"):
        check_store_settings(0, "ram")


def test_the_memory_store_holds_each_row_once_in_its_own_memory(entry, monkeypatch):
    """The rows are read one at a time (never the whole file beside them: it held the features twice), each
    kept row owns exactly its bytes (no view of an uncut row), and the files are closed once the rows are
    read: the store is the only copy of the features in the process."""
    import exittrain.safe_io

    def whole_file(*args, **kwargs):
        raise AssertionError("the memory store read a whole file at once")

    monkeypatch.setattr(exittrain.safe_io, "load_file", whole_file)
    path, rows, kept = entry
    store = FeatureStore.open(path, layouts(rows, MAX_LENGTH), feature_layers=LAYERS, top_k=K, mode="memory")
    assert store._handles == {}
    assert any(len(ids) > MAX_LENGTH for ids, _ in rows.values()), "some rows are cut"
    for r, (ids, n_prompt) in rows.items():
        n = min(len(ids), MAX_LENGTH)
        feats = store.features(r)
        assert torch.equal(feats, kept[r][0][:n])
        assert feats.untyped_storage().nbytes() == feats.numel() * feats.element_size()
        _, top_ids, top_logp = store.top_logprobs(r)
        for t in (top_ids, top_logp):
            assert t.shape[0] == n - n_prompt and t.untyped_storage().nbytes() == t.numel() * t.element_size()
