"""Which copy chain the target agrees with: the copy tail's chains scored on greedy answers.

``python -m exittrain bench copy [--sets code restating] [--prompts 8] [--skip 16] [--new-tokens 96]
[--length 20]``

No drafter and no timing: for each held-out prompt of a set, the embedded target answers greedily,
and at every answer position (the root) each chain rule's chain is compared with the tokens the
target went on to write. A chain's score is how many of its leading tokens agree, which is what a
T = 0 verifier would accept of it, grafted at the root. The rules:

- ``latest``: the tokens after the latest earlier occurrence of the root's 3-gram, else 2-gram
  (:func:`~exittrain.core.copy_tail.copy_chain`, the copy tail's first chain);
- ``earliest``: the same after the earliest occurrence (the copy tail's second chain);
- ``both``: the better of the two at each position, what grafting both gives a T = 0 verifier;
- ``prompt lookup``: Hugging Face's rule with ``prompt_lookup_num_tokens=10``: the earliest
  occurrence of the root's 2-gram, else 1-gram, at most 10 tokens.

Each rule's chain holds at most ``--length`` tokens (prompt lookup's 10).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from exittrain.core.copy_tail import copy_chain
from exittrain.tables import write_results

RULES = ("latest", "earliest", "both", "prompt lookup")
COPY_NGRAMS = (3, 2)  # the decoder's copy_ngrams default
LOOKUP_NGRAMS, LOOKUP_TOKENS = (2, 1), 10  # Hugging Face's max_matching_ngram_size=2, prompt_lookup_num_tokens=10


def agreed(chain: list[int], continuation: list[int]) -> int:
    """How many leading tokens of ``chain`` equal the continuation's."""
    n = 0
    for a, b in zip(chain, continuation):
        if a != b:
            break
        n += 1
    return n


def chain_scores(ids: list[int], n_prompt: int, length: int) -> dict[str, list[int]]:
    """Per rule (:data:`RULES`), the agreed tokens at each root from the last prompt token to the
    last but one token of ``ids`` (a prompt of ``n_prompt`` tokens and its answer)."""
    if not 1 <= n_prompt <= len(ids):
        raise ValueError(f"n_prompt={n_prompt} must be in 1..{len(ids)} (the prompt's length within ids)")
    if length < 1:
        raise ValueError(f"--length must be >= 1, got {length}")
    ids_T = torch.tensor(ids, dtype=torch.long)
    scores = {rule: [] for rule in RULES}
    for a in range(n_prompt - 1, len(ids) - 1):
        committed_T, rest = ids_T[: a + 1], ids[a + 1:]  # the root and what came before; what followed
        latest = agreed(copy_chain(committed_T, COPY_NGRAMS, length), rest)
        earliest = agreed(copy_chain(committed_T, COPY_NGRAMS, length, earliest=True), rest)
        lookup = agreed(copy_chain(committed_T, LOOKUP_NGRAMS, min(length, LOOKUP_TOKENS), earliest=True), rest)
        for rule, value in zip(RULES, (latest, earliest, max(latest, earliest), lookup)):
            scores[rule].append(value)
    return scores


def summary(scores: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Per rule: the mean agreed tokens a position, and the shares of positions with at least 1, 5 and 10."""
    out = {}
    for rule, values in scores.items():
        if not values:
            raise ValueError("no answer position to score: raise --new-tokens")
        out[rule] = {"mean": statistics.fmean(values),
                     **{f"at_least_{k}": sum(v >= k for v in values) / len(values) for k in (1, 5, 10)}}
    return out


def run(sets: list[str], n_prompts: int, skip: int, new_tokens: int, length: int) -> dict:
    from exittrain.bench.decode import check_sets, host, set_prompts
    from exittrain.decoding.speculative import autoregressive_generate
    from exittrain.models import load_target
    from exittrain.progress import Ticker

    check_sets(sets)
    target = load_target(None)
    measured = []
    for name in sets:
        prompts = set_prompts(target, name, n_prompts, skip)
        scores = {rule: [] for rule in RULES}
        ticker = Ticker(f"bench copy {name}", len(prompts), unit="prompt", every=1)
        for i, prompt in enumerate(prompts, 1):
            answer = autoregressive_generate(target, prompt, new_tokens).tokens
            for rule, values in chain_scores(list(prompt) + list(answer), len(prompt), length).items():
                scores[rule] += values
            ticker.update(i)
        measured.append({"name": name, "prompts": len(prompts), "positions": len(scores["latest"]),
                         "rules": summary(scores)})
    return {"host": host(), "skip": skip, "new_tokens": new_tokens, "length": length, "sets": measured}


def to_markdown(result: dict) -> str:
    lines = [f"Tokens of each copy chain the target's greedy answer agrees with, per answer position; chains of "
             f"at most {result['length']} tokens (prompt lookup: {LOOKUP_TOKENS}), {result['new_tokens']} answer "
             "tokens per prompt.", "",
             "| set | prompts | positions | rule | mean agreed | >= 1 | >= 5 | >= 10 |",
             "|---|---|---|---|---|---|---|---|"]
    for s in result["sets"]:
        for rule, r in s["rules"].items():
            lines.append(f"| {s['name']} | {s['prompts']} | {s['positions']} | {rule} | {r['mean']:.2f} | "
                         f"{r['at_least_1']:.2f} | {r['at_least_5']:.2f} | {r['at_least_10']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", default=["code", "restating"], help="prompt sets (bench decode's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--skip", type=int, default=16, help="evaluation prompts to leave out first")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--length", type=int, default=20, help="the most tokens a chain holds")
    parser.add_argument("--out", default="results/bench_copy")
    args = parser.parse_args(argv)
    result = run(list(dict.fromkeys(args.sets)), args.prompts, args.skip, args.new_tokens, args.length)
    write_results(args.out, result, to_markdown(result))
