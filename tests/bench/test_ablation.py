"""The ablation bench's reporting on synthetic arms: ratios, best weight type, markdown, PNGs, permutation test.

The training and decoding parts run on the real target in ``make bench-ablation-quick``; here the
pieces that turn results into claims are checked against numbers known in advance.
"""

from __future__ import annotations

import json
import random

import pytest

from exittrain.bench import ablation as ab
from exittrain.bench import ablation_report
from exittrain.heldout.decode_eval import summarize
from exittrain.report.plots import plot_grouped_bars
from tests.report.helpers import assert_png, prompt_rows, tree_example_dict

ARM_MEANS = {"baseline": 1.6, "control": 1.7, "exittrain-flow": 2.2, "exittrain-exit": 1.9, "exittrain-missing": 1.8}


def _domain(name: str, seed: int) -> dict:
    arms = {}
    for i, (arm, mean) in enumerate(ARM_MEANS.items()):
        rows = prompt_rows(arm, mean, budgets=(32, 64), temperatures=(0.0, 1.0), prompts=4, seed=seed + i)
        table = summarize(rows)
        for r in table:
            r["analytic_tau"] = r["tau"] + 0.1
        arms[arm] = {
            "table": table,
            "analytic": {"32": {"tau": mean, "exit_mass": [0.5, 0.3, 0.2]},
                         "64": {"tau": mean + 0.1, "exit_mass": [0.4, 0.35, 0.25]}},
            "block_lengths": {f"{r['budget']}/{r['temperature']:g}": [x for row in rows if row["budget"] == r["budget"]
                              and row["temperature"] == r["temperature"] for x in row["block_lengths"]]
                              for r in table},
        }
    for arm in arms.values():
        for r, c in zip(arm["table"], arms["control"]["table"]):
            r["tau_vs_control"] = r["tau"] / c["tau"]
            r["analytic_vs_control"] = r["analytic_tau"] / c["analytic_tau"]
    return {"domain": name, "train_rows": 100, "held_out_rows": 4, "prompts": 4, "arms": arms, "oracle": {},
            "timings": {}}


@pytest.fixture(scope="module")
def result():
    settings = ab.Settings(domains=("code", "math"))
    domains = [_domain("code", 0), _domain("math", 10)]
    verifiers = []
    for name, ms in (("tev", 2.0), ("predraw", 3.0), ("sequential", 2.5)):
        verifiers.append({"budget": 64, "temperature": 1.0, "verifier": name, "rounds": 30, "tau": 1.8,
                          "verify_ms_mean": ms, "verify_ms_median": ms, "round_ms_mean": 200.0,
                          "verify_vs_sequential": ms / 2.5, "p_same_mean_as_sequential": 0.7,
                          "block_lengths": [1, 2, 2, 3] * 5})
    return {"settings": ab.asdict(settings), "threads": 2, "domains": domains, "verifiers": verifiers,
            "verifier_domain": "code", "summary": ablation_report.summary(domains, settings), "seconds": 60.0}


def test_summary_averages_ratios_over_domains_and_picks_the_best_weight_type(result):
    sm = result["summary"]
    assert sm["best_weight_type"] == "exittrain-flow"
    overall = sm["overall_tau_vs_control"]
    assert overall["control"] == pytest.approx(1.0)
    # each cell is the mean over the two domains of tau(arm) / tau(control) at that (B, T)
    cell = "B=64 T=1"
    expected = sum(
        next(r["tau_vs_control"] for r in d["arms"]["exittrain-flow"]["table"]
             if r["budget"] == 64 and r["temperature"] == 1.0)
        for d in result["domains"]
    ) / 2
    assert sm["mean_tau_vs_control"]["exittrain-flow"][cell] == pytest.approx(expected)
    # the synthetic arms' means are ordered flow > exit > missing > control (block lengths clipped to 1..4)
    assert overall["exittrain-flow"] > overall["exittrain-exit"] > overall["control"]
    assert sm["goal_met"] is (overall["exittrain-flow"] >= 1.13)
    # analytic: per domain and budget, the arm's held-out sum P over the control's, then the mean
    assert sm["analytic_vs_control"]["exittrain-flow"] == pytest.approx((2.2 / 1.7 + 2.3 / 1.8) / 2)
    assert sm["analytic_vs_control"]["control"] == pytest.approx(1.0)


def test_markdown_holds_every_arm_domain_and_the_verdict(result):
    md = ablation_report.to_markdown(result)
    for arm in ARM_MEANS:
        assert f"| {arm} | 64 | 1 |" in md
    assert "### code" in md and "### math" in md
    assert "Best weight type: **exittrain-flow**" in md
    assert "| 64 | 1 | tev | 30 | 1.80 | 2.00 |" in md
    assert "p = 0.70" in md


def test_plots_are_written(result, tmp_path):
    trees = {"code": tree_example_dict()}
    paths = ablation_report.make_plots(result, tmp_path, trees)
    names = {p.rsplit("/", 1)[-1] for p in paths}
    assert {"code_tau_vs_budget.png", "code_block_lengths.png", "code_exit_mass.png", "code_draft_tree.png",
            "math_tau_vs_budget.png", "tau_vs_control.png", "verifier_ms.png", "verifier_block_lengths.png"} <= names
    for p in paths:
        assert_png(tmp_path / p.rsplit("/", 1)[-1], min_bytes=3000)


def test_grouped_bars_reject_nothing_to_plot(tmp_path):
    with pytest.raises(ValueError, match="no values"):
        plot_grouped_bars({"a": {}}, tmp_path / "x.png", title="t", ylabel="y")
    out = plot_grouped_bars({"a": {"s": 1.0, "t": 2.0}, "b": {"s": 1.5}}, tmp_path / "ok.png", title="t", ylabel="y",
                            reference=1.0, errors={"a": {"s": (0.9, 1.1)}})
    assert_png(out, min_bytes=3000)


def test_permutation_p_value_separates_equal_from_shifted_samples():
    rng = random.Random(0)
    a = [rng.choice([1, 2, 2, 3]) for _ in range(200)]
    b = [rng.choice([1, 2, 2, 3]) for _ in range(200)]
    shifted = [x + 1 for x in b]
    assert ab.permutation_p_value(a, b, resamples=2000) > 0.05
    assert ab.permutation_p_value(a, shifted, resamples=2000) < 0.001
    with pytest.raises(ValueError, match="non-empty"):
        ab.permutation_p_value([], b)


def test_finished_domains_survive_a_crash_in_a_later_one(monkeypatch, tmp_path):
    """``run`` writes ``ablation_partial.json`` after every domain, so a kill in the math domain
    keeps the code domain's tables (the final ``ablation.json`` is written only at the end)."""
    done = _domain("code", 0)
    del done["arms"]["exittrain-flow"]  # no drafter folder to load for the tree and verifier parts

    def fake_run_domain(domain, settings, out, target=None):
        if domain == "math":
            raise RuntimeError("killed while training math")
        return done, "target", [[1, 2, 3]]

    monkeypatch.setattr(ab, "run_domain", fake_run_domain)
    with pytest.raises(RuntimeError, match="killed while training math"):
        ab.run(ab.Settings(domains=("code", "math")), tmp_path)
    partial = json.loads((tmp_path / "ablation_partial.json").read_text())
    assert [d["domain"] for d in partial["domains"]] == ["code"]
    saved, want = partial["domains"][0]["arms"]["control"]["table"], done["arms"]["control"]["table"]
    assert [(r["budget"], r["temperature"], r["tau"]) for r in saved] == [
        (r["budget"], r["temperature"], r["tau"]) for r in want
    ]
    assert partial["settings"]["domains"] == ["code", "math"]


def test_stage_args_are_module_arguments_of_the_shipped_config(tmp_path):
    """The warm start and arm arguments the bench derives from `fit +recipe=code` pass the module's
    own check: stage keys such as ``stages.exittrain.eval_every`` are not module arguments."""
    from omegaconf import OmegaConf

    from exittrain.lit.module import check_module_args

    cfg = ab.compose_fit_config("code", tmp_path)
    assert "eval_every" in cfg.stages.exittrain  # the key the bench must leave out
    objective = {k: v for k, v in OmegaConf.to_container(cfg.objective, resolve=True).items() if not k.startswith("_")}
    pre, arms = ab.stage_args(cfg, ab.Settings())
    assert "eval_every" not in arms and pre["analytic_every"] == 0
    assert arms["anchors_per_seq"] == ab.Settings().arm_anchors
    check_module_args(**{**objective, **pre, "stage": "pretrain"})
    for stage in ("pretrain", "exittrain"):  # the control trains the pretrain stage with the arms' arguments
        check_module_args(**{**objective, **arms, "stage": stage})


class HeldOut:
    """What analytic_tau reads of a DataModule: its validation batches."""

    def __init__(self, batches):
        self.batches = batches

    def val_dataloader(self):
        return self.batches


def test_analytic_tau_calls_the_objective_and_agrees_with_the_module(tmp_path, tiny_llama_target, one_thread):
    """The analytic tau without a LightningModule equals the anchor-weighted means of the module's own losses."""
    import dataclasses

    import torch

    from exittrain.core import anchor_generator
    from exittrain.lit import ExitTrainModule
    from exittrain.models import new_drafter
    from tests.lit.helpers import batch_of

    target = tiny_llama_target
    cfg = ab.compose_fit_config("code", tmp_path)
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, num_heads=4, seed=0)
    batches = [batch_of(2, seed=1), batch_of(3, seed=2)]
    got = ab.analytic_tau(cfg, drafter, target, HeldOut(batches), [4, 8], anchors=3)
    assert drafter.training, "the drafter's mode is restored"
    objective = dataclasses.asdict(ab.analytic_objective(cfg, 4, 3))
    for budget in (4, 8):
        module = ExitTrainModule(drafter, target, **{**objective, "budget": budget})
        drafter.eval()
        sums, n_total = {"analytic_block_length": 0.0, "coverage": 0.0, "acc_d1": 0.0}, 0
        with torch.no_grad():
            for i, batch in enumerate(batches):
                values, _ = module.compute_losses(batch, anchor_generator(cfg.seed, i, 0, stream=1), exit_loss=False,
                                                  metrics=True)
                n = int(values["anchors"])
                n_total += n
                for k in sums:
                    sums[k] += n * float(values[k])
        drafter.train()
        assert got[budget]["anchors"] == n_total > 0
        assert got[budget]["tau"] == pytest.approx(sums["analytic_block_length"] / n_total, rel=1e-6)
        assert got[budget]["coverage"] == pytest.approx(sums["coverage"] / n_total, rel=1e-6)
        assert got[budget]["acc"][0] == pytest.approx(sums["acc_d1"] / n_total, rel=1e-6)
        assert len(got[budget]["exit_mass"]) == 4 and sum(got[budget]["exit_mass"]) == pytest.approx(1.0, abs=1e-5)
    assert got[8]["tau"] >= got[4]["tau"] - 1e-6  # a larger tree holds at least the smaller one's mass
    with pytest.raises(ValueError, match="val_fraction"):
        ab.analytic_tau(cfg, drafter, target, HeldOut([]), [4], anchors=3)
