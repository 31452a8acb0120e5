"""The serving track of fit's final table: what a chain-verifying engine (vLLM, SGLang) gets from a drafter.

A serving engine verifies one draft per round, the drafter's greedy K tokens (a chain,
:mod:`exittrain.decoding.chain_decoder`), where the tree track decodes DDTree's best-first tree of the
recipe's budget. For every drafter row of the table this module adds:

- ``chain_tau`` (and ``chain_ci95``, ``chain_K``) at each of ``eval.temperatures``: the block length
  of the chain verified exactly at T, pooled over every round of every held-out prompt (tokens /
  rounds), on the same prompts and token limit as the tree track: what the engine's mean acceptance
  length is for this drafter, measured with our own target. The rounds follow from the target's
  text, so :func:`chain_rows` walks them along its answers (:mod:`exittrain.heldout.round_walk`, a
  target pass per answer instead of a decode): its greedy answer at T = 0, where it also decodes the
  first prompt for real with :class:`~exittrain.decoding.chain_decoder.ChainDecoder` (greedy
  verifier) as the lossless check (``chain_lossless``) and the walk's live check
  (``chain_walk_exact``); its samples at T > 0;
- ``vllm`` (the exported drafter's row only, ``eval.vllm``): vLLM's mean acceptance length with
  the DFlash export on the same prompts, and whether vLLM's greedy outputs with speculation equal
  its outputs without (:func:`vllm_track`, through :func:`exittrain.serve.vllm_run.run_vllm`).

``+serve=dflash`` (conf/serve/dflash.yaml) is checked by :func:`check_serve_config`.

**Limits.** vLLM is run greedily only (its comparison is token for token), beside the T = 0 chain
tau. vLLM emits its first token from the prefill without a draft; the chain track does the same
(the target's first token, then rounds from the prompt plus that token:
:func:`exittrain.decoding.chain_decoder.decode_after_prefill`), so both count the same rounds.
vLLM's target runs its own CPU kernels: a near tie can still resolve differently, and the two
acceptance lengths then differ a little.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from exittrain.core import bootstrap_ci, pooled
from exittrain.heldout.round_walk import walk_checks
from exittrain.progress import Ticker

log = logging.getLogger(__name__)

__all__ = [
    "VLLM_MODES", "attach_chain", "chain_rows", "check_servable", "check_serve_config",
    "summarize_chain", "target_folder", "vllm_enabled", "vllm_track",
]

VLLM_MODES = ("auto", "true", "false")  # eval.vllm, compared lower-cased (Hydra reads true/false as booleans)
SERVE_KEYS = ("format", "engine", "num_speculative_tokens", "primary")  # serve.*: conf/serve/dflash.yaml
_SETUP = "make vllm-setup"


def check_serve_config(cfg) -> dict | None:
    """``cfg.serve`` (``+serve=dflash``) checked against the drafter it trains; None without it.

    ValueError naming the key: an unknown format, a K that is not ``drafter.block_size - 1`` (the
    engine drafts a block of root + K masks: another K runs a block the drafter never saw), a
    copy branch or a context window (the DFlash format holds neither), or an unknown ``primary``.
    """
    serve = cfg.get("serve")  # absent: the run serves nothing (conf/fit.yaml lists no serve group)
    if serve is None:
        return None
    missing = [f"serve.{k}" for k in SERVE_KEYS if k not in serve]
    if missing:  # conf/serve/dflash.yaml sets each one: the code gives them no default of its own
        raise ValueError(f"{missing} missing from the config: conf/serve/dflash.yaml sets them; add +serve=dflash")
    if serve.format != "dflash":
        raise ValueError(f"serve.format={serve.format!r}: only 'dflash' is served (+serve=dflash)")
    K = serve.num_speculative_tokens
    block = int(cfg.drafter.block_size)
    if isinstance(K, bool) or not isinstance(K, int) or K != block - 1:
        raise ValueError(
            f"serve.num_speculative_tokens={K!r} with drafter.block_size={block}: the engine drafts root + K masks, "
            f"so K must be block_size - 1 = {block - 1}; set one to match the other"
        )
    if list(cfg.drafter.get("copy_ngrams") or []):
        raise ValueError(f"drafter.copy_ngrams={list(cfg.drafter.copy_ngrams)} with +serve=dflash: the DFlash format "
                         "has no copy branch; set drafter.copy_ngrams=[]")
    if cfg.drafter.get("context_window") is not None:
        raise ValueError(f"drafter.context_window={cfg.drafter.context_window} with +serve=dflash: a DFlash drafter "
                         "attends to the whole context; set drafter.context_window=null")
    if serve.primary not in ("dflash", "drafter"):
        raise ValueError(f"serve.primary={serve.primary!r}: use dflash (drafter_dflash/) or drafter (drafter/)")
    return {"format": "dflash", "engine": serve.engine, "num_speculative_tokens": K, "primary": serve.primary}


def check_servable(drafter_config) -> None:
    """``+serve=dflash``, once the drafter is built: ValueError listing what the DFlash format would
    refuse (:meth:`~exittrain.models.drafter.configuration.DrafterConfig.dflash_problems`; the learned mask
    ships beside the weights and is fine), before any training."""
    problems = {k: v for k, v in drafter_config.dflash_problems().items() if k != "learned_mask"}
    if problems:
        raise ValueError("+serve=dflash trains a drafter the DFlash format cannot hold: "
                         + "; ".join(f"drafter.{k}: {why}" for k, why in problems.items()))


def vllm_enabled(mode, vllm_python: str | os.PathLike) -> bool:
    """Whether fit's finish runs vLLM: ``eval.vllm`` ``auto`` (when ``vllm_python`` is an executable),
    ``true`` (required: ValueError naming the fix when it is missing) or ``false``."""
    text = str(mode).lower()
    if text not in VLLM_MODES:
        raise ValueError(f"eval.vllm={mode!r}: use auto (when {vllm_python} exists), true (required) or false")
    present = Path(vllm_python).is_file() and os.access(vllm_python, os.X_OK)
    if text == "true" and not present:
        raise ValueError(f"eval.vllm=true but {vllm_python} is missing: build it with `{_SETUP}` or set eval.vllm=auto")
    return text == "true" or (text == "auto" and present)


def chain_rows(target, drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int = 0,
               label: str = "", ar_cache: dict | None = None, live: int | None = 1,
               temperatures: Sequence[float] = (0.0,), passes=None) -> list[dict]:
    """One row per (prompt, temperature): the drafter's greedy chain of K nodes verified as a serving
    engine does, ``block_lengths`` per round and ``new_tokens``, rounds counted as vLLM counts them
    (:func:`decode_after_prefill`: the first token from the prefill, then rounds).

    A round's acceptance follows from the target's text, so every prompt's rounds are walked along
    the target's own answer at each temperature (:func:`~exittrain.heldout.round_walk.walked_rounds`,
    ``decoded`` False; the answer is ``ar_cache[(T, i)]``, decoded here when absent): at T = 0 its
    greedy answer, where a greedy decode's rounds are the walk's exactly; at T > 0 its sample at T,
    where the rounds are distributed as those of any exact verifier of the chain at T (a serving
    engine's rejection sampling included; docs/algorithm.md section 6.1). At T = 0 the first ``live``
    prompts are also decoded for real by :class:`ChainDecoder` with the greedy verifier (``decoded``
    True): their rows add ``matches_target`` (the decode's tokens equal the target's greedy ones: the
    chain's lossless check) and ``walk_matches_decode`` (the walk gave the decode's rounds, logged as
    an error where not), and keep the decode's rounds. ``live=None`` decodes every T = 0 prompt and
    walks none: the slow reference twin (the walk's tests compare the two); it needs T = 0 alone.

    ``ar_cache``: the tree track's answers and baselines, keyed ``(temperature, prompt index)``
    (:func:`~exittrain.heldout.decode_eval.evaluate_prompts`), reused and filled. ``passes``: the
    :class:`~exittrain.heldout.sequence_passes.SequencePasses` the walks share (None: one for this call)."""
    from exittrain.decoding.chain_decoder import ChainDecoder, decode_after_prefill
    from exittrain.heldout.answers import cached_baseline, walk_answers
    from exittrain.heldout.round_walk import check_live, walked_rounds
    from exittrain.heldout.sequence_passes import SequencePasses

    check_live(live)
    temperatures = [float(t) for t in temperatures]
    if live is None and any(t > 0 for t in temperatures):
        raise ValueError(f"live=None decodes every prompt greedily: it takes temperatures=[0.0], got {temperatures}")
    ar_cache = {} if ar_cache is None else ar_cache
    if live is not None:  # the walked prompts' answers, in batches
        walk_answers(target, prompts, ar_cache, temperatures, live=live, max_new_tokens=max_new_tokens, seed=seed)
    passes = SequencePasses(target) if passes is None else passes
    decoder = ChainDecoder(target, drafter, verifier="greedy")
    ticker = Ticker(f"eval {label} chain".strip(), len(prompts) * len(temperatures), unit="prompt", every=4)
    rows = []
    for done, (temperature, i) in enumerate((t, i) for t in temperatures for i in range(len(prompts))):
        ticker.update(done)
        prompt = prompts[i]
        plain = cached_baseline(ar_cache, target, prompt, i, max_new_tokens, temperature, seed + i).tokens
        row = {"label": label, "prompt_index": i, "budget": decoder.budget, "temperature": temperature,
               "new_tokens": len(plain), "decoded": temperature == 0 and (live is None or i < live)}
        if not plain:  # no new token asked for: no round
            rows.append({**row, "block_lengths": [], "rounds": 0, "tau": 0.0, "matches_target": True})
            continue
        walked = None if live is None else walked_rounds(target, drafter, prompt, plain, max_new_tokens=max_new_tokens,
                                                         temperature=temperature, seed=seed + i, passes=passes)
        if not row["decoded"]:
            rows.append({**row, **_rounds(walked)})
            continue
        # rounds as vLLM counts them: its prefill emits the first token without a draft
        tokens, rounds = decode_after_prefill(decoder, list(prompt), plain[0], max_new_tokens, target.eos_token_ids)
        n = min(len(plain), len(tokens))
        row.update(**_rounds([r.block_length for r in rounds]), new_tokens=len(tokens),
                   matches_target=plain[:n] == tokens[:n])
        if walked is not None:
            row["walk_matches_decode"] = walked == row["block_lengths"]
            if not row["walk_matches_decode"]:
                log.error("eval %s chain, prompt %d: the walked rounds %s differ from the decoded %s (lossless: %s); "
                          "the chain tau of the walked prompts may be off (exittrain/heldout/round_walk.py, Limits)",
                          label, i, walked, row["block_lengths"], row["matches_target"])
        rows.append(row)
    ticker.update(len(prompts) * len(temperatures))
    return rows


def _rounds(blocks: list[int]) -> dict:
    """A prompt's rounds: ``block_lengths``, ``rounds`` and its own pooled ``tau``."""
    return {"block_lengths": blocks, "rounds": len(blocks), "tau": sum(blocks) / len(blocks) if blocks else 0.0}


def summarize_chain(rows: list[dict]) -> dict[float, dict]:
    """Per temperature, ``{chain_tau, chain_ci95, chain_K, chain_live[, chain_lossless, chain_walk_exact]}``
    pooled over ``rows`` (total tokens / total rounds of every prompt at that temperature):
    ``chain_lossless`` over the prompts decoded for real (``chain_live`` of them), ``chain_walk_exact``
    where a walk was checked against a decode."""
    if not rows:
        raise ValueError("no chain rows to summarize: decode at least one held-out prompt")
    out = {}
    for temperature in dict.fromkeys(r.get("temperature", 0.0) for r in rows):
        mine = [r for r in rows if r.get("temperature", 0.0) == temperature]
        lengths = [r["block_lengths"] for r in mine]
        decoded = [r for r in mine if r.get("decoded", True)]
        cell = {"chain_tau": pooled(lengths), "chain_ci95": bootstrap_ci(lengths), "chain_K": mine[0]["budget"]}
        if decoded:
            cell["chain_lossless"] = all(r["matches_target"] for r in decoded)
        out[temperature] = {**cell, **{f"chain_{k}": v for k, v in walk_checks(mine).items()}}
    return out


def attach_chain(table: list[dict], chain: dict[float, dict]) -> None:
    """Copy each temperature's chain summary (:func:`summarize_chain`) into every row of one drafter's
    table at that temperature (the chain has no budget of its own)."""
    for row in table:
        row.update(chain.get(row["temperature"], {}))


def target_folder(target, name_or_path) -> str:
    """The target as vLLM loads it: the embedded SmolLM2 converted to an HF folder, else ``target.name_or_path``."""
    from exittrain.models.target_loading import EMBEDDED_TARGET_NAME, convert_embedded_target

    if target.name == EMBEDDED_TARGET_NAME or name_or_path is None:
        return str(convert_embedded_target())
    return str(name_or_path)


def vllm_track(vllm_python: str | os.PathLike, target_dir: str, drafter_dir: str | os.PathLike,
               prompts: Sequence[Sequence[int]], *, max_new_tokens: int, workdir: Path,
               timeout: float = 1800.0, max_model_len: int = 2048) -> dict:
    """vLLM with the DFlash drafter in ``drafter_dir`` on ``prompts`` (token ids): ``{vllm_tau,
    vllm_ci95, vllm_per_prompt, vllm_matches_plain, vllm_version, drafts, prompts_equal, prompts}``
    (see :func:`exittrain.serve.vllm_run.run_vllm`, run one prompt at a time: ``vllm_per_prompt`` holds
    each prompt's drafts and accepted tokens, ``vllm_ci95`` the interval over prompts, and two
    drafters' tables on the same prompts pair with :func:`exittrain.serve.compare.paired_acceptance`).
    ``max_model_len``: vLLM's context, at most the target's ``max_position_embeddings`` (vLLM refuses
    more). A mismatch of speculative and plain outputs is logged as an error."""
    from exittrain.serve.compare import acceptance_interval
    from exittrain.serve.vllm_run import run_vllm

    result = run_vllm(vllm_python, target_dir, drafter_dir, [list(p) for p in prompts], max_tokens=max_new_tokens,
                      workdir=workdir, timeout=timeout, max_model_len=max_model_len, per_prompt=True)
    agreement = result["agreement"]
    out = {"vllm_tau": result["acceptance"]["mean_acceptance_length"],
           "vllm_ci95": acceptance_interval(result["per_prompt"])["ci95"], "vllm_per_prompt": result["per_prompt"],
           "vllm_matches_plain": agreement["equal"],
           "vllm_version": result["vllm_version"], "drafts": result["acceptance"]["drafts"],
           "prompts_equal": agreement["prompts_equal"], "prompts": agreement["prompts"],
           "num_speculative_tokens": result["num_speculative_tokens"]}
    if not agreement["equal"]:
        log.error("vLLM's greedy outputs WITH DFlash speculation differ from those WITHOUT on %d of %d prompts "
                  "(first mismatches %s): the engine's acceptance of this drafter is not lossless here; see %s",
                  agreement["prompts"] - agreement["prompts_equal"], agreement["prompts"],
                  agreement["first_mismatch"], workdir)
    return out
