"""Draft-tree construction (DDTree) and the tensors a built tree carries.

Shape legend: N trees (anchors), K drafter positions (depth limit), V vocabulary,
B budget (nodes per tree, root excluded), M = min(B, V) candidate tokens per depth,
C pruned candidates per depth.

Contract of :func:`build_tree` (docs/algorithm.md section 2): the tree of budget B is the set of the B
highest-scoring token paths of length 1..K, where the score of a path is the sum of the drafter's
log-probabilities ``log q_d(y_d)`` along it and, at each depth, only the M most likely tokens of
``q_d`` are candidates. Nodes come out in the order DDTree's best-first heap pops them.

**Ordering and tie-break.** Candidates are ranked by the key
``(score descending, depth ascending, rank path ascending lexicographically)``, where a path's
rank path is the tuple of its tokens' positions in the per-depth candidate list. The candidate
list of depth d is ``torch.topk(log q_d, M)``: descending probability, and among exactly equal
probabilities whatever order ``torch.topk`` returns (which tokens survive a tie at the M-th place
is also topk's choice). The heap reference shares that list, so both builders see the same
candidates. Scores are accumulated as ``parent_score + log q_d(token)`` in float32 (float64 if
the input is float64), once per depth, in both builders.

**Exactness.** With this key, a parent always precedes its children and a sibling of lower
rank precedes a sibling of higher rank, so the heap pops exactly the top B candidates by key.
The batched builder keeps, per depth, the top B extensions of the previous depth's kept paths
and then the top B over all depths; every top-B path's prefix is itself top-B, so this is the
same set. Candidate (i, j), the i-th kept prefix extended by the j-th token, is dominated by
the (i+1)(j+1)-1 pairs (i' <= i, j' <= j), so only pairs with (i+1)(j+1) <= B are scored.
Limit: that domination argument assumes that two different prefix scores never round to the
same sum. Rounding can only merge two sums that differ in their last bit; the tests check
equality on random float inputs and on dyadic inputs, which add exactly and tie often.
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass, field
from functools import cached_property

import torch

__all__ = [
    "DraftTree",
    "build_tree",
    "build_tree_reference",
    "candidate_tokens",
    "followed_depth",
    "followed_depth_reference",
]


@dataclass
class DraftTree:
    """A batch of N draft trees padded to budget B.

    Fields (each (N, B)): ``tokens`` (long), ``parents`` (long: 0 = root, j = node in column j-1),
    ``depths`` (long, 1..``max_depth`` for valid nodes), ``valid`` (bool). Node j (1-based) sits in
    column j-1 and parents come before children. Padding columns hold token 0, parent 0, depth 0,
    valid False: they hang off the root and carry no probability anywhere in the project.
    ``max_depth`` is K, the drafter horizon the tree was built for, or deeper once a copy tail is
    grafted on (:mod:`exittrain.core.copy_tail`, docs/algorithm.md section 2.5). ``scores`` (N, B) holds the
    drafter path log-probabilities, -inf on padding.

    Derived tensors (computed on first use and cached): :attr:`ancestor_mask`,
    :attr:`positions`, :meth:`child_token_mask`, :attr:`num_nodes`.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    max_depth: int
    scores: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, num_trees: int = 1, device: torch.device | str = "cpu") -> DraftTree:
        """``num_trees`` trees of no node: the target scores the root alone (a plain decoding step)
        and every verifier accepts nothing and draws the bonus from the root's distribution."""
        none = torch.zeros(num_trees, 0, dtype=torch.long, device=device)
        return cls(tokens=none, parents=none, depths=none, valid=none.bool(), max_depth=0,
                   scores=torch.zeros(num_trees, 0, device=device))

    @property
    def num_trees(self) -> int:
        return self.tokens.shape[0]

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    @cached_property
    def parents_with_root(self) -> torch.Tensor:
        """(N, B+1) parent index per row of the root-included layout; the root is its own parent."""
        root = self.parents.new_zeros(self.num_trees, 1)  # not parents[:, :1]: an empty tree (B = 0) has no column
        return torch.cat([root, self.parents], dim=1)

    @cached_property
    def valid_with_root(self) -> torch.Tensor:
        """(N, B+1) validity with the root (always valid) in column 0."""
        root = self.valid.new_ones(self.num_trees, 1)
        return torch.cat([root, self.valid], dim=1)

    @cached_property
    def positions(self) -> torch.Tensor:
        """(N, B+1) position offset of each row from the root: its depth, 0 for the root."""
        root = self.depths.new_zeros(self.num_trees, 1)
        return torch.cat([root, self.depths], dim=1)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """(N, B+1, B+1) bool: ``A[n, i, j]`` iff row j is row i or an ancestor of it (root incl.).

        Built with ``max_depth`` parent hops, each a gather and a scatter over (N, B+1).
        """
        N, B1 = self.parents_with_root.shape
        eye = torch.eye(B1, dtype=torch.bool, device=self.tokens.device)
        A_NBB = eye.expand(N, B1, B1).clone()
        hop_NB = torch.arange(B1, device=self.tokens.device).expand(N, B1)
        for _ in range(self.max_depth):
            hop_NB = self.parents_with_root.gather(1, hop_NB)
            A_NBB.scatter_(2, hop_NB.unsqueeze(-1), True)
        return A_NBB

    @cached_property
    def sibling_rank(self) -> torch.Tensor:
        """(N, B) rank of each node among its parent's children, in column order (0 = first child)."""
        N, B = self.parents.shape
        same_parent = torch.nn.functional.one_hot(self.parents, B + 1) & self.valid.unsqueeze(-1)  # (N, B, B+1)
        return (same_parent.cumsum(1) - 1).gather(2, self.parents.unsqueeze(-1)).squeeze(-1)

    @cached_property
    def num_nodes(self) -> torch.Tensor:
        """(N,) number of valid nodes, root excluded."""
        return self.valid.sum(-1)

    def child_token_mask(self, vocab_size: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Which vocabulary entries are children's tokens.

        Without ``rows``: (N, B+1, V) bool, ``mask[n, u, y]`` iff some valid child of row u carries
        token y. With ``rows`` (N,) long: (N, V) bool, the same for row ``rows[n]`` only, which is
        what a verifier needs after choosing one exit node (cheap for a large vocabulary).
        """
        N, B = self.tokens.shape
        if rows is None:
            index_NB = self.parents * vocab_size + self.tokens
            width = (B + 1) * vocab_size
        else:
            is_child_NB = (self.parents == rows.unsqueeze(-1)) & self.valid
            index_NB, width = torch.where(is_child_NB, self.tokens, vocab_size), vocab_size
        # padding / non-children write into one spare column that is dropped afterwards
        index_NB = torch.where(self.valid, index_NB, width)
        mask = torch.zeros(N, width + 1, dtype=torch.bool, device=self.tokens.device)
        mask.scatter_(1, index_NB, True)
        mask = mask[:, :width]
        return mask if rows is not None else mask.view(N, B + 1, vocab_size)

    def interior(self) -> tuple[DraftTree, torch.Tensor]:
        """The rows that are some node's parent, as trees of their own, and where each node's parent sits in them.

        Returns ``(inner, parent_row)``: ``inner`` (N trees of W = the most interior nodes of any tree)
        holds every valid node with a valid child, in column order, with its token, depth and parent
        (an interior node's parent is interior too); ``parent_row`` (N, B) gives, for every node of
        this tree, the row of ``inner`` (root-first, 0 = the root) that is its parent, 0 on padding.
        A node's edge probability reads its parent's row only (:func:`~exittrain.core.exit_law.exit_law_from_edges`),
        so scoring ``inner`` instead of the whole tree gives every edge with fewer target rows:
        leaves, about half of a best-first tree, need none.
        """
        N, B = self.tokens.shape
        children_NB1 = torch.zeros(N, B + 1, dtype=torch.long, device=self.tokens.device)
        children_NB1.scatter_add_(1, self.parents, self.valid.long())  # padding hangs off the root, adding 0
        keep_NB = (children_NB1[:, 1:] > 0) & self.valid
        row_NB1 = torch.cat([keep_NB.new_zeros(N, 1, dtype=torch.long), keep_NB.long().cumsum(1)], 1)  # old -> new
        W = int(keep_NB.sum(1).max()) if B and N else 0
        order_NW = (~keep_NB).long().argsort(dim=1, stable=True)[:, :W]  # the interior columns first, in order
        valid_NW = keep_NB.gather(1, order_NW)

        def pick(x):
            return torch.where(valid_NW, x.gather(1, order_NW), torch.zeros_like(order_NW))

        inner = DraftTree(tokens=pick(self.tokens), parents=pick(row_NB1.gather(1, self.parents)),
                          depths=pick(self.depths), valid=valid_NW, max_depth=self.max_depth)
        parent_row = torch.where(self.valid, row_NB1.gather(1, self.parents), torch.zeros_like(self.parents))
        return inner, parent_row

    def index(self, idx) -> DraftTree:
        """The sub-batch of trees selected by ``idx`` (any index valid for dim 0)."""
        return DraftTree(
            tokens=self.tokens[idx],
            parents=self.parents[idx],
            depths=self.depths[idx],
            valid=self.valid[idx],
            max_depth=self.max_depth,
            scores=None if self.scores is None else self.scores[idx],
        )

    def columns(self, width: int) -> DraftTree:
        """The first ``width`` columns of every tree: ValueError unless the nodes past them are padding
        (a tree cut there would lose nodes)."""
        if not 0 <= width <= self.budget:
            raise ValueError(f"width={width} must lie in [0, {self.budget}] (the trees' budget)")
        if bool(self.valid[:, width:].any()):
            raise ValueError(f"a tree has a node past column {width}: cutting there would lose it")
        return DraftTree(tokens=self.tokens[:, :width], parents=self.parents[:, :width],
                         depths=self.depths[:, :width], valid=self.valid[:, :width], max_depth=self.max_depth,
                         scores=None if self.scores is None else self.scores[:, :width])

    def expand(self, n: int) -> DraftTree:
        """A batch of ``n`` copies of a single tree (N must be 1); used for batched sampling."""
        if self.num_trees != 1:
            raise ValueError(f"expand needs a batch of one tree, got N={self.num_trees}; index it first")
        return self.index(torch.zeros(n, dtype=torch.long, device=self.tokens.device))


# ----------------------------------------------------------------------------------------------
# input checks


def _check_logprobs(logprobs: torch.Tensor, budget: int) -> None:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1 (number of draft nodes), got {budget!r}")
    if not torch.is_tensor(logprobs) or logprobs.dim() != 3:
        shape = tuple(logprobs.shape) if torch.is_tensor(logprobs) else type(logprobs).__name__
        raise ValueError(f"logprobs must be a (N, K, V) tensor of drafter log-probabilities, got {shape}")
    N, K, V = logprobs.shape
    if N < 1 or K < 1 or V < 1:
        raise ValueError(
            f"logprobs has shape {(N, K, V)}: need N >= 1 trees, K >= 1 draft positions and V >= 1 tokens"
        )
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be floating point, got {logprobs.dtype}")
    if torch.isnan(logprobs).any():
        raise ValueError("logprobs contains NaN; check the drafter output (e.g. a diverged loss)")
    if (logprobs == float("inf")).any():
        raise ValueError("logprobs contains +inf; pass log_softmax(logits), not raw logits")
    total = torch.logsumexp(logprobs.float(), dim=-1)
    tolerance = 1e-3 if logprobs.dtype in (torch.float32, torch.float64) else 3e-2  # half types round
    if not torch.allclose(total, torch.zeros_like(total), atol=tolerance):
        raise ValueError(
            "logprobs rows do not sum to 1 in probability space (max |logsumexp| = "
            f"{total.abs().max().item():.3g}); pass torch.log_softmax(logits, dim=-1)"
        )


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` upcast to float32 if it is a half type; float32 and float64 pass through."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def candidate_tokens(logprobs: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth candidate list: the M = min(budget, V) most likely tokens, best first.

    Returns ``(logq_NKM, tokens_NKM)``, log-probabilities in the score dtype (float32 or float64).
    """
    M = min(budget, logprobs.shape[-1])
    logq, tokens = torch.topk(logprobs, M, dim=-1, largest=True, sorted=True)
    return logq.to(_score_dtype(logprobs.dtype)), tokens


# ----------------------------------------------------------------------------------------------
# batched exact construction

_PAIR_CACHE: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _pruned_pairs(budget: int, M: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefix i, token j) pairs with (i+1)(j+1) <= budget, i < budget, j < M: about B ln B."""
    key = (budget, M, str(device))
    if key not in _PAIR_CACHE:
        i_list, j_list = [], []
        for i in range(budget):
            for j in range(min(M, budget // (i + 1))):
                i_list.append(i)
                j_list.append(j)
        _PAIR_CACHE[key] = (
            torch.tensor(i_list, dtype=torch.long, device=device),
            torch.tensor(j_list, dtype=torch.long, device=device),
        )
    return _PAIR_CACHE[key]


def _rank_by_key(score: torch.Tensor, valid: torch.Tensor, tiebreak: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the first ``k`` entries along dim 1 by (valid first, score desc, tiebreak asc).

    Two stable sorts: by the integer tie-break, then by score. Invalid entries get score -inf and
    the largest tie-break, so they sort after every valid one (valid scores may be -inf too).
    """
    big = torch.iinfo(torch.long).max
    tiebreak = torch.where(valid, tiebreak, torch.full_like(tiebreak, big))
    order = torch.sort(tiebreak, dim=1, stable=True).indices
    score_sorted = torch.where(valid, score, torch.full_like(score, float("-inf"))).gather(1, order)
    second = torch.sort(score_sorted, dim=1, descending=True, stable=True).indices
    return order.gather(1, second[:, :k])


def _dense_rank(key: torch.Tensor) -> torch.Tensor:
    """Rank of each entry of ``key`` along dim 1 (0 = smallest); keys are distinct where it matters."""
    order = torch.argsort(key, dim=1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(key.shape[1], device=key.device).expand_as(order))
    return rank


def build_tree(logprobs: torch.Tensor, budget: int, *, validate: bool = True) -> DraftTree:
    """Build N DDTree draft trees of ``budget`` nodes from (N, K, V) drafter log-probabilities.

    Batched and exact: tensor ops only, a loop over the K depths but none over nodes or trees,
    and no host synchronisation when ``validate=False`` (the input checks need one; decoders
    that produce log_softmax themselves may skip them). Returns nodes in heap pop order.
    See the module docstring for the tie-break rule.
    """
    if validate:
        _check_logprobs(logprobs, budget)
    N, K, V = logprobs.shape
    B = budget
    device = logprobs.device
    logq_NKM, tok_NKM = candidate_tokens(logprobs, B)
    M = logq_NKM.shape[-1]
    pair_i, pair_j = _pruned_pairs(B, M, device)

    # depth 1: the candidate list itself, padded to B
    pad = B - M
    level_score = torch.nn.functional.pad(logq_NKM[:, 0], (0, pad), value=float("-inf"))  # (N, B)
    level_valid = torch.arange(B, device=device).expand(N, B) < M  # (N, B)
    level_tok = torch.nn.functional.pad(tok_NKM[:, 0], (0, pad))  # (N, B)
    level_lex = torch.arange(B, device=device).expand(N, B)  # lexicographic rank within the level
    level_prefix = torch.zeros(N, B, dtype=torch.long, device=device)  # index into previous level

    scores, valids, toks, lexes, prefixes = [level_score], [level_valid], [level_tok], [level_lex], [level_prefix]
    for d in range(1, K):
        cand_score = level_score[:, pair_i] + logq_NKM[:, d, pair_j]  # (N, C)
        cand_valid = level_valid[:, pair_i]
        cand_lex = level_lex[:, pair_i] * M + pair_j  # rank path order, exact within the level
        keep = _rank_by_key(cand_score, cand_valid, cand_lex, B)  # (N, B)
        level_score = cand_score.gather(1, keep)
        level_valid = cand_valid.gather(1, keep)
        level_prefix = pair_i[keep]
        level_tok = tok_NKM[:, d].gather(1, pair_j[keep])
        kept_lex = cand_lex.gather(1, keep)
        level_lex = _dense_rank(torch.where(level_valid, kept_lex, torch.full_like(kept_lex, B * M)))
        scores.append(level_score)
        valids.append(level_valid)
        toks.append(level_tok)
        lexes.append(level_lex)
        prefixes.append(level_prefix)

    # the final top B over all K*B kept candidates
    all_score = torch.cat(scores, 1)  # (N, K*B)
    all_valid = torch.cat(valids, 1)
    depth_of = torch.arange(K, device=device).repeat_interleave(B)  # (K*B,) 0-based depth
    all_tie = depth_of * B + torch.cat(lexes, 1)  # shallower first, then rank path
    chosen = _rank_by_key(all_score, all_valid, all_tie, B)  # (N, B) flat index d*B + position

    valid = all_valid.gather(1, chosen)
    depth0 = chosen // B
    # column (1-based) of each kept candidate, 0 if not chosen; parents are chosen before children
    column_of = torch.zeros(N, K * B, dtype=torch.long, device=device)
    column_of.scatter_(1, chosen, torch.arange(1, B + 1, device=device).expand(N, B))
    prefix = torch.cat(prefixes, 1).gather(1, chosen)  # index into level d-1
    parent_flat = ((depth0 - 1).clamp_min(0) * B + prefix)
    parents = torch.where(depth0 > 0, column_of.gather(1, parent_flat), torch.zeros_like(prefix))

    zero = torch.zeros_like(parents)
    return DraftTree(
        tokens=torch.where(valid, torch.cat(toks, 1).gather(1, chosen), zero),
        parents=torch.where(valid, parents, zero),
        depths=torch.where(valid, depth0 + 1, zero),
        valid=valid,
        max_depth=K,
        scores=torch.where(valid, all_score.gather(1, chosen), torch.full_like(all_score[:, :B], float("-inf"))),
    )


# ----------------------------------------------------------------------------------------------
# reference twin: DDTree's best-first heap, one Python heap per tree


def _rounder(dtype: torch.dtype):
    if dtype == torch.float64:
        return lambda x: x
    # a float32 sum of two float32 numbers equals the double sum rounded once to float32
    return lambda x: struct.unpack("f", struct.pack("f", x))[0]


def build_tree_reference(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree's best-first heap (docs/algorithm.md section 2), the slow twin of :func:`build_tree`.

    Heap key: ``(-score, depth, rank path)``; see the module docstring. Scores are rounded to the
    score dtype after every addition so that both builders compare identical numbers.
    """
    _check_logprobs(logprobs, budget)
    N, K, V = logprobs.shape
    B = budget
    logq_NKM, tok_NKM = candidate_tokens(logprobs, B)
    M = logq_NKM.shape[-1]
    rnd = _rounder(logq_NKM.dtype)
    logq = logq_NKM.cpu().tolist()  # the host transfer is part of the heap's cost
    toks = tok_NKM.cpu().tolist()

    out_tok = [[0] * B for _ in range(N)]
    out_par = [[0] * B for _ in range(N)]
    out_dep = [[0] * B for _ in range(N)]
    out_val = [[False] * B for _ in range(N)]
    out_score = [[float("-inf")] * B for _ in range(N)]
    for n in range(N):
        lq, tk = logq[n], toks[n]
        # entry: (-score, depth, ranks, parent column, parent score)
        heap = [(-lq[0][0], 1, (0,), 0, 0.0)]
        count = 0
        while heap and count < B:
            neg, d, ranks, parent, parent_score = heapq.heappop(heap)
            score, r = -neg, ranks[-1]
            out_tok[n][count] = tk[d - 1][r]
            out_par[n][count] = parent
            out_dep[n][count] = d
            out_val[n][count] = True
            out_score[n][count] = score
            count += 1
            if r + 1 < M:  # next sibling: same parent, next token of q_d
                s = rnd(parent_score + lq[d - 1][r + 1])
                heapq.heappush(heap, (-s, d, ranks[:-1] + (r + 1,), parent, parent_score))
            if d < K:  # first child: best token of q_{d+1}
                s = rnd(score + lq[d][0])
                heapq.heappush(heap, (-s, d + 1, ranks + (0,), count, score))

    device = logprobs.device
    return DraftTree(
        tokens=torch.tensor(out_tok, dtype=torch.long, device=device),
        parents=torch.tensor(out_par, dtype=torch.long, device=device),
        depths=torch.tensor(out_dep, dtype=torch.long, device=device),
        valid=torch.tensor(out_val, dtype=torch.bool, device=device),
        max_depth=K,
        scores=torch.tensor(out_score, dtype=logq_NKM.dtype, device=device),
    )


def followed_depth(trees: DraftTree, labels_NK: torch.Tensor) -> torch.Tensor:
    """(N,) long: how deep each tree holds a given continuation, 0..K.

    Tree n is walked from its root along ``labels_NK[n]`` (the K tokens that follow its root):
    the result is the largest d such that the path ``labels[n, :d]`` is in the tree. When the
    labels are the target's greedy continuation, ``1 + followed_depth`` is exactly the block a
    T = 0 verifier accepts on that tree, bonus included: a decoded tau measured at every anchor of
    a recorded answer, without a target forward. Siblings carry distinct tokens, so at most one
    child matches. Batched over trees, a loop over the K depths only.
    """
    N = trees.tokens.shape[0]
    if labels_NK.dim() != 2 or labels_NK.shape[0] != N:
        raise ValueError(f"labels must be (N={N}, K) token ids, got {tuple(labels_NK.shape)}")
    K = min(labels_NK.shape[1], trees.max_depth)
    labels_NK = labels_NK.to(trees.tokens.device)
    row_N = torch.zeros(N, dtype=torch.long, device=trees.tokens.device)  # current node (0 = root)
    depth_N = torch.zeros_like(row_N)
    alive_N = torch.ones(N, dtype=torch.bool, device=row_N.device)
    for d in range(K):
        match_NB = trees.valid & (trees.parents == row_N.unsqueeze(1)) & (trees.tokens == labels_NK[:, d : d + 1])
        alive_N = alive_N & match_NB.any(1)
        row_N = torch.where(alive_N, match_NB.long().argmax(1) + 1, row_N)
        depth_N = depth_N + alive_N.long()
    return depth_N


def followed_depth_reference(trees: DraftTree, labels_NK: torch.Tensor) -> torch.Tensor:
    """Slow twin of :func:`followed_depth`: per tree, a search of each depth's children in Python."""
    tokens, parents, valid = trees.tokens.tolist(), trees.parents.tolist(), trees.valid.tolist()
    labels = labels_NK.tolist()
    out = []
    for n in range(len(tokens)):
        row, depth = 0, 0
        for d in range(min(len(labels[n]), trees.max_depth)):
            children = [j + 1 for j in range(len(tokens[n])) if valid[n][j] and parents[n][j] == row]
            hit = [j for j in children if tokens[n][j - 1] == labels[n][d]]
            if not hit:
                break
            row, depth = hit[0], depth + 1
        out.append(depth)
    return torch.tensor(out, dtype=torch.long)
