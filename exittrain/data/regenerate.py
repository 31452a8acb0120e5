"""Self-distillation data: the frozen target answers every training prompt itself.

Each prompt is wrapped in the target's chat template (one user turn, ``add_generation_prompt=True``)
and answered greedily by default, in left-padded batches. A result row holds:

- ``input_ids``: prompt ids followed by response ids, ``(n_prompt_tokens + n_response_tokens,)``;
- ``loss_mask``: 0 over the prompt, 1 over the response (its EOS included when it ended with one);
- ``prompt``, ``response`` (decoded without special tokens), ``prompt_index`` (position in the
  prompt list), ``n_prompt_tokens``, ``n_response_tokens``, ``finished`` (ended with EOS rather than
  at ``max_new_tokens``).

Prompts whose templated length exceeds ``GenerationConfig.max_prompt_tokens`` are not answered; they
are counted in the cache metadata (``rejected_too_long``) and logged.

``GenerationConfig.dtype`` answers with a copy of the target in another dtype (bf16 on a CPU: faster,
and an approximation of the fp32 target's answers). With ``feature_layers`` the outputs of those
target layers at every position of every row are kept while the target answers, and saved beside
the dataset as ``features-<layers>.safetensors`` (``prompt_index -> (n, F)`` bf16, n the row's
length; :func:`load_features`): the drafter's training then needs no target forward over the rows.
With ``top_logprobs`` S the answering model's S most likely next tokens and their log-probabilities
are kept at every response position (the distribution each response token was drawn from, before
any sampling warp), in ``top-logprobs-<S>.safetensors`` (``prompt_index -> (r, S)`` ids and
log-probabilities, r the row's response length; :func:`load_top_logprobs`): the soft labels of
the drafter's block cross-entropy, at no extra target work.

Cache layout under ``cache_dir`` (a ``datasets`` Arrow dataset written with ``save_to_disk``)::

    <name>-<key>/              complete; read with datasets.load_from_disk (+ meta.json, + features-*.safetensors)
    <name>-<key>.partial/      in progress: shard_00000/, shard_00001/, ... one per finished batch

``key`` hashes the target name, the prompt-set description, the prompt list and the generation
settings (:func:`cache_key`). Each shard and the final dataset are written to a temporary folder
and renamed into place, so a folder with the final name is always complete; an interrupted run
leaves finished shards behind and the next call with the same key generates only the missing
batches. Batches are formed from prompts sorted by templated length (less padding); batch
composition is part of the key because padding can change fp results, so ``batch_size`` is too.

Limits: one process writes a given key at a time (Lightning's ``prepare_data`` runs on one rank per
node); sampling (``do_sample=True``) is reproducible on resume because each batch reseeds torch
with ``seed + batch index``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import datasets
import torch
from tqdm.auto import tqdm

from exittrain import progress as progress_log
from exittrain.atomic import fsync_dir, fsync_tree
from exittrain.models.target import layer_output_hooks
from exittrain.precision import AUTO, generation_dtype

logger = logging.getLogger(__name__)

# Shapes: N = prompts in a batch, P = padded prompt length, G = generated length.

CACHE_VERSION = 1
META_FILE = "exittrain_meta.json"

FEATURES = datasets.Features(
    {
        "prompt_index": datasets.Value("int64"),
        "prompt": datasets.Value("string"),
        "response": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "n_prompt_tokens": datasets.Value("int32"),
        "n_response_tokens": datasets.Value("int32"),
        "finished": datasets.Value("bool"),
    }
)

GENERATION_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MIN_SHARED_PREFIX = 8
"""A batch's prompts share their prefix's forward only from this many tokens (below it, the copies cost more)."""


class Answer(NamedTuple):
    """One answered prompt (:func:`generate_batch`).

    ``response`` ids (r,), up to and including the first EOS; ``finished``: it ended with EOS;
    ``features`` (n_prompt + r, F) bf16 or None; ``top_ids`` (r, S) int32 and ``top_logprobs``
    (r, S) float32 (row j: the distribution response token j was drawn from), or None.
    """

    response: list[int]
    finished: bool
    features: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


TargetProvider = Callable[[], tuple[Any, Any]]
"""A zero-argument callable returning ``(model, tokenizer)``: a Hugging Face causal LM and its tokenizer."""


@dataclass(frozen=True)
class GenerationConfig:
    """How the target answers. Every field is part of the cache key.

    Attributes:
        max_new_tokens: response length cap; a response that reaches it has ``finished=False``.
        batch_size: prompts per ``generate`` call (40-50 suits the SmolLM2 target on a CPU).
        do_sample: sample instead of greedy decoding.
        temperature, top_p: sampling settings (used only with ``do_sample``).
        seed: sampling seed; batch ``i`` runs under ``torch.manual_seed(seed + i)``.
        max_prompt_tokens: templated prompts longer than this are not answered (counted).
        system_prompt: a system turn to put before the user turn; None keeps the template's default.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: answer with a copy of the target in
            that dtype (kept only while generating); None answers with the target as loaded;
            ``"auto"`` is bf16 where bf16 is fast on the answering device and None elsewhere
            (:func:`exittrain.precision.generation_dtype`), resolved by :meth:`resolved` before
            it keys the cache. bf16 answers are an approximation of the fp32 target's (``bench
            regen`` measures how close). A copy doubles the target's memory while it lives: for a
            large target, load it in the wanted dtype (``target.dtype``) and leave this None.
        share_prefix: run the target once over the tokens every prompt of a batch starts with
            (the chat template's system turn, a shared instruction) and start each row from a
            copy of that cache (:func:`generate_batch`). The same answers up to float rounding,
            for fewer prefill tokens.
    """

    max_new_tokens: int = 128
    batch_size: int = 48
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    max_prompt_tokens: int = 512
    system_prompt: str | None = None
    dtype: str | None = None
    share_prefix: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype != AUTO and self.dtype not in GENERATION_DTYPES:
            raise ValueError(
                f"GenerationConfig.dtype={self.dtype!r}: use one of {sorted(GENERATION_DTYPES)}, auto (bf16 where the "
                "hardware runs it fast) or null (the target's own dtype); in a fit config it is data.generation.dtype"
            )
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GenerationConfig.{name}={getattr(self, name)} must be positive")
        if self.do_sample and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(
                f"GenerationConfig: sampling needs temperature > 0 and 0 < top_p <= 1, "
                f"got temperature={self.temperature}, top_p={self.top_p}"
            )

    @classmethod
    def coerce(cls, value: GenerationConfig | Mapping[str, Any] | None) -> GenerationConfig:
        """Accept a config, a mapping of its fields (e.g. from Hydra) or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, GenerationConfig):
            return value
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"unknown generation settings {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(cls)]}"
            )
        return cls(**dict(value))

    def resolved(self, device: str | torch.device = "cpu") -> GenerationConfig:
        """This config with ``dtype="auto"`` decided for the device the target answers on."""
        if self.dtype != AUTO:
            return self
        return dataclasses.replace(self, dtype=generation_dtype(self.dtype, device))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# Chat template and response extraction
# ----------------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer: Any, prompt: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of ``prompt`` as one user turn in the chat template, ending with the assistant header.

    Raises ValueError naming the tokenizer when it has no chat template (a base model's tokenizer):
    the target must answer in the format it is decoded with, so there is no plain-text fallback.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no chat "
            "template; self-distillation wraps every prompt in the target's chat template: use an instruct/chat "
            "target (target.name_or_path=...), or set tokenizer.chat_template to a Jinja chat template"
        )
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def padding_token_id(tokenizer: Any) -> int:
    """The id that left-pads a batch of prompts: the tokenizer's pad token, else its EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
    return int(pad)


def answering_model(model: Any, dtype: str | None) -> Any:
    """The model that answers under ``GenerationConfig.dtype``: ``model`` itself when ``dtype`` is
    None or already its dtype, else a copy in ``dtype`` (``model`` stays as loaded)."""
    wanted = GENERATION_DTYPES.get(dtype)
    if wanted is None or next(model.parameters()).dtype == wanted:
        return model
    return copy.deepcopy(model).to(wanted)


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a response: the tokenizer's EOS plus the model's generation-config EOS."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation_config names an EOS token; set one")
    return sorted(ids)


def split_response(generated: Sequence[int], eos_ids: Sequence[int]) -> tuple[list[int], bool]:
    """The response part of ``generate``'s new tokens: up to and including the first EOS.

    Returns ``(response ids, finished)``; without an EOS the whole sequence is the response and
    ``finished`` is False. Padding after the EOS is dropped.
    """
    eos = set(eos_ids)
    for i, tok in enumerate(generated):
        if tok in eos:
            return list(generated[: i + 1]), True
    return list(generated), False


def make_row(
    prompt_index: int, prompt: str, prompt_ids: list[int], response_ids: list[int], finished: bool, tokenizer: Any
) -> dict[str, Any]:
    """One dataset row (see the module docstring)."""
    return {
        "prompt_index": prompt_index,
        "prompt": prompt,
        "response": tokenizer.decode(response_ids, skip_special_tokens=True),
        "input_ids": prompt_ids + response_ids,
        "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids),
        "n_prompt_tokens": len(prompt_ids),
        "n_response_tokens": len(response_ids),
        "finished": finished,
    }


@contextlib.contextmanager
def _forward_hook(module: torch.nn.Module | None, hook: Callable) -> Any:
    """``hook`` registered as a forward hook of ``module`` while the context is open (nothing for None)."""
    handle = module.register_forward_hook(hook) if module is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def shared_prefix_length(prompt_ids: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt of a batch shares, capped so that each prompt keeps at
    least one token of its own (the prefill must compute that last position's logits)."""
    shortest = min(len(ids) for ids in prompt_ids)
    n = 0
    while n < shortest - 1 and all(ids[n] == prompt_ids[0][n] for ids in prompt_ids):
        n += 1
    return n


@torch.inference_mode()
def generate_batch(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[list[int]],
    gen: GenerationConfig,
    pad_token_id: int,
    eos_ids: Sequence[int],
    feature_layers: Sequence[int] | None = None,
    top_logprobs: int = 0,
) -> list[Answer]:
    """Answer one batch of templated prompts; returns one :class:`Answer` per prompt.

    **Shared prefix.** Prompts in a chat template share their first tokens (the system turn, often
    an instruction). With ``gen.share_prefix`` and a shared prefix of ``S >= MIN_SHARED_PREFIX``
    tokens, the target runs over it once, for one row, and every row starts from a copy of its
    cache: the prefill computes only each prompt's own tokens. A row of the padded batch is then
    ``[prefix S][pads][the rest of the prompt]`` instead of ``[pads][prompt]``; Hugging Face
    positions are ``cumsum(mask) - 1``, so every real token keeps the position it has alone (the
    numbers differ from an unshared prefill by float rounding only).

    Rows are padded to a common width ``P`` on the model's device. With ``feature_layers``
    (target layer ids, the convention of :mod:`exittrain.models.target`) ``features`` is the
    concatenated output of those decoder layers at every position of prompt + response,
    ``(n_prompt + n_response, F)`` bf16 on the CPU, captured by hooks while the model runs: the
    shared prefix's forward and the prefill give the prompt's, each decode step the token it was
    fed. ``generate`` never feeds its last token back, so one more forward step (with its cache)
    gives that one.

    With ``top_logprobs`` S > 0 a hook on the output embeddings (the LM head) keeps, at every
    generation step, the S largest log-softmax values of the last position's raw logits (before
    temperature or top-p) and their ids: ``top_ids`` / ``top_logprobs`` (n_response, S) on the CPU.
    """
    device = next(model.parameters()).device
    layers = list(feature_layers or [])
    N, width = len(prompt_ids), max(len(ids) for ids in prompt_ids)
    S = shared_prefix_length(prompt_ids) if gen.share_prefix and N > 1 else 0
    S = S if S >= MIN_SHARED_PREFIX else 0
    input_ids_NP = torch.full((N, width), pad_token_id, dtype=torch.long)
    attention_mask_NP = torch.zeros((N, width), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        # the shared prefix at the left edge, the padding between it and the prompt's own tokens
        input_ids_NP[i, :S] = torch.tensor(ids[:S], dtype=torch.long)
        input_ids_NP[i, width - len(ids) + S :] = torch.tensor(ids[S:], dtype=torch.long)
        attention_mask_NP[i, :S] = 1
        attention_mask_NP[i, width - len(ids) + S :] = 1
    kwargs: dict[str, Any] = {"do_sample": gen.do_sample}
    if gen.do_sample:
        kwargs.update(temperature=gen.temperature, top_p=gen.top_p, top_k=0)
    steps: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}  # per layer: (N or 1, Q, H) per forward
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # per forward: (N, S) log-probs, (N, S) ids

    def keep(layer_id: int, output: torch.Tensor) -> None:
        steps[layer_id].append(output.to("cpu", torch.bfloat16))

    def keep_top(_module, _args, logits_NQV: torch.Tensor) -> None:
        values, ids = torch.log_softmax(logits_NQV[:, -1].float(), dim=-1).topk(top_logprobs, dim=-1)
        tops.append((values.cpu(), ids.to("cpu", torch.int32)))

    head = model.get_output_embeddings() if top_logprobs > 0 else None
    with layer_output_hooks(model, layers, keep):
        if S:
            prefix = model(input_ids=input_ids_NP[:1, :S].to(device), use_cache=True, logits_to_keep=1).cache
            prefix.batch_repeat_interleave(N)  # every row continues from its own copy
            for layer in layers:  # (1, S, H) -> (N, S, H): the rows share these positions
                steps[layer][0] = steps[layer][0].expand(N, -1, -1)
            kwargs["cache"] = prefix
        with _forward_hook(head, keep_top):  # generation steps only: not the extra step below
            out = model.generate(
                input_ids=input_ids_NP.to(device),
                attention_mask=attention_mask_NP.to(device),
                max_new_tokens=gen.max_new_tokens,
                pad_token_id=pad_token_id,
                eos_token_id=list(eos_ids),
                return_dict_in_generate=True,
                **kwargs,
            )
        sequences_NS = out.sequences  # (N, P + G)
        G = sequences_NS.shape[1] - width
        if layers and G > 0:
            # HF positions are cumsum(mask) - 1, so the last column sits at (real tokens so far) - 1
            mask_NS = torch.cat([attention_mask_NP, torch.ones(N, G, dtype=torch.long)], dim=1).to(device)
            model(
                input_ids=sequences_NS[:, -1:],
                attention_mask=mask_NS,
                position_ids=mask_NS.sum(1, keepdim=True) - 1,
                cache=out.cache,
                use_cache=True,
            )
    answers = [split_response(row, eos_ids) for row in sequences_NS[:, width:].tolist()]
    features_NSF = (
        torch.cat([torch.cat(steps[layer], dim=1) for layer in layers], dim=-1) if layers else None
    )  # (N, P + G, F)
    if top_logprobs > 0:
        if len(tops) != G:
            raise RuntimeError(f"the LM head ran {len(tops)} times for {G} generated tokens; cannot align log-probs")
        top_logp_NGS = torch.stack([v for v, _ in tops], dim=1) if G else torch.zeros(N, 0, top_logprobs)
        top_ids_NGS = (
            torch.stack([i for _, i in tops], dim=1) if G else torch.zeros(N, 0, top_logprobs, dtype=torch.int32)
        )
    result = []
    for i, (ids, (resp, fin)) in enumerate(zip(prompt_ids, answers)):
        r = len(resp)
        features = None
        if features_NSF is not None:  # the row's real positions: the shared prefix, then its own tokens
            own = features_NSF[i, width - len(ids) + S : width + r]
            features = torch.cat([features_NSF[i, :S], own]) if S else own.clone()
        result.append(
            Answer(
                resp,
                fin,
                features,
                None if top_logprobs <= 0 else top_ids_NGS[i, :r].clone(),
                None if top_logprobs <= 0 else top_logp_NGS[i, :r].clone(),
            )
        )
    return result


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------


def prompts_digest(prompts: Sequence[str]) -> str:
    """sha256 of the prompt list (order matters)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


_KEY_DEFAULTS_BEFORE = {("dtype", None), ("share_prefix", False)}


def cache_key(target_name: str, prompt_set: str, prompts: Sequence[str], gen: GenerationConfig) -> str:
    """Hex key of a regenerated dataset: target, prompt-set description, prompt list, settings.

    ``gen.dtype`` must be resolved (:meth:`GenerationConfig.resolved`): ``auto`` answers differently
    on different hosts, so it cannot key an entry."""
    if gen.dtype == AUTO:
        raise ValueError("cache_key needs a resolved GenerationConfig: call gen.resolved(device) first (dtype='auto')")
    payload = {
        "version": CACHE_VERSION,
        "target": target_name,
        "prompt_set": prompt_set,
        "n_prompts": len(prompts),
        "prompts_sha256": prompts_digest(prompts),
        # fields at the value that matches what came before them (the target's own dtype, no prefix
        # sharing) are left out, so entries written before the fields existed keep their keys
        "generation": {k: v for k, v in gen.to_dict().items() if (k, v) not in _KEY_DEFAULTS_BEFORE},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def cache_path(
    cache_dir: str | os.PathLike, target_name: str, prompt_set: str, prompts: Sequence[str], gen: GenerationConfig
) -> Path:
    """Folder of the complete regenerated dataset (it may not exist yet)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", target_name.split("/")[-1])[:40] or "target"
    return Path(cache_dir) / f"{slug}-{cache_key(target_name, prompt_set, prompts, gen)}"


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata written beside a complete regenerated dataset."""
    with open(Path(path) / META_FILE) as f:
        return json.load(f)


@contextlib.contextmanager
def _quiet_datasets_bars():
    """Hide datasets' per-save progress bars (one per shard would drown the regeneration bar)."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def features_file(layers: Sequence[int]) -> str:
    """File name of the features of target ``layers`` inside a cache entry (or a shard of one)."""
    return f"features-{'_'.join(str(int(x)) for x in layers)}.safetensors"


def load_features(path: str | os.PathLike, layers: Sequence[int]) -> dict[int, torch.Tensor] | None:
    """The features of ``layers`` saved beside the dataset at ``path``: ``prompt_index -> (n, F)``
    bf16, where n is the row's ``len(input_ids)``; None when the entry has none for these layers.
    A corrupt or truncated file raises ValueError naming it and saying to delete ``path``."""
    from exittrain.safe_io import load_safetensors

    file = Path(path) / features_file(layers)
    if not file.is_file():
        return None
    # a cache entry (or a shard of one) is a unit: deleting the folder makes the next run write it again
    fix = f"delete the cache entry folder {Path(path)} (or that shard of an unfinished entry) to regenerate it"
    tensors = load_safetensors(file, what="feature cache file", fix=fix)
    return {int(k): v for k, v in tensors.items()}


def top_logprobs_file(k: int) -> str:
    """File name of the top-``k`` next-token log-probabilities inside a cache entry (or a shard of one)."""
    return f"top-logprobs-{int(k)}.safetensors"


def load_top_logprobs(path: str | os.PathLike, k: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """The top-``k`` log-probabilities saved beside the dataset at ``path``: ``prompt_index ->
    (ids (r, k) int32, log-probabilities (r, k) float32)``, r the row's response length (row j: the
    distribution of response token j); None when the entry has none for this ``k``. A corrupt or
    truncated file raises ValueError naming it and saying to delete ``path``."""
    from exittrain.safe_io import load_safetensors

    file = Path(path) / top_logprobs_file(k)
    if not file.is_file():
        return None
    fix = f"delete the cache entry folder {Path(path)} (or that shard of an unfinished entry) to regenerate it"
    tensors = load_safetensors(file, what="soft-label cache file", fix=fix)
    return {
        int(key[: -len(".ids")]): (t, tensors[key[: -len(".ids")] + ".logp"])
        for key, t in tensors.items()
        if key.endswith(".ids")
    }


def _tensor_files(
    features: Mapping[int, torch.Tensor] | None,
    layers: Sequence[int],
    top: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None,
    k: int,
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """The safetensors files of a cache entry or shard: ``file name -> (tensors, metadata)``."""
    files = {}
    if features:
        tensors = {str(i): t.contiguous() for i, t in features.items()}
        files[features_file(layers)] = (tensors, {"layers": ",".join(map(str, layers))})
    if top:
        tensors = {}
        for i, (ids, logp) in top.items():
            tensors[f"{i}.ids"], tensors[f"{i}.logp"] = ids.contiguous(), logp.contiguous()
        files[top_logprobs_file(k)] = (tensors, {"k": str(k)})
    return files


def _save_atomic(
    ds: datasets.Dataset,
    final: Path,
    meta: dict[str, Any] | None = None,
    *,
    tensor_files: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, str]]] | None = None,
) -> None:
    """Write ``ds`` (and ``meta``, and every safetensors file of ``tensor_files``: name -> (tensors,
    metadata)) to a temporary sibling folder, then rename it to ``final``.

    A folder named ``final`` is therefore always complete: readers test ``final.is_dir()``, and a
    write that fails or is killed leaves only ``<final>.tmp-*``, which no reader opens (a failed
    write removes it; a killed one leaves it to the next regeneration of the key, which deletes it). The
    files are fsynced before the rename, so a power loss cannot leave a complete-looking folder of
    unwritten data either.
    """
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with _quiet_datasets_bars():
            ds.save_to_disk(str(tmp))
        if meta is not None:
            with open(tmp / META_FILE, "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
        if tensor_files:
            from safetensors.torch import save_file

            for name, (tensors, metadata) in tensor_files.items():
                save_file(tensors, str(tmp / name), metadata=metadata)
        fsync_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # another writer finished first; its copy is equivalent (the finally removes ours)
        fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _merge_shards(shards: Sequence[Path], load: Callable[[Path], dict | None], what: str, short: str) -> dict | None:
    """The union of ``load(shard)`` over the shards of one entry; None, with a warning, when a shard kept
    none (a shard of an interrupted run that kept no ``what``, or kept it for other settings)."""
    rows: dict = {}
    for b, shard in enumerate(shards):
        part = load(shard)
        if part is None:
            logger.warning("batch %d in %s kept no %s; the entry is saved without %s", b, shard.parent, what, short)
            return None
        rows.update(part)
    return rows


def _resolve(target: tuple[Any, Any] | TargetProvider) -> tuple[Any, Any]:
    model, tokenizer = target() if callable(target) else target
    return model, tokenizer


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def regenerate(
    prompts: Sequence[str],
    target: tuple[Any, Any] | TargetProvider,
    *,
    target_name: str,
    cache_dir: str | os.PathLike,
    gen: GenerationConfig | Mapping[str, Any] | None = None,
    prompt_set: str = "",
    progress: bool = True,
    feature_layers: Sequence[int] | None = None,
    top_logprobs: int = 0,
    device: str | torch.device = "cpu",
) -> datasets.Dataset:
    """The target's own answers to ``prompts``, from the cache or generated now.

    Args:
        prompts: prompt texts; row ``prompt_index`` refers to a position in this list.
        target: ``(model, tokenizer)`` or a callable returning them. A callable is called only when
            something must be generated, so a cache hit never loads the model. The model is used
            as it is (device, dtype); it should be in eval mode, fp32 on a CPU by default.
        target_name: identifies the target in the cache key (e.g. its hub id or path).
        cache_dir: folder of cached datasets.
        gen: generation settings (:class:`GenerationConfig` or a mapping of its fields).
        prompt_set: a description of where the prompts came from (source specs); part of the key.
        progress: show a tqdm bar over batches.
        feature_layers: target layer ids whose outputs to keep while generating (see
            :func:`generate_batch`); they are saved beside the dataset (:func:`load_features`), so
            training need not run the target over every row again. A cache hit never adds them: an
            entry written without them (or for other layers) is returned as it is.
        top_logprobs: keep the answering model's top-S next-token log-probabilities at every
            response position (:func:`generate_batch`; :func:`load_top_logprobs`), S > 0. Like the
            features, a cache hit never adds them.
        device: the device the target answers on; it decides ``gen.dtype="auto"`` before the cache
            is looked up (the model is not loaded for that).

    Returns:
        A ``datasets.Dataset`` with :data:`FEATURES`, rows sorted by ``prompt_index``. Prompts
        rejected as too long have no row.
    """
    gen = GenerationConfig.coerce(gen).resolved(device)
    if not prompts:
        raise ValueError("regenerate got no prompts; check the prompt sources")
    layers = [int(x) for x in feature_layers or []]
    if len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers={layers} repeats a layer id; give each target layer once")
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs={top_logprobs!r} must be an int >= 0 (0 keeps none)")
    final = cache_path(cache_dir, target_name, prompt_set, prompts, gen)
    if final.is_dir():
        logger.info("regenerated data found in cache: %s", final)
        return datasets.load_from_disk(str(final))
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    partial.mkdir(exist_ok=True)
    # temporary folders of a killed write (of a shard or of the entry): one process writes a key at a time
    for stale in [*final.parent.glob(f"{final.name}.tmp-*"), *partial.glob("shard_*.tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)

    model, tokenizer = _resolve(target)
    pad_token_id = padding_token_id(tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    depth = len(model.get_decoder().layers)
    if any(not 0 <= x < depth for x in layers):
        raise ValueError(f"feature_layers={layers} must be layer ids in [0, {depth}) of target {target_name!r}")

    templated = [chat_prompt_ids(tokenizer, p, gen.system_prompt) for p in prompts]
    too_long = [i for i, ids in enumerate(templated) if len(ids) > gen.max_prompt_tokens]
    if too_long:
        logger.warning(
            "%d of %d prompts exceed max_prompt_tokens=%d after the chat template and are not answered "
            "(first indices %s)",
            len(too_long),
            len(prompts),
            gen.max_prompt_tokens,
            too_long[:5],
        )
    skip = set(too_long)
    order = sorted((i for i in range(len(prompts)) if i not in skip), key=lambda i: -len(templated[i]))
    if not order:
        raise ValueError(
            f"every one of the {len(prompts)} prompts exceeds max_prompt_tokens={gen.max_prompt_tokens} after the "
            f"chat template of target {target_name!r} (shortest: {min(len(t) for t in templated)} tokens); raise "
            "generation.max_prompt_tokens (data.generation.max_prompt_tokens in a fit config) or use shorter prompts"
        )
    batches = [order[s : s + gen.batch_size] for s in range(0, len(order), gen.batch_size)]

    def shard_dir(b: int) -> Path:
        return partial / f"shard_{b:05d}"

    todo = [b for b in range(len(batches)) if not shard_dir(b).is_dir()]
    if len(todo) < len(batches):
        logger.info("resuming regeneration: %d of %d batches already done", len(batches) - len(todo), len(batches))

    was_training = model.training
    model.eval()
    answerer = answering_model(model, gen.dtype)
    # no bar draws into a redirected stdout (a log file, SLURM): log lines there instead, one per batch
    # while batches take 30 s or more, else one every 30 s or every 1/50 of the batches
    as_lines = progress and not progress_log.interactive()
    bar = tqdm(
        total=len(batches),
        initial=len(batches) - len(todo),
        desc=f"regenerate ({target_name})",
        unit="batch",
        disable=not progress or as_lines,
    )
    ticker = progress_log.Ticker(
        f"regenerate ({target_name})",
        len(batches),
        unit="batch",
        every=max(1, len(batches) // 50),
        start=len(batches) - len(todo),
    )
    answered = 0
    new_tokens, t0 = 0, time.perf_counter()
    try:
        for b in todo:
            idx = batches[b]
            if gen.do_sample:
                torch.manual_seed(gen.seed + b)
            answers = generate_batch(
                answerer, tokenizer, [templated[i] for i in idx], gen, pad_token_id, eos_ids, layers, top_logprobs
            )
            rows = [
                make_row(i, prompts[i], templated[i], a.response, a.finished, tokenizer) for i, a in zip(idx, answers)
            ]
            features = {i: a.features for i, a in zip(idx, answers) if a.features is not None}
            top = {i: (a.top_ids, a.top_logprobs) for i, a in zip(idx, answers) if a.top_ids is not None}
            shard = datasets.Dataset.from_list(rows, features=FEATURES)
            _save_atomic(shard, shard_dir(b), tensor_files=_tensor_files(features, layers, top, top_logprobs))
            new_tokens += sum(len(a.response) for a in answers)
            bar.update(1)
            tok_s = new_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{tok_s:.0f}")
            answered += len(answers)
            if as_lines:
                ticker.advance(answers=answered, tok_s=tok_s)
    finally:
        bar.close()
        model.train(was_training)
        del answerer

    shards = [datasets.load_from_disk(str(shard_dir(b))) for b in range(len(batches))]
    for b, shard in enumerate(shards):
        assert shard["prompt_index"] == batches[b], f"shard {b} in {partial} does not match its batch"
    ds = datasets.concatenate_datasets(shards)
    shard_dirs = [shard_dir(b) for b in range(len(batches))]
    feature_rows = (
        _merge_shards(shard_dirs, lambda d: load_features(d, layers), f"features of layers {layers}", "features")
        if layers
        else None
    )
    top_rows = (
        _merge_shards(
            shard_dirs, lambda d: load_top_logprobs(d, top_logprobs), f"top-{top_logprobs} log-probabilities", "them"
        )
        if top_logprobs
        else None
    )
    index = ds["prompt_index"]
    ds = ds.select(sorted(range(len(ds)), key=index.__getitem__))
    meta = {
        "version": CACHE_VERSION,
        "target": target_name,
        "prompt_set": prompt_set,
        "n_prompts": len(prompts),
        "prompts_sha256": prompts_digest(prompts),
        "generation": gen.to_dict(),
        "rows": len(ds),
        "rejected_too_long": len(too_long),
        "unfinished": int(len(ds) - sum(ds["finished"])),
        "pad_token_id": int(pad_token_id),
        "eos_token_ids": eos_ids,
        "feature_layers": layers if feature_rows else [],
        "top_logprobs": top_logprobs if top_rows else 0,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"datasets": datasets.__version__, "torch": torch.__version__},
    }
    _save_atomic(ds, final, meta, tensor_files=_tensor_files(feature_rows, layers, top_rows, top_logprobs))
    shutil.rmtree(partial, ignore_errors=True)
    logger.info(
        "regenerated %d responses (%d hit max_new_tokens=%d, %d prompts too long) -> %s",
        len(ds),
        meta["unfinished"],
        gen.max_new_tokens,
        len(too_long),
        final,
    )
    return datasets.load_from_disk(str(final))
