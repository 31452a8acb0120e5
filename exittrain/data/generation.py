"""How the frozen target answers a prompt: the chat template, one batch of greedy (or sampled)
answers, and what is kept while it answers.

Each prompt is wrapped in the target's chat template (one user turn, ``add_generation_prompt=True``,
:func:`chat_prompt_ids`) and answered in left-padded batches (:func:`generate_batch`); a response
runs up to and including its first EOS (:func:`split_response`).

``GenerationConfig.dtype`` answers with a copy of the target in another dtype (bf16 on a CPU: faster,
and an approximation of the fp32 target's answers; :func:`answering_model`). With ``feature_layers``
the outputs of those target layers at every position of every row are kept while the target
answers: the drafter's training then needs no target forward over the rows. With ``top_logprobs``
S the answering model's S most likely next tokens and their log-probabilities are kept at every
response position (the distribution each response token was drawn from, before any sampling
warp): the soft labels of the drafter's block cross-entropy, at no extra target work. Where they
are stored is :mod:`exittrain.data.regen_cache`'s concern; the run that drives the batches is
:func:`exittrain.data.regenerate.regenerate`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from exittrain.host_choices import HostChoice
from exittrain.models.hf_cache import cache_kwargs, output_cache
from exittrain.models.target_model import layer_output_hooks
from exittrain.precision import AUTO, generation_dtype_choice

# Shapes: N = prompts in a batch, P = padded prompt length, G = generated length.

GENERATION_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BACKENDS = ("hf", "vllm")
"""Who answers the prompts: Hugging Face ``generate`` in this process, or vLLM (:mod:`exittrain.data.vllm_backend`)."""
MIN_SHARED_PREFIX = 8
"""A batch's prompts share their prefix's forward only from this many tokens (below it, the copies cost more)."""


class Answer(NamedTuple):
    """One answered prompt (:func:`generate_batch`).

    ``response`` ids (r,), up to and including the first EOS; ``finished``: it ended with EOS;
    ``features`` (n_prompt + r, F) bf16 or None; ``top_ids`` (r, S) int32 and ``top_logprobs``
    (r, S) float32 (row j: the distribution response token j was drawn from), or None.
    ``error``: why the answering engine rejected the prompt (then ``response`` is empty and the
    prompt gets no row: the run counts and names it in the cache metadata), None for an answer.
    """

    response: list[int]
    finished: bool
    features: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    error: str | None = None


@dataclass(frozen=True)
class GenerationConfig:
    """How the target answers. Every field is part of the cache key.

    Attributes:
        max_new_tokens: response length cap; a response that reaches it has ``finished=False``.
        batch_size: prompts per ``generate`` call.
        do_sample: sample instead of greedy decoding.
        temperature, top_p: sampling settings (used only with ``do_sample``).
        seed: sampling seed; batch ``i`` runs under ``torch.manual_seed(seed + i)``.
        max_prompt_tokens: templated prompts longer than this are not answered (counted).
        system_prompt: a system turn to put before the user turn; None keeps the template's default.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: answer with a copy of the target in
            that dtype (kept only while generating); None answers with the target as loaded;
            ``"auto"`` is bf16 where bf16 is fast on the answering device and None elsewhere
            (:func:`exittrain.precision.generation_dtype_choice`: on a CPU, measured once per host
            type and recorded), resolved by :meth:`resolved` before it keys the cache; how it was
            chosen is :meth:`dtype_choice`, kept in the entry's metadata. bf16 answers are an
            approximation of the fp32 target's (``bench regen`` measures how close). A copy
            doubles the target's memory while it lives: for a large target, load it in the
            wanted dtype (``target.dtype``) and leave this None.
        share_prefix: run the target once over the tokens every prompt of a batch starts with
            (the chat template's system turn, a shared instruction) and start each row from a
            copy of that cache (:func:`generate_batch`). The same answers up to float rounding,
            for fewer prefill tokens. HF backend only.
        backend: who answers: ``"hf"`` (Hugging Face ``generate`` in this process) or ``"vllm"``
            (vLLM's offline engine in ``engine_python``'s environment, or the OpenAI-compatible
            server at ``server_url``: :mod:`exittrain.data.vllm_backend`). Part of the key.
        server_url: with ``backend="vllm"``, the base URL of a running vLLM server (e.g.
            ``http://host:8000``); None starts the offline engine. Not part of the key (where the
            engine runs does not change the answers; its version does).
        engine_python: the interpreter of the environment vLLM is installed in; None:
            :func:`exittrain.vllm_interpreter.default_vllm_python` (``$EXITTRAIN_VLLM_PYTHON``,
            else the checkout's ``.venv-vllm``, which ``make vllm-setup`` builds). Not part of the key.
        engine_version: the answering engine's version, filled in when the run resolves the
            backend (:func:`exittrain.data.vllm_backend.resolve_engine`); part of the key.
        shard: ``"I/N"``: this process answers only shard I (0-based) of N of the batches, under
            the same key as the whole entry; the process that completes the last shard merges
            the entry. None: every batch (or, under torchrun/SLURM with several ranks, the rank's
            shard). Not part of the key.
    """

    max_new_tokens: int = 96
    batch_size: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    max_prompt_tokens: int = 512
    system_prompt: str | None = None
    dtype: str | None = None
    share_prefix: bool = True
    backend: str = "hf"
    server_url: str | None = None
    engine_python: str | None = None
    engine_version: str | None = None
    shard: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"GenerationConfig.backend={self.backend!r}: use one of {list(BACKENDS)} (data.generation.backend "
                "in a fit config; vllm needs `make vllm-setup` or data.generation.server_url=http://HOST:PORT)"
            )
        if self.server_url is not None and self.backend != "vllm":
            raise ValueError(
                f"GenerationConfig.server_url={self.server_url!r} is only read with backend=vllm; set "
                "data.generation.backend=vllm or drop server_url"
            )
        if self.shard is not None:
            parse_shard(self.shard)
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

    def resolved(
        self, device: str | torch.device = "cpu", remember_in: str | os.PathLike | None = None
    ) -> GenerationConfig:
        """This config with ``dtype="auto"`` decided for the device the target answers on
        (:meth:`dtype_choice`)."""
        if self.dtype != AUTO:
            return self
        return dataclasses.replace(self, dtype=self.dtype_choice(device, remember_in).value)

    def dtype_choice(
        self, device: str | torch.device = "cpu", remember_in: str | os.PathLike | None = None
    ) -> HostChoice:
        """How ``dtype`` is chosen on ``device``: as set, or for ``auto`` the recorded choice of this
        host type, read from ``remember_in`` (the cache folder, so every shard and a later ``fit``
        key the same entry) else from the host's folder (:func:`exittrain.precision.generation_dtype_choice`)."""
        return generation_dtype_choice(self.dtype, device, remember_in=remember_in)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_shard(shard: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``; ValueError naming ``data.generation.shard`` otherwise."""
    try:
        index, count = (int(x) for x in str(shard).split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise ValueError(
            f"data.generation.shard={shard!r}: write I/N with 0 <= I < N, e.g. shard=0/8 for the first of 8 "
            "independent jobs (a SLURM array: shard=$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)"
        )
    return index, count


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


# ----------------------------------------------------------------------------------------------
# One batch
# ----------------------------------------------------------------------------------------------


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
    (target layer ids, the convention of :mod:`exittrain.models.target_model`) ``features`` is the
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
            prefix = output_cache(model(input_ids=input_ids_NP[:1, :S].to(device), use_cache=True, logits_to_keep=1))
            prefix.batch_repeat_interleave(N)  # every row continues from its own copy
            for layer in layers:  # (1, S, H) -> (N, S, H): the rows share these positions
                steps[layer][0] = steps[layer][0].expand(N, -1, -1)
            kwargs.update(cache_kwargs(prefix))
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
                use_cache=True,
                **cache_kwargs(output_cache(out)),
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
