"""Who answers the regeneration's prompts, and which of its batches this process answers.

- :func:`process_shard`: the shard I of N of an entry's batches this process answers
  (``data.generation.shard``, else the launcher's rank and world size, else every batch);
- :class:`Answerer`: the seam between the run (:func:`exittrain.data.regenerate.regenerate`) and
  the backends: :class:`HFAnswerer` (:func:`~exittrain.data.generation.generate_batch` in this
  process) or vLLM (:mod:`exittrain.data.vllm_backend`, imported only for ``backend="vllm"``), with
  the features, when asked, from one teacher-forced target pass (:class:`TeacherForcedFeatures`);
- :func:`resolve_backend`: the engine version that keys the cache.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from exittrain.data.generation import (
    Answer,
    GenerationConfig,
    answering_model,
    generate_batch,
    padding_token_id,
    parse_shard,
)

__all__ = [
    "LAUNCHER_RANKS",
    "Answerer",
    "HFAnswerer",
    "ProcessShard",
    "TeacherForcedFeatures",
    "open_answerer",
    "process_shard",
    "resolve_backend",
]

# launcher environment variables naming (global rank, world size), in the order they are read
LAUNCHER_RANKS = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))


# ----------------------------------------------------------------------------------------------
# Which part of the entry this process answers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessShard:
    """Shard ``index`` of ``count`` of an entry's batches (batch b is the shard's when
    ``b % count == index``), and where that came from (``source``)."""

    index: int
    count: int
    source: str

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, batch: int) -> bool:
        return batch % self.count == self.index


def process_shard(gen: GenerationConfig, environ: Mapping[str, str] | None = None) -> ProcessShard:
    """The shard this process answers: ``gen.shard`` (``"I/N"``) when set; else the launcher's
    global rank and world size (torchrun's ``RANK``/``WORLD_SIZE``, then srun's
    ``SLURM_PROCID``/``SLURM_NTASKS``; each pair only when both are set); else 0/1, every batch.

    Limit: a batch script inside a SLURM allocation of several tasks that runs one process without
    ``srun`` still sees ``SLURM_NTASKS``: give it ``data.generation.shard=0/1``.
    ValueError, naming the variables, for values that are not a shard."""
    if gen.shard is not None:
        index, count = parse_shard(gen.shard)
        return ProcessShard(index, count, "data.generation.shard")
    env = os.environ if environ is None else environ
    for rank_var, world_var in LAUNCHER_RANKS:
        rank, world = env.get(rank_var), env.get(world_var)
        if rank is None or world is None:
            continue
        try:
            index, count = parse_shard(f"{rank}/{world}")
        except ValueError as e:
            raise ValueError(
                f"{rank_var}={rank!r} and {world_var}={world!r} do not name a process of the launch (need "
                f"0 <= {rank_var} < {world_var}); fix the launcher's environment or set data.generation.shard=I/N"
            ) from e
        return ProcessShard(index, count, f"{rank_var}/{world_var}")
    return ProcessShard(0, 1, "one process")


# ----------------------------------------------------------------------------------------------
# Who answers: the seam between the run and the backends
# ----------------------------------------------------------------------------------------------


class Answerer(Protocol):
    """Answers batches of templated prompts (:mod:`exittrain.data.vllm_backend` has the same shape)."""

    def answer(self, prompt_ids: list[list[int]], batch_index: int) -> list[Answer]: ...

    def close(self) -> None: ...

    def describe(self) -> dict: ...


class HFAnswerer:
    """:func:`generate_batch` in this process, on the target or its ``gen.dtype`` copy
    (:func:`answering_model`); the model is in eval mode until :meth:`close` restores it."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        gen: GenerationConfig,
        *,
        eos_ids: Sequence[int],
        feature_layers: Sequence[int] = (),
        top_logprobs: int = 0,
    ) -> None:
        self.model, self.tokenizer, self.gen = model, tokenizer, gen
        self.eos_ids, self.layers, self.top_logprobs = list(eos_ids), list(feature_layers), top_logprobs
        self.pad_token_id = padding_token_id(tokenizer)
        self._was_training = model.training
        model.eval()
        self._answering = answering_model(model, gen.dtype)

    def answer(self, prompt_ids: list[list[int]], batch_index: int) -> list[Answer]:
        if self.gen.do_sample:
            torch.manual_seed(self.gen.seed + batch_index)  # the same draws whichever process answers the batch
        return generate_batch(
            self._answering, self.tokenizer, prompt_ids, self.gen, self.pad_token_id, self.eos_ids, self.layers,
            self.top_logprobs,
        )

    def close(self) -> None:
        self.model.train(self._was_training)
        self._answering = None

    def describe(self) -> dict:
        return {"backend": "hf", "dtype": self.gen.dtype, "share_prefix": self.gen.share_prefix}


class TeacherForcedFeatures:
    """An engine's answers with the target's features added by one teacher-forced pass over each
    answered row (:func:`~exittrain.data.teacher_forced.teacher_forced`), in ``feature_layers``'
    order; the engine's own soft labels are kept."""

    def __init__(self, engine: Answerer, model: Any, gen: GenerationConfig, feature_layers: Sequence[int]) -> None:
        self.engine, self.model, self.layers = engine, model, list(feature_layers)
        self._was_training = model.training
        model.eval()
        self._forward_model = answering_model(model, gen.dtype)

    def answer(self, prompt_ids: list[list[int]], batch_index: int) -> list[Answer]:
        from exittrain.data.teacher_forced import teacher_forced

        answers = self.engine.answer(prompt_ids, batch_index)
        answered = [i for i, a in enumerate(answers) if a.error is None]
        rows = [(list(prompt_ids[i]) + list(answers[i].response), len(prompt_ids[i])) for i in answered]
        forced = teacher_forced(self._forward_model, rows, feature_layers=self.layers) if rows else []
        out = list(answers)
        for i, kept in zip(answered, forced):
            out[i] = answers[i]._replace(features=kept.features)
        return out

    def close(self) -> None:
        self.engine.close()
        self.model.train(self._was_training)
        self._forward_model = None

    def describe(self) -> dict:
        return {**self.engine.describe(), "features": "teacher-forced target pass"}


def open_answerer(
    gen: GenerationConfig,
    *,
    model: Any,
    tokenizer: Any,
    target_name: str,
    eos_ids: Sequence[int],
    feature_layers: Sequence[int] = (),
    top_logprobs: int = 0,
) -> Answerer:
    """The answerer of ``gen.backend``: :class:`HFAnswerer`, or vLLM
    (:func:`exittrain.data.vllm_backend.open_answerer`, imported only here) with the features, when
    asked, from a teacher-forced pass of ``model`` (:class:`TeacherForcedFeatures`)."""
    if gen.backend == "hf":
        return HFAnswerer(
            model, tokenizer, gen, eos_ids=eos_ids, feature_layers=feature_layers, top_logprobs=top_logprobs
        )
    from exittrain.data import vllm_backend

    engine = vllm_backend.open_answerer(
        gen, target_name=target_name, tokenizer=tokenizer, model=model, top_logprobs=top_logprobs, eos_ids=list(eos_ids)
    )
    return TeacherForcedFeatures(engine, model, gen, feature_layers) if feature_layers else engine


def resolve_backend(gen: GenerationConfig) -> GenerationConfig:
    """``gen`` with the answering engine's version filled in (it keys the cache): unchanged for
    ``hf`` or a version already set, else :func:`exittrain.data.vllm_backend.resolve_engine`."""
    if gen.backend == "hf" or gen.engine_version is not None:
        return gen
    from exittrain.data import vllm_backend

    return vllm_backend.resolve_engine(gen)
