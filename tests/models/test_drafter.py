"""The block drafter: shapes, causality, decode/training path agreement, saving without the
target's weights, target pairing, gradients and bf16 autocast (tiny targets, CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from exittrain.core import build_tree
from exittrain.models import BlockDrafter, DrafterConfig, load_drafter, new_drafter
from exittrain.models.drafter.starting_points import default_layer_ids
from tests.models.helpers import VOCAB, tiny_target

S = 4  # block size: K = 3 predicted tokens


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture()
def drafter(target):
    d = new_drafter(target, block_size=S, num_layers=2, num_heads=4, seed=0, layer_ids=[0, 2])
    # make the layers matter: the default init leaves the residual stream near the root embedding
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d


def _features(L: int, T: int, F: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(L, T, F, generator=torch.Generator().manual_seed(seed))


def _ids(L: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, (L, T), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_config(target, drafter):
    F = drafter.config.feature_size
    assert F == 2 * target.hidden_size and drafter.config.num_draft_tokens == S - 1
    logits = drafter(_features(3, 5, F), torch.tensor([2, 3, 4]))
    assert logits.shape == (3, S - 1, VOCAB) and torch.isfinite(logits).all()
    hidden = drafter(_features(3, 5, F), torch.tensor([2, 3, 4]), apply_lm_head=False)
    assert hidden.shape == (3, S - 1, target.hidden_size)
    torch.testing.assert_close(target.lm_head(hidden), logits)
    anchors = drafter.forward_anchors(_features(2, 9, F), _ids(2, 9), torch.tensor([[0, 3, 8], [1, 2, 5]]))
    assert anchors.shape == (6, S - 1, VOCAB)


def test_narrow_drafter_projects_to_target_width(target):
    d = new_drafter(target, block_size=3, hidden_size=16, num_heads=2, seed=1)
    assert d.input_proj is not None and d.output_proj is not None
    out = d(_features(2, 4, d.config.feature_size), torch.tensor([5, 6]))
    assert out.shape == (2, 2, VOCAB)


def test_default_layer_ids_spread_over_depth():
    assert default_layer_ids(30) == [2, 15, 28]
    assert default_layer_ids(3) == [1, 2]
    assert default_layer_ids(1) == [0]


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="block_size"):
        DrafterConfig(block_size=1)
    with pytest.raises(ValueError, match="num_heads"):
        DrafterConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterConfig(target_name="t", target_num_layers=3, target_hidden_size=8, target_layer_ids=[3])


def test_target_weights_are_not_drafter_parameters(target, drafter):
    target_ids = {id(p) for p in target.model.parameters()}
    assert not target_ids & {id(p) for p in drafter.parameters()}
    table = tuple(target.input_embeddings.weight.shape)
    assert not any(tuple(v.shape) == table for v in drafter.state_dict().values())
    assert drafter.mask_embedding.requires_grad


def test_gradients_reach_only_the_drafter(target, drafter):
    F = drafter.config.feature_size
    logits = drafter.forward_anchors(_features(2, 8, F), _ids(2, 8), torch.tensor([[2, 5], [1, 7]]))
    labels = torch.randint(0, VOCAB, logits.shape[:2])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in target.model.parameters())


def test_output_at_anchor_ignores_features_at_and_after_it(drafter):
    L, T, F = 1, 10, drafter.config.feature_size
    feats, ids = _features(L, T, F, seed=3), _ids(L, T, seed=3)
    anchors = torch.tensor([[4, 7]])
    base = drafter.forward_anchors(feats, ids, anchors)
    later = feats.clone()
    later[:, 4:] += 5.0  # positions >= 4: invisible to anchor 4, visible to anchor 7
    moved = drafter.forward_anchors(later, ids, anchors)
    torch.testing.assert_close(moved[0], base[0], atol=1e-5, rtol=0)
    assert (moved[1] - base[1]).abs().max() > 1e-3
    earlier = feats.clone()
    earlier[:, 3] += 5.0
    assert (drafter.forward_anchors(earlier, ids, anchors)[0] - base[0]).abs().max() > 1e-3
    # other tokens than the root do not matter either (labels never leak in)
    ids2 = ids.clone()
    ids2[:, 5:7] = (ids2[:, 5:7] + 1) % VOCAB
    torch.testing.assert_close(drafter.forward_anchors(feats, ids2, anchors)[0], base[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_training_path_equals_decode_path(drafter, window):
    L, T, F = 2, 9, drafter.config.feature_size
    feats, ids = _features(L, T, F, seed=5), _ids(L, T, seed=5)
    anchors = torch.tensor([[0, 2, 8], [5, 1, 6]])
    batched = drafter.forward_anchors(feats, ids, anchors, context_window=window)
    # decode path: each anchor's prefix right-aligned and left-padded into one batch
    C = int(anchors.max())
    ctx = torch.zeros(L * 3, C, F)
    mask = torch.zeros(L * 3, C, dtype=torch.bool)
    roots = torch.empty(L * 3, dtype=torch.long)
    pairs = [(seq, a) for seq in range(L) for a in anchors[seq].tolist()]
    for n, (l, a) in enumerate(pairs):
        if a:
            ctx[n, C - a :] = feats[l, :a]
            mask[n, C - a :] = True
        roots[n] = ids[l, a]
    decoded = drafter(ctx, roots, mask, context_window=window)
    torch.testing.assert_close(batched, decoded, atol=2e-5, rtol=0)


def test_context_window_drops_older_features(drafter):
    F = drafter.config.feature_size
    feats, ids, anchors = _features(1, 10, F, seed=7), _ids(1, 10, seed=7), torch.tensor([[9]])
    base = drafter.forward_anchors(feats, ids, anchors, context_window=4)
    old = feats.clone()
    old[:, :5] += 5.0  # positions < 9 - 4
    torch.testing.assert_close(drafter.forward_anchors(old, ids, anchors, context_window=4), base, atol=1e-5, rtol=0)
    full_old, full = drafter.forward_anchors(old, ids, anchors), drafter.forward_anchors(feats, ids, anchors)
    assert (full_old - full).abs().max() > 1e-3


def test_save_load_roundtrip_without_target_weights(target, drafter, tmp_path):
    F = drafter.config.feature_size
    feats, roots = _features(2, 6, F, seed=9), torch.tensor([7, 8])
    before = drafter(feats, roots)
    drafter.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        numel = sum(f.get_tensor(k).numel() for k in keys)
    assert keys == set(drafter.state_dict())
    assert numel == sum(p.numel() for p in drafter.parameters())
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert not any(tuple(f.get_tensor(k).shape) == (VOCAB, target.hidden_size) for k in keys)

    loaded = load_drafter(tmp_path, target)
    assert loaded.has_target and isinstance(loaded, BlockDrafter)
    assert loaded.config.target_name == target.name and loaded.config.target_layer_ids == [0, 2]
    torch.testing.assert_close(loaded(feats, roots), before, atol=0, rtol=0)
    again = BlockDrafter.from_pretrained(tmp_path, target=target)
    torch.testing.assert_close(again(feats, roots), before, atol=0, rtol=0)


def test_pairing_errors_name_both_targets_and_the_field(target, drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    other = tiny_target("qwen3", layers=2)
    with pytest.raises(ValueError, match="target_num_layers") as err:
        load_drafter(tmp_path, other)
    assert "tiny-llama" in str(err.value) and "tiny-qwen3" in str(err.value)

    renamed = tiny_target("llama")
    renamed.name = "my-llama"
    with pytest.raises(ValueError, match="target_name") as err:
        load_drafter(tmp_path, renamed)
    assert "tiny-llama" in str(err.value) and "my-llama" in str(err.value)
    assert load_drafter(tmp_path, renamed, check_name=False).has_target

    wider = tiny_target("llama")
    wider.vocab_size = VOCAB + 1
    with pytest.raises(ValueError, match="target_vocab_size"):
        drafter.attach_target(wider)


def test_forward_without_target_fails_clearly(drafter):
    bare = BlockDrafter(drafter.config)
    with pytest.raises(ValueError, match="attach_target"):
        bare(_features(1, 2, drafter.config.feature_size), torch.tensor([1]))


def test_mask_embedding_starts_at_mask_token(target):
    d = new_drafter(target, block_size=3, mask_token_id=5, seed=0)
    torch.testing.assert_close(d.mask_embedding.detach(), target.input_embeddings.weight[5])


def test_mask_embedding_starts_at_zero_without_mask_token(target):
    d = new_drafter(target, block_size=3, seed=0)
    assert float(d.mask_embedding.detach().abs().max()) == 0.0
    assert float(BlockDrafter(d.config).mask_embedding.detach().abs().max()) == 0.0  # same without new_drafter
    F = d.config.feature_size
    logits = d.forward_anchors(_features(1, 6, F), _ids(1, 6), torch.tensor([[2, 3]]))
    assert torch.isfinite(logits).all()


def test_bf16_autocast_forward_and_backward(drafter):
    F = drafter.config.feature_size
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = drafter.forward_anchors(_features(2, 8, F), _ids(2, 8), torch.tensor([[3, 6], [2, 7]]))
        loss = logits.float().logsumexp(-1).mean()
    assert torch.isfinite(logits.float()).all()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())


def test_drafter_feeds_tree_building_and_scoring(target, drafter):
    """End to end on shapes: target features -> drafter -> trees -> exact target scores."""
    seqs, anchors = _ids(2, 10, seed=11), torch.tensor([[2, 6], [4, 5]])
    feats = target.sequence_features(seqs, drafter.config.target_layer_ids)
    with torch.no_grad():
        logq = torch.log_softmax(drafter.forward_anchors(feats, seqs, anchors).float(), -1)
    trees = build_tree(logq, 5)
    scores = target.score_trees(seqs, anchors, trees)
    assert scores.logits.shape == (4, 6, VOCAB) and torch.isfinite(scores.logits).all()


def test_init_from_target_layers_reproduces_the_target_layer():
    """A drafter layer copied from Qwen3 target layer 2, fed target layer 1's output as its context
    (the identity context projection) and as its query row, computes target layer 2's output there
    (Q/K norms and grouped-query heads included)."""
    target = tiny_target("qwen3")
    d = new_drafter(target, block_size=S, num_layers=1, layer_ids=[1], init_from_layers=[2], seed=0)
    assert d.config.num_heads == 4 and d.config.intermediate_size == 64  # the target's, not 3 * D
    assert d.config.num_key_value_heads == 2 and d.config.head_dim == 8
    assert d.config.rope_theta == target.config.rope_parameters["rope_theta"]
    ids = _ids(2, 9, seed=3)
    captured = {}
    from exittrain.models.target_model import layer_output_hooks

    with torch.no_grad(), layer_output_hooks(target.model, [1, 2], captured.__setitem__):
        target.model(input_ids=ids)
    h1, h2 = captured[1], captured[2]  # (L, T, H)
    L, T, _ = h1.shape
    with torch.no_grad():
        ctx = d._context(h1[:, :-1])  # (L, T-1, H)
        pos_ctx = torch.arange(T - 1).expand(L, T - 1)
        pos_x = torch.full((L, 1), T - 1)
        allowed = torch.ones(L, 1, T, dtype=torch.bool)
        out = d.layers[0](h1[:, -1:], pos_x, allowed, ctx_BCD=ctx, ctx_pos_BC=pos_ctx)
    torch.testing.assert_close(out, h2[:, -1:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(d.norm.weight, target.model.get_decoder().norm.weight)
    # a random start does not: the check can fail
    r = new_drafter(
        target, block_size=S, num_layers=1, layer_ids=[1], num_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, seed=0,
    )
    with torch.no_grad():
        other = r.layers[0](h1[:, -1:], pos_x, allowed, ctx_BCD=r._context(h1[:, :-1]), ctx_pos_BC=pos_ctx)
    assert (other - h2[:, -1:]).abs().max() > 1e-2


def test_init_from_target_layers_rejects_bad_shapes(target):
    with pytest.raises(ValueError, match="one per drafter layer"):
        new_drafter(target, block_size=S, num_layers=2, init_from_layers=[2])
    with pytest.raises(ValueError, match="num_heads"):
        new_drafter(target, block_size=S, num_layers=1, num_heads=2, init_from_layers=[2])


def test_init_from_layers_auto_copies_the_last_layer_of_a_llama_target(target):
    auto = new_drafter(target, block_size=S, num_layers=2, layer_ids=[1], init_from_layers="auto", seed=0)
    last = new_drafter(target, block_size=S, num_layers=2, layer_ids=[1], init_from_layers=[2, 2], seed=0)
    for (name, a), b in zip(auto.state_dict().items(), last.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    top = target.model.get_decoder().layers[2]
    torch.testing.assert_close(auto.layers[1].self_attn.q_proj.weight, top.self_attn.q_proj.weight)


@pytest.mark.parametrize("kind, reason", [("qwen2", "attention biases")])
def test_init_from_layers_refuses_layers_it_cannot_copy(kind, reason, caplog):
    other = tiny_target(kind)
    with pytest.raises(ValueError, match=reason):
        new_drafter(other, block_size=S, num_layers=1, init_from_layers=[2])
    with caplog.at_level("INFO", logger="exittrain.models.drafter"):
        d = new_drafter(other, block_size=S, num_layers=1, init_from_layers="auto", seed=0)
    assert reason in caplog.text and "start at random" in caplog.text
    assert d.config.intermediate_size == 3 * d.config.hidden_size  # the random-start shape


def test_init_from_layers_auto_respects_an_explicit_shape(target, caplog):
    with caplog.at_level("INFO", logger="exittrain.models.drafter"):
        d = new_drafter(target, block_size=S, num_layers=1, num_heads=2, init_from_layers="auto", seed=0)
    assert d.config.num_heads == 2 and "num_heads" in caplog.text
    with pytest.raises(ValueError, match="init_from_layers='last'"):
        new_drafter(target, block_size=S, num_layers=1, init_from_layers="last")


# -- the n-gram copy branch ---------------------------------------------------------------------


@pytest.fixture()
def copy_drafter(target):
    d = new_drafter(target, block_size=S, num_layers=2, num_heads=4, seed=0, layer_ids=[0, 2], copy_ngrams=[2, 1])
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d


def test_copy_gate_starts_at_its_init_value(target):
    d = new_drafter(target, block_size=S, seed=0, layer_ids=[0, 2], copy_ngrams=[3, 2], copy_gate_init=0.7)
    assert d.copy_gate.weight.abs().max() == 0
    torch.testing.assert_close(torch.sigmoid(d.copy_gate.bias), torch.full((2,), 0.7))
    # the root 9 after 4 occurred before, followed by 11 and 12: at the start q_1(11) >= 0.7
    ids = torch.tensor([[3, 4, 9, 11, 12, 4, 9]])
    with torch.no_grad():
        logq = d.forward_anchors(_features(1, 7, d.config.feature_size), ids, torch.tensor([[6]]))
    assert float(logq[0, 0, 11].exp()) >= 0.7 and float(logq[0, 1, 12].exp()) >= 0.7
    torch.testing.assert_close(logq.exp().sum(-1), torch.ones(1, S - 1))
    with pytest.raises(ValueError, match="copy_gate_init"):
        new_drafter(target, block_size=S, copy_ngrams=[2], copy_gate_init=1.0)
    with pytest.raises(ValueError, match="copy_ngrams"):
        new_drafter(target, block_size=S, copy_ngrams=[2, 2])


@pytest.mark.parametrize("window", [None, 3])
def test_copy_branch_training_path_equals_decode_path(copy_drafter, window):
    L, T, F = 2, 12, copy_drafter.config.feature_size
    feats = _features(L, T, F, seed=11)
    ids = torch.randint(2, 6, (L, T), generator=torch.Generator().manual_seed(11))  # few tokens: many copies
    anchors = torch.tensor([[0, 4, 11], [7, 2, 9]])
    batched, copy = copy_drafter.forward_anchors(feats, ids, anchors, context_window=window, with_copy_terms=True)
    assert (copy[0] >= 0).sum() >= 6  # the lookup found copies to mix
    C = int(anchors.max())
    ctx, mask = torch.zeros(L * 3, C, F), torch.zeros(L * 3, C, dtype=torch.bool)
    ctx_ids = torch.full((L * 3, C), -1, dtype=torch.long)  # left padding: -1
    roots = torch.empty(L * 3, dtype=torch.long)
    for n, (l, a) in enumerate((seq, a) for seq in range(L) for a in anchors[seq].tolist()):
        if a:
            ctx[n, C - a :], mask[n, C - a :], ctx_ids[n, C - a :] = feats[l, :a], True, ids[l, :a]
        roots[n] = ids[l, a]
    decoded = copy_drafter(ctx, roots, mask, context_ids=ctx_ids, context_window=window)
    torch.testing.assert_close(batched, decoded, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="context_ids"):
        copy_drafter(ctx, roots, mask)
    hidden = copy_drafter.forward_anchors(feats, ids, anchors, context_window=window, apply_lm_head=False)
    torch.testing.assert_close(copy_drafter.head(hidden, copy), batched)


def test_copy_drafter_roundtrip_and_gradients(target, copy_drafter, tmp_path):
    F = copy_drafter.config.feature_size
    feats, anchors = _features(1, 10, F, seed=3), torch.tensor([[8]])
    ids = torch.tensor([[2, 3, 4, 2, 3, 5, 2, 3, 4, 2]])
    before = copy_drafter.forward_anchors(feats, ids, anchors)
    copy_drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, target)
    assert loaded.config.copy_ngrams == [2, 1] and loaded.copy_gate is not None
    torch.testing.assert_close(loaded.forward_anchors(feats, ids, anchors), before, atol=0, rtol=0)
    before[0, 0, 4].backward()  # the copy token of depth 1 (after the 2-gram (2, 3) came 4)
    assert copy_drafter.copy_gate.bias.grad.abs().sum() > 0 and copy_drafter.fc.weight.grad.abs().sum() > 0


def test_a_drafter_saved_without_the_branch_loads_with_it(target, drafter, tmp_path):
    import json

    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(copy_ngrams=[3, 2], copy_gate_init=0.7)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(tmp_path, target)
    assert loaded.copy_gate.weight.abs().max() == 0
    torch.testing.assert_close(torch.sigmoid(loaded.copy_gate.bias.detach()), torch.full((2,), 0.7))
    torch.testing.assert_close(loaded.fc.weight, drafter.fc.weight, atol=0, rtol=0)
