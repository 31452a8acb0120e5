"""Training-step benchmark on the embedded target: anchors/s, peak memory, where a step's time goes.

``python -m exittrain bench train [--steps 12] [--budgets 8 16 32] [--anchors 16] [--batch 4]``

For each tree budget, side by side in one process on the same cached self-distilled code
sequences: ExitTrain steps (stage ``exittrain``, exact scoring) through a real Lightning
Trainer. Reports anchors per second, the peak resident memory of the process, and the share of
the step spent in target features, the drafter (forward + block CE), tree building, target
tree scoring, the exit law + node loss, and backward (from ``train/time_*_ms``; the first two
steps are warm-up and not counted). Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch

from exittrain.objective import OBJECTIVE_PARTS
from exittrain.tables import markdown_table, write_results

PARTS = (*OBJECTIVE_PARTS, "backward")  # where a step's time goes


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run(steps: int, budgets: list[int], anchors: int, batch: int, prompts: int) -> dict:
    from exittrain.data import ExitTrainDataModule
    from exittrain.lit import ExitTrainModule
    from exittrain.lit.step_timing import timed_training_steps
    from exittrain.models import load_target, new_drafter
    from exittrain.precision import trainer_precision

    precision = trainer_precision("auto", "cpu")
    target = load_target(None)
    layers = new_drafter(target, seed=0).config.target_layer_ids  # the store serves the drafters' features
    dm = ExitTrainDataModule(
        "code", target=lambda: (target.model, target.tokenizer), tokenizer=target.tokenizer, target_name=target.name,
        cache_dir="data/cache/regen", max_length=448, batch_size=batch, max_train_prompts=prompts, val_fraction=0.0,
        generation={"max_new_tokens": 32, "batch_size": 16}, progress=False, feature_layers=layers,
    )

    results = []
    for budget in budgets:
        drafter = new_drafter(target, seed=0)
        module = ExitTrainModule(drafter, target, stage="exittrain", budget=budget, anchors_per_seq=anchors,
                                feature_cache=True)
        rows = timed_training_steps(module, dm, steps=steps, precision=precision, parts=(*PARTS, "step"))
        rows = rows[2:] or rows  # the first two steps warm up
        step_ms = statistics.median(r["step"] for r in rows)
        parts = {p: statistics.median(r.get(p, 0.0) for r in rows) for p in PARTS}
        results.append({
            "budget": budget,
            "step_ms": step_ms,
            "anchors_per_s": statistics.median(r["anchors"] for r in rows) / (step_ms / 1e3),
            "share": {p: v / step_ms for p, v in parts.items()},
            "tree_and_exit_share": (parts["tree"] + parts["exit"]) / step_ms,
            "peak_rss_mb": _peak_rss_mb(),
        })
    return {"steps": steps, "anchors_per_seq": anchors, "batch": batch, "threads": torch.get_num_threads(),
            "precision": precision, "rows": results}


def to_markdown(result: dict) -> str:
    rows = (
        [r["budget"], f"{r['step_ms']:.0f}", f"{r['anchors_per_s']:.1f}",
         *(f"{100 * r['share'][p]:.0f}%" for p in PARTS), f"{100 * r['tree_and_exit_share']:.1f}%",
         f"{r['peak_rss_mb']:.0f}"]
        for r in result["rows"]
    )
    lines = [
        f"ExitTrain steps on the embedded SmolLM2 (CPU, {result['threads']} threads, precision "
        f"{result.get('precision', 'bf16-mixed')}), batch "
        f"{result['batch']} x {result['anchors_per_seq']} anchors, median over {result['steps'] - 2} steps.",
        "",
        *markdown_table(["B", "step (ms)", "anchors/s", *PARTS, "tree + exit law", "peak RSS (MB)"], rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--out", default="results/bench_train")
    args = parser.parse_args(argv)
    result = run(args.steps, args.budgets, args.anchors, args.batch, args.prompts)
    write_results(args.out, result, to_markdown(result))


if __name__ == "__main__":
    main()
