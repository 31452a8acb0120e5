"""``bench gpu``: the goal verdicts, the per-point guard and the tables (fast), and the CPU twin of the GPU
check (slow): the same code path on tiny random targets of both families, every section filled."""

from __future__ import annotations

import json
import math

import pytest
import torch

from exittrain.bench import gpu_check
from exittrain.bench.gpu_check import (
    MEMORY_GOAL,
    SCORING_GOAL,
    STEP_STAGES,
    TARGETS,
    dflash_shape,
    drafter_overrides,
    failed_points,
    goal_verdict,
    guarded,
    ratio_of,
    to_markdown,
)
from exittrain.bench.registry import BENCHES

CPU = torch.device("cpu")
SECTIONS = ("## Training steps: memory and time", "## Tree scoring against a plain forward", "## Verifiers",
            "## Decode round against an autoregressive step")


def test_gpu_check_is_registered():
    assert BENCHES["gpu"] == "exittrain.bench.gpu_check"


def test_memory_goal_is_fifteen_percent_either_way():
    assert goal_verdict(ratio_of(100, 100), MEMORY_GOAL) == "met"
    assert goal_verdict(0.85, MEMORY_GOAL) == goal_verdict(1.15, MEMORY_GOAL) == "met"  # the bounds are in
    assert goal_verdict(ratio_of(120, 100), MEMORY_GOAL) == "missed"  # the plan 20% under the measured peak
    assert goal_verdict(ratio_of(80, 100), MEMORY_GOAL) == "missed"  # the plan 25% over it
    assert goal_verdict(ratio_of(None, 100), MEMORY_GOAL) == "not measured"  # a CPU twin's step


def test_scoring_goal_is_at_most_one_point_three():
    assert goal_verdict(1.3, SCORING_GOAL) == "met"
    assert goal_verdict(0.7, SCORING_GOAL) == "met"
    assert goal_verdict(ratio_of(131, 100), SCORING_GOAL) == "missed"


def test_ratio_of_a_missing_or_empty_side_is_none():
    assert ratio_of(1.0, None) is None and ratio_of(None, 1.0) is None and ratio_of(1.0, 0.0) is None
    assert ratio_of(3.0, 2.0) == 1.5


def test_guard_records_a_failed_point_and_goes_on():
    assert guarded("ok", CPU, {"B": 16}, lambda: {"ms": 2.0}) == {"B": 16, "status": "ok", "ms": 2.0}

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")

    def broken():
        raise RuntimeError("shape mismatch")

    reason = "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"  # the first line only
    assert guarded("oom", CPU, {"B": 16}, out_of_memory) == {"B": 16, "status": "out of memory", "reason": reason}
    assert guarded("bug", CPU, {}, broken) == {"status": "error", "reason": "RuntimeError: shape mismatch"}


def test_the_drafters_are_the_dflash_ones_plan_assumes():
    qwen = drafter_overrides(dflash_shape("Qwen/Qwen3-8B"))
    assert {"drafter.block_size=16", "drafter.num_layers=5", "drafter.layer_ids=[1,9,17,25,33]",
            "drafter.copy_ngrams=[]", "+drafter.mask_token_id=151669", "+drafter.learned_mask=false",
            "+drafter.intermediate_size=12288"} <= set(qwen)
    llama = drafter_overrides(dflash_shape("meta-llama/Llama-3.1-8B-Instruct"))
    assert {"+drafter.mask_token_id=null", "+drafter.learned_mask=true",
            "+drafter.intermediate_size=14336"} <= set(llama)
    with pytest.raises(ValueError, match="no DFlash drafter known"):
        dflash_shape("org/unknown")


def test_tables_name_a_failed_target_and_the_exit_lists_it():
    result = {"host": {"cpu_model": "x", "cpu_capability": "AVX2", "threads": 1, "torch": "2"}, "device": "cuda",
              "tiny": False, "repeats": 3, "seconds": 1.0, "memory_goal": list(MEMORY_GOAL), "scoring_goal": 1.3,
              "targets": [{"target": "qwen3_8b", "status": "error", "reason": "ValueError: no config"}]}
    markdown = to_markdown(result)
    assert all(title in markdown for title in SECTIONS)
    assert "- qwen3_8b: error: ValueError: no config" in markdown
    assert failed_points(result) == ["qwen3_8b check: ValueError: no config"]


def _finite_positive(x) -> bool:
    return x is not None and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_cpu_twin_runs_every_section(tmp_path, one_thread):
    """The twin: both families, both step kinds, every budget of every section; tens of seconds on 2 cores."""
    out = tmp_path / "gpu_check"
    gpu_check.main(["--tiny", "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    budgets = [16, 32, 64, 128, 256]  # the defaults
    assert result["budgets"] == budgets and result["device"] == "cpu"
    assert {"torch", "cpu_capability", "cpu_model"} <= set(result["host"])
    assert [c["target"] for c in result["targets"]] == list(TARGETS)
    for c in result["targets"]:
        assert c["status"] == "ok", c.get("reason")
        assert c["drafter_params"] == c["plan_drafter"]["params"]  # the measured drafter is the planned one
        assert [s["stage"] for s in c["steps"]] == list(STEP_STAGES)
        for s in c["steps"]:
            assert s["status"] == "ok", s.get("reason")
            assert _finite_positive(s["planned_peak_bytes"]) and _finite_positive(s["step_ms"])
            assert s["measured_peak_bytes"] is None and s["verdict"] == "not measured"  # no CPU memory figure
        assert c["scoring"]["status"] == "ok" and _finite_positive(c["scoring"]["ratio"])
        assert [r["B"] for r in c["verify"]] == budgets
        for r in c["verify"]:
            assert all(_finite_positive(r[f"{v}_ms"]) for v in ("tev", "greedy", "sequential")), r
        assert [r["B"] for r in c["decode"]] == budgets
        assert all(r["status"] == "ok" and _finite_positive(r["ratio"]) for r in c["decode"]), c["decode"]
    markdown = out.with_suffix(".md").read_text()
    assert all(title in markdown for title in SECTIONS)
    assert all(name in markdown for name in TARGETS)


@pytest.mark.slow
def test_a_step_the_plan_says_does_not_fit_is_skipped(tmp_path):
    from exittrain.plan import compose_fit, make_plan

    overrides = gpu_check.check_overrides("llama31_8b", CPU, tmp_path)
    plan = make_plan(overrides, device_memory="1MiB")
    row = gpu_check.measure_step(compose_fit(overrides), plan, "exittrain", None, None, repeats=1)
    assert row["status"] == "skipped" and "does not fit" in row["reason"]
    assert row["verdict"] == "skipped" and row["ratio"] is None
