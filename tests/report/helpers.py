"""Fake run directories with the exact file layouts of `fit` and `eval` runs (no model needed).

The files are written through :class:`exittrain.run_dir.RunDir`, as `fit`, `eval` and the callbacks write them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from exittrain.heldout.decode_eval import summarize
from exittrain.run_dir import RunDir

STAGES_FINAL = {
    "pretrain": {"train/exit_mass_d0": 0.5, "train/exit_mass_d1": 0.3, "train/exit_mass_d2": 0.15,
                 "train/exit_mass_d3": 0.05, "train/analytic_block_length": 1.75, "train/coverage": 0.75,
                 "train/mean_exit_depth": 0.75, "val/block_length": 1.6, "val/analytic_block_length": 1.7},
    "exittrain": {"train/exit_mass_d0": 0.3, "train/exit_mass_d1": 0.3, "train/exit_mass_d2": 0.25,
                  "train/exit_mass_d3": 0.15, "train/analytic_block_length": 2.25, "train/coverage": 1.25,
                  "train/mean_exit_depth": 1.25, "val/block_length": 2.1, "val/analytic_block_length": 2.2},
}


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def prompt_rows(label: str, mean_len: float, *, budgets=(8, 16), temperatures=(0.0,), prompts: int = 3,
                oracle: bool = True, seed: int = 0) -> list[dict]:
    """Per-prompt rows in the evaluate_prompts layout, block lengths around ``mean_len`` (+0.5 per budget doubling)."""
    rng = random.Random(seed)
    rows = []
    for t in temperatures:
        for b in budgets:
            shift = 0.5 * (b.bit_length() - 4)
            for i in range(prompts):
                lengths = [max(1, min(4, round(rng.gauss(mean_len + shift, 0.8)))) for _ in range(10)]
                row = {
                    "label": label, "prompt_index": i, "budget": b, "temperature": t, "verifier": "tev",
                    "new_tokens": sum(lengths), "rounds": len(lengths), "tau": sum(lengths) / len(lengths),
                    "block_lengths": lengths, "seconds": 0.5, "tokens_per_s": sum(lengths) / 0.5,
                    "time_draft": 0.1, "time_tree": 0.05, "time_target": 0.25, "time_verify": 0.05,
                    "time_commit": 0.05, "ar_tokens_per_s": 12.0,
                    "speedup": sum(lengths) / 0.5 / 12.0, "matches_target": True,
                }
                if oracle:
                    o = [4] * 8 + [3, 3]
                    row.update(tau_oracle=sum(o) / len(o), tau_oracle_analytic=3.6, oracle_block_lengths=o)
                rows.append(row)
    return rows


def _roundtrip(data):
    return json.loads(json.dumps(data))


def tree_example_dict() -> dict:
    """A hand-built 5-node tree in the tree_example layout with a consistent exit law."""
    parents = [0, 0, 1, 1, 3]
    depths = [1, 1, 2, 2, 3]
    edge = [0.6, 0.3, 0.5, 0.25, 0.8]
    reach = [1.0]
    for p, e in zip(parents, edge):
        reach.append(reach[p] * e)
    child = [0.0] * 6
    for p, e in zip(parents, edge):
        child[p] += e
    missing = [1 - c for c in child]
    exit_mass = [r * m for r, m in zip(reach, missing)]
    return {
        "format": "exittrain.tree_example/1", "budget": 5, "max_depth": 3, "num_nodes": 5, "temperature": 0.0,
        "law_temperature": 1.0, "seed": 0, "root_token": 7, "root_text": " def", "prompt_text": "x = 1\n def",
        "tokens": [10, 11, 12, 13, 14], "token_texts": [" sum", "\\n", "_list", " $x$", "("],
        "parents": parents, "depths": depths, "edge": edge, "draft_logprob": [-0.1, -1.0, -0.5, -1.5, -0.2],
        "reach": reach, "missing": missing, "exit_mass": exit_mass,
        "expected_block_length": sum(reach), "coverage": sum(reach[1:]),
        "accepted_rows": [1, 3], "accepted_tokens": [10, 12], "accepted_texts": [" sum", "_list"], "exit_row": 3,
        "bonus_token": 14, "bonus_text": "(", "block_length": 3,
    }


def make_fit_run(path: Path, recipe: str = "code", *, tree: bool = True) -> Path:
    """A `fit` run directory: metrics.json, eval_<label>.json, metrics_<stage>.json, tree_example.json."""
    files = RunDir(path)
    tables, metrics = {}, {}
    for label, stage, mean in (("warm_start", "pretrain", 1.8), ("exittrain", "exittrain", 2.4)):
        rows = prompt_rows(label, mean, seed=len(label))
        files.write_eval_rows(label, rows)
        tables[label] = _roundtrip(summarize(rows))
        history = [{"step": float(s), "block_length": mean - 0.5 + 0.1 * k, "tokens_per_s": 10.0, "rounds": 16.0,
                    "tokens": 30.0, "seconds": 1.0} for k, s in enumerate((10, 20, 30))]
        files.write_stage_metrics(stage, {
            "global_step": 30, "epoch": 0, "final": STAGES_FINAL[stage],
            "best": [{"monitor": "val/block_length", "mode": "max", "score": history[-1]["block_length"],
                      "path": str(path / "checkpoints" / "x.ckpt")}],
            "decode_eval": {"best": history[-1], "history": history},
        })
        metrics[f"{stage}_metrics"] = dict(STAGES_FINAL[stage])
    files.write_fit_summary({
        "recipe": recipe, "stages": ["pretrain", "exittrain"], "target": "tiny-llama", "tables": tables,
        "timings": {"total_s": 12.0}, "drafter": str(path / "drafter"), **metrics,
    })
    (path / ".hydra").mkdir(parents=True, exist_ok=True)
    (path / "checkpoints").mkdir(exist_ok=True)
    if tree:
        files.write_tree_example(tree_example_dict())
    return path


def make_eval_run(path: Path, recipe: str = "math", budgets=(4, 8, 16)) -> Path:
    """An `eval` run directory: results.json with rows and summary."""
    rows = prompt_rows(recipe, 2.0, budgets=budgets, temperatures=(0.0, 1.0), seed=3)
    RunDir(path).write_results(rows, _roundtrip(summarize(rows)), path / "drafter")
    return path


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path, min_bytes: int = 5000) -> tuple[int, int]:
    """The file is a PNG of at least ``min_bytes``; returns (width, height) from the IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > min_bytes, f"{path} is suspiciously small ({len(data)} bytes)"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
