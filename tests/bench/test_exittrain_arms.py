"""The ExitTrain experiment's grid, comparisons and verdict on synthetic per-anchor block lengths.

Training and measuring run on the real target in the slow test below and in ``make bench-exittrain``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from exittrain.bench import exittrain_arms as bx


def test_every_exittrain_arm_has_its_matched_control_in_the_grid():
    names = [a.name for a in bx.ARMS]
    assert len(set(names)) == len(names)
    for arm in bx.ARMS:
        if arm.stage == "exittrain":
            assert arm.control in names, f"{arm.name} has no matched control"
            control = next(a for a in bx.ARMS if a.name == arm.control)
            assert (control.labels, control.rows) == (arm.labels, arm.rows)
            assert arm.module_args()["lambda_exit"] == arm.lambda_exit > 0
        else:
            assert "lambda_exit" not in arm.module_args()
    hard = bx.Arm("hard", lambda_exit=0.1)
    assert hard.module_args()["soft_label_weight"] == 0.0 and hard.name == "exittrain-hard-flow-l0.1-fresh"
    assert bx.Arm(budget_train=32, lambda_exit=1.0).name.endswith("-B32-fresh")


def _measured(shift: float, noise: float, prompts: int = 12, anchors: int = 20) -> dict:
    """Per-row block lengths of the warm start, the control and one ExitTrain arm that adds ``shift``."""
    g = torch.Generator().manual_seed(0)
    base = [2.0 + torch.rand(anchors, generator=g) for _ in range(prompts)]
    control = [b + 0.01 for b in base]
    arm = [c + shift + noise * torch.randn(anchors, generator=g) for c in control]
    key = "16/1"
    return {"per_row": {"warm start": {key: base}, "control-soft-fresh": {key: control},
                        "exittrain-soft-flow-l1-fresh": {key: arm}},
            "oracle": {key: [torch.full((anchors,), 5.0) for _ in range(prompts)]}}


def test_compare_pairs_each_arm_with_its_control_and_the_verdict_reads_the_interval():
    rows = bx.compare(_measured(shift=0.2, noise=0.05), "warm start")
    arm = next(r for r in rows if r["drafter"] == "exittrain-soft-flow-l1-fresh")
    assert arm["control"] == "control-soft-fresh"
    assert arm["vs_control"]["delta"] == pytest.approx(0.2, abs=0.02)
    assert arm["vs_warm_start"]["delta"] == pytest.approx(0.21, abs=0.02)
    assert arm["tau_oracle"] == 5.0 and arm["efficiency"] == pytest.approx(arm["tau"] / 5.0)
    assert [r["vs_control"] for r in rows if r["drafter"] != "exittrain-soft-flow-l1-fresh"] == [None, None]
    assert len(bx.verdict(rows)) == 1 and "beats control-soft-fresh" in bx.verdict(rows)[0]
    # a null arm (no shift, real noise) has an interval across 0: no verdict line
    assert bx.verdict(bx.compare(_measured(shift=0.0, noise=0.3), "warm start")) == []
    losing = bx.verdict(bx.compare(_measured(shift=-0.2, noise=0.05), "warm start"))
    assert len(losing) == 1 and "loses to" in losing[0] and "negligible" not in losing[0]
    # a consistent but tiny shift excludes 0 and is called what it is
    tiny = bx.verdict(bx.compare(_measured(shift=0.001, noise=0.0), "warm start"))
    assert len(tiny) == 1 and "beats" in tiny[0] and "negligible" in tiny[0]


def test_the_report_states_the_verdict_and_plots(tmp_path):
    rows = bx.compare(_measured(shift=0.0, noise=0.3), "warm start")
    result = {"domain": "code", "warm_start": "W", "steps": 3, "prompts": 12, "skip": 16, "max_new_tokens": 8,
              "analytic_anchors": 20, "rows": rows, "verdict": bx.verdict(rows),
              "train": {"control-soft-fresh": {"train_s": 3.0, "s_per_step": 1.0}}}
    md = bx.to_markdown(result)
    assert "none: no ExitTrain setting" in md and "control-soft-fresh" in md
    bx.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bad_arguments_name_the_option(tmp_path):
    with pytest.raises(SystemExit):
        bx.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        bx.parse_args(["--warm-start", str(tmp_path)])  # no config.json there
    with pytest.raises(SystemExit):
        bx.parse_args(["--temperatures", "-1"])
    with pytest.raises(SystemExit):  # one count per budget, none above --analytic-anchors
        bx.parse_args(["--budgets", "16", "64", "--budget-anchors", "2"])
    with pytest.raises(SystemExit):
        bx.parse_args(["--analytic-anchors", "2", "--budget-anchors", "3", "1"])
    assert bx.parse_args(["--analytic-anchors", "4"]).budget_anchors == [4, 4]


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_on_the_embedded_target(tmp_path, monkeypatch):
    monkeypatch.setenv("EXITTRAIN_CACHE", str(tmp_path / "cache"))
    args = bx.parse_args([
        "--steps", "2", "--fresh-prompts", "8", "--prompts", "2", "--max-new-tokens", "12",
        "--analytic-anchors", "2", "--budgets", "4", "3", "--budget-anchors", "2", "1", "--oracle-prompts", "1",
        "--temperatures", "0", "1",
        "--arms", "control-soft-fresh", "exittrain-soft-flow-l1-fresh",
        "--override", "debug=smoke", "--override", "stages.pretrain.max_steps=2", "--out", str(tmp_path / "out"),
    ])
    result = bx.run(args)
    saved = json.loads((tmp_path / "out" / "exittrain.json").read_text())
    assert saved["verdict"] == result["verdict"]
    names = {r["drafter"] for r in saved["rows"]}
    assert names == {"warm start", "control-soft-fresh", "exittrain-soft-flow-l1-fresh"}
    analytic = [r for r in saved["rows"] if r["temperature"] == 1.0]
    for r in analytic:  # a block of a budget-B tree: at least the bonus, at most 1 + B; the oracle bounds it
        assert 1.0 <= r["tau"] <= 1 + r["budget"] and r["efficiency"] <= 1 + 1e-6 and r["oracle_prompts"] == 1
    arm = {r["budget"]: r for r in analytic if r["drafter"] == "exittrain-soft-flow-l1-fresh"}
    assert arm[4]["vs_control"] is not None and arm[4]["anchors"] == 2 * 2 and arm[3]["anchors"] == 2 * 1
    assert os.path.exists(tmp_path / "out" / "exittrain_vs_control.png")
    assert not (tmp_path / "out" / bx.PARTIAL).exists()  # the partial file lives while it runs only

    # a rerun reuses the trained arms and every measurement: nothing is trained, sampled or scored again
    def never(*a, **k):
        raise AssertionError("a rerun measured again what it had measured")

    from exittrain.heldout import measures as heldout_law

    for name in ("answer_rows", "analytic_block_lengths", "oracle_block_lengths"):
        monkeypatch.setattr(heldout_law, name, never)
    monkeypatch.setattr(bx, "train_drafter", never)
    args.resume = True
    again = bx.run(args)
    assert again["rows"] == result["rows"]
