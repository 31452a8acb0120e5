"""`eval` as a library function: decode a recipe's held-out prompts with a saved drafter.

:func:`run_eval` takes a composed ``eval`` config (conf/eval.yaml with a recipe) and writes
``results.json``, ``results.csv`` and ``tree_example.json`` into ``paths.output_dir``
(:class:`~exittrain.run_dir.RunDir`).
"""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig

from exittrain.build import build_target
from exittrain.heldout.decode_eval import auto_reasons, evaluate_prompts, format_table, summarize
from exittrain.heldout.heldout_law import held_out_law
from exittrain.heldout.tree_example import tree_example
from exittrain.lit.run_logging import close_logger, log_table, make_logger
from exittrain.models import load_drafter
from exittrain.run_dir import RunDir
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
    logger = make_logger(cfg, f"{cfg.recipe_name}-eval")
    try:
        rows = evaluate_prompts(target, drafter, prompts, label=cfg.recipe_name, **settings)
        table = summarize(rows)
        law = held_out_law(target, prompts, checked.analytic, max_new_tokens=settings["max_new_tokens"],
                           seed=settings["seed"])
        if law is not None:
            law.attach(table, law.measure(drafter, settings["budgets"]))
        log_table(logger, "eval", table)
    finally:
        close_logger(logger)
    json_path, csv_path = out.write_results(rows, table, path)
    out.write_tree_example(tree_example(target, drafter, prompts[0], budget=max(settings["budgets"])))
    print(f"\n{cfg.recipe_name}: held-out decoding with {path}\n" + format_table(table))
    for reason in auto_reasons(table):
        print(f"\n{reason}")
    print(f"\nResults: {json_path}, {csv_path}")
    return {"rows": rows, "summary": table}
