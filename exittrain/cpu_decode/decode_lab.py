"""What the runs take from this layer for ``eval.decode=auto``, passed to them as one explicit argument.

``fit`` and ``eval`` (:mod:`exittrain.fit`, :mod:`exittrain.evaluate`) never import
:mod:`exittrain.cpu_decode` (the layer test, tests/test_architecture.py): the entry layer
(:mod:`exittrain.cli`) builds a :class:`DecodeLab` only when the config asks for
``eval.decode=auto`` and passes it as ``fit(cfg, lab=...)`` / ``run_eval(cfg, lab=...)``. Without
it, a run at ``eval.decode=auto`` stops with a ValueError that names this class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from exittrain.cpu_decode.auto_settings import auto_probe
from exittrain.cpu_decode.draft_vocab import count_answer_tokens, save_token_counts

__all__ = ["DecodeLab"]


@dataclass(frozen=True)
class DecodeLab:
    """The CPU decode lab's part in a run at ``eval.decode=auto``; each field a function, replaceable
    in tests:

    - ``auto_probe(target, verifier, token_counts=None)``: the evaluator's ``auto`` argument
      (:func:`~exittrain.cpu_decode.auto_settings.auto_probe`);
    - ``count_answer_tokens(rows)``: the training answers' tokens by frequency, from
      ``(input_ids, loss_mask)`` rows (:func:`~exittrain.cpu_decode.draft_vocab.count_answer_tokens`);
      the probe tries a draft vocabulary of them;
    - ``save_token_counts(folder, record, source=)``: writes them beside a drafter as
      ``draft_vocab.json`` (:func:`~exittrain.cpu_decode.draft_vocab.save_token_counts`), for a later
      ``eval.decode=auto`` or ``bench decode`` of that drafter.
    """

    auto_probe: Callable = auto_probe
    count_answer_tokens: Callable = count_answer_tokens
    save_token_counts: Callable = save_token_counts
