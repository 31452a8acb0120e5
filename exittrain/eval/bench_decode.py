"""Decoding benchmark on the embedded target: speculative vs autoregressive, per-stage times.

``python -m exittrain bench decode [--drafter PATH] [--budgets 16 32 64] [--prompts 4] [--new-tokens 64]``

Side by side in one run, on the same prompts and the same target wrapper: the autoregressive
baseline, then the speculative decoder at each budget (TEV, temperature 0). Reports tau,
tokens/s, speedup, the share of each round stage (draft, tree, target, verify, commit) and the
per-round overhead outside the two model forwards: (tree + verify + commit) / round time.
Stage times come from ``perf_counter`` laps inside the decoder (with an accelerator sync
before each lap on a GPU). Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse

import torch

from exittrain.data import chat_prompt_ids, load_domain
from exittrain.decoding import STAGES, SpeculativeDecoder, autoregressive_generate
from exittrain.eval.bench import write_results
from exittrain.models import load_drafter, load_target, new_drafter
from exittrain.tables import markdown_table


def run(drafter_path: str | None, budgets: list[int], n_prompts: int, new_tokens: int, domain: str) -> dict:
    target = load_target(None)
    drafter = load_drafter(drafter_path, target) if drafter_path else new_drafter(target, seed=0)
    texts = load_domain(domain).eval[:n_prompts]
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in texts]
    # warm-up: one short decode of each kind so lazy initialisation is not timed
    autoregressive_generate(target, prompts[0], 4)
    SpeculativeDecoder(target, drafter, budget=budgets[0]).generate(prompts[0], 4)

    ar = [autoregressive_generate(target, p, new_tokens) for p in prompts]
    ar_tps = sum(len(r.tokens) for r in ar) / sum(r.seconds for r in ar)
    rows = []
    for budget in budgets:
        decoder = SpeculativeDecoder(target, drafter, budget=budget, verifier="tev")
        results = [decoder.generate(p, new_tokens, temperature=0.0) for p in prompts]
        rounds = [r for res in results for r in res.rounds]
        stage = {s: sum(r.times.get(s, 0.0) for r in rounds) for s in STAGES}
        round_time = sum(stage.values())
        tps = sum(len(r.tokens) for r in results) / sum(r.seconds for r in results)
        rows.append({
            "budget": budget,
            "tau": sum(r.block_length for r in rounds) / len(rounds),
            "tokens_per_s": tps,
            "speedup": tps / ar_tps,
            "ms_per_round": 1e3 * round_time / len(rounds),
            "stage_ms_per_round": {s: 1e3 * v / len(rounds) for s, v in stage.items()},
            "overhead_share": (stage["tree"] + stage["verify"] + stage["commit"]) / round_time,
            "lossless": all(a.tokens == s.tokens for a, s in zip(ar, results)),
        })
    return {"domain": domain, "prompts": n_prompts, "new_tokens": new_tokens, "drafter": drafter_path or "fresh",
            "threads": torch.get_num_threads(), "ar_tokens_per_s": ar_tps, "rows": rows}


def to_markdown(result: dict) -> str:
    rows = (
        [r["budget"], f"{r['tau']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['ms_per_round']:.1f}",
         *(f"{r['stage_ms_per_round'][s]:.1f}" for s in STAGES), f"{100 * r['overhead_share']:.1f}%", r["lossless"]]
        for r in result["rows"]
    )
    lines = [
        f"Decoding on the embedded SmolLM2-135M-Instruct, CPU, {result['threads']} threads; drafter: "
        f"{result['drafter']}; {result['prompts']} {result['domain']} prompts x {result['new_tokens']} new tokens, "
        f"T=0, TEV. Autoregressive: {result['ar_tokens_per_s']:.1f} tok/s.",
        "",
        *markdown_table(["B", "tau", "tok/s", "speedup", "ms/round", *(f"{s} ms" for s in STAGES), "overhead",
                         "lossless"], rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="saved drafter folder (default: a fresh drafter)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--domain", default="code")
    parser.add_argument("--out", default="results/bench_decode")
    args = parser.parse_args(argv)
    result = run(args.drafter, args.budgets, args.prompts, args.new_tokens, args.domain)
    write_results(args.out, result, to_markdown(result))


if __name__ == "__main__":
    main()
