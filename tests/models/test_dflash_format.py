"""The DFlash checkpoint format both ways, against the reference ``dflash`` package: equal block
logits when ours is loaded into theirs and theirs into ours, warm starts from a checkpoint the
package wrote, pairing errors, and what the export refuses or drops (tiny targets, CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from exittrain.models import load_drafter, new_drafter
from exittrain.models.dflash_format import MASK_EMBEDDING_FILE, export_dflash, load_dflash
from tests.models.helpers import VOCAB, tiny_target

dflash_model = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0 (Makefile setup)")

S, MASK = 4, 5  # block size, mask token id


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def _shake(module, scale=0.3, seed=0):
    """Random weights everywhere (norms included), so every parameter shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return module


def _ours(target, **kw):
    args = dict(block_size=S, num_layers=2, num_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                layer_ids=[0, 1], mask_token_id=MASK, learned_mask=False, rope_theta=5000.0, seed=0)
    return _shake(new_drafter(target, **{**args, **kw}))


def _theirs_logits(model, target, feats_NCF, roots_N):
    """The reference's block logits: its forward over [root, M, .., M] after the context, the target head."""
    N, C, _ = feats_NCF.shape
    ids = torch.cat([roots_N[:, None], torch.full((N, S - 1), MASK)], dim=1)
    with torch.no_grad():
        hidden = model(position_ids=torch.arange(C + S)[None], noise_embedding=target.input_embeddings(ids),
                       target_hidden=feats_NCF)
        return target.lm_head(hidden[:, 1:])


def _inputs(d, N=3, C=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, C, d.config.feature_size, generator=g), torch.randint(0, VOCAB, (N,), generator=g)


def test_ours_loaded_into_theirs_gives_equal_logits(target, tmp_path):
    ours = _ours(target)
    report = export_dflash(ours, tmp_path)
    assert report["dropped"] == [] and not (tmp_path / MASK_EMBEDDING_FILE).exists()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"target_layer_ids": [0, 1], "mask_token_id": MASK}
    assert config["block_size"] == S and config["num_target_layers"] == target.num_layers
    theirs = dflash_model.DFlashDraftModel.from_pretrained(tmp_path).eval()
    assert theirs.target_layer_ids == [0, 1] and theirs.block_size == S
    feats, roots = _inputs(ours)
    with torch.no_grad():
        mine = ours(feats, roots)
    torch.testing.assert_close(_theirs_logits(theirs, target, feats, roots), mine, atol=1e-5, rtol=1e-5)


def test_theirs_loaded_into_ours_gives_equal_logits(target, tmp_path):
    """A checkpoint written by the dflash package for the tiny target: warm-startable, same function."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=5000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=512)
    config.num_target_layers, config.block_size = target.num_layers, S
    config.dflash_config = {"target_layer_ids": [0, 1], "mask_token_id": MASK}
    torch.manual_seed(0)
    theirs = _shake(dflash_model.DFlashDraftModel(config)).eval()
    theirs.save_pretrained(tmp_path)
    ours = load_drafter(tmp_path, target)  # what fit warm_start=DIR calls
    assert ours.config.dflash_problems() == {} and ours.config.target_name == target.name
    feats, roots = _inputs(ours, seed=2)
    with torch.no_grad():
        mine = ours(feats, roots)
    want = _theirs_logits(theirs, target, feats, roots)
    torch.testing.assert_close(mine, want, atol=1e-5, rtol=1e-5)
    assert want.abs().max() > 0.5  # not a vacuous comparison
    # and back: exporting it again writes the same tensors
    export_dflash(ours, tmp_path / "again")
    again = load_dflash(tmp_path / "again", target)
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def _saved_theirs(tmp_path, **changes):
    folder = tmp_path / "theirs"
    from transformers import Qwen3Config

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)
    model = dflash_model.DFlashDraftModel(
        Qwen3Config(**fields, num_target_layers=3, block_size=S,
                    dflash_config={"target_layer_ids": [0, 1], "mask_token_id": MASK})
    )
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key == "target_layer_ids":
            config["dflash_config"]["target_layer_ids"] = value
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": 96}, "vocab_size=96, but target 'tiny-llama' has 64"),
        ({"num_target_layers": 4}, "num_target_layers=4, but target 'tiny-llama' has 3"),
        ({"target_layer_ids": [0, 2]}, r"must lie in \[0, 2\)"),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
)
def test_warm_start_pairing_errors_name_the_key(target, tmp_path, change, message):
    folder = _saved_theirs(tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        load_drafter(folder, target)


def test_warm_start_refuses_another_hidden_size(tmp_path):
    folder = _saved_theirs(tmp_path)
    with pytest.raises(ValueError, match="hidden_size=32, but target"):
        load_drafter(folder, _wider_target())


def _wider_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    from exittrain.models import TargetModel

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    return TargetModel(model, None, name="tiny-wide")


def test_export_drops_the_copy_branch_and_says_so(target, tmp_path, caplog):
    ours = _ours(target, copy_ngrams=[2, 1])
    with caplog.at_level("WARNING", logger="exittrain.models.dflash_format"):
        report = export_dflash(ours, tmp_path)
    assert "copy branch" in caplog.text and report["dropped"] == ["copy_ngrams=[2, 1] (the n-gram copy branch)"]
    assert json.loads((tmp_path / "config.json").read_text())["exittrain"]["dropped"] == report["dropped"]
    served = load_dflash(tmp_path, target)
    feats, roots = _inputs(ours)
    with torch.no_grad():  # the served drafter is ours without the branch
        without = ours.head(ours(feats, roots, apply_lm_head=False))
        torch.testing.assert_close(served(feats, roots), without, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "kw, message",
    [({"context_window": 4}, "context_window"), ({"hidden_size": 16, "num_heads": 2}, "hidden_size"),
     ({"layer_ids": [0, 2]}, "target_layer_ids")],
)
def test_export_refuses_what_the_format_cannot_express(target, tmp_path, kw, message):
    with pytest.raises(ValueError, match=f"cannot be written in the DFlash format: {message}"):
        export_dflash(_ours(target, **kw), tmp_path)


def test_learned_mask_ships_as_vllms_mask_embedding_file(target, tmp_path):
    ours = _ours(target, learned_mask=True, mask_token_id=None)
    with pytest.raises(ValueError, match="mask token id"):
        export_dflash(ours, tmp_path)
    export_dflash(ours, tmp_path, mask_token_id=7)
    saved = torch.load(tmp_path / MASK_EMBEDDING_FILE, weights_only=True)
    assert saved["mask_token_id"] == 7
    torch.testing.assert_close(saved["embedding"], ours.mask_embedding.detach())
    back = load_dflash(tmp_path, target)
    assert back.config.learned_mask and back.config.mask_token_id == 7
    feats, roots = _inputs(ours)
    with torch.no_grad():
        torch.testing.assert_close(back(feats, roots), ours(feats, roots), atol=1e-6, rtol=1e-6)


def test_export_command(target, tmp_path, capsys):
    from exittrain.__main__ import main

    _ours(target, copy_ngrams=[2]).save_pretrained(tmp_path / "drafter")
    main(["export", str(tmp_path / "drafter"), str(tmp_path / "out"), "--format", "dflash"])
    assert "dropped: copy_ngrams=[2]" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").is_file()
    windowed = tmp_path / "windowed"
    _ours(target, context_window=3).save_pretrained(windowed)
    with pytest.raises(SystemExit):
        main(["export", str(windowed), str(tmp_path / "out2")])
    assert "context_window" in capsys.readouterr().err


def test_fit_writes_drafter_dflash_or_says_why_not(target, tmp_path, caplog):
    from exittrain.export import export_beside

    done = export_beside(_ours(target, copy_ngrams=[2]), tmp_path / "run")
    assert done["path"] == str(tmp_path / "run" / "drafter_dflash") and "copy_ngrams=[2]" in done["dropped"][0]
    assert (tmp_path / "run" / "drafter_dflash" / "config.json").is_file()
    with caplog.at_level("WARNING", logger="exittrain.export"):
        skipped = export_beside(_ours(target, context_window=8), tmp_path / "other")
    assert skipped["path"] is None and "context_window" in skipped["why"]
    assert "no drafter_dflash/ written" in caplog.text and "python -m exittrain export" in caplog.text
    assert not (tmp_path / "other" / "drafter_dflash").exists()


class _Tokenizer:
    """What spare_token_id reads of a tokenizer: its length, BOS/pad ids and added tokens."""

    def __init__(self, size, added, bos=None, pad=None):
        self.size, self.added_tokens_decoder = size, dict.fromkeys(added)
        self.bos_token_id, self.pad_token_id = bos, pad

    def __len__(self):
        return self.size


def test_the_spare_mask_token_is_a_padding_row_else_an_unused_added_token():
    from exittrain.export import spare_token_id

    assert spare_token_id(_Tokenizer(60, [0, 1, 2]), 64, exclude=[2]) == 60  # rows 60..63 encode no text
    assert spare_token_id(_Tokenizer(64, [0, 1, 2, 3, 9]), 64, exclude=[2]) == 9
    assert spare_token_id(_Tokenizer(64, [0, 1, 2, 9], bos=9, pad=1), 64, exclude=[0]) == 2
    assert spare_token_id(_Tokenizer(64, [0, 1], bos=1), 64, exclude=[0]) is None


def test_fit_ships_a_learned_mask_under_the_targets_spare_token(target, tmp_path, monkeypatch):
    from exittrain.export import export_beside

    monkeypatch.setattr(target, "tokenizer", _Tokenizer(VOCAB, [0, 1, 3], bos=1), raising=False)
    monkeypatch.setattr(target, "eos_token_ids", [0], raising=False)
    drafter = _ours(target, learned_mask=True, mask_token_id=None)
    done = export_beside(drafter, tmp_path / "run", target)
    assert done["mask_token_id"] == 3
    folder = tmp_path / "run" / "drafter_dflash"
    assert json.loads((folder / "config.json").read_text())["dflash_config"]["mask_token_id"] == 3
    shipped = torch.load(folder / MASK_EMBEDDING_FILE)
    assert shipped["mask_token_id"] == 3 and torch.equal(shipped["embedding"], drafter.mask_embedding.detach())
    without = export_beside(drafter, tmp_path / "bare")  # no target: no id to ship the mask under
    assert without["path"] is None and "mask_token_id" in without["why"]
