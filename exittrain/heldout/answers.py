"""The target's own answers to the held-out prompts, which every walked track follows.

At T = 0 the greedy answer, along which a walk gives a decode's rounds exactly; at T > 0 a sample of
the target at T, along which the walked rounds are distributed as a decode's at T
(:mod:`exittrain.heldout.round_walk`). One function draws them all (:func:`answer_sets`: one prefill
a batch of prompts for every temperature), one fills an evaluator's cache with them
(:func:`walk_answers`), and :func:`cached_baseline` gives the one-prompt autoregressive decode that
the live checks and the speed columns compare against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ANSWER_BATCH", "answer_sets", "cached_baseline", "walk_answers"]


def _check_temperature(temperature: float, name: str = "temperature") -> None:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
        raise ValueError(f"{name} must be a number >= 0 (0 = greedy), got {temperature!r}")



ANSWER_BATCH = 16  # held-out prompts prefilled together by answer_sets


def _next_tokens(logits_RV: torch.Tensor, temperatures: list[float], generators: list) -> torch.Tensor:
    """(R,) next tokens of rows ``r``, row r at ``temperatures[r % C]``: the argmax where T = 0, a draw
    from ``softmax(logits / T)`` by that temperature's generator elsewhere."""
    C = len(temperatures)
    tokens_R = logits_RV.argmax(-1)
    for c, (T, generator) in enumerate(zip(temperatures, generators, strict=True)):
        if T > 0:
            probs_NV = torch.softmax(logits_RV[c::C] / T, dim=-1)
            tokens_R[c::C] = torch.multinomial(probs_NV, 1, generator=generator).squeeze(1)
    return tokens_R


@torch.no_grad()
def answer_sets(
    target, prompts: Sequence[Sequence[int]], temperatures: Sequence[float], max_new_tokens: int, *,
    seed: int = 0, batch: int = ANSWER_BATCH,
) -> dict[float, list[tuple[torch.Tensor, int, None]]]:
    """The target's answers to templated ``prompts`` at each of ``temperatures``: ``{T: rows}``, a row
    per prompt in order, ``(ids (n,) long, n_prompt, None)`` (features: None).

    T = 0: greedy, the argmax of the target's raw logits (the token the decoders' target law puts
    first); T > 0: drawn from ``softmax(logits / T)``, top-k and top-p off, by a generator of its own
    seeded with ``seed + round(1000 T)`` (the global random streams are untouched), so a temperature
    and a seed give the same answers whatever sets are drawn beside them (up to the float rounding of
    another batch's width). An answer stops after one of ``target.eos_token_ids`` (kept) or ``max_new_tokens``
    tokens, where the decoders stop.

    Why one function for every temperature: a batch of ``batch`` prompts is prefilled once and its
    cache copied for each temperature, and the copies decode together. The prefill of a held-out
    prompt costs several times its 64-token answer, so the sets cost little more than one set. Rows
    are left-padded to the batch's widest prompt, as batched generation pads them: a row's logits
    differ from its prompt's alone by float rounding only.
    """
    from exittrain.data.generation import split_response
    from exittrain.models.hf_cache import cache_kwargs, output_cache

    temps = [float(t) for t in temperatures]
    for t in temps:
        _check_temperature(t)
    if len(set(temps)) != len(temps) or not temps:
        raise ValueError(f"temperatures={list(temperatures)}: need distinct temperatures, at least one")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: need an integer >= 1")
    model, device, C = target.model, target.device, len(temps)
    eos = torch.tensor(target.eos_token_ids, dtype=torch.long, device=device)
    pad = target.eos_token_ids[0] if target.eos_token_ids else 0  # left padding and finished rows: masked or dropped
    # a generator per temperature: a set's answers do not depend on the sets drawn beside it
    generators = [torch.Generator(device=device).manual_seed(seed + round(1000 * t)) for t in temps]
    out: dict[float, list] = {t: [] for t in temps}
    for start in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[start : start + batch]]
        N, W = len(chunk), max(len(p) for p in chunk)
        ids_NW = torch.full((N, W), pad, dtype=torch.long)
        mask_NW = torch.zeros((N, W), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids_NW[i, W - len(p) :], mask_NW[i, W - len(p) :] = torch.tensor(p, dtype=torch.long), 1
        mask_NW = mask_NW.to(device)
        prefill = model(input_ids=ids_NW.to(device), attention_mask=mask_NW,
                        position_ids=(mask_NW.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
        cache = output_cache(prefill)
        cache.batch_repeat_interleave(C)  # row r: prompt r // C at temps[r % C]
        R = N * C
        logits_RV = prefill.logits[:, -1].float().repeat_interleave(C, 0)
        mask_RS = mask_NW.repeat_interleave(C, 0)
        done_R = torch.zeros(R, dtype=torch.bool, device=device)
        new_RG = []
        for step in range(max_new_tokens):
            tokens_R = torch.where(done_R, pad, _next_tokens(logits_RV, temps, generators))
            new_RG.append(tokens_R)
            done_R |= torch.isin(tokens_R, eos)
            if bool(done_R.all()) or step == max_new_tokens - 1:
                break
            mask_RS = torch.cat([mask_RS, torch.ones(R, 1, dtype=torch.long, device=device)], dim=1)
            logits_RV = model(input_ids=tokens_R[:, None], attention_mask=mask_RS,
                              position_ids=mask_RS.sum(1, keepdim=True) - 1, use_cache=True,
                              **cache_kwargs(cache)).logits[:, -1].float()
        new_RG = torch.stack(new_RG, dim=1).cpu()
        for r in range(R):
            answer, _ = split_response(new_RG[r].tolist(), target.eos_token_ids)
            prompt = chunk[r // C]
            out[temps[r % C]].append((torch.tensor(prompt + answer, dtype=torch.long), len(prompt), None))
    return out


def walk_answers(target, prompts: Sequence[Sequence[int]], ar_cache: dict, temperatures: Sequence[float], *,
                 live: int, max_new_tokens: int, seed: int = 0) -> None:
    """Fill ``ar_cache[(T, i)]`` with the target's answers the walked tracks follow, from one
    :func:`answer_sets` call (one prefill of the prompts for every temperature): at T = 0 the greedy
    answer of every prompt ``i >= live`` (the live prompts keep the one-prompt baseline their
    lossless check compares against), at T > 0 a sample at T of every prompt. Entries the cache
    holds are kept; each is a :class:`~exittrain.decoding.GenerationResult` of at most
    ``max_new_tokens`` tokens (EOS kept).

    The entries carry no timing (``seconds`` 0): they are answers to walk along, not baselines to
    time a decode against, so a cache filled here must not feed speed columns (the evaluator's
    cache serves one mode for its life)."""
    from exittrain.decoding import GenerationResult
    from exittrain.progress import Heartbeat

    todo = {float(T): [i for i in range(live if T == 0 else 0, len(prompts)) if (float(T), i) not in ar_cache]
            for T in temperatures}
    todo = {T: idx for T, idx in todo.items() if idx}
    if not todo:
        return
    union = sorted({i for idx in todo.values() for i in idx})
    what = ", ".join(f"{T:g}" for T in todo)
    with Heartbeat(f"eval: the target's answers to {len(union)} prompts at T = {what}"):
        sets = answer_sets(target, [prompts[i] for i in union], list(todo), max_new_tokens, seed=seed)
    for T, idx in todo.items():
        rows = dict(zip(union, sets[T], strict=True))
        for i in idx:
            ids, n_prompt, _ = rows[i]
            ar_cache[(T, i)] = GenerationResult(ids[n_prompt:].tolist())


def cached_baseline(ar_cache: dict, target, prompt: Sequence[int], i: int, max_new_tokens: int,
                    temperature: float = 0.0, seed: int = 0):
    """``ar_cache[(temperature, i)]``, the target's own decode of prompt ``i``
    (:func:`~exittrain.decoding.autoregressive_generate`, timed), decoded now if absent: it depends on
    neither the drafter nor the budget, so every row of one prompt shares it."""
    from exittrain.decoding import autoregressive_generate

    key = (temperature, i)
    if key not in ar_cache:
        ar_cache[key] = autoregressive_generate(target, list(prompt), max_new_tokens, temperature, seed=seed)
    return ar_cache[key]
