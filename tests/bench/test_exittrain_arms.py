"""The ExitTrain experiment's grid, comparisons and verdict on synthetic per-anchor block lengths.

Training and measuring run on the real target in the slow test below and in ``make bench-exittrain``.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from exittrain.bench import exittrain_arms as bx
from exittrain.bench.exittrain_grid import ARMS, Arm
from exittrain.bench.exittrain_report import SEQUENCE, replicate_verdicts, to_markdown, vllm_verdict
from exittrain.report.experiment_page import uncorrected


def test_every_exittrain_arm_has_its_matched_control_in_the_grid():
    names = [a.name for a in ARMS]
    assert len(set(names)) == len(names)
    for arm in ARMS:
        if arm.stage == "exittrain":
            assert arm.control in names, f"{arm.name} has no matched control"
            control = next(a for a in ARMS if a.name == arm.control)
            assert (control.labels, control.rows) == (arm.labels, arm.rows)
            assert arm.module_args()["lambda_exit"] == arm.lambda_exit > 0
        else:
            assert "lambda_exit" not in arm.module_args()
    hard = Arm("hard", lambda_exit=0.1)
    assert hard.module_args()["soft_label_weight"] == 0.0 and hard.name == "exittrain-hard-flow-l0.1-fresh"
    assert Arm(budget_train=32, lambda_exit=1.0).name.endswith("-B32-fresh")


def test_the_chain_arm_trains_on_its_shape_against_the_same_control():
    chain = next(a for a in ARMS if a.tree_shape == "chain")
    assert chain.name == "exittrain-soft-flow-l1-chain-fresh"
    assert chain.control == "control-soft-fresh"
    # the shape is passed whatever tree.shape says, for both shapes; the chain keeps budget_train (min(B, K) nodes)
    assert chain.module_args()["tree_shape"] == "chain" and chain.module_args()["budget"] == 16
    tree = Arm("soft", lambda_exit=1.0)
    assert tree.name == "exittrain-soft-flow-l1-fresh" and tree.module_args()["tree_shape"] == "ddtree"
    assert Arm().module_args()["tree_shape"] == "ddtree"  # the control: passed, unused (no node loss)
    # the chain's size is K, not the budget: no -B suffix at any budget
    assert Arm(lambda_exit=1.0, budget_train=32, tree_shape="chain").name == "exittrain-soft-flow-l1-chain-fresh"
    with pytest.raises(ValueError, match="ddtree"):
        Arm(lambda_exit=1.0, tree_shape="tree")


def test_the_node_only_arm_drops_block_ce_and_pairs_with_the_soft_control():
    node = next(a for a in ARMS if a.lambda_tok == 0)
    assert node.name == "nodeonly-flow-l1-fresh" and node.control == "control-soft-fresh"
    args = node.module_args()
    assert args["lambda_tok"] == 0.0 and args["lambda_exit"] == 1.0 and node.stage == "exittrain"
    assert Arm(lambda_exit=1.0).module_args()["lambda_tok"] == 1.0  # ExitTrain keeps its block CE
    assert bx.matched_control("nodeonly-flow-l1-fresh@seed2") == "control-soft-fresh@seed2"
    with pytest.raises(ValueError, match="lambda_tok"):
        Arm(lambda_tok=0.0)  # neither loss


def test_fresh_rows_leave_out_the_warm_starts_whole_sample():
    args = bx.parse_args(["--seed", "3", "--fresh-prompts", "240"])
    assert bx.fresh_overrides(args, 720) == ["data.seed=4", "data.exclude_seed=3", "data.exclude_size=720",
                                             "data.max_train_prompts=240"]
    with pytest.raises(ValueError, match="max_train_prompts is null"):
        bx.fresh_overrides(args, None)


@pytest.mark.real_model
def test_heldout_prompts_follow_the_configs_evaluation_sources(tmp_path):
    """The bench measures on the prompts fit evaluates: an override of data.eval_sources moves them (its
    equals leave the training sample), and asking for more than the list holds names the list."""
    from exittrain.data import chat_prompt_ids
    from exittrain.models import load_target

    target = load_target(None)
    args = bx.parse_args(["--domain", "dialogue", "--skip", "2", "--prompts", "3", "--out", str(tmp_path)])
    default = bx.heldout_prompts(args, target)
    args.override = ["data.eval_sources=['pkg:ifbench?limit=8&seed=5']"]
    moved = bx.heldout_prompts(args, target)
    assert len(default) == len(moved) == 3 and default != moved
    from exittrain.data import load_domain

    ifbench = load_domain("dialogue", train=["pkg:sharegpt_dummy"], eval=["pkg:ifbench?limit=8&seed=5"]).eval
    assert moved == [chat_prompt_ids(target.tokenizer, t) for t in ifbench[2:5]]
    assert bx.measure_settings(args)["eval_sources"] == ["pkg:ifbench?limit=8&seed=5"]  # keys the measured cache
    args.skip, args.override = 78, []
    assert bx.measure_settings(args) == {k: getattr(args, k) for k in bx.MEASURE_SETTINGS}  # the key caches had
    with pytest.raises(ValueError, match=r"pkg:mt_bench\) are 80; lower --skip"):
        bx.heldout_prompts(args, target)


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
    assert len(uncorrected(rows)) == 1 and "beats control-soft-fresh" in uncorrected(rows)[0]
    # a null arm (no shift, real noise) has an interval across 0: no verdict line
    assert uncorrected(bx.compare(_measured(shift=0.0, noise=0.3), "warm start")) == []
    losing = uncorrected(bx.compare(_measured(shift=-0.2, noise=0.05), "warm start"))
    assert len(losing) == 1 and "loses to" in losing[0] and "negligible" not in losing[0]
    # a consistent but tiny shift excludes 0 and is called what it is
    tiny = uncorrected(bx.compare(_measured(shift=0.001, noise=0.0), "warm start"))
    assert len(tiny) == 1 and "beats" in tiny[0] and "negligible" in tiny[0]


def _chain_measured(shift: float, prompts: int = 12, anchors: int = 20) -> dict:
    """Chain entries at T = 0 and 0.6 (the chain arm adds ``shift`` over the control) beside one tree entry."""
    g = torch.Generator().manual_seed(1)
    out = {"per_row": {}, "oracle": {"16/0.6": [torch.full((anchors,), 5.0) for _ in range(prompts)]}, "K": 7}
    base = {key: [1.0 + torch.rand(anchors, generator=g) for _ in range(prompts)]
            for key in ("chain/0", "chain/0.6", "16/0.6")}
    out["per_row"]["warm start"] = base
    out["per_row"]["control-soft-fresh"] = {k: [v + 0.05 for v in vs] for k, vs in base.items()}
    out["per_row"]["exittrain-soft-flow-l1-chain-fresh"] = {
        k: [v + 0.05 + (shift if k.startswith("chain") else 0.0) + 0.01 * torch.randn(anchors, generator=g)
            for v in vs] for k, vs in base.items()}
    return out


def test_compare_pairs_the_chain_with_its_control_at_every_temperature():
    rows = bx.compare(_chain_measured(shift=0.3), "warm start")
    chain = [r for r in rows if r["shape"] == "chain"]
    assert len(chain) == 3 * 2 and {r["budget"] for r in chain} == {7}  # 3 drafters x T = 0, 0.6; budget = K
    arm = {r["temperature"]: r for r in chain if r["drafter"] == "exittrain-soft-flow-l1-chain-fresh"}
    assert set(arm) == {0.0, 0.6}
    for r in arm.values():
        assert r["control"] == "control-soft-fresh"
        assert r["vs_control"]["delta"] == pytest.approx(0.3, abs=0.02)
        assert r["vs_warm_start"]["delta"] == pytest.approx(0.35, abs=0.02)
        assert "tau_oracle" not in r and "efficiency" not in r  # the oracle bounds trees only
    tree = next(r for r in rows if r["drafter"] == "exittrain-soft-flow-l1-chain-fresh" and r["shape"] == "ddtree")
    assert tree["budget"] == 16 and tree["tau_oracle"] == 5.0
    lines = uncorrected(rows)  # the chain beats its control at T = 0 and 0.6; the tree entry does not move
    assert len(lines) == 2 and all("on the chain of K = 7" in line and "beats control-soft-fresh" in line
                                   for line in lines)
    assert any("at T = 0:" in line for line in lines) and any("at T = 0.6:" in line for line in lines)
    md = to_markdown({"domain": "code", "warm_start": "W", "steps": 3, "prompts": 12, "skip": 16,
                         "max_new_tokens": 8, "analytic_anchors": 20, "rows": rows, "train": {}})
    table = [line for line in md.splitlines() if line.startswith(("| warm start", "| control-", "| exittrain-"))]
    shapes = ["chain K=7" in line for line in table]
    assert shapes == sorted(shapes) and sum(shapes) == 6  # the chain rows together, after the trees
    # a control measured without the chain (--no-chain, cached): the arm's chain rows stand unpaired
    partial = _chain_measured(shift=0.3)
    partial["per_row"]["control-soft-fresh"] = {"16/0.6": partial["per_row"]["control-soft-fresh"]["16/0.6"]}
    unpaired = [r for r in bx.compare(partial, "warm start") if r["drafter"] == "exittrain-soft-flow-l1-chain-fresh"]
    assert [(r["shape"], r["vs_control"] is None) for r in unpaired] == [("chain", True), ("chain", True),
                                                                         ("ddtree", False)]
    with pytest.raises(ValueError, match="'K'"):
        bx.compare({k: v for k, v in _chain_measured(shift=0.3).items() if k != "K"}, "warm start")


def _replicates(shifts: dict[int, float], control_noise: float, prompts: int = 12, anchors: int = 20) -> dict:
    """Per training seed: a control (its seed's training noise: a constant offset of ``control_noise`` x
    the seed's index) and the ExitTrain arm ``shifts[seed]`` above its own control, at B = 16, T = 0.6."""
    g = torch.Generator().manual_seed(2)
    key = "16/0.6"
    base = [1.0 + torch.rand(anchors, generator=g) for _ in range(prompts)]
    per_row = {"warm start": {key: base}}
    for i, (seed, shift) in enumerate(sorted(shifts.items())):
        control = [b + control_noise * i + 0.01 * torch.randn(anchors, generator=g) for b in base]
        per_row[f"control-soft-fresh@seed{seed}"] = {key: control}
        per_row[f"exittrain-soft-flow-l1-fresh@seed{seed}"] = {key: [c + shift for c in control]}
    return {"per_row": per_row, "oracle": {}}


def test_replicates_pair_within_a_seed_and_the_controls_give_the_noise_floor():
    from exittrain.bench.exittrain_grid import replicate, split_replicate

    assert split_replicate(replicate("control-soft-fresh", 3)) == ("control-soft-fresh", 3)
    assert split_replicate("control-soft-fresh") == ("control-soft-fresh", None) == \
        split_replicate(replicate("control-soft-fresh", None))
    assert bx.matched_control("exittrain-soft-flow-l1-fresh@seed1") == "control-soft-fresh@seed1"
    assert bx.matched_control("exittrain-soft-flow-l1-fresh") == "control-soft-fresh"
    assert bx.matched_control("control-soft-fresh@seed1") is None and bx.matched_control("warm start") is None

    measured = _replicates({0: 0.05, 1: 0.06, 2: 0.04}, control_noise=0.01)
    rows = bx.compare(measured, "warm start")
    arm = {r["drafter"]: r for r in rows if r["drafter"].startswith("exittrain-")}
    assert {r["control"] for r in arm.values()} == {f"control-soft-fresh@seed{s}" for s in (0, 1, 2)}
    assert arm["exittrain-soft-flow-l1-fresh@seed1"]["vs_control"]["delta"] == pytest.approx(0.06, abs=1e-5)
    floor = bx.noise_floor(measured)
    (entry,) = floor.values()
    assert [p["seeds"] for p in entry["pairs"]] == [[0, 1], [0, 2], [1, 2]]
    assert entry["spread"] == pytest.approx(0.02, abs=0.005)  # seeds 0 and 2 part by 2 x 0.01
    (v,) = replicate_verdicts(rows, floor)
    assert v["seeds"] == [0, 1, 2] and v["mean"] == pytest.approx(0.05, abs=1e-5)
    assert v["noise_floor"] == entry["spread"] and v["verdict"] == "confirmed"  # 0.05 >= 0.02 and >= 2 x 0.02
    # the same gains under a larger training noise: inside twice the floor, so not confirmed
    noisy = _replicates({0: 0.05, 1: 0.06, 2: 0.04}, control_noise=0.02)
    (v,) = replicate_verdicts(bx.compare(noisy, "warm start"), bx.noise_floor(noisy))
    assert v["verdict"] == "inconclusive"
    # one seed at -0.03 refutes, whatever the mean; a mean under 0.01 refutes
    for shifts in ({0: 0.10, 1: 0.10, 2: -0.03}, {0: 0.005, 1: 0.01, 2: 0.0}):
        m = _replicates(shifts, control_noise=0.0)
        (v,) = replicate_verdicts(bx.compare(m, "warm start"), bx.noise_floor(m))
        assert v["verdict"] == "refuted", shifts
    # one replicate: no floor, so never confirmed
    single = _replicates({0: 0.5}, control_noise=0.0)
    assert bx.noise_floor(single) == {}
    (v,) = replicate_verdicts(bx.compare(single, "warm start"), {})
    assert v["noise_floor"] is None and v["verdict"] == "inconclusive"
    md = to_markdown({"domain": "code", "warm_start": "W", "steps": 3, "prompts": 12, "skip": 16,
                         "max_new_tokens": 8, "analytic_anchors": 20, "rows": rows, "train": {},
                         "train_seeds": [0, 1, 2], "replicates": replicate_verdicts(rows, floor)})
    assert "Replicates (training seeds [0, 1, 2])" in md and "| confirmed |" in md


def _verdict(T: float, word: str, shape: str = "ddtree", budget: int = 16, arm: str = "A") -> dict:
    return {"drafter": arm, "shape": shape, "budget": budget, "temperature": T, "verdict": word}


def test_the_fixed_sequence_tests_a_secondary_only_after_every_one_before_it_was_confirmed():
    from exittrain.bench.exittrain_report import _gatekeep

    assert SEQUENCE[0] == ("ddtree", 16, 0.6)  # the protocol's primary
    # the primary inconclusive: every secondary is descriptive, whatever the rule says of it
    vs = [_verdict(0.6, "inconclusive"), _verdict(0.0, "confirmed"), _verdict(0.6, "refuted", budget=64)]
    _gatekeep(vs)
    assert [(v["role"], v["reading"]) for v in vs] == [
        ("primary", "inconclusive"), ("secondary 1", "descriptive"), ("secondary 3", "descriptive")]
    # the primary and T = 0 confirmed: T = 1 is tested (refuted) and the sequence ends there
    vs = [_verdict(0.6, "confirmed"), _verdict(0.0, "confirmed"), _verdict(1.0, "refuted"),
          _verdict(0.6, "confirmed", budget=64), _verdict(0.6, "confirmed", shape="chain", budget=7),
          _verdict(0.0, "confirmed", budget=64)]
    _gatekeep(vs)
    assert [v["reading"] for v in vs] == ["confirmed", "confirmed", "refuted", "descriptive", "descriptive",
                                          "descriptive"]
    assert vs[4]["role"] == "secondary 4" and vs[5]["role"] is None  # B = 64, T = 0 is not in the sequence
    # a setting the run did not measure ends the sequence for what follows; each arm has its own
    vs = [_verdict(0.6, "confirmed"), _verdict(1.0, "confirmed"), _verdict(0.6, "confirmed", arm="B"),
          _verdict(0.0, "confirmed", arm="B")]
    _gatekeep(vs)
    assert [v["reading"] for v in vs] == ["confirmed", "descriptive", "confirmed", "confirmed"]


def test_the_report_states_the_verdict_and_plots(tmp_path):
    rows = bx.compare(_measured(shift=0.0, noise=0.3), "warm start")
    result = {"domain": "code", "warm_start": "W", "steps": 3, "prompts": 12, "skip": 16, "max_new_tokens": 8,
              "analytic_anchors": 20, "rows": rows,
              "train": {"control-soft-fresh": {"train_s": 3.0, "s_per_step": 1.0}}}
    md = to_markdown(result)
    assert "none: no ExitTrain setting" in md and "control-soft-fresh" in md
    bx.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    chain_rows = bx.compare(_chain_measured(shift=0.3), "warm start")
    bx.plot({**result, "rows": chain_rows}, tmp_path / "c.png")  # a panel per (B, T) of the tree, per T of the chain
    assert (tmp_path / "c.png").stat().st_size > 1000


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
    assert bx.parse_args([]).chain is True and bx.parse_args(["--no-chain"]).chain is False


def test_vllm_pairs_each_arm_with_its_control_and_the_warm_start_on_the_same_prompts(tmp_path, monkeypatch, capsys):
    """vLLM's per-prompt counts (vLLM itself runs in tests/bench/test_vllm_acceptance.py): each arm is
    paired with its matched control and the warm start; an interval off 0 joins the verdict."""
    import exittrain.bench.vllm_acceptance as va

    chain = "exittrain-soft-flow-l1-chain-fresh"
    counts = {"warm start": [(10, 5), (10, 8), (10, 2)], "control-soft-fresh": [(10, 6), (10, 8), (10, 3)],
              chain: [(10, 9), (10, 12), (10, 6)]}  # (drafts, accepted) per prompt: the chain +0.33 on each

    def fake_measure(python, target_dir, folders, prompts, **kw):
        assert list(folders) == list(counts) and len(prompts) == 3
        return {"vllm_version": "0.32.0", "drafters": {name: {
            "tau": 0.0, "ci95": [0.0, 0.0], "vs_first": None, "K": 7, "lossless": True,
            "per_prompt": [{"drafts": d, "accepted_tokens": a} for d, a in counts[name]]} for name in folders}}

    monkeypatch.setattr(va, "measure_vllm", fake_measure)
    monkeypatch.setattr(va, "dflash_folder", lambda path, label, work, target: path)
    monkeypatch.setattr(bx, "heldout_prompts", lambda args, target: [[1], [2], [3], [4]])
    monkeypatch.setattr("exittrain.heldout.serving_track.target_folder", lambda target, name: "T")
    args = bx.parse_args(["--out", str(tmp_path), "--vllm-prompts", "3"])
    args.vllm_python = "python"
    vllm = bx.measure_in_vllm(args, None, {name: tmp_path / name for name in counts}, "warm start")
    per = vllm["drafters"]
    assert per["warm start"]["vs_warm_start"] is None and per["warm start"]["vs_control"] is None
    assert per[chain]["control"] == "control-soft-fresh"
    assert per[chain]["vs_control"]["delta"] == pytest.approx(1.0 / 3.0)  # (27 - 17) / 30 accepted per draft
    assert per[chain]["vs_warm_start"]["delta"] == pytest.approx(0.4)
    lines = vllm_verdict(vllm)
    assert lines == [f"{chain} beats control-soft-fresh in vLLM's measured acceptance length: +0.3333 "
                     f"({per[chain]['vs_control']['ci95'][0]:+.4f} to {per[chain]['vs_control']['ci95'][1]:+.4f})"]
    assert per[chain]["vs_control"]["ci95"][0] > 0  # every prompt gains: the interval excludes 0
    result = {"domain": "code", "warm_start": "W", "steps": 3, "prompts": 3, "skip": 16, "max_new_tokens": 8,
              "analytic_anchors": 2, "rows": [], "train": {}, "vllm": vllm}
    md = to_markdown(result)
    assert "vLLM 0.32.0's own acceptance length" in md and f"- {lines[0]}" in md
    with pytest.raises(SystemExit):
        bx.parse_args(["--train-seeds", "1", "1"])
    with pytest.raises(SystemExit):
        bx.parse_args(["--vllm", "--vllm-python", str(tmp_path / "none")])
    assert "make vllm-setup" in capsys.readouterr().err


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_on_the_embedded_target(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EXITTRAIN_CACHE", str(tmp_path / "cache"))
    args = bx.parse_args([
        "--steps", "2", "--fresh-prompts", "8", "--prompts", "2", "--max-new-tokens", "12",
        "--analytic-anchors", "2", "--budgets", "4", "3", "--budget-anchors", "2", "1", "--oracle-prompts", "1",
        "--temperatures", "0", "1",
        "--arms", "control-soft-fresh", "exittrain-soft-flow-l1-fresh", "exittrain-soft-flow-l1-chain-fresh",
        "--override", "debug=smoke", "--override", "stages.pretrain.max_steps=2", "--out", str(tmp_path / "out"),
    ])
    result = bx.run(args)
    saved = json.loads((tmp_path / "out" / "exittrain.json").read_text())
    assert saved["rows"] == result["rows"] and "verdict" not in saved  # derived from the rows when read
    names = {r["drafter"] for r in saved["rows"]}
    assert names == {"warm start", "control-soft-fresh", "exittrain-soft-flow-l1-fresh",
                     "exittrain-soft-flow-l1-chain-fresh"}
    chain = [r for r in saved["rows"] if r["shape"] == "chain"]
    K = saved["num_draft_tokens"]
    assert {(r["drafter"], r["temperature"]) for r in chain} == {(n, T) for n in names for T in (0.0, 1.0)}
    for r in chain:  # a chain of K nodes: a block of at least the bonus, at most 1 + K; every anchor at T > 0
        assert r["budget"] == K and 1.0 <= r["tau"] <= 1 + K and math.isfinite(r["tau"])
        assert r["temperature"] == 0 or r["anchors"] == 2 * 2
    assert all(r["vs_control"] is not None for r in chain if r["drafter"].startswith("exittrain-"))
    analytic = [r for r in saved["rows"] if r["temperature"] == 1.0 and r["shape"] == "ddtree"]
    for r in analytic:  # a block of a budget-B tree: at least the bonus, at most 1 + B; the oracle bounds it
        assert 1.0 <= r["tau"] <= 1 + r["budget"] and r["efficiency"] <= 1 + 1e-6 and r["oracle_prompts"] == 1
    arm = {r["budget"]: r for r in analytic if r["drafter"] == "exittrain-soft-flow-l1-fresh"}
    assert arm[4]["vs_control"] is not None and arm[4]["anchors"] == 2 * 2 and arm[3]["anchors"] == 2 * 1
    assert os.path.exists(tmp_path / "out" / "exittrain_vs_control.png")
    assert not (tmp_path / "out" / bx.PARTIAL).exists()  # the partial file lives while it runs only
    said = capsys.readouterr().out  # every drafter's measurement says when it starts and ends
    for label in ["T=0: warm start, greedy walks", "T=1 B=4: the oracle on 1 prompts",
                  "T=1 B=3: exittrain-soft-flow-l1-fresh", f"T=1 chain of {K}: control-soft-fresh"]:
        assert f"{label}: measuring" in said and f"{label}: done (" in said, label

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
    for name, trained in result["train"].items():  # each arm's training record comes back with it
        assert again["train"][name] == {**trained, "reused": True}, name


@pytest.mark.slow
def test_a_training_seed_repeats_bit_for_bit_and_two_seeds_differ(tmp_path, monkeypatch):
    """Replicates: the same arm under seeds 0 and 1 trains two different drafters from one warm start, and
    seed 0 again (another run, another folder) trains the same drafter to the bit."""
    from safetensors.torch import load_file

    monkeypatch.setenv("EXITTRAIN_CACHE", str(tmp_path / "cache"))
    common = ["--steps", "3", "--fresh-prompts", "8", "--prompts", "1", "--max-new-tokens", "8",
              "--budgets", "4", "--temperatures", "0", "--no-chain", "--oracle-prompts", "1",
              "--arms", "control-soft-fresh", "--override", "debug=smoke", "--override", "stages.pretrain.max_steps=2"]
    first = bx.run(bx.parse_args([*common, "--train-seeds", "0", "1", "--out", str(tmp_path / "a")]))
    assert set(first["train"]) == {"control-soft-fresh@seed0", "control-soft-fresh@seed1"}
    assert [first["train"][n]["train_seed"] for n in sorted(first["train"])] == [0, 1]
    warm = tmp_path / "a" / "warm_start"
    bx.run(bx.parse_args([*common, "--train-seeds", "0", "--warm-start", str(warm), "--out", str(tmp_path / "b")]))

    def weights(folder):
        (path,) = (tmp_path / folder).glob("*.safetensors")
        return load_file(path)

    seed0, seed1, again = (weights(f) for f in ("a/control-soft-fresh@seed0", "a/control-soft-fresh@seed1",
                                                  "b/control-soft-fresh@seed0"))
    assert seed0.keys() == again.keys() and all(torch.equal(seed0[k], again[k]) for k in seed0)
    assert any(not torch.equal(seed0[k], seed1[k]) for k in seed0)
