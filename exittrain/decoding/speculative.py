"""Speculative decoding with draft trees: drafter -> build_tree -> one target forward -> verify -> commit.

Shape legend: C committed context length, B budget, K drafter horizon, V vocabulary, F feature width.

Round structure (docs/algorithm.md sections 1 and 6). The round's root is the last committed token
that the target has not yet processed: the last prompt token in the first round, then the
previous round's bonus token. The drafter sees the target features of the positions before the
root and the root's embedding, and proposes K distributions; :func:`build_tree` turns them into
a tree of ``budget`` nodes; the target scores root + nodes in one forward; the verifier picks
the exit node and the bonus; the cache keeps only root + accepted path. The drafter keeps its
own cache of the context's keys and values, to which each round adds only the positions it
committed (:mod:`exittrain.decoding.drafter_context`), so its cost per round does not grow with
the context.

Batch size 1 (one sequence). Every verifier is exact, so at temperature 0 the output equals the
target's own greedy decoding, and at temperature > 0 it is a sample from the warped target.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from exittrain.core import VERIFIERS, build_tree, check_ngrams
from exittrain.core.copy_tail import graft_copy_tail
from exittrain.core.verify import sample_categorical, warp_probs
from exittrain.decoding.drafter_context import drafter_context
from exittrain.models.hf_cache import cache_kwargs
from exittrain.timing import device_now

__all__ = ["RoundStats", "GenerationResult", "GreedyDecoder", "SpeculativeDecoder", "autoregressive_generate",
           "COPY_LED", "DRAFTED", "ROUND_KINDS", "ROUND_PARTS", "STEP", "check_drafter_temperature",
           "draft_logprobs", "rounds_by_kind"]

ROUND_PARTS = ("draft", "tree", "target", "verify", "commit")
# what a round verified: the drafter's tree (and any copy tail), the copy chain alone, or the root alone.
# This decoder's rounds all draft; the other two kinds are rounds the drafter skips, which
# exittrain.cpu_decode.round_policy.RoundPolicyDecoder chooses through SpeculativeDecoder._round_without_drafter
DRAFTED, COPY_LED, STEP = "drafted", "copy-led", "step"
ROUND_KINDS = (DRAFTED, COPY_LED, STEP)


def check_drafter_temperature(value, key: str = "drafter_temperature") -> float:
    """``value`` as a float when it is a drafter temperature, a finite number > 0; else a ValueError
    naming ``key`` (``eval.drafter_temperature`` where the config sets it) and the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key}={value!r}: the drafter temperature divides the drafter's logits before its draft "
                         "tree is built; need a finite number > 0 (1.0: the drafter as trained)")
    return float(value)


def draft_logprobs(logits_NKV: torch.Tensor, drafter_temperature: float = 1.0) -> torch.Tensor:
    """(N, K, V) fp32 ``log_softmax(logits / t_d)``: the drafter's log-probabilities a round's draft
    tree is built from, at drafter temperature ``t_d`` (1.0: the logits as they are, no division; a
    ``t_d`` below 1 sharpens each depth's distribution, above 1 flattens it). The one place both
    the decoder and the held-out walk (:func:`exittrain.heldout.round_walk.anchor_logprobs`) make
    them, so the two build the same trees.

    What ``t_d`` changes: a best-first tree (:func:`~exittrain.core.build_tree`) ranks candidate
    paths by their log-probabilities summed across depths, and dividing by ``t_d`` rescales every
    depth's log-probabilities by ``1 / t_d`` around its own normaliser, so the budget's nodes
    change. What it does not: each depth's argmax (the greedy chain, :func:`~exittrain.core.chain_tree`),
    and the verifiers, which read the target's probabilities and the tree's tokens only (the
    sequential one also its column order, the score order, which leaves its law unchanged;
    docs/algorithm.md sections 6.1 and 6.4): decoding stays exact at every ``t_d``."""
    logits_NKV = logits_NKV.float()
    if drafter_temperature != 1.0:
        logits_NKV = logits_NKV / drafter_temperature
    return torch.log_softmax(logits_NKV, dim=-1)


@dataclass
class RoundStats:
    """One round: tokens it yielded (accepted + bonus, before any EOS/max cut), stage times (s),
    the draft nodes the target verified (the budget plus any copy tail; 0 where no tree), and its
    kind (:data:`ROUND_KINDS`): ``drafted`` (the drafter's tree), ``copy-led`` (the copy chain
    alone) or ``step`` (the root alone, no drafter)."""

    block_length: int
    accept_length: int
    times: dict[str, float]
    tree_nodes: int = 0
    kind: str = DRAFTED

    @property
    def drafted(self) -> bool:
        return self.kind == DRAFTED


def rounds_by_kind(rounds) -> dict[str, dict]:
    """Per kind of :data:`ROUND_KINDS` that occurred among ``rounds`` (:class:`RoundStats`): how
    many rounds, their mean ms (every stage) and their mean block length."""
    out = {}
    for kind in ROUND_KINDS:
        mine = [r for r in rounds if r.kind == kind]
        if mine:
            out[kind] = {"rounds": len(mine), "ms": 1e3 * sum(sum(r.times.values()) for r in mine) / len(mine),
                         "block_length": sum(r.block_length for r in mine) / len(mine)}
    return out


@dataclass
class GenerationResult:
    """New tokens (prompt excluded), per-round statistics and the total wall time."""

    tokens: list[int]
    rounds: list[RoundStats] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def mean_block_length(self) -> float:
        """tau: mean tokens per round, bonus included (0 rounds -> 0.0)."""
        return sum(r.block_length for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    def stage_seconds(self) -> dict[str, float]:
        """Total time per stage over all rounds."""
        return {s: sum(r.times.get(s, 0.0) for r in self.rounds) for s in ROUND_PARTS}

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "rounds": [asdict(r) for r in self.rounds]}


def _prepare(target, input_ids, max_new_tokens, temperature, seed, tree_rows: int):
    """Validate a generate call; returns ``(ids (1, T) on the target device, generator, eos ids)``.

    ``tree_rows`` is how many positions past the committed text a round may occupy (B + 1).
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one sequence, (T,) or (1, T); got {tuple(ids.shape)} (batch size 1)")
    if ids.shape[1] < 2:
        raise ValueError("input_ids needs at least 2 tokens (a context and a root); apply the chat template first")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] + max_new_tokens + tree_rows > limit:
        raise ValueError(
            f"prompt of {ids.shape[1]} tokens + max_new_tokens={max_new_tokens} + tree of {tree_rows} exceeds the "
            f"target's context of {limit} positions; shorten the prompt or lower max_new_tokens"
        )
    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return ids.to(device), generator, set(target.eos_token_ids)


def _finish(tokens: list[int], new: list[int], eos_ids: set[int], max_new_tokens: int) -> bool:
    """Append ``new`` to ``tokens`` up to EOS (kept) or the cap; True when generation must stop."""
    for tok in new:
        tokens.append(tok)
        if tok in eos_ids or len(tokens) >= max_new_tokens:
            return True
    return False


def _check_vocab(ids, vocab_size: int, budget: int) -> torch.Tensor | None:
    """``draft_vocab`` as (S,) sorted unique long ids in 0..V-1 with S >= budget, or None."""
    if ids is None:
        return None
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or ids.dtype != torch.long or ids.numel() < budget or ids.unique().numel() != ids.numel() \
            or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"draft_vocab must be distinct long token ids in 0..{vocab_size - 1}, at least budget={budget} of them "
            f"(draft_vocabulary() gives them), got {ids.numel()} of dtype {ids.dtype}"
        )
    return ids.sort().values


class _Clock:
    """Stage timer; synchronises an accelerator before reading the clock so times are real."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.times: dict[str, float] = {}
        self._t = device_now(self.device)

    def lap(self, stage: str) -> None:
        now = device_now(self.device)  # the target's own GPU, not the current one
        self.times[stage] = self.times.get(stage, 0.0) + now - self._t
        self._t = now


class SpeculativeDecoder:
    """Tree speculative decoding of one sequence with a block drafter and an exact verifier.

    ``verifier`` is one of ``"tev"``, ``"predraw"``, ``"sequential"``, ``"greedy"`` (the last only at
    temperature 0). ``budget`` is the number of draft nodes per round. ``drafter_cache`` (default
    True) keeps the drafter's context K/V and projects only each round's newly committed
    positions (:class:`~exittrain.decoding.drafter_context.CachedDrafterContext`); False re-reads
    the whole context every round, the slow reference twin. Both decode the same tokens. Oracle
    trees, which need no drafter, are :func:`exittrain.decoding.oracle_generate`.

    ``copy_tail`` (default 0, off) grafts up to that many copy tokens onto each round's tree
    (:mod:`exittrain.core.copy_tail`): the n-gram copy chain at the root (``copy_ngrams``,
    longest first) is walked down the tree, and what follows the deepest node that carries it
    is appended under that node, past the drafter's horizon if need be. ``copy_match`` is how
    many chain tokens the tree must already hold for the graft to happen (0: graft beside the
    tree too). ``copy_earliest`` (default False) grafts a second chain the same way, the one after
    the earliest occurrence of the root's n-gram (:func:`~exittrain.core.copy_tail.graft_copy_tail`):
    up to ``2 * copy_tail`` copy nodes a round. Off by default: on held-out code and restating
    prompts it raised tau by 1-3% and added 0.5-1 node a round, and decoded no faster on a 2-core
    CPU. The tree stays independent of the target's scores, so every verifier stays exact.

    ``draft_vocab`` (default None: every token) is a draft vocabulary, (S,) token ids
    (:func:`exittrain.cpu_decode.draft_vocab.draft_vocabulary`): the drafter's LM head scores only
    those, which on a CPU saves most of the drafter's time; the verifiers still see the whole
    vocabulary, so decoding stays exact. S must be at least the budget.

    ``drafter_temperature`` (default 1.0: the drafter as trained) divides the drafter's logits
    before each round's tree is built (:func:`draft_logprobs`, a finite number > 0): a measurement
    option (``eval.drafter_temperature``) that changes which nodes a budget holds, never the
    verification, so decoding stays exact.

    Every round drafts a tree, the target verifies it, the verifier accepts a path. Rounds that
    skip the drafter (copy-led rounds, steps after a miss) are the CPU decoder's, chosen through
    one hook, :meth:`_round_without_drafter`
    (:class:`exittrain.cpu_decode.round_policy.RoundPolicyDecoder`).
    """

    def __init__(
        self,
        target,
        drafter,
        budget: int = 16,
        verifier: str = "tev",
        drafter_cache: bool = True,
        copy_tail: int = 0,
        copy_match: int = 1,
        copy_ngrams: tuple[int, ...] = (3, 2),
        draft_vocab: torch.Tensor | None = None,
        copy_earliest: bool = False,
        drafter_temperature: float = 1.0,
    ):
        if verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {sorted(VERIFIERS)}, got {verifier!r}")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ValueError(f"budget must be an integer >= 1 (draft nodes per round), got {budget!r}")
        if drafter is None:
            raise ValueError("drafter is required; create one with new_drafter(target) or load_drafter(path, target)")
        if not drafter.has_target:
            drafter.attach_target(target)
        for key, value in (("copy_tail", copy_tail), ("copy_match", copy_match)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be an integer >= 0 (0 turns it off), got {value!r}")
        self.target, self.drafter, self.budget, self.verifier = target, drafter, budget, verifier
        self.drafter_cache = bool(drafter_cache)
        self.copy_tail, self.copy_match = copy_tail, copy_match
        self.copy_earliest = bool(copy_earliest)
        self.copy_ngrams = check_ngrams(copy_ngrams, key="copy_ngrams")
        self.draft_vocab = _check_vocab(draft_vocab, target.vocab_size, budget)
        self.drafter_temperature = check_drafter_temperature(drafter_temperature)
        self.layers = list(drafter.config.target_layer_ids)

    def _most_nodes(self) -> int:
        """The most draft nodes a round verifies: the budget plus the copy tail's (both chains'
        with ``copy_earliest``). It sizes the context check and the products' rows; a subclass
        whose rounds may verify more says so here."""
        return self.budget + self.copy_tail * (2 if self.copy_earliest else 1)

    def _round_without_drafter(self, context, root_1: torch.Tensor, rounds: list[RoundStats]):
        """The hook for rounds that skip the drafter, asked at the start of every round: None
        (always, here) drafts the round; else ``(kind, tree)``, a kind of :data:`ROUND_KINDS` and
        the tree the target verifies instead of the drafter's.

        ``context.ids`` (1, C) with ``root_1`` (1,) is the committed text, ``rounds`` the past
        rounds of this decode. An override must choose from those only, never from this round's
        target scores: the tree is then fixed before the target scores it, and every verifier
        stays exact. :class:`exittrain.cpu_decode.round_policy.RoundPolicyDecoder` chooses
        copy-led rounds and steps after a miss here."""
        return None

    def _tree(self, logq_1KV: torch.Tensor, context, root_1: torch.Tensor):
        """The round's draft tree: best-first, ``budget`` nodes from the drafter's log-probabilities
        (1, K, V), then the copy tail when it is on (the committed ids and the root give its chain)."""
        tree = build_tree(logq_1KV, self.budget, validate=False)
        if self.copy_tail and self.copy_ngrams:
            ids_T = torch.cat([context.ids[0], root_1.reshape(1)])
            tree, _ = graft_copy_tail(tree, ids_T, self.copy_ngrams, self.copy_tail, self.copy_match,
                                      earliest=self.copy_earliest)
        return tree

    def _verify(self, tree, logits, temperature, top_k, top_p, generator):
        if self.verifier == "greedy":
            if temperature != 0:
                raise ValueError("verifier='greedy' decodes at temperature 0 only; pick tev/predraw/sequential")
            return VERIFIERS["greedy"](tree, logits, validate=False)
        return VERIFIERS[self.verifier](
            tree, logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, validate=False
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> GenerationResult:
        """Decode up to ``max_new_tokens`` new tokens; stops after an EOS token (which is kept)."""
        tree_rows = self._most_nodes() + 1
        ids, generator, eos = _prepare(self.target, input_ids, max_new_tokens, temperature, seed, tree_rows)
        with self.products(tree_rows):
            return self._generate(ids, max_new_tokens, temperature, top_k, top_p, generator, eos)

    def products(self, tree_rows: int):
        """The context the rounds run in, entered before the clock starts: nothing to prepare here;
        :class:`exittrain.cpu_decode.fast_products.FastCpuDecoder` makes its packs and head layouts
        for up to ``tree_rows`` rows there (its faster products are options of its own target and
        drafter, never switched on for this process)."""
        return contextlib.nullcontext()

    def _generate(self, ids, max_new_tokens, temperature, top_k, top_p, generator, eos) -> GenerationResult:
        device = self.target.device
        start = time.perf_counter()
        pre = self.target.prefill(ids[:, :-1], layers=self.layers)
        cache = pre.cache
        # the drafter's context: features (1, C, F) and ids of the committed positions before the root
        context = drafter_context(self.drafter, pre.features, ids[:, :-1], cached=self.drafter_cache,
                                  vocab_ids=self.draft_vocab)
        root = ids[:, -1]
        tokens: list[int] = []
        result = GenerationResult(tokens)
        while True:
            clock = _Clock(device)
            skipped = self._round_without_drafter(context, root, result.rounds)
            if skipped is None:
                kind = DRAFTED
                logq_1KV = draft_logprobs(context.draft(root), self.drafter_temperature)
                clock.lap("draft")
                tree = self._tree(logq_1KV, context, root)
            else:
                kind, tree = skipped
            clock.lap("tree")
            C = cache.get_seq_length()
            out = self.target.tree_forward(cache, root, tree, layers=self.layers)
            clock.lap("target")
            verdict = self._verify(tree, out.logits, temperature, top_k, top_p, generator)
            n_accept = int(verdict.accept_length[0])  # the round's one host transfer
            clock.lap("verify")
            new_1N = torch.cat([verdict.accepted_tokens[:, :n_accept], verdict.bonus.view(1, 1)], dim=1)
            done = _finish(tokens, new_1N[0].tolist(), eos, max_new_tokens)
            if not done:  # the last round's commit would feed no further round
                rows = verdict.accepted_rows[0, :n_accept]
                self.target.commit(cache, C, rows)
                clock.lap("commit")
                new_rows = torch.cat([rows.new_zeros(1), rows])  # root, then the accepted nodes
                # the round committed the root and the accepted path: they enter the drafter's
                # context, the drafter's work for the next round (booked under draft)
                context.extend(out.features[:, new_rows], torch.cat([root.view(1, 1), new_1N[:, :-1]], dim=1))
                root = verdict.bonus
                clock.lap("draft")
            clock.lap("commit")
            result.rounds.append(RoundStats(n_accept + 1, n_accept, clock.times, tree.budget, kind))
            if done:
                break
        result.seconds = time.perf_counter() - start
        return result


@torch.no_grad()
def autoregressive_generate(
    target,
    input_ids,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> GenerationResult:
    """The baseline: one target forward per token through the same wrapper and cache.

    Each token is one "round" of block length 1 whose time is booked under ``target``.
    """
    ids, generator, eos = _prepare(target, input_ids, max_new_tokens, temperature, seed, 1)
    device = target.device
    start = time.perf_counter()
    pre = target.prefill(ids)
    cache, logits = pre.cache, pre.logits  # (1, V) after the last prompt token
    tokens: list[int] = []
    result = GenerationResult(tokens)
    while True:
        clock = _Clock(device)
        probs = warp_probs(logits, temperature, top_k, top_p)
        token = sample_categorical(probs, generator)  # (1,)
        clock.lap("verify")
        result.rounds.append(RoundStats(1, 0, {}))
        if _finish(tokens, [int(token[0])], eos, max_new_tokens):
            result.rounds[-1].times = clock.times
            break
        out = target.model(input_ids=token.view(1, 1), use_cache=True, **cache_kwargs(cache))
        logits = out.logits[:, -1]
        clock.lap("target")
        result.rounds[-1].times = clock.times
    result.seconds = time.perf_counter() - start
    return result


class GreedyDecoder:
    """Decoding without a drafter, behind :class:`SpeculativeDecoder`'s ``generate``: what
    ``decode: auto`` falls back to when no drafting setting is expected to beat greedy decoding
    on this host (:mod:`exittrain.cpu_decode.auto_settings`). ``generate`` is
    :func:`autoregressive_generate`; ``budget`` and ``copy_tail`` read 0."""

    budget = copy_tail = 0
    draft_vocab = None

    def __init__(self, target):
        self.target = target

    def generate(self, input_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None) -> GenerationResult:
        return autoregressive_generate(self.target, input_ids, max_new_tokens, temperature, top_k, top_p, seed)
