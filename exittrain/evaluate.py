"""`eval` as a library function: measure saved drafters on a recipe's held-out prompts.

:func:`run_eval` takes a composed ``eval`` config (conf/eval.yaml with a recipe; ``drafter_path``
one folder or a list) and measures every drafter with one
:class:`~exittrain.heldout.evaluator.HeldOutEvaluator`, the one ``fit``'s final table comes from:
the same answers walked for every drafter, so their rows are paired, and every drafter after the
first carries its paired differences against the first. It prints one table and writes
``results.json`` and ``results.csv`` (every drafter's per-prompt rows and the table), ``chain.json``
(the per-prompt chain rows) and ``tree_example.json`` (the first drafter's) into
``paths.output_dir`` (:class:`~exittrain.run_dir.RunDir`).
"""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

from exittrain.build import build_target
from exittrain.heldout.evaluator import HeldOutEvaluator, format_report
from exittrain.heldout.tree_example import tree_example
from exittrain.lit.run_logging import close_logger, log_table, make_logger
from exittrain.models import load_drafter
from exittrain.run_dir import RunDir, write_json_atomic
from exittrain.settings import check_eval_config

__all__ = ["drafter_labels", "run_eval"]


def _check_prompt_lengths(prompts: list[list[int]], target, settings: dict) -> None:
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is None:
        return
    for i, p in enumerate(prompts):
        if len(p) + settings["max_new_tokens"] + max(settings["budgets"]) + 1 > limit:
            raise ValueError(
                f"eval prompt {i} has {len(p)} tokens: with eval.max_new_tokens={settings['max_new_tokens']} it "
                f"exceeds the target's {limit} positions; lower eval.max_new_tokens"
            )


def drafter_labels(paths: list[Path]) -> list[str]:
    """One distinct label per drafter folder, in order: the folder's name (``drafter``,
    ``warmstart_drafter``); names that two folders share take their parent's too (``run_a/drafter``),
    and a folder given twice gets ``#2``, ``#3``, ... on its later labels."""
    resolved = [Path(p).resolve() for p in paths]
    names = [p.name for p in resolved]
    labels = [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in resolved]
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def run_eval(cfg: DictConfig, *, target=None, lab=None) -> dict:
    """Measure the drafters at ``cfg.drafter_path`` (one folder or a list) on the recipe's held-out
    prompts; returns ``rows`` (per prompt, budget and temperature), ``summary`` (the table), ``chain``
    (per prompt and temperature) and ``drafters`` ({label: folder}), every row labelled by
    :func:`drafter_labels`.

    One evaluator measures every drafter with ``reference`` = the first's label: each later drafter's
    table rows carry their paired pooled differences against it. ``target``: a built target, or a
    function that returns one, instead of building ``cfg.target``. ``lab``: the CPU decode lab
    (:class:`exittrain.cpu_decode.decode_lab.DecodeLab`), which ``eval.decode=auto`` needs for its
    probe and nothing else reads (``python -m exittrain eval`` passes it then). Every drafter folder
    is checked before the target loads."""
    checked = check_eval_config(cfg)  # every setting and every drafter folder, before the target loads
    paths, settings = checked.drafter_paths, checked.eval
    if settings["decode"] == "auto" and lab is None:
        raise ValueError("eval.decode=auto needs the CPU decode lab, which eval does not import: pass run_eval(cfg, "
                         "lab=DecodeLab()) (exittrain.cpu_decode.decode_lab; python -m exittrain eval passes it), "
                         "or set eval.decode=fixed")
    labels = drafter_labels(paths)
    out = RunDir(cfg.paths.output_dir)
    target = build_target(cfg, target)
    prompts = _eval_prompts(cfg, target)
    _check_prompt_lengths(prompts, target, settings)
    # the evaluator fit's final table comes from: the same measures and columns
    auto = lab.auto_probe(target, settings["verifier"]) if settings["decode"] == "auto" else None
    evaluator = HeldOutEvaluator(target, prompts, settings, auto=auto, reference=labels[0])
    logger = make_logger(cfg, f"{cfg.recipe_name}-eval")
    table, rows, chain = [], [], []
    first = None  # the reference drafter, whose tree the example draws
    try:
        for label, path in zip(labels, paths):
            drafter = load_drafter(path, target)
            if first is None:
                first = drafter
            drafter_table, drafter_rows, drafter_chain = evaluator.measure(drafter, label)
            log_table(logger, f"eval/{label}", drafter_table)
            table += drafter_table
            rows += drafter_rows
            chain += drafter_chain
    finally:
        close_logger(logger)
    json_path, csv_path = out.write_results(rows, table, paths[0] if len(paths) == 1 else ", ".join(map(str, paths)))
    write_json_atomic(out.path / "chain.json", chain)
    out.write_tree_example(tree_example(target, first, prompts[0], budget=max(settings["budgets"])))
    named = "\n".join(f"  {label}: {path}" for label, path in zip(labels, paths))
    print(f"\n{cfg.recipe_name}: held-out evaluation (docs/metrics.md) of\n{named}\n"
          + format_report(table, reference=labels[0]))
    print(f"\nResults: {json_path}, {csv_path}")
    return {"rows": rows, "summary": table, "chain": chain, "drafters": dict(zip(labels, map(str, paths)))}


def _eval_prompts(cfg: DictConfig, target) -> list[list[int]]:
    """The first ``eval.num_prompts`` held-out prompts of the recipe's datamodule, as ``fit`` reads them."""
    datamodule = instantiate(cfg.data)(
        target=lambda: (target.model, target.tokenizer), tokenizer=target.tokenizer, target_name=target.name
    )
    return datamodule.eval_prompts(cfg.eval.num_prompts)
