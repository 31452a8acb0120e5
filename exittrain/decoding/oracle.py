"""Oracle trees: the budget-B tree of highest target flow, for the tau_oracle column (docs/algorithm.md section 5.2).

Built best-first from the target's own (warped) conditionals: a candidate child y of row u has
score ``log P(u) + log p_u(y)``; the best candidate becomes a node, which costs one target
forward of one token (its conditionals are needed to extend it). The tree of the B best paths
maximises ``1 + C(T)`` over all trees of B nodes (optionally of depth <= ``max_depth``), so its
decoded block length bounds what any drafter can reach at that budget.

Cost: B + 1 single-token target forwards per round, against one tree forward for a drafter:
an evaluation tool, not a decoder. At temperature 0 the oracle tree is the greedy chain.
"""

from __future__ import annotations

import heapq
import math

import torch

from exittrain.core import DraftTree, verify_tev, warp_probs
from exittrain.core.exit_law import exit_law
from exittrain.models.hf_cache import cache_kwargs

from .speculative import GenerationResult, RoundStats, _Clock, _finish, _prepare

__all__ = ["oracle_generate"]


def _row_forward(target, cache, token: int, position: int, context_len: int, ancestors: list[int]):
    """Append one tree token; it sees the context and its ancestor rows (0-based tree rows)."""
    device = target.device
    n_tree = cache.get_seq_length() - context_len  # tree rows already in the cache
    allowed = torch.zeros(1, 1, context_len + n_tree + 1, dtype=torch.bool, device=device)
    allowed[..., :context_len] = True
    for row in ancestors:
        allowed[..., context_len + row] = True
    allowed[..., -1] = True
    out = target.model(
        input_ids=torch.tensor([[token]], device=device),
        attention_mask=target._additive(allowed),
        position_ids=torch.tensor([[position]], device=device),
        use_cache=True,
        **cache_kwargs(cache),
    )
    return out.logits[0, -1]  # (V,)


@torch.no_grad()
def oracle_generate(
    target,
    input_ids,
    budget: int = 16,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    max_depth: int | None = None,
) -> tuple[GenerationResult, list[float]]:
    """Decode with oracle trees and TEV. Returns the result and each round's analytic ``sum P``."""
    ids, generator, eos = _prepare(target, input_ids, max_new_tokens, temperature, seed, budget + 1)
    K = max_depth or budget
    device = target.device
    pre = target.prefill(ids[:, :-1])
    cache, root = pre.cache, int(ids[0, -1])
    tokens: list[int] = []
    result, analytic = GenerationResult(tokens), []
    start_all = _Clock(device)
    while True:
        clock = _Clock(device)
        C = cache.get_seq_length()
        rows_logits = [_row_forward(target, cache, root, C, C, [])]
        probs0 = warp_probs(rows_logits[0], temperature, top_k, top_p)
        node_tok, node_par, node_dep, ancestors = [], [], [0], [[]]  # node_dep/ancestors per row
        log_reach = [0.0]
        cand_lists = {}

        def push_first(row, probs, heap, cand_lists=cand_lists, log_reach=log_reach):
            values, toks = torch.topk(probs, min(budget, probs.shape[-1]))
            cand_lists[row] = (values.tolist(), toks.tolist())
            if values[0] > 0:
                heapq.heappush(heap, (-(log_reach[row] + math.log(values[0])), row, 0))

        heap: list = []
        push_first(0, probs0, heap)
        while heap and len(node_tok) < budget:
            neg, parent, rank = heapq.heappop(heap)
            values, toks = cand_lists[parent]
            token = toks[rank]
            row = len(node_tok) + 1
            node_tok.append(token)
            node_par.append(parent)
            node_dep.append(node_dep[parent] + 1)
            ancestors.append(ancestors[parent] + [parent])
            log_reach.append(-neg)
            if rank + 1 < len(values) and values[rank + 1] > 0:  # next sibling
                heapq.heappush(heap, (-(log_reach[parent] + math.log(values[rank + 1])), parent, rank + 1))
            logits_row = _row_forward(target, cache, token, C + node_dep[row], C, ancestors[row])
            rows_logits.append(logits_row)
            if node_dep[row] < K:
                push_first(row, warp_probs(logits_row, temperature, top_k, top_p), heap)
        n = len(node_tok)
        pad = budget - n
        tree = DraftTree(
            tokens=torch.tensor([node_tok + [0] * pad], device=device),
            parents=torch.tensor([node_par + [0] * pad], device=device),
            depths=torch.tensor([node_dep[1:] + [0] * pad], device=device),
            valid=torch.tensor([[True] * n + [False] * pad], device=device),
            max_depth=K,
        )
        logits = torch.stack(rows_logits + [rows_logits[0]] * pad).unsqueeze(0)  # padding rows unused
        clock.lap("target")
        law = exit_law(tree, warp_probs(logits, temperature, top_k, top_p), validate=False)
        analytic.append(float(law.expected_block_length[0]))
        verdict = verify_tev(tree, logits, temperature=temperature, top_k=top_k, top_p=top_p,
                             generator=generator, validate=False)
        n_accept = int(verdict.accept_length[0])
        clock.lap("verify")
        target.commit(cache, C, verdict.accepted_rows[0, :n_accept])
        clock.lap("commit")
        new = verdict.accepted_tokens[0, :n_accept].tolist() + [int(verdict.bonus[0])]
        root = new[-1]
        result.rounds.append(RoundStats(n_accept + 1, n_accept, clock.times, n))
        if _finish(tokens, new, eos, max_new_tokens):
            break
    start_all.lap("total")
    result.seconds = start_all.times["total"]
    return result, analytic
