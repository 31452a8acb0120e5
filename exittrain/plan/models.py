"""The inputs of a plan: the ``fit`` config composed from the overrides, the target's and the
drafter's configs (a local folder, the hub cache, or the published values tabled here), both models
built on the ``meta`` device, and the dtypes, devices and world size the run would use."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

# The published config.json values of targets the plan knows without a network. Used only when the
# target's config.json is neither a local folder nor in the hub cache (the plan then says so).
# Sources: huggingface.co/Qwen/Qwen3-8B/blob/main/config.json and
# huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json (Llama's has no head_dim
# key: hidden_size / num_attention_heads = 128).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-8B": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=151936, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
}

# The DFlash drafters of those targets (``warm_start=``), used when their config.json is not cached.
# z-lab/Qwen3-8B-DFlash-b16: block 16 (its name, README), 5 layers shaped like the target's, layer ids
# [1, 9, 17, 25, 33] (= exittrain.models.dflash_format.default_target_layer_ids(36, 5)), mask token
# 151669: the fixture of that config in vllm-project/speculators' DFlash converter test. For
# z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat no config was readable here: its width is the target's
# (DFlash needs it), the rest is ASSUMED like the Qwen3 drafter's (5 layers shaped like the target's,
# block 16, default_target_layer_ids(32, 5)); a third-party model list gives it ~1B parameters, which
# matches (1.17B). The plan prints the assumed fields.
KNOWN_DFLASH: dict[str, dict[str, Any]] = {
    "z-lab/Qwen3-8B-DFlash-b16": dict(
        target="Qwen/Qwen3-8B", block_size=16, num_hidden_layers=5, hidden_size=4096, intermediate_size=12288,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, target_layer_ids=[1, 9, 17, 25, 33],
        mask_token_id=151669, assumed=[],
    ),
    "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat": dict(
        target="meta-llama/Llama-3.1-8B-Instruct", block_size=16, num_hidden_layers=5, hidden_size=4096,
        intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        target_layer_ids=[1, 8, 15, 22, 29], mask_token_id=None,
        assumed=["block_size", "num_hidden_layers", "intermediate_size", "heads", "target_layer_ids"],
    ),
}

PRECISIONS = {  # trainer.precision -> (parameter bytes, autocast)
    "32-true": (4, False), "32": (4, False), 32: (4, False),
    "bf16-mixed": (4, True), "bf16": (4, True), "16-mixed": (4, True), "16": (4, True), 16: (4, True),
    "bf16-true": (2, False), "16-true": (2, False),
}


# ----------------------------------------------------------------------------------------------
# composing the config, reading the target and the drafter


def compose_fit(overrides: list[str]):
    """The ``fit`` config of ``overrides`` as ``python -m exittrain fit`` composes it (recipes
    registered, Hydra's runtime set so that ``${hydra:runtime.cwd}`` resolves); ValueError naming
    the overrides when Hydra refuses them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from exittrain.configs import CONF_DIR, register_recipes

    register_recipes()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("fit", overrides=list(overrides), return_hydra_config=True)
    except Exception as e:  # Hydra's own errors: an unknown key, group option or recipe
        raise ValueError(f"the overrides {list(overrides)} do not compose ({type(e).__name__}: {e})") from e
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        if not any(o.split("=", 1)[0].lstrip("+") == "paths.output_dir" for o in overrides):
            # Hydra's run directory does not exist outside a run; the plan writes nothing there (the
            # checks only build the callbacks, which create no folder)
            cfg.paths.output_dir = str(Path(tempfile.gettempdir()) / "exittrain-plan")
        del cfg["hydra"]
    return cfg


def _is_hub_id(value: str) -> bool:
    path = Path(value).expanduser()
    return not (path.exists() or path.is_absolute() or value.startswith((".", "~")) or value.count("/") != 1)


def target_config(node) -> tuple[Any, str, str]:
    """``(config, name, source)`` of ``cfg.target``: the target's config.json, read without weights
    or network, or :data:`KNOWN_CONFIGS` for a hub id whose config is not cached (ValueError naming
    ``target.name_or_path`` otherwise)."""
    from transformers import AutoConfig

    value = node.get("name_or_path")
    cache_dir = node.get("cache_dir")
    if value is None:
        from exittrain.models.target_loading import EMBEDDED_TARGET_NAME, convert_embedded_target

        path = convert_embedded_target(cache_dir)  # a folder of the cache; converted once if missing
        return AutoConfig.from_pretrained(path), EMBEDDED_TARGET_NAME, f"embedded SmolLM2 ({path}/config.json)"
    value = str(value)
    if not _is_hub_id(value):
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            raise ValueError(f"target.name_or_path={value} {what}: pass a Hugging Face model folder or a hub id")
        return AutoConfig.from_pretrained(path), value.rstrip("/"), f"{path / 'config.json'}"
    try:
        config = AutoConfig.from_pretrained(value, cache_dir=cache_dir, local_files_only=True, trust_remote_code=False)
        return config, value, "the hub cache's config.json"
    except (OSError, ValueError) as e:
        if value not in KNOWN_CONFIGS:
            raise ValueError(
                f"target.name_or_path={value}: its config.json is not in the hub cache and the plan uses no network "
                f"({type(e).__name__}); fetch it first (huggingface-cli download {value} config.json) or pass a "
                f"local folder; targets known without it: {sorted(KNOWN_CONFIGS)}"
            ) from e
    values = {k: v for k, v in KNOWN_CONFIGS[value].items() if k != "model_type"}
    config = AutoConfig.for_model(KNOWN_CONFIGS[value]["model_type"], **values)
    return config, value, "published config.json values (exittrain/plan/models.py KNOWN_CONFIGS; not cached here)"


def meta_target(config, name: str, dtype):
    """A :class:`~exittrain.models.TargetModel` of ``config`` on the meta device (no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from exittrain.models import TargetModel

    text = config.get_text_config(decoder=True)
    attention = "eager" if getattr(text, "attn_logit_softcapping", None) is not None else "sdpa"  # as load_target
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    return TargetModel(model, None, name=name)


def _dflash_config(warm_start: str) -> tuple[dict | None, str]:
    """A DFlash or exittrain drafter's config.json as a dict (a local folder, the hub cache, or
    :data:`KNOWN_DFLASH`), and where it came from; None and ``""`` when there is none."""
    path = Path(warm_start).expanduser()
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text()), str(path / "config.json")
    if _is_hub_id(warm_start):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(warm_start, "config.json")
        if isinstance(cached, str):
            return json.loads(Path(cached).read_text()), "the hub cache's config.json"
        if warm_start in KNOWN_DFLASH:
            known = dict(KNOWN_DFLASH[warm_start])
            assumed = known.pop("assumed")
            raw = dict(known, architectures=["DFlashDraftModel"],
                       dflash_config={"target_layer_ids": known["target_layer_ids"],
                                      "mask_token_id": known["mask_token_id"]})  # fmt: skip
            note = "exittrain/plan/models.py KNOWN_DFLASH (not cached here)"
            return raw, note + (f"; assumed: {', '.join(assumed)}" if assumed else "")
    return None, ""


def meta_drafter(cfg, target) -> tuple[Any, str]:
    """``(drafter on meta, source)``: ``warm_start``'s config (DFlash or exittrain), else
    ``cfg.drafter`` applied to the meta target as ``fit`` applies it."""
    import torch
    from hydra.utils import instantiate

    from exittrain.models import new_drafter
    from exittrain.models.dflash_format import default_target_layer_ids, is_dflash_folder

    if cfg.warm_start is None:
        with torch.device("meta"):
            drafter = instantiate(cfg.drafter)(target)
        return drafter, "cfg.drafter (a fresh drafter, as fit builds it)"
    warm = str(cfg.warm_start)
    raw, source = _dflash_config(warm)
    if raw is None:
        raise ValueError(
            f"warm_start={warm}: no config.json in that folder or in the hub cache, and no known DFlash drafter "
            f"of that name ({sorted(KNOWN_DFLASH)}); pass a saved drafter folder"
        )
    with torch.device("meta"):
        if "DFlashDraftModel" in (raw.get("architectures") or []) or is_dflash_folder(warm):
            extra = raw.get("dflash_config") or {}
            layers = int(raw["num_hidden_layers"])
            depth = int(raw.get("num_target_layers") or target.num_layers)
            ids = extra.get("target_layer_ids") or default_target_layer_ids(depth, layers)
            mask = extra.get("mask_token_id")
            learned = mask is None or (Path(warm) / "mask_embedding.pt").is_file()  # as load_dflash reads it
            drafter = new_drafter(
                target, block_size=int(extra.get("block_size", raw.get("block_size", 16))), num_layers=layers,
                hidden_size=int(raw["hidden_size"]), num_heads=int(raw["num_attention_heads"]),
                num_key_value_heads=int(raw["num_key_value_heads"]), head_dim=raw.get("head_dim"),
                intermediate_size=int(raw["intermediate_size"]), layer_ids=[int(x) for x in ids],
                mask_token_id=mask, learned_mask=learned, copy_ngrams=[],
            )
        else:
            from exittrain.models.drafter.block_drafter import BlockDrafter
            from exittrain.models.drafter.configuration import DrafterConfig

            fields = {k: v for k, v in raw.items() if k in DrafterConfig.__annotations__}
            drafter = BlockDrafter(DrafterConfig(**fields))
    return drafter, f"warm_start {warm} ({source})"


# ----------------------------------------------------------------------------------------------
# precision and world


def target_device(cfg) -> str:
    """``cuda`` or ``cpu``: where the run's target will sit. ``auto`` (and a ``device_map``) follow the
    trainer: a GPU run's target is on its GPU whatever this host has."""
    import torch

    node = cfg.target
    gpu_run = str(cfg.trainer.get("accelerator", "cpu")) in ("gpu", "cuda") or (
        str(cfg.trainer.get("accelerator")) == "auto" and torch.cuda.is_available())
    device = str(node.get("device", "cpu"))
    if node.get("device_map") is not None or device == "auto":
        return "cuda" if gpu_run else "cpu"
    return "cuda" if device.startswith("cuda") else device.split(":")[0]


def resolve_dtypes(cfg, notes: list[str]):
    """``(trainer precision, target dtype)`` the run would use; ``auto`` resolved via exittrain.precision
    where this host can decide it, else assumed bf16 (with a note)."""
    import torch

    from exittrain.models.target_loading import as_dtype
    from exittrain.precision import target_dtype, trainer_precision

    node = cfg.target
    device = target_device(cfg)
    cuda_here = torch.cuda.is_available()
    if node.get("dtype", "auto") != "auto":
        dtype = as_dtype(node.dtype)
    elif device == "cuda" and not cuda_here:
        dtype = torch.bfloat16
        notes.append("target.dtype auto -> bf16 on its CUDA device (fp16 on a GPU without bf16: same bytes); "
                     "no CUDA on this host to check")
    else:
        dtype = as_dtype(target_dtype("auto", device))
        notes.append(f"target.dtype auto -> {dtype} on {device} (exittrain.precision)")
    accelerator = str(cfg.trainer.get("accelerator", "cpu"))
    precision = cfg.trainer.get("precision", "32-true")
    if precision == "auto":
        if device == "cuda" and not cuda_here:
            precision = "bf16-mixed"
            notes.append("trainer.precision auto -> bf16-mixed on a bf16 GPU (16-mixed without bf16: same bytes); "
                         "no CUDA on this host to check")
        else:
            precision = trainer_precision("auto", accelerator)
            notes.append(f"trainer.precision auto -> {precision} (exittrain.precision, measured on this host)")
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r}: the plan knows {sorted(map(str, PRECISIONS))}")
    return precision, dtype


def world_layout(cfg) -> tuple[int, int, str]:
    """``(devices per node, nodes, strategy)``; ValueError naming trainer.devices when it cannot be counted."""
    import torch

    t = cfg.trainer
    devices, nodes = t.get("devices", 1), int(t.get("num_nodes", 1) or 1)
    accelerator = str(t.get("accelerator", "cpu"))
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        devices = len(devices)  # a list of GPU indices
    elif devices in (-1, "-1", "auto"):
        if gpu and torch.cuda.is_available():
            devices = torch.cuda.device_count()
        elif not gpu:
            devices = 1
        else:
            raise ValueError(
                f"trainer.devices={devices}: every GPU of the host the run starts on, which this host cannot count; "
                "pass trainer.devices=N (e.g. trainer.devices=8)"
            )
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"trainer.devices={devices!r}: need a GPU count >= 1, -1 or auto")
    strategy = t.get("strategy")
    target = strategy.get("_target_", "") if hasattr(strategy, "get") else str(strategy or "")
    kind = "fsdp" if "FSDP" in target else "ddp" if devices * nodes > 1 else "single"
    return devices, nodes, kind
