"""Held-out T = 0 block length of saved drafters at every position of the target's own answers.

``python -m exittrain bench heldout DRAFTER [DRAFTER ...] [--prompts 64] [--skip 8] [--budget 16]``

The fp32 target (as loaded) answers the domain's evaluation prompts ``skip .. skip + prompts``
greedily, keeping the target features of every drafter's layers. Each answer position is then an
anchor: its token is the root, the target features before it are the drafter's context, and the
next K answer tokens are the target's own greedy continuation. Each drafter builds its tree of
budget B there, and 1 + :func:`exittrain.core.followed_depth` is exactly the block a T = 0
verifier would accept on it (the ``greedy_block_length`` that training logs on its own rows).

Why: the final table of ``fit`` decodes 8 prompts, a few hundred rounds, and its 95% interval is
about +-0.2; this measures every one of several thousand anchors, and needs no target forward per
drafter, so drafters of two runs can be compared within a few hundredths. It is not the decoded
tau: decoding visits only the anchors where rounds start. The first ``skip`` prompts are the ones
``fit`` decodes (``eval.num_prompts``), left out so that both measures use separate prompts.
Reports the mean, its 95% interval (bootstrap over prompts) and the per-depth accuracy of each
drafter's argmax. Every drafter after the first is also compared with the first at the same
anchors: the mean paired difference and its 95% interval (bootstrap over prompts, resampling the
anchors' differences), which is much narrower than the two drafters' own intervals, so a change
of 1-2% can be told from noise. Drafters of another block size have other anchors and get no
paired difference. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse

import torch

from exittrain.eval.bench import write_results
from exittrain.tables import markdown_table


def answer_with_features(target, prompts: list[list[int]], layers: list[int], max_new_tokens: int, batch: int):
    """Greedy fp32 answers of ``prompts`` with the target features of ``layers`` at every position:
    a list of ``(ids (n,) long, n_prompt, features (n, F) bf16)``."""
    from exittrain.data.regenerate import GenerationConfig, eos_token_ids, generate_batch, padding_token_id

    model, tok = target.model, target.tokenizer
    gen = GenerationConfig(max_new_tokens=max_new_tokens, batch_size=batch)
    eos, pad = eos_token_ids(model, tok), padding_token_id(tok)
    rows = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        for prompt, answer in zip(chunk, generate_batch(model, tok, chunk, gen, pad, eos, layers)):
            rows.append((torch.tensor(prompt + answer.response), len(prompt), answer.features))
    return rows


def greedy_block_lengths(drafter, rows, layers: list[int], budget: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per row, the (A,) T = 0 block lengths of ``drafter`` at its answer anchors; and the (K,)
    per-depth argmax accuracy over all anchors. ``rows`` as :func:`answer_with_features` returns,
    with the features of ``layers`` (a superset of the drafter's, in that order)."""
    from exittrain.core import build_tree, followed_depth

    K, H = drafter.config.num_draft_tokens, drafter.config.target_hidden_size
    slots = [layers.index(x) for x in drafter.config.target_layer_ids]
    pick = torch.cat([torch.arange(s * H, (s + 1) * H) for s in slots])  # the drafter's slices of F
    per_row, hits, anchors_seen = [], torch.zeros(K), 0
    with torch.no_grad():
        for ids, n_prompt, features in rows:
            T = ids.shape[0]
            if T - K <= n_prompt - 1:  # an answer shorter than K tokens has no full anchor
                continue
            anchors = torch.arange(n_prompt - 1, T - K)  # roots: the last prompt token, then the answer
            logits = drafter.forward_anchors(features[:, pick].float()[None], ids[None], anchors[None]).float()
            labels = ids[anchors.unsqueeze(1) + torch.arange(1, K + 1)]  # (A, K) the target's continuation
            hits += (logits.argmax(-1) == labels).float().sum(0)
            anchors_seen += labels.shape[0]
            tree = build_tree(torch.log_softmax(logits, -1), budget, validate=False)
            per_row.append(1.0 + followed_depth(tree, labels).float())
    return per_row, hits / max(anchors_seen, 1)


def paired_difference(per_row: list[torch.Tensor], first: list[torch.Tensor]) -> dict | None:
    """Mean of ``per_row - first`` over all anchors and its 95% interval, bootstrapping prompts;
    ``None`` when the two drafters were not measured at the same anchors (another block size)."""
    from exittrain.eval.decode_eval import bootstrap_ci

    if len(per_row) != len(first) or any(a.shape != b.shape for a, b in zip(per_row, first)):
        return None
    diffs = [(a - b).tolist() for a, b in zip(per_row, first)]
    n = sum(len(d) for d in diffs)
    low, high = bootstrap_ci(diffs)
    return {"delta": sum(map(sum, diffs)) / max(n, 1), "ci95": [low, high]}


def run(
    drafters: list[str], prompts: int, skip: int, max_new_tokens: int, budget: int, domain: str, batch: int = 32
) -> dict:
    from exittrain.data import ExitTrainDataModule
    from exittrain.eval.decode_eval import bootstrap_ci
    from exittrain.models import load_drafter, load_target

    if not drafters:
        raise ValueError("name at least one saved drafter folder (RUN_DIR/drafter or RUN_DIR/warmstart_drafter)")
    target = load_target(None)
    loaded = [load_drafter(path, target) for path in drafters]
    layers = sorted({x for d in loaded for x in d.config.target_layer_ids})
    data = ExitTrainDataModule(domain, tokenizer=target.tokenizer, progress=False)
    templated = data.eval_prompts(skip + prompts)[skip:]
    if not templated:
        raise ValueError(f"--skip {skip} leaves no {domain} evaluation prompt; lower --skip")
    rows = answer_with_features(target, templated, layers, max_new_tokens, batch)
    results, first = [], None
    for path, drafter in zip(drafters, loaded):
        drafter.eval()
        per_row, accuracy = greedy_block_lengths(drafter, rows, layers, budget)
        flat = torch.cat(per_row)
        # bootstrap over prompts: anchors of one answer are not independent
        low, high = bootstrap_ci([r.tolist() for r in per_row])
        results.append(
            {
                "drafter": path,
                "greedy_block_length": float(flat.mean()),
                "ci95": [low, high],
                "anchors": int(flat.numel()),
                "accuracy_by_depth": accuracy.tolist(),
                "vs_first": None if first is None else paired_difference(per_row, first),
            }
        )
        first = per_row if first is None else first
    return {
        "domain": domain,
        "prompts": len(rows),
        "skip": skip,
        "max_new_tokens": max_new_tokens,
        "budget": budget,
        "rows": results,
    }


def to_markdown(result: dict) -> str:
    K = len(result["rows"][0]["accuracy_by_depth"])

    def vs_first(r: dict) -> str:
        pair = r.get("vs_first")
        return "-" if pair is None else f"{pair['delta']:+.3f} ({pair['ci95'][0]:+.3f} to {pair['ci95'][1]:+.3f})"

    rows = (
        [r["drafter"], r["anchors"], f"{r['greedy_block_length']:.3f}", f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}",
         vs_first(r), *(f"{a:.2f}" for a in r["accuracy_by_depth"])]
        for r in result["rows"]
    )
    header = ["drafter", "anchors", "greedy tau", "95% CI (prompts)", "vs the first (paired 95% CI)",
              *(f"acc d{k}" for k in range(1, K + 1))]
    lines = [
        f"T = 0 block length at every answer position of the fp32 target's greedy answers to {result['prompts']} "
        f"{result['domain']} evaluation prompts (from #{result['skip']}), {result['max_new_tokens']} new tokens "
        f"at most, B = {result['budget']}.",
        "",
        *markdown_table(header, rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+", help="saved drafter folders")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--skip", type=int, default=8, help="evaluation prompts to leave out first (fit decodes them)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--domain", default="code", choices=["code", "dialogue", "math"])
    parser.add_argument("--out", default="results/bench_heldout")
    args = parser.parse_args(argv)
    result = run(args.drafters, args.prompts, args.skip, args.max_new_tokens, args.budget, args.domain)
    write_results(args.out, result, to_markdown(result))


if __name__ == "__main__":
    main()
