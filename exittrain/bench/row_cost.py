"""What a target forward costs by the rows it scores, on this host: the price list of a round.

``python -m exittrain bench rows [--rows 1 2 3 4 6 8 11 17] [--contexts 300] [--repeats 9]
[--packed on off] [--attention grouped repeated] [--set restating] [--target PATH]``

A decoding round pays one target forward over the tree's rows (the root and its B nodes, and
the copy tail's); a greedy step pays one over one row. How the cost grows with the rows decides
which budget and copy tail pay (:mod:`exittrain.cpu_decode.auto_settings` measures it through real
decodes; this bench isolates it). For each context length C, the target prefills C tokens of a
held-out prompt (a set of ``bench decode``; prompts are joined until C tokens are reached),
then at each row count R times ``repeats`` forwards after one untimed warm-up:

- R = 1: the greedy step, ``target.model`` on one token with the cache, as
  :func:`~exittrain.decoding.autoregressive_generate` runs it;
- R > 1: :meth:`~exittrain.models.target_model.TargetModel.tree_forward` of a chain of R - 1 nodes
  under the root (:func:`~exittrain.core.copy_tail.copy_only_tree`), as a round runs it.

Tree forwards run with the decoder layers' linears packed for their rows where that times
faster here (``--packed on``: the target's ``row_kernels`` option,
:class:`~exittrain.cpu_decode.fast_products.RowKernels`, :mod:`exittrain.cpu_decode.packed_linears`),
with ``F.linear`` (``off``), or both side by side; and with grouped query heads reading the cached
keys in place (``--attention grouped``, :mod:`exittrain.models.grouped_attention`), sdpa's keys
repeated per head (``repeated``: the target's ``grouped_attention=False``), or both. Each
combination is a target made with those options
(:meth:`~exittrain.models.target_model.TargetModel.with_options`), the LM head in the layout a CPU
decode runs (:func:`~exittrain.cpu_decode.row_layouts.head_rows`).
After each forward the cache is cut back to C, so every forward sees the same context. The
figure is the median; the table also gives each count's ratio to one row. The rows are timed
interleaved (every count once per repeat), so a load that drifts during the run spreads over
all counts rather than landing on one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exittrain.core.copy_tail import copy_only_tree
from exittrain.cpu_decode.fast_products import RowKernels
from exittrain.cpu_decode.packed_linears import packed_choices
from exittrain.cpu_decode.row_layouts import choose_layouts, head_rows
from exittrain.models.hf_cache import cache_kwargs
from exittrain.tables import write_results

DEFAULT_ROWS = (1, 2, 3, 4, 6, 8, 11, 17)


def check_counts(values, key: str) -> list[int]:
    """The distinct values, sorted; ValueError naming ``key`` unless each is an integer >= 1."""
    if not values or any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{key} {list(values or [])}: give integers >= 1")
    return sorted(set(values))


def context_ids(prompts: list[list[int]], length: int) -> list[int]:
    """The first ``length`` tokens of the prompts joined; ValueError when they hold fewer."""
    ids = [t for p in prompts for t in p]
    if len(ids) < length:
        raise ValueError(f"--contexts {length}: the prompts hold only {len(ids)} tokens; lower it or raise --prompts")
    return ids[:length]


ATTENTION_MODES = ("grouped", "repeated")
"""``--attention``: grouped query heads read their key/value heads in place (what a tree forward
runs, :mod:`exittrain.models.grouped_attention`), or transformers' sdpa repeats them."""


def tree_targets(target, max_rows: int, packed: tuple[str, ...], attention: tuple[str, ...]) -> dict:
    """``{(packing mode, attention): target}``: ``target`` with the options a CPU decode's tree
    forwards run (its LM head in :func:`~exittrain.cpu_decode.row_layouts.head_rows`' layout, and
    for ``on`` its linears packed for up to ``max_rows`` rows), or their reference twins (``off``:
    ``F.linear``; ``repeated``: ``grouped_attention=False``); made now, before the first lap."""
    kernels = None
    if "on" in packed:
        kernels = RowKernels(target.model, target.tree_linears())
        kernels.prepare(max_rows)
    head = target.plain_head()
    if head is not None:
        choose_layouts(head.weight, range(2, max_rows + 1))
    return {(mode, a): target.with_options(row_kernels=kernels if mode == "on" else None, head_product=head_rows,
                                           grouped_attention=a == "grouped")
            for mode in packed for a in attention}


def _columns(rows: list[int], modes, attentions=("grouped",)) -> list[tuple[int, str | None, str | None]]:
    """``(R, packing mode, attention)`` per timed forward: one row has neither (no tree), each tree
    every combination."""
    return [(r, m, a) for r in rows
            for m, a in ([(None, None)] if r == 1 else [(m, a) for m in modes for a in attentions])]


def _key(r: int, mode: str | None, attention: str | None) -> str:
    """The result key of a column: ``"R"`` for one row, ``"R MODE"`` for a tree, with ``" repeated"``
    after it for repeated keys."""
    if mode is None:
        return str(r)
    return f"{r} {mode}" + ("" if attention == "grouped" else f" {attention}")


@torch.no_grad()
def forward_ms(target, ids: list[int], rows: list[int], repeats: int, packed: tuple[str, ...] = ("on",),
               attention: tuple[str, ...] = ("grouped",)) -> dict[str, float]:
    """Median ms of one target forward over each count of ``rows`` after the context ``ids``
    (the last id is the root), interleaved across counts, keyed ``"R"`` for one row and ``"R
    MODE"`` for a tree of R rows with packing ``MODE`` (``on``/``off``), ``"R MODE repeated"``
    with sdpa's repeated keys (``attention``, :data:`ATTENTION_MODES`); see the module docstring."""
    device = target.device
    ids_1T = torch.tensor([ids], device=device)
    cache = target.prefill(ids_1T[:, :-1]).cache
    root = ids_1T[:, -1]
    # the chain's tokens: the context's own, so the tree holds ordinary text ids
    chain = [ids[i % len(ids)] for i in range(max(rows))]
    trees = {r: copy_only_tree(chain[: r - 1], device) for r in rows if r > 1}
    keys = _columns(rows, packed, attention)
    tree_target = tree_targets(target, max(rows), packed, attention)

    def forward(r: int, mode: str | None, attention: str | None) -> float:
        start = time.perf_counter()
        if r == 1:
            target.model(input_ids=root.view(1, 1), use_cache=True, **cache_kwargs(cache))
        else:
            tree_target[mode, attention].tree_forward(cache, root, trees[r])
        seconds = time.perf_counter() - start
        cache.crop(-r)  # back to the context alone
        return seconds

    laps = {key: [] for key in keys}
    for repeat in range(repeats + 1):
        for key in keys:
            seconds = forward(*key)
            if repeat:  # the first pass is the warm-up
                laps[key].append(seconds)
    return {_key(*key): 1e3 * statistics.median(v) for key, v in laps.items()}


def run(rows: list[int], contexts: list[int], repeats: int, set_name: str, target_path: str | None,
        n_prompts: int = 8, packed: tuple[str, ...] = ("on",), attention: tuple[str, ...] = ("grouped",)) -> dict:
    from exittrain.bench.decode import check_sets, host, set_prompts
    from exittrain.models import load_target
    from exittrain.progress import Ticker

    rows, contexts = check_counts(rows, "--rows"), check_counts(contexts, "--contexts")
    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: give an integer >= 1")
    check_sets([set_name])
    target = load_target(target_path)
    prompts = set_prompts(target, set_name, n_prompts, 0)
    measured = []
    ticker = Ticker("bench rows", len(contexts), unit="context", every=1)
    for i, C in enumerate(contexts, 1):
        ms = forward_ms(target, context_ids(prompts, C + 1), rows, repeats, packed, attention)
        measured.append({"context": C, "ms": {str(r): v for r, v in ms.items()}})
        ticker.update(i)
    packs = packed_choices(target.model)
    return {"host": host(), "set": set_name, "repeats": repeats, "rows": rows, "packed": list(packed),
            "attention": list(attention),
            "packed_buckets": packs, "contexts": measured}


def to_markdown(result: dict) -> str:
    from exittrain.bench.decode import host_line, packed_lines

    rows, modes = result["rows"], result.get("packed", ["on"])
    attentions = result.get("attention", ["grouped"])  # results from before the axis ran grouped
    columns = _columns(rows, modes, attentions)
    names = {"on": "packed", "off": "F.linear"}

    def label(r: int, m: str | None, a: str | None) -> str:
        tags = [m] * (len(modes) > 1 and m is not None) + [a] * (len(attentions) > 1 and a is not None)
        return f"{r} row{'s' * (r > 1)}" + "".join(f", {t}" for t in tags)

    lines = [f"Target forward by rows scored, median of {result['repeats']} after a warm-up; context from the "
             f"{result['set']} set; host: {host_line(result['host'])}. Trees' decoder linears: "
             + ", ".join(f"{m} ({names[m]})" for m in modes) + "; attention: " + ", ".join(attentions) + ".", "",
             "| context | " + " | ".join(label(*column) for column in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for c in result["contexts"]:
        ms = c["ms"]
        one = ms.get("1")
        cells = []
        for r, m, a in columns:
            v = ms[_key(r, m, a)]
            cells.append(f"{v:.1f} ms" + (f" ({v / one:.2f}x)" if one and r > 1 else ""))
        lines.append(f"| {c['context']} | " + " | ".join(cells) + " |")
    return "\n".join(lines + packed_lines(result.get("packed_buckets"))) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="row counts (1: a greedy step)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300], help="context lengths, tokens")
    parser.add_argument("--repeats", type=int, default=9, help="timed forwards per row count and context")
    parser.add_argument("--packed", nargs="+", choices=["on", "off"], default=["on"],
                        help="trees' decoder linears packed for their rows (on), F.linear (off), or both")
    parser.add_argument("--attention", nargs="+", choices=ATTENTION_MODES, default=["grouped"],
                        help="trees' attention: query heads grouped over the cache in place, repeated keys, or both")
    parser.add_argument("--set", default="restating", help="the prompt set the context comes from (bench decode's)")
    parser.add_argument("--target", default=None, help="a target path (default: the embedded SmolLM2)")
    parser.add_argument("--out", default="results/bench_rows")
    args = parser.parse_args(argv)
    result = run(args.rows, args.contexts, args.repeats, args.set, args.target,
                 packed=tuple(dict.fromkeys(args.packed)), attention=tuple(dict.fromkeys(args.attention)))
    write_results(args.out, result, to_markdown(result))
