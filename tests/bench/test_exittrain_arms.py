"""The ExitTrain experiment's grid, its pooled comparisons and verdict on synthetic evaluator rows.

Training and measuring run on the real target in the slow tests below and in ``make bench-exittrain``.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from omegaconf import OmegaConf

from exittrain.bench import exittrain_arms as bx
from exittrain.bench.exittrain_grid import ARMS, Arm, split_replicate
from exittrain.bench.exittrain_report import SEQUENCE, replicate_verdicts, to_markdown, vllm_verdict
from exittrain.core import pooled
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


def _measurement(settings: dict[tuple, list[list[int]]], K: int = 7, oracle: list[list[int]] | None = None) -> dict:
    """One drafter's measurement as :func:`bx.measure` keeps it: the evaluator's per-prompt rows of
    ``settings`` (``{(shape, budget, T): one block-length list per prompt}``), tree rows and chain rows."""
    rows, chain = [], []
    for (shape, budget, T), blocks in settings.items():
        for i, b in enumerate(blocks):
            row = {"label": "-", "prompt_index": i, "budget": budget, "temperature": T, "block_lengths": list(b),
                   "rounds": len(b), "tau": sum(b) / len(b), "new_tokens": sum(b), "decoded": i == 0}
            if oracle is not None and shape == "ddtree":
                row["oracle_block_lengths"] = oracle[i]
            (chain if shape == "chain" else rows).append(row)
    return {"table": [], "rows": rows, "chain": chain, "num_draft_tokens": K}


def _blocks(prompts: int = 12, rounds: int = 20, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 6, (prompts, rounds), generator=g).tolist()


def _bump(blocks: list[list[int]], n: int, by: int = 1) -> list[list[int]]:
    """``by`` more tokens in each of a prompt's first ``n`` rounds: pooled tau + n x by / rounds a prompt."""
    return [[v + by * (j < n) for j, v in enumerate(b)] for b in blocks]


def _noisy(blocks: list[list[int]], seed: int) -> list[list[int]]:
    """One token more or less in each round at random: no shift, real noise."""
    g = torch.Generator().manual_seed(seed)
    return [[v + int(d) for v, d in zip(b, torch.randint(-1, 2, (len(b),), generator=g).tolist())] for b in blocks]


def _three(arm_blocks, key=("ddtree", 16, 1.0), oracle=None, rounds: int = 20) -> dict:
    """The warm start, the control (one token more per prompt than the warm start) and one ExitTrain arm."""
    base = _blocks(rounds=rounds)
    control = _bump(base, 1)
    return {"warm start": _measurement({key: base}, oracle=oracle),
            "control-soft-fresh": _measurement({key: control}, oracle=oracle),
            "exittrain-soft-flow-l1-fresh": _measurement({key: arm_blocks(control)}, oracle=oracle)}


def test_tau_is_pooled_over_rounds_not_a_mean_of_prompts_or_positions():
    """A prompt of ten 1-token rounds and one of two 5-token rounds: 20 tokens in 12 rounds. The mean of the
    prompts' taus (3.0) or of the positions would overstate what a decode reports (20 / 12)."""
    measured = {"warm start": _measurement({("ddtree", 4, 0.0): [[1] * 10, [5, 5]]})}
    (row,) = bx.compare(measured)
    assert row["tau"] == pytest.approx(20 / 12) and row["rounds"] == 12 and row["prompts"] == 2
    assert row["vs_warm_start"] is None and row["vs_control"] is None


def test_compare_pairs_each_arm_with_its_control_and_the_verdict_reads_the_interval():
    oracle = [[5] * 20 for _ in range(12)]
    rows = bx.compare(_three(lambda c: _bump(c, 4), oracle=oracle))
    arm = next(r for r in rows if r["drafter"] == "exittrain-soft-flow-l1-fresh")
    assert arm["control"] == "control-soft-fresh"
    assert arm["vs_control"]["delta"] == pytest.approx(4 / 20)  # pooled: 4 more tokens in 20 rounds a prompt
    assert arm["vs_warm_start"]["delta"] == pytest.approx(5 / 20)
    assert arm["vs_control"]["prompts"] == 12 and arm["vs_control"]["ci95"][0] > 0
    assert arm["tau_oracle"] == 5.0 and arm["efficiency"] == pytest.approx(arm["tau"] / 5.0)
    assert [r["vs_control"] for r in rows if r["drafter"] != "exittrain-soft-flow-l1-fresh"] == [None, None]
    assert len(uncorrected(rows)) == 1 and "beats control-soft-fresh" in uncorrected(rows)[0]
    # a null arm (no shift, real noise) has an interval across 0: no verdict line
    assert uncorrected(bx.compare(_three(lambda c: _noisy(c, 3)))) == []
    losing = uncorrected(bx.compare(_three(lambda c: _bump(c, 4, by=-1))))
    assert len(losing) == 1 and "loses to" in losing[0] and "negligible" not in losing[0]
    # a consistent but tiny shift excludes 0 and is called what it is: one token more in 250 rounds a prompt
    tiny = uncorrected(bx.compare(_three(lambda c: _bump(c, 1), rounds=250)))
    assert len(tiny) == 1 and "beats" in tiny[0] and "negligible" in tiny[0]
    # prompts measured elsewhere (another prompt set) are not paired
    other = _three(lambda c: _bump(c, 4))
    other["control-soft-fresh"]["rows"] = other["control-soft-fresh"]["rows"][:-1]
    arm = next(r for r in bx.compare(other) if r["drafter"] == "exittrain-soft-flow-l1-fresh")
    assert arm["vs_control"] is None and "control" not in arm


def _chain_measured(shift: int) -> dict:
    """Chain entries at T = 0 and 0.6 (the chain arm ``shift`` tokens a prompt over the control) beside one tree."""
    keys = [("chain", 7, 0.0), ("chain", 7, 0.6), ("ddtree", 16, 0.6)]
    base = {key: _blocks(seed=i) for i, key in enumerate(keys)}
    control = {key: _bump(b, 1) for key, b in base.items()}
    arm = {key: _bump(b, shift) if key[0] == "chain" else b for key, b in control.items()}
    oracle = [[5] * 20 for _ in range(12)]
    return {"warm start": _measurement(base, oracle=oracle), "control-soft-fresh": _measurement(control, oracle=oracle),
            "exittrain-soft-flow-l1-chain-fresh": _measurement(arm, oracle=oracle)}


def test_compare_pairs_the_chain_with_its_control_at_every_temperature():
    rows = bx.compare(_chain_measured(shift=6))
    chain = [r for r in rows if r["shape"] == "chain"]
    assert len(chain) == 3 * 2 and {r["budget"] for r in chain} == {7}  # 3 drafters x T = 0, 0.6; budget = K
    arm = {r["temperature"]: r for r in chain if r["drafter"] == "exittrain-soft-flow-l1-chain-fresh"}
    assert set(arm) == {0.0, 0.6}
    for r in arm.values():
        assert r["control"] == "control-soft-fresh"
        assert r["vs_control"]["delta"] == pytest.approx(6 / 20)
        assert r["vs_warm_start"]["delta"] == pytest.approx(7 / 20)
        assert "tau_oracle" not in r and "efficiency" not in r  # the evaluator's oracle: tree rows only here
    tree = next(r for r in rows if r["drafter"] == "exittrain-soft-flow-l1-chain-fresh" and r["shape"] == "ddtree")
    assert tree["budget"] == 16 and tree["tau_oracle"] == 5.0
    lines = uncorrected(rows)  # the chain beats its control at T = 0 and 0.6; the tree entry does not move
    assert len(lines) == 2 and all("on the chain of K = 7" in line and "beats control-soft-fresh" in line
                                   for line in lines)
    assert any("at T = 0:" in line for line in lines) and any("at T = 0.6:" in line for line in lines)
    md = to_markdown({"domain": "code", "warm_start": "W", "steps": 3, "prompts": 12, "skip": 16,
                      "max_new_tokens": 8, "rows": rows, "train": {}})
    assert "| tau (pooled) |" in md and "total tokens / total rounds" in md
    table = [line for line in md.splitlines() if line.startswith(("| warm start", "| control-", "| exittrain-"))]
    shapes = ["chain K=7" in line for line in table]
    assert shapes == sorted(shapes) and sum(shapes) == 6  # the chain rows together, after the trees
    # a control measured without the chain (--no-chain, kept): the arm's chain rows stand unpaired
    partial = _chain_measured(shift=6)
    partial["control-soft-fresh"]["chain"] = []
    unpaired = [r for r in bx.compare(partial) if r["drafter"] == "exittrain-soft-flow-l1-chain-fresh"]
    assert sorted((r["shape"], r["vs_control"] is None) for r in unpaired) == [("chain", True), ("chain", True),
                                                                               ("ddtree", False)]


def _replicates(shifts: dict[int, int], control_noise: int) -> dict:
    """Per training seed: a control (its seed's training noise: ``control_noise`` x the seed's index more
    tokens a prompt) and the ExitTrain arm ``shifts[seed]`` tokens a prompt above its own control, at B = 16,
    T = 0.6 (20 rounds a prompt: a token a prompt is 0.05 of tau)."""
    key = ("ddtree", 16, 0.6)
    base = _blocks(seed=2)
    measured = {"warm start": _measurement({key: base})}
    for i, (seed, shift) in enumerate(sorted(shifts.items())):
        control = _bump(base, control_noise * i)
        measured[f"control-soft-fresh@seed{seed}"] = _measurement({key: control})
        arm = _bump(control, abs(shift), by=1 if shift >= 0 else -1)
        measured[f"exittrain-soft-flow-l1-fresh@seed{seed}"] = _measurement({key: arm})
    return measured


def test_replicates_pair_within_a_seed_and_the_controls_give_the_noise_floor():
    from exittrain.bench.exittrain_grid import replicate, split_replicate

    assert split_replicate(replicate("control-soft-fresh", 3)) == ("control-soft-fresh", 3)
    assert split_replicate("control-soft-fresh") == ("control-soft-fresh", None) == \
        split_replicate(replicate("control-soft-fresh", None))
    assert bx.matched_control("exittrain-soft-flow-l1-fresh@seed1") == "control-soft-fresh@seed1"
    assert bx.matched_control("exittrain-soft-flow-l1-fresh") == "control-soft-fresh"
    assert bx.matched_control("control-soft-fresh@seed1") is None and bx.matched_control("warm start") is None

    measured = _replicates({0: 2, 1: 3, 2: 2}, control_noise=0)  # 0.10, 0.15, 0.10 over identical controls
    rows = bx.compare(measured)
    arm = {r["drafter"]: r for r in rows if r["drafter"].startswith("exittrain-")}
    assert {r["control"] for r in arm.values()} == {f"control-soft-fresh@seed{s}" for s in (0, 1, 2)}
    assert arm["exittrain-soft-flow-l1-fresh@seed1"]["vs_control"]["delta"] == pytest.approx(0.15)
    floor = bx.noise_floor(measured)
    (entry,) = floor.values()
    assert entry["key"] == "16/0.6" and [p["seeds"] for p in entry["pairs"]] == [[0, 1], [0, 2], [1, 2]]
    assert entry["spread"] == 0.0  # identical controls
    (v,) = replicate_verdicts(rows, floor)
    assert v["seeds"] == [0, 1, 2] and v["mean"] == pytest.approx(0.35 / 3)
    assert v["noise_floor"] == 0.0 and v["verdict"] == "confirmed"
    # the same gains under a training noise of a token a prompt per seed (0.05): the floor is 0.10, and a mean
    # of 0.117 is under twice it
    noisy = _replicates({0: 2, 1: 3, 2: 2}, control_noise=1)
    assert bx.noise_floor(noisy)["control-soft-fresh/16/0.6"]["spread"] == pytest.approx(0.10)
    (v,) = replicate_verdicts(bx.compare(noisy), bx.noise_floor(noisy))
    assert v["verdict"] == "inconclusive"
    # a seed below -0.02 refutes, whatever the mean; a mean under 0.01 refutes
    for shifts in ({0: 4, 1: 4, 2: -1}, {0: 0, 1: 0, 2: 0}):  # -1: a token less a prompt
        m = _replicates(shifts, control_noise=0)
        (v,) = replicate_verdicts(bx.compare(m), bx.noise_floor(m))
        assert v["verdict"] == "refuted", shifts
    # one replicate: no floor, so never confirmed
    single = _replicates({0: 10}, control_noise=0)
    assert bx.noise_floor(single) == {}
    (v,) = replicate_verdicts(bx.compare(single), {})
    assert v["noise_floor"] is None and v["verdict"] == "inconclusive"
    md = to_markdown({"domain": "code", "warm_start": "W", "steps": 3, "prompts": 12, "skip": 16,
                      "max_new_tokens": 8, "rows": rows, "train": {},
                      "train_seeds": [0, 1, 2], "replicates": replicate_verdicts(rows, floor)})
    assert "Replicates (training seeds [0, 1, 2])" in md and "| confirmed |" in md


def test_the_crossed_rule_reads_the_registered_contrasts_in_their_fixed_sequences(tmp_path):
    """``--rule crossed``: the 2026-12-07 protocol's contrasts off the replicates' per-prompt rows and vLLM's
    counts. N is 4 tokens a prompt (+0.2 a round) over C everywhere, E is C, S is as good as N: P1 is confirmed
    and its X - S refuted, so the rest of its sequence is descriptive; P2 is refuted at its primary."""
    from exittrain.bench import node_loss_protocol as nlp

    settings = [("ddtree", 16, 0.6), ("ddtree", 16, 0.0), ("chain", 7, 0.0)]
    measured, vllm = {"warm start": _measurement({k: _blocks(seed=9) for k in settings})}, {"drafters": {}}
    shifts = {nlp.C: 0, nlp.E: 0, nlp.N: 4, nlp.S: 4, nlp.C5: 1}
    for seed in (0, 1, 2):
        control = {k: _noisy(_blocks(seed=i), seed) for i, k in enumerate(settings)}
        for arm, shift in shifts.items():
            measured[f"{arm}@seed{seed}"] = _measurement({k: _bump(b, shift) for k, b in control.items()})
            vllm["drafters"][f"{arm}@seed{seed}"] = {"per_prompt": [
                {"drafts": 20, "accepted_tokens": 10 + p % 3 + seed + shift} for p in range(12)]}
    args = bx.parse_args(["--train-seeds", "0", "1", "2", "--out", str(tmp_path)])
    result = bx.result_of(args, tmp_path, measured, {}, {}, vllm, registered=bx.registered_block(args, measured, vllm))
    assert result["rule"] == "crossed" and result["replicates"] == [] and result["protocol"] == nlp.PROTOCOL
    by = {r["label"]: r for r in result["registered"]}
    assert [r["label"] for r in result["registered"]] == [c.label for seq in nlp.sequences(7) for c in seq]
    primary = by["N - C"]
    assert primary["estimate"] == pytest.approx(4 / 20) and primary["seeds"] == [0, 1, 2]
    assert (primary["role"], primary["verdict"], primary["reading"]) == ("primary", "confirmed", "confirmed")
    assert by["N - C, T = 0"]["reading"] == "confirmed"
    assert by["N - S"]["verdict"] == "refuted" == by["N - S"]["reading"]  # the gain is no more than S's
    assert by["N - C5"]["reading"] == "descriptive" == by["N - C, vLLM"]["reading"]
    assert by["N - C, vLLM"]["estimate"] == pytest.approx(4 / 20)  # vLLM's acceptance: 1 + accepted / drafts
    assert by["N - C, vLLM"]["setting"] == {"shape": "vllm", "budget": 7, "temperature": 0.0}
    assert (by["E - C"]["verdict"], by["E - C, T = 0"]["reading"]) == ("refuted", "descriptive")
    assert result["transfer"]["N"] == {"claimed": False, "why": "vLLM's contrast reads descriptive"}
    md = to_markdown({**result, "train": {}, "vllm": None})  # (vLLM's own table needs its whole block)
    assert f"Registered contrasts of {nlp.PROTOCOL}" in md and "| N - S |" in md
    # the 2026-12-05 protocol's rule instead: its replicates, no registered contrasts
    floor_rule = bx.parse_args(["--train-seeds", "0", "1", "2", "--rule", "noise-floor"])
    old = bx.result_of(floor_rule, tmp_path, measured, {}, {},
                       registered=bx.registered_block(floor_rule, measured, None))
    assert old["replicates"] and "registered" not in old


def test_the_registered_contrasts_are_the_protocol_files():
    """node_loss_protocol states the protocol for the code: its arms, margins and order are the file's."""
    from pathlib import Path

    from exittrain.bench import node_loss_protocol as nlp

    text = (Path(__file__).resolve().parents[2] / nlp.PROTOCOL).read_text()
    for tag, name in (("C", nlp.C), ("N", nlp.N), ("E", nlp.E), ("C5", nlp.C5), ("S", nlp.S)):
        assert f"| **{tag}** | `{name}` |" in text, name
    assert "δ is +0.05 tokens a round at T = 0.6 (tree or chain), +0.10 at T = 0, and +0.03 for vLLM's" in text
    assert (nlp.DELTA_T06, nlp.DELTA_T0, nlp.DELTA_VLLM) == (0.05, 0.10, 0.03)
    secondaries = ["1. X - C at T = 0 (tree, B = 16);", "2. X - S at T = 0.6 (tree, B = 16);",
                   "3. X - C5 at T = 0.6 (tree, B = 16);", "4. vLLM's greedy acceptance length, X - C,",
                   "5. the pooled chain tau at K = 7, X - C, at T = 0."]
    assert all(line in text for line in secondaries)
    for seq in nlp.sequences(7):
        (arm,) = {c.arm for c in seq}
        assert [(c.control, c.setting, c.delta) for c in seq] == [
            (nlp.C, ("ddtree", 16, 0.6), 0.05), (nlp.C, ("ddtree", 16, 0.0), 0.10), (nlp.S, ("ddtree", 16, 0.6), 0.05),
            (nlp.C5, ("ddtree", 16, 0.6), 0.05), (nlp.C, ("vllm", 7, 0.0), 0.03), (nlp.C, ("chain", 7, 0.0), 0.10)]
    assert [seq[0].arm for seq in nlp.sequences(7)] == [nlp.N, nlp.E]  # P1, P2


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
    rows = bx.compare(_three(lambda c: _noisy(c, 3)))
    result = {"domain": "code", "warm_start": "W", "steps": 3, "prompts": 12, "skip": 16, "max_new_tokens": 8,
              "rows": rows, "train": {"control-soft-fresh": {"train_s": 3.0, "s_per_step": 1.0}}}
    md = to_markdown(result)
    assert "none: no ExitTrain setting" in md and "control-soft-fresh" in md
    bx.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    chain_rows = bx.compare(_chain_measured(shift=6))
    bx.plot({**result, "rows": chain_rows}, tmp_path / "c.png")  # a panel per (B, T) of the tree, per T of the chain
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_bad_arguments_name_the_option(tmp_path):
    for bad in (["--steps", "0"], ["--warm-start", str(tmp_path)], ["--temperatures", "-1"], ["--budgets", "0"],
                ["--skip", "-1"], ["--max-new-tokens", "0"]):
        with pytest.raises(SystemExit):
            bx.parse_args(bad)
    assert bx.parse_args([]).chain is True and bx.parse_args(["--no-chain"]).chain is False
    assert bx.parse_args([]).oracle is False and bx.parse_args(["--oracle"]).oracle is True


def test_the_cpu_matched_control_trains_the_first_seeds_cpu_ratio_of_steps_decided_once(tmp_path, capsys):
    from argparse import Namespace

    c5 = next(a for a in ARMS if a.cpu_match is not None)
    assert c5.name == "control-soft-fresh-cpumatched" and c5.stage == "pretrain" and c5.control == "control-soft-fresh"
    assert c5.cpu_match in {a.name for a in ARMS}
    args = Namespace(out=str(tmp_path), steps=30, train_seeds=[1, 2])
    info = {"nodeonly-flow-l1-fresh@seed1": {"train_cpu_s": 75.0}, "control-soft-fresh@seed1": {"train_cpu_s": 30.0}}
    first = bx.cpu_matched_steps(args, c5, info)
    assert first["steps"] == 75 and first["ratio"] == 2.5 and first["matches"] == "nodeonly-flow-l1-fresh@seed1"
    # the next seed (another ratio, the host busier) reads the run's record back: the same steps
    later = {"nodeonly-flow-l1-fresh@seed2": {"train_cpu_s": 300.0}, "control-soft-fresh@seed2": {"train_cpu_s": 30.0}}
    assert bx.cpu_matched_steps(args, c5, later) == first
    with pytest.raises(ValueError, match="--steps 30"):  # a record decided for other steps is not reused
        bx.cpu_matched_steps(Namespace(out=str(tmp_path), steps=20, train_seeds=[1]), c5, info)
    other = tmp_path / "other"
    with pytest.raises(ValueError, match="--arms nodeonly-flow-l1-fresh control-soft-fresh"):  # nothing to derive from
        bx.cpu_matched_steps(Namespace(out=str(other), steps=30, train_seeds=None), c5, {})
    cheaper = {"nodeonly-flow-l1-fresh": {"train_cpu_s": 10.0}, "control-soft-fresh": {"train_cpu_s": 30.0}}
    assert bx.cpu_matched_steps(Namespace(out=str(other), steps=30, train_seeds=None), c5, cheaper)["steps"] == 30
    with pytest.raises(SystemExit):  # it cannot run without the two arms it is matched between
        bx.parse_args(["--arms", c5.name, "control-soft-fresh"])
    assert "add nodeonly-flow-l1-fresh to --arms" in capsys.readouterr().err
    with pytest.raises(ValueError, match="only a block-CE control"):
        Arm(lambda_exit=1.0, cpu_match="control-soft-fresh")


def test_the_options_reach_the_evaluator_as_eval_settings(tmp_path):
    """The bench composes one fit config, its options as ``seed`` and ``eval.*`` after ``--override``: the
    evaluator reads them there, checked by eval_settings as fit's are."""
    from exittrain.bench.recipe import compose_fit_config
    from exittrain.settings import eval_settings

    args = bx.parse_args(["--seed", "3", "--budgets", "4", "8", "--temperatures", "0", "0.6", "--max-new-tokens",
                          "12", "--oracle", "--override", "eval.baseline=false"])
    cfg = compose_fit_config("code", tmp_path, [*args.override, *bx.measure_overrides(args)])
    settings = eval_settings(cfg)
    assert settings["budgets"] == [4, 8] and settings["temperatures"] == [0.0, 0.6]
    assert settings["max_new_tokens"] == 12 and settings["oracle"] is True and settings["seed"] == 3
    assert settings["baseline"] is False and cfg.seed == 3  # an --override the bench does not set stays
    fresh = OmegaConf.merge(cfg, OmegaConf.from_dotlist(bx.fresh_overrides(args, 720)))
    assert (fresh.data.seed, fresh.data.exclude_seed, fresh.data.exclude_size) == (4, 3, 720)
    assert cfg.data.exclude_size != 720  # the fresh rows' config is a copy


class _Evaluator:
    """The evaluator's contract as the bench reads it: ``measure(drafter, label) -> (table, rows, chain)``."""

    made: list = []
    sharpen: dict = {}

    def __init__(self, target, prompts, settings, *, reference, chain, auto=None):
        self.prompts, self.reference, self.chain, self.measured = prompts, reference, chain, []
        _Evaluator.made.append(self)

    def measure(self, drafter, label, *, drafter_temperature=None):
        self.measured.append(label)
        self.temperatures = [*getattr(self, "temperatures", []), drafter_temperature]
        # a drafter's blocks: its value, plus what its t_d adds (_Evaluator.sharpen: {value: {t_d: bonus}})
        value = drafter.value + _Evaluator.sharpen.get(drafter.value, {}).get(drafter_temperature, 0)
        rows = [{"label": label, "prompt_index": i, "budget": 4, "temperature": 0.0,
                 "block_lengths": [value] * 3, "rounds": 3, "tau": float(value)}
                for i in range(len(self.prompts))]
        chain = [{**r, "budget": 2} for r in rows] if self.chain else []
        return [{"label": label, "budget": 4, "temperature": 0.0, "tau": float(drafter.value),
                 "ci95": (1.0, 2.0)}], rows, chain


def test_one_evaluator_measures_every_drafter_and_a_rerun_measures_only_what_is_new(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from safetensors.torch import save_file

    import exittrain.heldout.evaluator
    import exittrain.models

    folders = {}
    for name, value in (("warm start", 2), ("control-soft-fresh", 3)):
        folders[name] = tmp_path / name.replace(" ", "_")
        folders[name].mkdir()
        save_file({"w": torch.full((2,), float(value))}, folders[name] / "model.safetensors")

    def load(path, target):
        value = {str(f): v for f, v in zip(folders.values(), (2, 3, 4))}[str(path)]
        drafter = SimpleNamespace(value=value, config=SimpleNamespace(num_draft_tokens=2))
        drafter.eval = lambda: drafter
        return drafter

    monkeypatch.setattr(exittrain.heldout.evaluator, "HeldOutEvaluator", _Evaluator)
    monkeypatch.setattr(exittrain.models, "load_drafter", load)
    _Evaluator.made = []
    args = bx.parse_args(["--out", str(tmp_path / "out")])
    target = SimpleNamespace(name="tiny")
    settings = {"budgets": [4], "temperatures": [0.0], "seed": 0, "drafter_temperature": 1.0}
    steps = []
    measured = bx.measure(args, target, folders, [[1, 2], [3]], settings, on_step=lambda m: steps.append(list(m)))
    (evaluator,) = _Evaluator.made
    assert evaluator.reference == bx.WARM and evaluator.measured == ["warm start", "control-soft-fresh"]
    assert steps == [["warm start"], ["warm start", "control-soft-fresh"]]
    assert measured["control-soft-fresh"]["table"][0]["ci95"] == [1.0, 2.0]  # as JSON keeps it
    assert measured["warm start"]["num_draft_tokens"] == 2
    # a rerun with one more drafter measures that drafter only
    folders["new"] = tmp_path / "new"
    folders["new"].mkdir()
    save_file({"w": torch.zeros(2)}, folders["new"] / "model.safetensors")
    again = bx.measure(args, target, folders, [[1, 2], [3]], settings)
    assert _Evaluator.made[-1].measured == ["new"]
    assert {k: again[k] for k in measured} == measured
    # other prompts, other settings, or other measuring code: measured again
    bx.measure(args, target, folders, [[1, 2], [4]], settings)
    assert _Evaluator.made[-1].measured == list(folders)
    monkeypatch.setattr("exittrain.bench.measure_cache.code_version", lambda: "another version")
    bx.measure(args, target, folders, [[1, 2], [3]], settings)
    assert _Evaluator.made[-1].measured == list(folders)


def test_the_sharpening_control_is_chosen_on_the_development_split_and_measured_at_its_temperature(
        tmp_path, monkeypatch, capsys):
    """The warm start's and the control's drafter temperature are chosen on the development split alone (the
    control's averaged over its seeds, a tie to the t_d nearest 1), and kept: a rerun measures nothing again."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    import exittrain.heldout.evaluator
    import exittrain.models

    values = {"warm start": 2, "control-soft-fresh@seed0": 3, "control-soft-fresh@seed1": 4,
              "nodeonly-flow-l1-fresh@seed0": 5}
    folders = {}
    for name, value in values.items():
        folders[name] = tmp_path / name.replace(" ", "_")
        folders[name].mkdir()
        save_file({"w": torch.full((2,), float(value))}, folders[name] / "model.safetensors")

    def load(path, target):
        drafter = SimpleNamespace(value=values[next(n for n, f in folders.items() if f == path)],
                                  config=SimpleNamespace(num_draft_tokens=2))
        drafter.eval = lambda: drafter
        return drafter

    monkeypatch.setattr(exittrain.heldout.evaluator, "HeldOutEvaluator", _Evaluator)
    monkeypatch.setattr(exittrain.models, "load_drafter", load)
    dev = []
    monkeypatch.setattr(bx, "heldout_prompts", lambda cfg, target, n, skip: dev.append((n, skip)) or [[1]] * n)
    # seed 0 peaks at 0.7, seed 1 at 0.5 by less: their average peaks at 0.7; the warm start ties 0.5 and 0.7,
    # and the tie goes to the one nearer 1
    _Evaluator.sharpen = {3: {0.7: 0.4, 0.5: 0.1}, 4: {0.5: 0.2}, 2: {0.5: 0.3, 0.7: 0.3}}
    _Evaluator.made = []
    args = bx.parse_args(["--out", str(tmp_path / "out"), "--skip", "8", "--prompts", "4", "--dev-skip", "0",
                          "--dev-prompts", "3", "--sharpen-temperatures", "0.5", "0.7", "1.0", "1.5"])
    settings = {"budgets": [16, 64], "temperatures": [0.0, 0.6], "seed": 0, "drafter_temperature": 1.0}
    target = SimpleNamespace(name="tiny")
    chosen = bx.choose_sharpening(args, None, target, folders, settings)
    assert dev == [(3, 0)]  # the development split, not the measured prompts
    (evaluator,) = _Evaluator.made
    assert evaluator.chain is False and evaluator.reference is None
    assert "nodeonly-flow-l1-fresh@seed0 at t_d 0.5" not in evaluator.measured  # only the warm start and C
    assert chosen["chosen"] == {"warm start": 0.7, "control-soft-fresh": 0.7}
    assert chosen["tau"]["control-soft-fresh"]["0.7"] == pytest.approx((3.4 + 4) / 2)
    assert chosen["per_drafter"]["control-soft-fresh@seed1"]["0.5"] == pytest.approx(4.2)
    assert "sharpening: control-soft-fresh at t_d 0.7" in capsys.readouterr().out
    again = bx.choose_sharpening(args, None, target, folders, settings)
    assert again == chosen and _Evaluator.made[-1].measured == []  # kept under <out>/measured_dev
    assert bx.sharpened_name("control-soft-fresh@seed1") == "sharpened-control-soft-fresh@seed1"
    assert split_replicate(bx.sharpened_name("control-soft-fresh@seed1")) == ("sharpened-control-soft-fresh", 1)
    # the measurement: each sharpened drafter at its t_d, the others at the settings' one, on one evaluator
    drafters = {**folders, "sharpened-control-soft-fresh@seed0": folders["control-soft-fresh@seed0"]}
    measured = bx.measure(args, target, drafters, [[1]] * 4, settings,
                          drafter_temperatures={"sharpened-control-soft-fresh@seed0": 0.7})
    assert _Evaluator.made[-1].temperatures == [1.0, 1.0, 1.0, 1.0, 0.7]
    assert measured["sharpened-control-soft-fresh@seed0"]["rows"][0]["block_lengths"] == [3.4] * 3
    for bad in (["--dev-skip", "6", "--dev-prompts", "4"], ["--sharpen-temperatures", "0"],
                ["--arms", "nodeonly-flow-l1-fresh"]):
        with pytest.raises(SystemExit):  # the split overlaps the measured prompts; t_d <= 0; no control to sharpen
            bx.parse_args(["--skip", "8", "--prompts", "4", "--sharpen-temperatures", "0.5", *bad])
    assert "overlaps the measured prompts" in capsys.readouterr().err
    _Evaluator.sharpen = {}


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
    monkeypatch.setattr("exittrain.heldout.serving_track.target_folder", lambda target, name: "T")
    args = bx.parse_args(["--out", str(tmp_path), "--vllm-prompts", "3"])
    args.vllm_python = "python"
    vllm = bx.measure_in_vllm(args, None, {name: tmp_path / name for name in counts}, [[1], [2], [3]])
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
              "rows": [], "train": {}, "vllm": vllm}
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
    # one measuring-code version for both runs, whatever is edited meanwhile (a new version measures again:
    # tests/bench/test_measure_cache.py)
    monkeypatch.setattr("exittrain.bench.measure_cache.code_version", lambda: "this test")
    args = bx.parse_args([
        "--steps", "2", "--fresh-prompts", "8", "--prompts", "2", "--max-new-tokens", "12",
        "--budgets", "4", "3", "--temperatures", "0", "1", "--oracle",
        "--arms", "control-soft-fresh", "exittrain-soft-flow-l1-fresh", "exittrain-soft-flow-l1-chain-fresh",
        "--override", "debug=smoke", "--override", "stages.pretrain.max_steps=2", "--out", str(tmp_path / "out"),
        "--sharpen-temperatures", "0.3", "1.0", "--dev-skip", "0", "--dev-prompts", "1", "--sharpen-budget", "4",
        "--sharpen-at", "1",
    ])
    result = bx.run(args)
    saved = json.loads((tmp_path / "out" / "exittrain.json").read_text())
    assert saved["rows"] == result["rows"] and "verdict" not in saved  # derived from the rows when read
    # the settings the host decides are shown with the result they shaped, and how they were chosen
    dtype = saved["choices"]["fresh"]["data.generation.dtype"]
    # auto answers in bf16 where the host runs it fast, else with the target as loaded (null)
    assert dtype["setting"] == "auto" and dtype["value"] in (None, "bfloat16") and dtype["reason"]
    assert saved["choices"]["fresh"]["trainer.precision"]["value"]
    assert "total tokens / total rounds" in saved["statistic"]
    names = {r["drafter"] for r in saved["rows"]}
    assert names == {"warm start", "control-soft-fresh", "exittrain-soft-flow-l1-fresh",
                     "exittrain-soft-flow-l1-chain-fresh", "sharpened warm start", "sharpened-control-soft-fresh"} \
        == set(saved["per_prompt"]) == set(saved["tables"])
    # the sharpening control: chosen on the development split, measured at its t_d on the same answers; the
    # greedy chain is an argmax, the same at every t_d
    sharp = saved["sharpening"]
    assert sharp["dev_prompts"] == 1 and set(sharp["chosen"]) == {"warm start", "control-soft-fresh"}
    assert set(sharp["per_drafter"]) == {"warm start", "control-soft-fresh"}
    for name in ("warm start", "control-soft-fresh"):
        chosen = sharp["chosen"][name]
        assert sharp["tau"][name][f"{chosen:g}"] == max(sharp["tau"][name].values())
        sharpened = saved["per_prompt"][bx.sharpened_name(name)]
        assert {r["drafter_temperature"] for r in sharpened["rows"] + sharpened["chain"]} == {chosen}
        assert [r["block_lengths"] for r in sharpened["chain"]] == \
            [r["block_lengths"] for r in saved["per_prompt"][name]["chain"]]
    chain = [r for r in saved["rows"] if r["shape"] == "chain"]
    K = saved["num_draft_tokens"]
    assert {(r["drafter"], r["temperature"]) for r in chain} == {(n, T) for n in names for T in (0.0, 1.0)}
    for r in chain:  # a chain of K nodes: a block of at least the bonus, at most 1 + K
        assert r["budget"] == K and 1.0 <= r["tau"] <= 1 + K and math.isfinite(r["tau"]) and r["prompts"] == 2
    assert all(r["vs_control"] is not None for r in chain if r["drafter"].startswith("exittrain-"))
    trees = [r for r in saved["rows"] if r["shape"] == "ddtree"]
    assert {(r["budget"], r["temperature"]) for r in trees} == {(b, T) for b in (4, 3) for T in (0.0, 1.0)}
    for r in trees:  # a block of a budget-B tree: at least the bonus, at most 1 + B; the oracle bounds it at T = 0
        assert 1.0 <= r["tau"] <= 1 + r["budget"] and "tau_oracle" in r
        assert r["temperature"] > 0 or r["efficiency"] <= 1 + 1e-6
    for name, one in saved["per_prompt"].items():  # every figure recomputes from the evaluator's per-prompt rows
        row = next(r for r in saved["rows"] if r["drafter"] == name and r["shape"] == "ddtree" and r["budget"] == 4
                   and r["temperature"] == 1.0)
        blocks = [p["block_lengths"] for p in sorted(one["rows"], key=lambda p: p["prompt_index"])
                  if p["budget"] == 4 and p["temperature"] == 1.0]
        assert row["tau"] == pooled(blocks)
    arm = {r["budget"]: r for r in trees if r["drafter"] == "exittrain-soft-flow-l1-fresh" and r["temperature"] == 1}
    assert arm[4]["vs_control"] is not None and arm[3]["vs_warm_start"]["prompts"] == 2
    assert os.path.exists(tmp_path / "out" / "exittrain_vs_control.png")
    assert not (tmp_path / "out" / bx.PARTIAL).exists()  # the partial file lives while it runs only
    said = capsys.readouterr().out  # every drafter's measurement says when it starts and ends
    for label in names:
        assert f"{label}: measuring" in said and f"{label}: done (" in said, label

    # a rerun reuses the trained arms and every measurement: nothing is trained or measured again
    def never(*a, **k):
        raise AssertionError("a rerun measured again what it had measured")

    import exittrain.heldout.evaluator

    monkeypatch.setattr(exittrain.heldout.evaluator.HeldOutEvaluator, "measure", never)
    monkeypatch.setattr(bx, "train_drafter", never)
    args.resume = True
    again = bx.run(args)
    assert again["rows"] == result["rows"] and again["per_prompt"] == saved["per_prompt"]
    for name, trained in result["train"].items():  # each arm's training record comes back with it
        assert again["train"][name] == {**trained, "reused": True}, name


@pytest.mark.slow
def test_a_training_seed_repeats_bit_for_bit_and_two_seeds_differ(tmp_path, monkeypatch):
    """Replicates: the same arm under seeds 0 and 1 trains two different drafters from one warm start, and
    seed 0 again (another run, another folder) trains the same drafter to the bit."""
    from safetensors.torch import load_file

    monkeypatch.setenv("EXITTRAIN_CACHE", str(tmp_path / "cache"))
    common = ["--steps", "3", "--fresh-prompts", "8", "--prompts", "1", "--max-new-tokens", "8",
              "--budgets", "4", "--temperatures", "0", "--no-chain",
              "--override", "debug=smoke", "--override", "stages.pretrain.max_steps=2"]
    first = bx.run(bx.parse_args([*common, "--arms", "control-soft-fresh", "nodeonly-flow-l1-fresh",
                                  "control-soft-fresh-cpumatched", "--train-seeds", "0", "1",
                                  "--out", str(tmp_path / "a")]))
    assert set(first["train"]) == {f"{arm}@seed{s}" for s in (0, 1) for arm in
                                   ("control-soft-fresh", "nodeonly-flow-l1-fresh", "control-soft-fresh-cpumatched")}
    # the CPU-matched control: the steps of seed 0's CPU ratio, for both seeds
    matched = [first["train"][f"control-soft-fresh-cpumatched@seed{s}"] for s in (0, 1)]
    ratio = first["train"]["nodeonly-flow-l1-fresh@seed0"]["train_cpu_s"] / \
        first["train"]["control-soft-fresh@seed0"]["train_cpu_s"]
    assert matched[0]["cpu_matched"] == matched[1]["cpu_matched"]
    assert matched[0]["steps"] == matched[1]["steps"] == max(3, round(3 * ratio))
    assert all(first["train"][n]["train_seed"] == int(n[-1]) for n in first["train"])
    warm = tmp_path / "a" / "warm_start"
    bx.run(bx.parse_args([*common, "--arms", "control-soft-fresh", "--train-seeds", "0", "--warm-start", str(warm),
                          "--out", str(tmp_path / "b")]))

    def weights(folder):
        (path,) = (tmp_path / folder).glob("*.safetensors")
        return load_file(path)

    seed0, seed1, again = (weights(f) for f in ("a/control-soft-fresh@seed0", "a/control-soft-fresh@seed1",
                                                  "b/control-soft-fresh@seed0"))
    assert seed0.keys() == again.keys() and all(torch.equal(seed0[k], again[k]) for k in seed0)
    assert any(not torch.equal(seed0[k], seed1[k]) for k in seed0)
