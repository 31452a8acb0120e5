"""`eval` as a library function: decode a recipe's held-out prompts with a saved drafter.

:func:`run_eval` takes a composed ``eval`` config (conf/eval.yaml with a recipe) and writes
``results.json``, ``results.csv`` and ``tree_example.json`` into ``paths.output_dir``
(:class:`~exittrain.run_dir.RunDir`).
"""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig

from exittrain.build import build_target
from exittrain.cpu_decode.auto_settings import auto_probe
from exittrain.heldout.evaluator import HeldOutEvaluator, format_report
from exittrain.heldout.tree_example import tree_example
from exittrain.lit.run_logging import close_logger, log_table, make_logger
from exittrain.models import load_drafter
from exittrain.run_dir import RunDir, write_json_atomic
from exittrain.settings import check_eval_config

__all__ = ["run_eval"]


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


def run_eval(cfg: DictConfig, *, target=None) -> dict:
    """Decode the recipe's held-out prompts with the drafter at ``cfg.drafter_path``; returns rows and summary.

    ``target``: a built target, or a function that returns one, instead of building ``cfg.target``.
    The drafter folder is checked before the target loads.
    """
    checked = check_eval_config(cfg)  # every setting and the drafter folder, before the target loads
    path, settings = checked.drafter_path, checked.eval
    out = RunDir(cfg.paths.output_dir)
    target = build_target(cfg, target)
    drafter = load_drafter(path, target)
    datamodule = instantiate(cfg.data)(
        target=lambda: (target.model, target.tokenizer), tokenizer=target.tokenizer, target_name=target.name
    )
    prompts = datamodule.eval_prompts(cfg.eval.num_prompts)
    _check_prompt_lengths(prompts, target, settings)
    # the evaluator fit's final table comes from: the same measures and columns
    auto = auto_probe(target, settings["verifier"]) if settings["decode"] == "auto" else None
    evaluator = HeldOutEvaluator(target, prompts, settings, auto=auto, reference=None)
    logger = make_logger(cfg, f"{cfg.recipe_name}-eval")
    try:
        table, rows, chain = evaluator.measure(drafter, cfg.recipe_name)
        log_table(logger, "eval", table)
    finally:
        close_logger(logger)
    json_path, csv_path = out.write_results(rows, table, path)
    write_json_atomic(out.path / "chain.json", chain)
    out.write_tree_example(tree_example(target, drafter, prompts[0], budget=max(settings["budgets"])))
    print(f"\n{cfg.recipe_name}: held-out decoding with {path} (docs/metrics.md)\n" + format_report(table))
    print(f"\nResults: {json_path}, {csv_path}")
    return {"rows": rows, "summary": table}
