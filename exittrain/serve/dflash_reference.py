"""DFlash-format drafter folders through the reference ``dflash`` package (z-lab, MIT).

Shape legend: C context positions, S block size (root + K mask rows), K draft tokens, V
vocabulary, H target hidden size, F = len(target_layer_ids) * H.

Two things the serving check needs before a drafter is served:

- :func:`write_random_dflash_drafter` writes a DFlash-format folder with random weights, shaped
  for a given target (``config.json`` with ``architectures: ["DFlashDraftModel"]``,
  ``model_type: "qwen3"``, ``block_size``, ``num_target_layers`` and
  ``dflash_config: {target_layer_ids, mask_token_id}``, plus safetensors). It exercises the
  serving path when no trained drafter is at hand; its drafts are almost never accepted.
- :class:`ReferenceDFlashDrafter` loads a DFlash-format folder with ``dflash.DFlashDraftModel``
  and gives it the call interface :class:`~exittrain.decoding.SpeculativeDecoder` expects
  (``drafter(features_1CF, root_1, context_ids=...) -> logits (1, K, V)``), so our own tree
  decoder can run exactly the drafter that vLLM serves.

**Layer ids.** DFlash's ``target_layer_ids`` name the output of decoder layer ``l`` (Hugging
Face ``hidden_states[l + 1]``): the convention of :mod:`exittrain.models.target_model`, so ids pass
through unchanged. (vLLM adds one internally: its auxiliary layer ``l + 1`` is the residual
stream after ``l + 1`` decoder layers, the same tensor.)

**Mask rows.** The block's mask rows are the target's embedding of ``mask_token_id``, or the
vector of a shipped ``mask_embedding.pt`` (a tensor, or ``{"embedding", "mask_token_id"}``),
which vLLM reads in its place and the ``dflash`` package ignores.

**Limits.** The adapter re-encodes the whole context every round (no drafter cache). ``dflash``
must be installed (``pip install --no-deps dflash==0.1.0``: it pins an older ``datasets``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from exittrain.models.drafter.starting_points import default_layer_ids
from exittrain.models.vocab_head import vocab_logits_reference

__all__ = ["ReferenceDFlashDrafter", "read_dflash_config", "write_random_dflash_drafter"]

_INSTALL = "pip install --no-deps dflash==0.1.0"


def _dflash_model_class():
    try:
        from dflash.model import DFlashDraftModel
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"the reference DFlash drafter needs the dflash package: {_INSTALL}") from e
    return DFlashDraftModel


def read_dflash_config(folder: str | os.PathLike) -> dict:
    """The ``config.json`` of a DFlash-format folder, checked for the fields serving reads.

    Raises ``ValueError`` naming the folder and the missing or wrong field.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json; pass a DFlash-format drafter folder (exported or z-lab's)")
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict) or "DFlashDraftModel" not in (config.get("architectures") or []):
        raise ValueError(
            f"{path}: architectures must list 'DFlashDraftModel' (got {config.get('architectures')!r}); export an "
            "exittrain drafter with `python -m exittrain export RUN_DIR/drafter OUT --format dflash`"
        )
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"{path}: dflash_config must be an object with target_layer_ids and mask_token_id")
    layer_ids = dflash.get("target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(x, int) for x in layer_ids):
        raise ValueError(f"{path}: dflash_config.target_layer_ids must be a non-empty list of ints, got {layer_ids!r}")
    if not isinstance(dflash.get("mask_token_id"), int):
        raise ValueError(f"{path}: dflash_config.mask_token_id must be an int, got {dflash.get('mask_token_id')!r}")
    block_size = config.get("block_size")
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"{path}: block_size must be an int >= 2 (root + K draft rows), got {block_size!r}")
    return config


def write_random_dflash_drafter(
    target_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a random-weight DFlash-format drafter for the HF target in ``target_dir`` into ``out``.

    Layer shapes (hidden size, heads, head size, MLP width, norm epsilon, rope) and the
    vocabulary come from the target's ``config.json``. ``target_layer_ids`` default to
    :func:`exittrain.models.drafter.starting_points.default_layer_ids`; ``mask_token_id`` defaults to the target's
    ``unk_token_id`` (else its ``pad_token_id``).
    """
    from transformers import Qwen3Config

    target = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    depth = int(target["num_hidden_layers"])
    if target_layer_ids is None:
        target_layer_ids = default_layer_ids(depth)  # the layers an exittrain drafter reads by default
    bad = [x for x in target_layer_ids if not 0 <= x < depth]
    if bad:
        raise ValueError(f"target_layer_ids={target_layer_ids}: ids must lie in [0, {depth}) for this target")
    if mask_token_id is None:
        mask_token_id = target.get("unk_token_id", target.get("pad_token_id"))
    if not isinstance(mask_token_id, int):
        raise ValueError(f"{target_dir}: the target names no unk/pad token; pass mask_token_id explicitly")
    heads = int(target["num_attention_heads"])
    rope = target.get("rope_parameters") or {"rope_type": "default", "rope_theta": target.get("rope_theta", 1e4)}
    config = Qwen3Config(
        vocab_size=int(target["vocab_size"]),
        hidden_size=int(target["hidden_size"]),
        intermediate_size=int(target["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(target.get("num_key_value_heads", heads)),
        head_dim=int(target.get("head_dim", int(target["hidden_size"]) // heads)),
        rms_norm_eps=float(target["rms_norm_eps"]),
        rope_parameters=dict(rope),
        max_position_embeddings=int(target["max_position_embeddings"]),
        tie_word_embeddings=False,
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = block_size
    config.num_target_layers = depth
    config.dflash_config = {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id}
    torch.manual_seed(seed)
    model = _dflash_model_class()(config).to(torch.float32)
    out = Path(out)
    model.save_pretrained(out)
    read_dflash_config(out)  # what we wrote must pass the reader's checks
    return out


def _read_mask_embedding(folder: Path, mask_token_id: int, hidden: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The optional ``mask_embedding.pt`` (H,): a tensor, or ``{"embedding": (H,), "mask_token_id": M}``."""
    path = folder / "mask_embedding.pt"
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        if state.get("mask_token_id", mask_token_id) != mask_token_id:
            raise ValueError(
                f"{path}: mask_token_id {state.get('mask_token_id')} differs from dflash_config.mask_token_id "
                f"{mask_token_id}; re-export the drafter"
            )
        state = state.get("embedding")
    if not torch.is_tensor(state) or state.numel() != hidden:
        raise ValueError(f"{path}: need a tensor of {hidden} values (the mask row), got {type(state).__name__}")
    return state.reshape(hidden).to(dtype)


class ReferenceDFlashDrafter(nn.Module):
    """A DFlash-format folder, run by ``dflash.DFlashDraftModel``, behind our drafter interface.

    ``config`` exposes what the decoder reads: ``target_layer_ids``, ``block_size``,
    ``num_draft_tokens`` (K = S - 1) and ``context_window`` (None: the whole prefix).
    """

    def __init__(self, folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        raw = read_dflash_config(folder)
        self.model = _dflash_model_class().from_pretrained(folder, dtype=dtype).eval()
        self.model.requires_grad_(False)
        self.mask_token_id = int(raw["dflash_config"]["mask_token_id"])
        self.mask_embedding = _read_mask_embedding(Path(folder), self.mask_token_id, int(raw["hidden_size"]), dtype)
        self.scale = float(raw["dflash_config"].get("input_embedding_scale", 1.0))
        self.config = SimpleNamespace(
            target_layer_ids=list(raw["dflash_config"]["target_layer_ids"]),
            block_size=int(raw["block_size"]),
            num_draft_tokens=int(raw["block_size"]) - 1,
            context_window=None,
            hidden_size=int(raw["hidden_size"]),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=int(raw.get("num_target_layers", 0)),
        )
        self._target = {}

    def attach_target(self, target) -> ReferenceDFlashDrafter:
        """Pair with a :class:`~exittrain.models.TargetModel`; checks width, vocabulary, depth and layer ids."""
        cfg = self.config
        problems = []
        if cfg.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {cfg.hidden_size} != target {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {cfg.vocab_size} != target {target.vocab_size}")
        if cfg.num_target_layers and cfg.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers {cfg.num_target_layers} != target {target.num_layers}")
        if problems:
            raise ValueError(f"DFlash drafter does not fit target {target.name!r}: " + "; ".join(problems))
        target.check_layers(cfg.target_layer_ids, "dflash_config.target_layer_ids")
        self._target = {"target": target}
        return self

    @property
    def has_target(self) -> bool:
        return bool(self._target)

    @torch.no_grad()
    def forward(self, features_1CF: torch.Tensor, root_1: torch.Tensor, context_ids=None,
                vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits (1, K, V) for the root after a context with target features (1, C, F).

        The context sits at positions 0..C-1 and the block [root, mask x K] at C..C+K.
        ``context_ids`` is accepted for the interface and unused (DFlash has no copy branch);
        ``vocab_ids``, a draft vocabulary, masks every other token to -inf (the full head, masked).
        """
        target = self._target["target"]
        C, S = features_1CF.shape[1], self.config.block_size
        block_1S = torch.full((1, S), self.mask_token_id, dtype=torch.long, device=target.device)
        block_1S[:, 0] = root_1.reshape(-1)[0]
        noise_1SH = target.input_embeddings(block_1S) * self.scale
        if self.mask_embedding is not None:  # a shipped mask row replaces the mask token's embedding
            noise_1SH[:, 1:] = self.mask_embedding.to(noise_1SH)
        positions = torch.arange(C + S, device=target.device).unsqueeze(0)
        hidden_1SH = self.model(
            target_hidden=features_1CF.to(noise_1SH.dtype), noise_embedding=noise_1SH, position_ids=positions
        )
        logits_1KV = self.model.compute_logits(hidden_1SH[:, 1:], target.lm_head)
        return logits_1KV if vocab_ids is None else vocab_logits_reference(logits_1KV, vocab_ids)
