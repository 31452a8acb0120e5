"""Exact expected TEV block lengths of drafters, and the oracle bound, at held-out anchors.

Shape legend: A anchors of one answer, B budget, K drafter horizon, V vocabulary, F feature
width, H oracle rows held so far, M = min(B, V) candidate children per row.

A *row* is one answered prompt: ``(ids (n,) long, n_prompt, features (n, F))`` from
:func:`answer_rows`, greedy at T = 0 and sampled from the target at T > 0, so that the anchors
follow the distribution that decoding at T visits. An *anchor* a is an answer position (the
last prompt token first): its token is the root, ``ids[:a]`` the committed context.

- :func:`analytic_block_lengths`: the drafter's tree is built exactly as
  :class:`~exittrain.decoding.SpeculativeDecoder` builds it (``build_tree`` of the raw drafter
  log-probabilities, fp32 target features of the context), the target scores every row of it
  (``score_trees(mode="exact")``, the rows a node's edge reads: the root and the nodes with
  children, :meth:`~exittrain.core.DraftTree.interior`), and the exit law under the target warped to T
  (``warp_probs``) gives ``sum_v P(v)``: exactly what one TEV round started at that anchor yields
  in expectation (docs/algorithm.md sections 4.2 and 6.5). ``shape="chain"``: the same on the
  drafter's greedy chain of ``min(budget, K)`` nodes (``chain_tree``), the draft vLLM and SGLang
  verify, where ``sum_v P(v) = 1 + sum_k prod_{j<=k} p_j(x_j)`` is their expected acceptance
  length at T (docs/algorithm.md section 4.6).
- :func:`answer_sets`: the target's answers at several temperatures from one prefill a batch: the
  law's samples at T > 0 and the greedy answers that the T = 0 tracks walk their rounds along
  (:func:`greedy_answers`, :mod:`exittrain.heldout.round_walk`).
- :func:`oracle_block_lengths`: ``sum_v P(v)`` of the tree of the B nodes of highest warped
  target reach, depth <= K (docs/algorithm.md section 5.2): the bound of every tree of B nodes.

Limits: these are per-round expectations at positions of target samples, not the decoded tau,
which visits only the positions where rounds start. Each anchor costs one target forward of
at most B + 1 rows, its tree's interior (the oracle: one per wave, of all rows held so far), so
only a fixed-seed subset of anchors is scored (:func:`heldout_anchors`), the same for every
drafter of one block size. The causal pass over a row (its K/V and the drafter's features) runs
once for every drafter, budget and temperature (:func:`~exittrain.heldout.row_prefix.row_prefix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import torch

__all__ = [
    "ANSWER_BATCH",
    "answer_rows",
    "answer_sets",
    "cache_answers",
    "cached_baseline",
    "greedy_answers",
    "heldout_anchors",
    "analytic_block_lengths",
    "drafter_logprobs",
    "drafter_trees",
    "expected_block_lengths",
    "oracle_block_lengths",
    "oracle_block_lengths_reference",
    "paired_difference",
    "width_groups",
]


def _check_temperature(temperature: float, name: str = "temperature") -> None:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
        raise ValueError(f"{name} must be a number >= 0 (0 = greedy), got {temperature!r}")


def _check_budget(budget: int) -> None:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget (--budgets) must be an integer >= 1 (tree nodes), got {budget!r}")


def _check_shape(shape: str) -> None:
    from exittrain.core import TREE_SHAPES

    if shape not in TREE_SHAPES:
        raise ValueError(f"shape={shape!r}: the drafter's tree shape must be one of {TREE_SHAPES}")


def answer_rows(
    target, prompts: list[list[int]], layers: list[int], max_new_tokens: int, batch: int,
    temperature: float = 0.0, seed: int = 0, top_p: float | None = None, eos_ids: Sequence[int] | None = None,
) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """The target's answers to templated ``prompts`` with the features of ``layers`` at every position.

    Returns per prompt ``(ids (n,) long, n_prompt, features (n, F) bf16)``. T = 0: greedy, with the
    target as loaded. T > 0: sampled at that temperature (top-k off, ``top_p`` or 1), batch i of
    ``batch`` prompts under ``torch.manual_seed(seed + i)`` (as regeneration seeds), so the same
    call gives the same answers. Answers stop after EOS or ``max_new_tokens`` tokens; ``eos_ids``
    are the ids that end one (None: the tokenizer's and the generation config's, as regeneration
    reads them; the decoders stop at ``target.eos_token_ids``).
    """
    from exittrain.data.generation import GenerationConfig, eos_token_ids, generate_batch, padding_token_id

    _check_temperature(temperature)
    sample = temperature > 0
    gen = GenerationConfig(max_new_tokens=max_new_tokens, batch_size=batch, do_sample=sample,
                           temperature=float(temperature) if sample else 1.0, top_p=1.0 if top_p is None else top_p,
                           seed=seed)
    model, tok = target.model, target.tokenizer
    eos = eos_token_ids(model, tok) if eos_ids is None else list(eos_ids)
    pad = padding_token_id(tok) if tok is not None else (eos[0] if eos else 0)  # left padding is masked out
    rows = []
    for b, start in enumerate(range(0, len(prompts), batch)):
        chunk = prompts[start : start + batch]
        if sample:
            torch.manual_seed(seed + b)
        for prompt, answer in zip(chunk, generate_batch(model, tok, chunk, gen, pad, eos, layers)):
            rows.append((torch.tensor(prompt + answer.response), len(prompt), answer.features))
    return rows


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
    per prompt in order, ``(ids (n,) long, n_prompt, None)`` (the row layout of :func:`answer_rows`,
    without features).

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


def greedy_answers(target, prompts: Sequence[Sequence[int]], ar_cache: dict, *, live: int, max_new_tokens: int) -> None:
    """Fill ``ar_cache[(0.0, i)]`` for every walked prompt (``i >= live``) it lacks with the target's
    greedy answer, a :class:`~exittrain.decoding.GenerationResult` of ``max_new_tokens`` tokens at
    most (EOS kept), from :func:`answer_sets` (the evaluator fills them with its sampled sets
    instead, one prefill for all: :meth:`~exittrain.heldout.evaluator.HeldOutEvaluator.measure`).

    The entries carry no timing (``seconds`` 0): they are answers to walk along, not baselines to
    time a decode against, so a cache filled here must not feed speed columns (the evaluator's
    cache serves one mode for its life). The live prompts (``i < live``) are left to the
    one-prompt baseline their lossless check needs."""
    from exittrain.progress import Heartbeat

    todo = [i for i in range(live, len(prompts)) if (0.0, i) not in ar_cache]
    if not todo:
        return
    with Heartbeat(f"eval: the target's greedy answers to {len(todo)} prompts"):
        rows = answer_sets(target, [prompts[i] for i in todo], [0.0], max_new_tokens)[0.0]
    cache_answers(ar_cache, dict(zip(todo, rows, strict=True)))


def cache_answers(ar_cache: dict, rows: dict[int, tuple]) -> None:
    """``ar_cache[(0.0, i)]``: the greedy answer of ``rows[i]`` (an :func:`answer_sets` row) as a
    :class:`~exittrain.decoding.GenerationResult` without timing, for the T = 0 walks; an entry the
    cache holds already is kept."""
    from exittrain.decoding import GenerationResult

    for i, (ids, n_prompt, _) in rows.items():
        ar_cache.setdefault((0.0, i), GenerationResult(ids[n_prompt:].tolist()))


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


def heldout_anchors(rows, num_draft_tokens: int, per_row: int, seed: int) -> list[torch.Tensor]:
    """Per row, the sorted (A_r,) anchor positions: ``per_row`` of the positions that have K tokens
    after them (``n_prompt - 1 <= a < n - K``, those of the greedy measure), drawn without
    replacement by one generator seeded with ``seed``; all of them when fewer, none (an empty
    tensor) for an answer shorter than K. They depend on the rows and K only: every drafter of one
    block size is scored at the same anchors, so paired differences are valid."""
    if not isinstance(per_row, int) or isinstance(per_row, bool) or per_row < 1:
        raise ValueError(f"per_row (--analytic-anchors) must be an integer >= 1, got {per_row!r}")
    K = num_draft_tokens
    g = torch.Generator().manual_seed(seed)
    out = []
    for ids, n_prompt, _ in rows:
        first, stop = n_prompt - 1, ids.shape[0] - K
        n = max(stop - first, 0)
        pick = torch.randperm(n, generator=g)[:per_row] if n else torch.zeros(0, dtype=torch.long)
        out.append(pick.sort().values + first)
    return out


@torch.no_grad()
def analytic_block_lengths(
    drafter, target, rows, layers: list[int], anchors: list[torch.Tensor], budget: int, temperature: float,
    top_k: int | None = None, top_p: float | None = None, *, stored_features: bool = False, shape: str = "ddtree",
) -> list[torch.Tensor]:
    """Per row, the (A_r,) exact expected TEV block length ``sum_v P(v)`` of ``drafter``'s tree at each anchor.

    ``shape``: ``ddtree`` (the decoder's best-first tree of ``budget`` nodes) or ``chain`` (the
    drafter's greedy chain of ``min(budget, K)`` nodes: the expected block length of a serving
    engine's chain verification at T). The drafter sees the fp32 target features of the context,
    recomputed by one causal target pass (what decoding feeds it); ``stored_features=True`` reads
    the rows' stored (bf16) features instead, sliced out of ``layers`` (the layers they hold, a
    superset of the drafter's, in that order). At T = 0 the result is the greedy followed depth + 1
    along the target's argmax. :func:`expected_block_lengths` measures several drafts at once.
    """
    return expected_block_lengths(drafter, target, rows, layers, anchors, [(shape, budget)], temperature, top_k,
                                  top_p, stored_features=stored_features)[shape, budget]


@torch.no_grad()
def expected_block_lengths(
    drafter, target, rows, layers: list[int], anchors: list[torch.Tensor], drafts: Sequence[tuple[str, int]],
    temperature: float, top_k: int | None = None, top_p: float | None = None, *, stored_features: bool = False,
) -> dict[tuple[str, int], list[torch.Tensor]]:
    """:func:`analytic_block_lengths` of several drafts, ``(shape, budget)`` pairs, from one drafter
    pass a row: ``{draft: per-row (A_r,) expected block lengths}``. The drafter's log-probabilities
    at an anchor do not depend on the draft built from them, so the tree and the chain of one
    drafter (fit's table measures both) cost one drafter forward; and the chain's nodes that the
    largest tree lacks are grafted onto it (:func:`~exittrain.core.graft_chain`), so one target
    forward scores both."""
    from exittrain.core import graft_chain, shaped_tree
    from exittrain.heldout.row_prefix import row_prefix

    _check_temperature(temperature)
    drafts = [tuple(d) for d in drafts]  # dict keys
    for shape, budget in drafts:
        _check_budget(budget)
        _check_shape(shape)
    chains = [d for d in drafts if d[0] == "chain"]
    hosts = sorted((d for d in drafts if d[0] != "chain"), key=lambda d: d[1])
    graft = (chains[0], hosts[-1]) if chains and hosts else (None, None)  # (chain, the largest tree)
    own = list(drafter.config.target_layer_ids)
    H = drafter.config.target_hidden_size
    pick = torch.cat([torch.arange(layers.index(x) * H, (layers.index(x) + 1) * H) for x in own]) if stored_features \
        else None
    out: dict[tuple[str, int], list[torch.Tensor]] = {d: [] for d in drafts}
    for (ids, n_prompt, features), anchors_A in zip(rows, anchors, strict=True):
        if anchors_A.numel() == 0:
            for per_row in out.values():
                per_row.append(torch.zeros(0))
            continue
        # the K/V the trees attend to and (without stored features) the drafter's features; the prompt's
        # part is kept for the answers to it at the other temperatures
        prefix = row_prefix(target, ids, own, shared=n_prompt)
        logprobs_AKV = drafter_logprobs(drafter, target, ids, anchors_A,
                                        features[:, pick].float() if stored_features else None)
        trees = {draft: shaped_tree(logprobs_AKV, draft[1], draft[0], validate=False) for draft in out}
        for draft, tree in trees.items():
            if draft == graft[0]:
                continue  # scored with its host tree
            if draft == graft[1]:  # the chain's nodes the tree lacks join it: one forward scores both
                union, columns_AC = graft_chain(tree, trees[graft[0]])
                edge = _edges(target, ids, anchors_A, union, prefix, temperature, top_k, top_p)
                out[graft[0]].append(_block_length(trees[graft[0]], edge.gather(1, columns_AC)))
                edge = edge[:, : tree.budget]
            else:
                edge = _edges(target, ids, anchors_A, tree, prefix, temperature, top_k, top_p)
            out[draft].append(_block_length(tree, edge))
    return out


def _edges(target, ids: torch.Tensor, anchors_A: torch.Tensor, tree, prefix, temperature: float, top_k, top_p):
    """(A, B) edge probabilities of ``tree`` at each anchor under the target warped to T. An edge
    reads its parent's row only: the target scores the root and the nodes with children
    (:meth:`~exittrain.core.DraftTree.interior`)."""
    from exittrain.core import warp_probs
    from exittrain.core.exit_law import edge_probabilities

    inner, parent_row = tree.interior()
    scores_AWV = _interior_scores(target, ids, anchors_A, inner, prefix)
    return edge_probabilities(tree, warp_probs(scores_AWV, temperature, top_k, top_p), parent_row)


def _block_length(tree, edge: torch.Tensor) -> torch.Tensor:
    """(A,) fp32 ``sum_v P(v)`` on the CPU from ``tree``'s (A, B) edge probabilities."""
    from exittrain.core.exit_law import exit_law_from_edges

    return exit_law_from_edges(tree, edge).expected_block_length.float().cpu()


_WIDTH_GROUPS = 3  # target forwards a row's interiors take at most: each pads its anchors to its widest


def width_groups(widths: Sequence[int], groups: int = _WIDTH_GROUPS) -> list[list[int]]:
    """``widths``' indices split into at most ``groups`` runs of the width-sorted order, chosen so that
    the rows scored (each run padded to its widest) are fewest; ties go to fewer runs."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    w = [widths[i] for i in order]
    n = len(w)
    best: tuple[int, tuple[int, ...]] = (n * (w[-1] if w else 0), ())

    def cost(cuts: tuple[int, ...]) -> int:
        bounds = (0, *cuts, n)
        return sum((b - a) * w[b - 1] for a, b in zip(bounds, bounds[1:]) if b > a)

    for k in range(1, groups):
        for cuts in combinations(range(1, n), k):
            c = cost(cuts)
            if c < best[0]:
                best = (c, cuts)
    bounds = (0, *best[1], n)
    return [order[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _interior_scores(target, ids: torch.Tensor, anchors_A: torch.Tensor, inner, prefix) -> torch.Tensor:
    """(A, W+1, V) target logits of the rows of ``inner`` (:meth:`~exittrain.core.DraftTree.interior`)
    at each anchor of ``ids``. The interiors' sizes differ from anchor to anchor (a best-first tree's
    is about half its budget, its widest near the budget): the anchors are scored in a few groups of
    similar width (:func:`width_groups`), each padded to its own widest, not all to the widest of
    all. Rows past an anchor's interior hold zeros: no edge reads them."""
    sizes = inner.valid.sum(1).tolist()  # (A,) interior nodes, root excluded
    out = None
    ids_1T = ids[None].to(target.device)
    for group in width_groups(sizes):
        width = max(sizes[i] for i in group)
        index = torch.tensor(group, device=inner.tokens.device)
        sub = inner.index(index).columns(width)
        logits = target.score_trees(ids_1T, anchors_A[index][None].to(target.device), sub, mode="exact",
                                    prefix=prefix).logits  # (a, width+1, V)
        if out is None:
            out = logits.new_zeros(len(sizes), inner.budget + 1, logits.shape[-1])
        out[index.to(out.device), : width + 1] = logits
    return out


@torch.no_grad()
def drafter_trees(drafter, target, ids: torch.Tensor, anchors_A: torch.Tensor, budget: int,
                  features_TF: torch.Tensor | None = None, *, shape: str = "ddtree"):
    """The (A trees) DraftTree the decoder would build for a round rooted at each anchor of ``ids``:
    ``build_tree(log_softmax(drafter logits), budget)`` (``shape="chain"``: the greedy chain of
    ``min(budget, K)`` nodes, :class:`~exittrain.decoding.chain_decoder.ChainDecoder`'s) of
    :func:`drafter_logprobs`."""
    from exittrain.core import shaped_tree

    return shaped_tree(drafter_logprobs(drafter, target, ids, anchors_A, features_TF), budget, shape, validate=False)


@torch.no_grad()
def drafter_logprobs(drafter, target, ids: torch.Tensor, anchors_A: torch.Tensor,
                     features_TF: torch.Tensor | None = None) -> torch.Tensor:
    """(A, K, V) fp32 log-probabilities of the drafter at each anchor of ``ids``, seeing the target
    features before the anchor: ``features_TF`` (the drafter's own layers) or, when None, the fp32
    features of the row's causal target pass (:func:`~exittrain.heldout.row_prefix.row_prefix`)."""
    from exittrain.heldout.round_walk import anchor_logprobs
    from exittrain.heldout.row_prefix import row_prefix

    if features_TF is None:
        features_1TF = row_prefix(target, ids, drafter.config.target_layer_ids).features
    else:
        features_1TF = features_TF[None].to(target.device)
    return anchor_logprobs(drafter, features_1TF, ids[None].to(target.device), anchors_A)


def _rank(score: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """(A, X) rank of each entry by higher score, then shallower depth (a parent before a child of
    equal reach, so every top-r set is prefix-closed), then column order."""
    by_depth = depth.argsort(dim=-1, stable=True)
    order = by_depth.gather(1, (-score.gather(1, by_depth)).argsort(dim=-1, stable=True))
    return torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order).contiguous())


@torch.no_grad()
def _oracle_row(target, ids: torch.Tensor, anchors_A: torch.Tensor, budget: int, K: int, temperature: float,
                top_k, top_p) -> torch.Tensor:
    """(A,) oracle ``sum P`` at the anchors of one sequence, in waves (see :func:`oracle_block_lengths`)."""
    from exittrain.core import DraftTree, warp_probs
    from exittrain.heldout.row_prefix import row_prefix

    A = anchors_A.numel()
    ids_1T, anchors_1A = ids[None].to(target.device), anchors_A[None].to(target.device)
    M = min(budget, target.vocab_size)
    neg = torch.tensor(float("-inf"))
    # held rows (root-first): reach log P, depth; nodes: token, parent, validity
    logr, dep = torch.zeros(A, 1), torch.zeros(A, 1, dtype=torch.long)
    tok, par, val = (torch.zeros(A, 1, dtype=torch.long), torch.zeros(A, 1, dtype=torch.long),
                     torch.zeros(A, 1, dtype=torch.bool))  # one padding column: scores the root alone
    logr, dep = torch.cat([logr, neg.expand(A, 1)], 1), torch.cat([dep, torch.zeros(A, 1, dtype=torch.long)], 1)
    cand_lp, cand_tok = torch.full((A, 2, M), float("-inf")), torch.zeros(A, 2, M, dtype=torch.long)
    new_from = 0  # rows >= new_from (root-first) still need their conditionals
    prefix = row_prefix(target, ids, None)  # one causal pass for every wave
    while True:
        tree = DraftTree(tokens=tok, parents=par, depths=dep[:, 1:], valid=val, max_depth=K)
        logits = target.score_trees(ids_1T, anchors_1A, tree, mode="exact", prefix=prefix).logits[:, new_from:].cpu()
        logp = warp_probs(logits, temperature, top_k, top_p).log()  # (A, rows, V)
        values, index = logp.topk(M, dim=-1)
        row_ok = (dep[:, new_from:] < K) & torch.cat([torch.ones(A, 1, dtype=torch.bool), val], 1)[:, new_from:]
        cand_lp[:, new_from:] = torch.where(row_ok.unsqueeze(-1), values, neg)
        cand_tok[:, new_from:] = index
        # the B best of everything known (held nodes and frontier candidates); candidates among
        # them become nodes. None left: no unknown node can beat the B-th held one (reach does
        # not grow down a path, and every unknown node descends from a candidate), so done.
        rows_n = logr.shape[1]
        cand_score = (logr.unsqueeze(-1) + cand_lp).view(A, -1)  # (A, rows*M)
        cand_dep = (dep + 1).unsqueeze(-1).expand(A, rows_n, M).reshape(A, -1)
        score = torch.cat([logr[:, 1:], cand_score], 1)
        depth = torch.cat([dep[:, 1:], cand_dep], 1)
        top = (_rank(score, depth) < budget) & (score > float("-inf"))
        pop = top[:, rows_n - 1 :]  # (A, rows*M)
        n_pop = pop.sum(1)
        if int(n_pop.max()) == 0:
            break
        W = int(n_pop.max())
        key = torch.where(pop, torch.arange(pop.shape[1]).expand_as(pop), pop.shape[1])
        flat = key.sort(dim=1).values[:, :W]  # (A, W) popped candidates, then filler
        ok = flat < pop.shape[1]
        flat = flat.clamp_max(pop.shape[1] - 1)
        parent = flat // M
        new_tok = cand_tok.view(A, -1).gather(1, flat)
        new_logr = torch.where(ok, cand_score.gather(1, flat), neg)
        cand_lp.view(A, -1).scatter_(1, flat, torch.where(ok, neg, cand_lp.view(A, -1).gather(1, flat)))  # taken
        new_from = rows_n
        tok = torch.cat([tok, torch.where(ok, new_tok, 0)], 1)
        par = torch.cat([par, torch.where(ok, parent, 0)], 1)
        val = torch.cat([val, ok], 1)
        dep = torch.cat([dep, torch.where(ok, dep.gather(1, parent) + 1, 0)], 1)
        logr = torch.cat([logr, new_logr], 1)
        cand_lp = torch.cat([cand_lp, torch.full((A, W, M), float("-inf"))], 1)
        cand_tok = torch.cat([cand_tok, torch.zeros(A, W, M, dtype=torch.long)], 1)
    held = logr[:, 1:]
    k = min(budget, held.shape[1])
    return 1.0 + held.topk(k, dim=1).values.exp().sum(1)


def oracle_block_lengths(
    target, rows, anchors: list[torch.Tensor], budget: int, max_depth: int, temperature: float,
    top_k: int | None = None, top_p: float | None = None,
) -> list[torch.Tensor]:
    """Per row, the (A_r,) oracle bound ``sum_v P(v)`` at each anchor: the tree of the ``budget``
    nodes of highest reach under the warped target, depth <= ``max_depth``.

    Exact, in waves: the nodes held so far (prefix-closed, conditionals known) and their
    candidate children (the M = min(B, V) most likely tokens of each row, reach known) are ranked
    together; the candidates among the B best become nodes, and one ``score_trees`` call on the
    grown trees gives their conditionals. It stops when no candidate is among the B best and
    keeps the B best held nodes. One wave is one target forward over the row's anchors' trees;
    a row needs at least (oracle tree depth + 1) of them, and holds up to a few times B rows. T = 0: the oracle is
    the target's greedy chain, ``1 + min(B, K)``, with no forward.
    :func:`oracle_block_lengths_reference` is the one-node-at-a-time twin.
    """
    _check_temperature(temperature)
    _check_budget(budget)
    if not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be an integer >= 1 (the drafter's num_draft_tokens), got {max_depth!r}")
    out = []
    for (ids, _, _), anchors_A in zip(rows, anchors, strict=True):
        if temperature == 0 or anchors_A.numel() == 0:
            out.append(torch.full((anchors_A.numel(),), 1.0 + min(budget, max_depth)))
        else:
            out.append(_oracle_row(target, ids, anchors_A, budget, max_depth, temperature, top_k, top_p))
    return out


def oracle_block_lengths_reference(
    target, rows, anchors: list[torch.Tensor], budget: int, max_depth: int, temperature: float,
    top_k: int | None = None, top_p: float | None = None,
) -> list[torch.Tensor]:
    """Slow twin of :func:`oracle_block_lengths`: per anchor, the first round of
    :func:`~exittrain.decoding.oracle_generate` on ``ids[: a + 1]`` (a best-first heap that adds
    one node per single-token target forward), its analytic ``sum P``."""
    from exittrain.decoding.oracle import oracle_generate

    out = []
    for (ids, _, _), anchors_A in zip(rows, anchors, strict=True):
        per = [oracle_generate(target, ids[: int(a) + 1], budget, 1, temperature, top_k, top_p, seed=0,
                               max_depth=max_depth)[1][0] for a in anchors_A]
        out.append(torch.tensor(per, dtype=torch.float32))
    return out


def paired_difference(per_row: list[torch.Tensor], first: list[torch.Tensor]) -> dict | None:
    """Mean of ``per_row - first`` over all anchors and its 95% interval, bootstrapping prompts;
    ``None`` when the two drafters were not measured at the same anchors (another block size)."""
    from exittrain.core import bootstrap_ci

    if len(per_row) != len(first) or any(a.shape != b.shape for a, b in zip(per_row, first)):
        return None
    diffs = [(a - b).tolist() for a, b in zip(per_row, first) if a.numel()]
    n = sum(len(d) for d in diffs)
    low, high = bootstrap_ci(diffs) if diffs else (0.0, 0.0)
    return {"delta": sum(map(sum, diffs)) / max(n, 1), "ci95": [low, high]}


def summary(per_row: list[torch.Tensor]) -> dict:
    """Mean over all anchors, its 95% interval (bootstrap over prompts) and the anchor count."""
    from exittrain.core import bootstrap_ci

    kept = [r.tolist() for r in per_row if r.numel()]
    n = sum(len(r) for r in kept)
    low, high = bootstrap_ci(kept) if kept else (0.0, 0.0)
    return {"mean": sum(map(sum, kept)) / max(n, 1), "ci95": [low, high], "anchors": n}
