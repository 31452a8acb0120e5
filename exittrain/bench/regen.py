"""Regeneration benchmark on the embedded target: answers per second by dtype, and what bf16 changes.

``python -m exittrain bench regen [--prompts 64] [--max-new-tokens 48] [--batch 32]``

Side by side in one process, on the same training prompts of a domain (default code), each arm
answers every prompt greedily through :func:`exittrain.data.generation.generate_batch`, in the
batches :func:`~exittrain.data.regenerate.regenerate` would form (sorted by templated length):

- ``float32``: the target as loaded (the reference answers);
- ``bfloat16``: a bf16 copy of the target (``data.generation.dtype: bfloat16``);
- ``bfloat16 + features``: the same, keeping the drafter's default target layers at every position
  (what ``fit`` does, so that training needs no feature pass);
- ``float32, shared prefix`` and ``bfloat16 + features, shared prefix``: the same arms with
  ``generation.share_prefix`` (the default): each batch's common prefix is run once.

The arms without ``shared prefix`` run with ``share_prefix=False``, so the pairs show what sharing
saves on the same answers.

Reports seconds per answer, new tokens per second and the speedup over ``float32``. For the bf16
arms it also reports how faithful the answers are to the fp32 target: the share of answers equal
to the fp32 answer, and the share of response positions where the fp32 target, reading the bf16
answer so far, would pick the same next token (one fp32 forward per answer, not timed). Writes
``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time

import torch

from exittrain.tables import markdown_table, write_results


def run(prompts: int, max_new_tokens: int, batch: int, domain: str) -> dict:
    from exittrain.data import chat_prompt_ids
    from exittrain.data.generation import (
        GenerationConfig,
        answering_model,
        eos_token_ids,
        generate_batch,
        padding_token_id,
        shared_prefix_length,
    )
    from exittrain.data.prompts.prompt_plan import PromptPlan
    from exittrain.models import load_target
    from exittrain.models.drafter.starting_points import default_layer_ids

    target = load_target(None)
    model, tok = target.model, target.tokenizer
    texts = PromptPlan(domain, max_train_prompts=prompts).train
    templated = sorted((chat_prompt_ids(tok, p) for p in texts), key=len, reverse=True)
    batches = [templated[s : s + batch] for s in range(0, len(templated), batch)]
    gen = GenerationConfig(max_new_tokens=max_new_tokens, batch_size=batch, share_prefix=False)
    shared = dataclasses.replace(gen, share_prefix=True)
    eos = eos_token_ids(model, tok)
    pad = padding_token_id(tok)
    layers = default_layer_ids(target.num_layers)
    bf16 = answering_model(model, "bfloat16")

    def answer(m, keep: list[int] | None, g: GenerationConfig) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        out = [a.response for b in batches for a in generate_batch(m, tok, b, g, pad, eos, keep)]
        return time.perf_counter() - t0, out

    arms = [
        ("float32", model, None, gen),
        ("float32, shared prefix", model, None, shared),
        ("bfloat16", bf16, None, gen),
        ("bfloat16 + features", bf16, layers, gen),
        ("bfloat16 + features, shared prefix", bf16, layers, shared),
    ]
    rows, reference = [], None
    for name, m, keep, g in arms:
        seconds, answers = answer(m, keep, g)
        new_tokens = sum(len(a) for a in answers)
        row = {
            "arm": name,
            "seconds": seconds,
            "s_per_answer": seconds / len(answers),
            "new_tok_per_s": new_tokens / seconds,
            "answers_sha256": hashlib.sha256(json.dumps(answers).encode()).hexdigest(),
        }
        if reference is None:
            reference = (seconds, answers)
        else:
            row["speedup"] = reference[0] / seconds
            row["same_answer"] = sum(a == r for a, r in zip(answers, reference[1])) / len(answers)
            agree = total = 0
            with torch.no_grad():
                for prompt, resp in zip(templated, answers):
                    ids = torch.tensor([prompt + resp])
                    picks = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
                    agree += int((picks == ids[0, len(prompt) :]).sum())
                    total += len(resp)
            row["fp32_next_token_agreement"] = agree / max(total, 1)
        rows.append(row)
    return {
        "domain": domain,
        "prompts": len(templated),
        "batch": batch,
        "max_new_tokens": max_new_tokens,
        "mean_prompt_tokens": sum(map(len, templated)) / len(templated),
        "mean_shared_prefix_tokens": sum(shared_prefix_length(b) for b in batches) / len(batches),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "feature_layers": layers,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def to_markdown(result: dict) -> str:
    def cells(r: dict) -> list[str]:
        if "speedup" not in r:
            return ["1.00x", "-", "-"]
        agreement = f"{100 * r['fp32_next_token_agreement']:.1f}%"
        return [f"{r['speedup']:.2f}x", f"{100 * r['same_answer']:.0f}%", agreement]

    lines = [
        f"Greedy regeneration of {result['prompts']} {result['domain']} prompts (mean "
        f"{result['mean_prompt_tokens']:.0f} templated tokens, of which a batch shares "
        f"{result.get('mean_shared_prefix_tokens', 0):.0f}), {result['max_new_tokens']} new tokens at most, "
        f"batches of {result['batch']}, embedded SmolLM2 target, CPU ({result.get('cpu_capability', '?')}), "
        f"{result['threads']} threads.",
        "",
        *markdown_table(
            ["arm", "s / answer", "new tok/s", "speedup", "same answer as fp32", "fp32 next-token agreement"],
            ([r["arm"], f"{r['s_per_answer']:.2f}", f"{r['new_tok_per_s']:.0f}", *cells(r)] for r in result["rows"]),
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--domain", default="code", choices=["code", "dialogue", "math"])
    parser.add_argument("--out", default="results/bench_regen")
    args = parser.parse_args(argv)
    result = run(args.prompts, args.max_new_tokens, args.batch, args.domain)
    write_results(args.out, result, to_markdown(result))


if __name__ == "__main__":
    main()
