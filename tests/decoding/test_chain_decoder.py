"""The chain decoder against the reference dflash_generate loop (the chain trees: tests/core/test_chain.py)."""

from __future__ import annotations

import time

import pytest
import torch

from exittrain.decoding import autoregressive_generate
from exittrain.decoding.chain_decoder import ChainDecoder, decode_after_prefill
from exittrain.models import TargetModel

pytest.importorskip("dflash", reason="the reference DFlash drafter needs `pip install --no-deps dflash==0.1.0`")

from exittrain.serve.dflash_reference import ReferenceDFlashDrafter, write_random_dflash_drafter  # noqa: E402

VOCAB = 8  # a small vocabulary, so a random drafter's greedy tokens are accepted now and then


def _tiny_target(seed: int = 0) -> TargetModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, eos_token_id=None,
        bos_token_id=None, pad_token_id=None, attn_implementation="sdpa",
    )
    return TargetModel(LlamaForCausalLM(config), None, name="tiny-llama-v8")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    target = _tiny_target()
    folder = tmp_path_factory.mktemp("tiny_target")
    target.model.config.save_pretrained(folder)
    drafter_dir = write_random_dflash_drafter(
        folder, folder / "dflash", num_layers=1, block_size=4, target_layer_ids=[0, 2], mask_token_id=0, seed=1
    )
    return target, drafter_dir


def test_chain_decoder_matches_dflash_generate(tiny_pair, one_thread, monkeypatch):
    """Same drafter, same prompts: our chain decoder commits the reference loop's tokens, round by round."""
    import dflash.model as reference

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # the reference times itself with CUDA syncs
    target, drafter_dir = tiny_pair
    drafter = ReferenceDFlashDrafter(drafter_dir).attach_target(target)
    with torch.no_grad():  # sharper random weights, so the drafts depend on the context features
        for name, weight in drafter.model.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                weight.mul_(10)
    decoder = ChainDecoder(target, drafter, verifier="greedy", drafter_cache=False)
    g = torch.Generator().manual_seed(3)
    new_tokens, accepted = 24, 0
    for _ in range(4):
        prompt = torch.randint(0, VOCAB, (7,), generator=g).tolist()
        greedy = autoregressive_generate(target, prompt, new_tokens).tokens
        ref = reference.dflash_generate(
            drafter.model, target.model, torch.tensor([prompt]), new_tokens, None, return_stats=True
        )
        # the reference emits its first token from the prefill; so does decode_after_prefill (the chain track's)
        tokens, rounds = decode_after_prefill(decoder, prompt, greedy[0], new_tokens, target.eos_token_ids)
        assert ref.output_ids[0, len(prompt):].tolist() == greedy == tokens
        assert decode_after_prefill(decoder, prompt, greedy[0], new_tokens, {greedy[0]}) == ([greedy[0]], [])
        # near the end the reference drafts a shorter block (what is left of max_new_tokens): compare the
        # rounds it drafted a full block for
        full, produced = 0, 0
        for length in ref.acceptance_lengths:
            if new_tokens - produced < drafter.config.block_size:
                break
            full, produced = full + 1, produced + length
        assert full >= 3
        assert [r.block_length for r in rounds[:full]] == ref.acceptance_lengths[:full]
        accepted += sum(r.accept_length for r in rounds[:full])
    assert accepted > 0  # the comparison saw accepted drafts, not only rejections


def test_reference_drafter_refuses_another_target(tiny_pair):
    _, drafter_dir = tiny_pair
    from transformers import LlamaConfig, LlamaForCausalLM

    other = TargetModel(
        LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2)),
        None, name="other",
    )
    with pytest.raises(ValueError, match="vocab_size 8 != target 9"):
        ReferenceDFlashDrafter(drafter_dir).attach_target(other)
    with pytest.raises(ValueError, match="at most K=3"):
        ChainDecoder(_tiny_target(), ReferenceDFlashDrafter(drafter_dir), budget=4)


def test_reference_drafter_reads_the_layers_dflash_reads(tiny_pair):
    """Our features of layer l (decoder layer l's output) are DFlash's ``hidden_states[l + 1]``."""
    from dflash.model import extract_context_feature

    target, drafter_dir = tiny_pair
    drafter = ReferenceDFlashDrafter(drafter_dir).attach_target(target)
    ids = torch.tensor([[3, 1, 4, 1, 5, 2, 6]])
    features_1CF = target.prefill(ids[:, :-1], layers=drafter.config.target_layer_ids).features
    with torch.no_grad():
        hidden = target.model(ids[:, :-1], output_hidden_states=True).hidden_states
        reference_1CF = extract_context_feature(hidden, drafter.model.target_layer_ids)
        shifted_1CF = extract_context_feature(hidden, [x + 1 for x in drafter.model.target_layer_ids])
    assert torch.allclose(features_1CF, reference_1CF, atol=1e-6)
    ours = drafter(features_1CF, ids[:, -1])
    assert ours.shape == (1, drafter.config.num_draft_tokens, VOCAB)
    assert torch.allclose(ours, drafter(reference_1CF, ids[:, -1]), atol=1e-6)
    assert not torch.allclose(ours, drafter(shifted_1CF, ids[:, -1]), atol=1e-3)  # an off-by-one shows


def test_exittrain_drafter_reads_the_folder_as_the_reference_does(tiny_pair, one_thread):
    """The same DFlash folder through load_drafter (exittrain's drafter) and through dflash's module:
    equal draft logits, and so the chain decoder's rounds."""
    from exittrain.models import load_drafter

    target, drafter_dir = tiny_pair
    ours, reference = load_drafter(str(drafter_dir), target), ReferenceDFlashDrafter(drafter_dir).attach_target(target)
    assert list(ours.config.target_layer_ids) == reference.config.target_layer_ids
    ids = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3]])
    features_1CF = target.prefill(ids[:, :-1], layers=reference.config.target_layer_ids).features
    with torch.no_grad():
        assert torch.allclose(ours(features_1CF, ids[:, -1]), reference(features_1CF, ids[:, -1]), atol=1e-5)
        # with a draft vocabulary: equal on its tokens, -inf on every other one in both
        vocab = torch.arange(0, target.vocab_size, 2)
        mine = ours(features_1CF, ids[:, -1], vocab_ids=vocab)
        theirs = reference(features_1CF, ids[:, -1], vocab_ids=vocab)
        assert torch.equal(torch.isinf(mine), torch.isinf(theirs)) and torch.isinf(theirs[..., 1::2]).all()
        assert torch.allclose(mine[..., vocab], theirs[..., vocab], atol=1e-5)
    prompt = [3, 1, 4, 1, 5, 2, 6]
    a = ChainDecoder(target, ours).generate(prompt, 20)
    b = ChainDecoder(target, reference, drafter_cache=False).generate(prompt, 20)
    assert a.tokens == b.tokens
    assert [r.accept_length for r in a.rounds] == [r.accept_length for r in b.rounds]


def test_a_shipped_mask_row_is_read_by_both(tiny_pair, tmp_path):
    """mask_embedding.pt (what vLLM reads for the mask rows) changes the drafts alike in both readers."""
    import shutil

    from exittrain.models import load_drafter

    target, drafter_dir = tiny_pair
    folder = tmp_path / "with_mask"
    shutil.copytree(drafter_dir, folder)
    mask = torch.randn(32, generator=torch.Generator().manual_seed(5))
    torch.save({"embedding": mask, "mask_token_id": 0}, folder / "mask_embedding.pt")
    ids = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3]])
    reference = ReferenceDFlashDrafter(folder).attach_target(target)
    features_1CF = target.prefill(ids[:, :-1], layers=reference.config.target_layer_ids).features
    with torch.no_grad():
        with_mask = reference(features_1CF, ids[:, -1])
        assert torch.allclose(load_drafter(str(folder), target)(features_1CF, ids[:, -1]), with_mask, atol=1e-5)
        plain = ReferenceDFlashDrafter(drafter_dir).attach_target(target)(features_1CF, ids[:, -1])
    assert not torch.allclose(with_mask, plain, atol=1e-3)
    torch.save({"embedding": mask, "mask_token_id": 3}, folder / "mask_embedding.pt")
    with pytest.raises(ValueError, match="differs from dflash_config.mask_token_id"):
        ReferenceDFlashDrafter(folder)
