"""One real draft tree with its exit law, as a JSON-able dict for :func:`exittrain.report.plots.plot_draft_tree`.

:func:`tree_example` runs the first round of speculative decoding on one prompt exactly as
:class:`~exittrain.decoding.SpeculativeDecoder` does (prefill ``prompt[:-1]`` with the drafter's
feature layers, draft from the root ``prompt[-1]``, :func:`~exittrain.core.build_tree` on the
drafter's log-softmax (or its greedy chain, ``shape="chain"``), one
:meth:`TargetModel.tree_forward`), then records the exit law of that tree (docs/algorithm.md
section 4) and the path a verifier accepts.

Two temperatures, on purpose:

- ``temperature`` is the decoding temperature: it picks the accepted path (0: the greedy
  verifier, which follows the target's argmax child; > 0: the TEV verifier with ``seed``).
- ``law_temperature`` is the temperature of the distribution the exit law is computed under
  (:func:`~exittrain.core.warp_probs`). Default ``None`` means ``temperature`` when it is > 0,
  else 1.0. At temperature 0 the exact law is one-hot (P is 0 or 1 on every node, all exit mass
  on one node), which is correct but says little about the tree, so the default draws the raw
  target law (temperature 1, the law behind the "analytic tau" of docs/algorithm.md section 9).
  Pass ``law_temperature=0.0`` for the exact greedy law.

The layout (``format = "exittrain.tree_example/1"``; written and read as ``tree_example.json`` by
:mod:`exittrain.run_dir`), padding columns of the tree dropped,
nodes renumbered so that node j (1-based) is list index j-1 and row j in the root-first lists:

- ``budget``, ``max_depth``, ``num_nodes``, ``temperature``, ``law_temperature``, ``seed``
- ``root_token``, ``root_text``, ``prompt_text`` (decoded prompt tail, for the plot's caption)
- ``tokens``, ``token_texts``, ``parents`` (0 = root, j = node j), ``depths`` (1..K), ``edge``
  (``p_{pi(v)}(x_v)``), ``draft_logprob`` (drafter path score): one entry per node
- ``reach``, ``missing``, ``exit_mass``: ``num_nodes + 1`` entries, root first
- ``expected_block_length`` (= sum of reach), ``coverage`` (= sum of reach without the root)
- ``accepted_rows`` (node rows root -> exit, root excluded), ``accepted_tokens``,
  ``accepted_texts``, ``exit_row`` (0 = root), ``bonus_token``, ``bonus_text``, ``block_length``
  (accepted + bonus)

Token texts are ``tokenizer.decode([id])`` made printable by :func:`printable_token` (control
characters escaped); with no tokenizer (``target.tokenizer is None``) they are ``str(id)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from exittrain.core import exit_law, shaped_tree, verify_greedy, verify_tev, warp_probs

__all__ = ["tree_example", "printable_token", "FORMAT"]

FORMAT = "exittrain.tree_example/1"
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def printable_token(text: str) -> str:
    """``text`` with non-printable characters escaped (``\\n``, ``\\t``, ``\\xNN``, ``\\uNNNN``).

    Printable characters (letters of any script, punctuation, spaces) are kept as they are, so a
    leading space stays visible to a caller that wants to mark it.
    """
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def _finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _decode(tokenizer, token: int) -> str:
    if tokenizer is None:
        return str(int(token))
    return printable_token(tokenizer.decode([int(token)]))


@torch.no_grad()
def tree_example(
    target,
    drafter,
    prompt_ids: Sequence[int],
    budget: int = 16,
    temperature: float = 0.0,
    *,
    law_temperature: float | None = None,
    seed: int = 0,
    shape: str = "ddtree",
) -> dict:
    """Draft, build and score one tree for ``prompt_ids`` and return its exit law (module docstring).

    ``prompt_ids``: at least 2 token ids (context + root; apply the chat template first).
    ``budget``: tree nodes (root excluded). ``shape``: ``ddtree`` (the decoder's best-first tree) or
    ``chain`` (the drafter's greedy chain of ``min(budget, K)`` nodes, what a serving engine
    verifies: ``tree.shape`` of a ``+serve=dflash`` run). Raises ValueError on a bad prompt,
    budget, temperature or shape.
    The drafter is run in eval mode and put back into its previous mode afterwards.
    """
    ids = [int(t) for t in prompt_ids]
    if len(ids) < 2:
        raise ValueError(f"prompt_ids needs at least 2 tokens (a context and a root), got {len(ids)}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1 (draft nodes), got {budget!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if law_temperature is None:
        law_temperature = float(temperature) if temperature > 0 else 1.0
    if not isinstance(law_temperature, (int, float)) or law_temperature < 0:
        raise ValueError(f"law_temperature must be >= 0, got {law_temperature!r}")
    if not drafter.has_target:
        drafter.attach_target(target)

    device = target.device
    layers = list(drafter.config.target_layer_ids)
    ids_1T = torch.tensor([ids], dtype=torch.long, device=device)
    root_1 = ids_1T[:, -1]
    was_training = drafter.training
    drafter.eval()
    try:
        pre = target.prefill(ids_1T[:, :-1], layers=layers)
        logits_1KV = drafter(pre.features, root_1, context_ids=ids_1T[:, :-1])
    finally:
        drafter.train(was_training)
    tree = shaped_tree(torch.log_softmax(logits_1KV.float(), dim=-1), budget, shape)
    out = target.tree_forward(pre.cache, root_1, tree)
    logits = out.logits.float()
    law = exit_law(tree, warp_probs(logits, law_temperature))
    if temperature == 0:
        verdict = verify_greedy(tree, logits)
    else:
        generator = torch.Generator(device=logits.device).manual_seed(seed)
        verdict = verify_tev(tree, logits, temperature=float(temperature), generator=generator)

    # drop padding columns and renumber rows (old row j -> new row)
    valid = tree.valid[0].tolist()
    keep = [j for j, v in enumerate(valid) if v]  # columns
    new_row = {0: 0, **{col + 1: i + 1 for i, col in enumerate(keep)}}
    tokens = [int(tree.tokens[0, c]) for c in keep]
    keep_rows = [0] + [c + 1 for c in keep]
    tok = getattr(target, "tokenizer", None)
    n_accept = int(verdict.accept_length[0])
    accepted_rows = [new_row[int(r)] for r in verdict.accepted_rows[0, :n_accept].tolist()]
    accepted_tokens = [int(t) for t in verdict.accepted_tokens[0, :n_accept].tolist()]
    bonus = int(verdict.bonus[0])
    scores = tree.scores[0] if tree.scores is not None else None
    return {
        "format": FORMAT,
        "budget": budget,
        "max_depth": int(tree.max_depth),
        "num_nodes": len(keep),
        "temperature": float(temperature),
        "law_temperature": float(law_temperature),
        "seed": int(seed),
        "root_token": ids[-1],
        "root_text": _decode(tok, ids[-1]),
        "prompt_text": printable_token(tok.decode(ids[-32:])) if tok is not None else " ".join(map(str, ids[-16:])),
        "tokens": tokens,
        "token_texts": [_decode(tok, t) for t in tokens],
        "parents": [new_row[int(tree.parents[0, c])] for c in keep],
        "depths": [int(tree.depths[0, c]) for c in keep],
        "edge": [float(law.edge[0, c]) for c in keep],
        "draft_logprob": [_finite(scores[c]) for c in keep] if scores is not None else None,
        "reach": [float(law.reach[0, r]) for r in keep_rows],
        "missing": [float(law.missing[0, r]) for r in keep_rows],
        "exit_mass": [float(law.exit_mass[0, r]) for r in keep_rows],
        "expected_block_length": float(law.expected_block_length[0]),
        "coverage": float(law.coverage[0]),
        "accepted_rows": accepted_rows,
        "accepted_tokens": accepted_tokens,
        "accepted_texts": [_decode(tok, t) for t in accepted_tokens],
        "exit_row": new_row[int(verdict.exit_node[0])],
        "bonus_token": bonus,
        "bonus_text": _decode(tok, bonus),
        "block_length": n_accept + 1,
    }
