"""RESULTS.md from result JSONs: summaries of fake run directories, schema errors, the page's rules."""

from __future__ import annotations

import copy
import json

import pytest

from exittrain.report import results_markdown, results_page
from exittrain.report import run_report as report
from tests.report.helpers import make_fit_run, write_json

HOST = {"cpu_model": "Test CPU", "cores": 2, "cpu_capability": "AVX512", "gpu": None, "torch": "2.13.0",
        "shared": False}
PAGE = {
    "recipes": ["code", "math"],
    "not_measured": {"math": "docs/notebook/old.md"},
    "ablation": {"command": "python -m exittrain bench exittrain", "notebook": "docs/notebook/abl.md",
                 "verdict": "No ablation result yet; bench exittrain asks its question now."},
    "negatives": [{"text": "The stage lowers tau.", "see": ["fit-a", "docs/notebook/old.md"]}],
    "notebook": [{"path": "docs/notebook/old.md", "title": "2026-11-30: the old runs"}],
    "findings": {"question": "Does the node loss help?", "answer": "Not shown yet.", "default_recipe": "code"},
}


def fake_run(tmp_path, name="run", capability="AVX2", date="2026-12-01"):
    run = make_fit_run(tmp_path / name)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["pretrain_metrics"]["val/greedy_block_length"] = 2.5
    metrics["timings"] = {"regeneration_and_setup_s": 60.0, "pretrain_s": 120.0, "total_s": 300.0}
    write_json(run / "metrics.json", metrics)
    (run / "cli.log").write_text(
        f"[{date} 10:33:44,376][exittrain][INFO] - target.dtype auto -> float32\n"
        f"[{date} 10:33:46,108][exittrain][INFO] - trainer.precision auto -> 32-true (CPU capability "
        f"{capability}, no bf16 units)\n"
    )
    return run, metrics


def make_root(tmp_path, results: list[dict], page=PAGE):
    root = tmp_path / "root"
    for res in results:
        write_json(root / "results" / f"{res['name']}.json", res)
    write_json(root / "results" / "page.json", page)
    return root


def test_summary_of_a_fit_run_keeps_its_tables_heldout_date_and_capability(tmp_path):
    run, metrics = fake_run(tmp_path)
    res = results_page.summarize_fit_run(run, name="fit-a", command="python -m exittrain fit +recipe=code",
                                         commit="abc1234", host=HOST, peak_rss_gb=6.5)
    assert res["date"] == "2026-12-01" and res["recipe"] == "code"
    assert res["host"]["cpu_capability"] == "AVX2"  # the run's own (an emulation changes it), not the summariser's
    assert res["host"]["cpu_model"] == "Test CPU"
    want = [(label, r["budget"], r["tau"], r["ci95"]) for label in ("warm_start", "exittrain")
            for r in metrics["tables"][label]]
    assert [(r["label"], r["budget"], r["tau"], r["ci95"]) for r in res["tables"]] == want
    analytic = metrics["pretrain_metrics"]["val/analytic_block_length"]
    assert res["heldout"] == {"greedy_tau": 2.5, "analytic_tau": analytic}
    assert res["wall_s"]["total_s"] == 300.0
    assert not any("block_lengths" in r for r in res["tables"])  # summaries only, no per-prompt rows


def _pooled_run(tmp_path, name="pooled"):
    """A fit run as the pooled evaluator writes it: rows at T = 0 and 0.6, metrics.json led by ``served``."""
    run, metrics = fake_run(tmp_path, name=name)
    rows = []
    for T, tau, chain in ((0.0, 2.5, 1.9), (0.6, 2.1, 1.6)):
        rows.append({"label": "exittrain", "budget": 16, "temperature": T, "prompts": 16, "tau": tau,
                     "ci95": [tau - 0.2, tau + 0.2], "chain_tau": chain, "chain_ci95": [chain - 0.1, chain + 0.1],
                     "chain_K": 7})
    metrics["tables"] = {"warm_start": [dict(r, label="warm_start") for r in rows], "exittrain": rows}
    metrics = {"served": {"label": "exittrain", "dflash_path": "x", "dropped": [], "by_temperature": {}}, **metrics}
    write_json(run / "metrics.json", metrics)
    return run


def test_the_page_opens_with_the_findings_and_labels_earlier_results(tmp_path):
    """The findings block comes first: the question, its answer, the default recipe's served drafter at its
    newest pooled fit (chain tau and tree tau at each T), and what is not measured; the older fit is kept
    under its own legend."""
    old_run, _ = fake_run(tmp_path)
    old = results_page.summarize_fit_run(old_run, name="fit-a", command="c", commit="abc1234", host=HOST)
    new = results_page.summarize_fit_run(_pooled_run(tmp_path), name="fit-b", command="c", commit="def5678",
                                         host=HOST)
    assert "statistic" not in old and new["statistic"] == "pooled" and new["served"]["label"] == "exittrain"
    text = results_markdown.render_page([old, new], results_page.load_page(make_root(tmp_path, [old, new]) / "results"))
    assert text.index("## Findings") < text.index("| commit |") < text.index("## Hosts")
    findings = text[text.index("## Findings"):text.index("| commit |")]
    assert "Does the node loss help?" in findings and "Not shown yet." in findings
    assert "[fit-b](results/fit-b.json)" in findings and "chain tau at K = 7, T = 0.6: **1.60** (1.50-1.70)" in findings
    assert "tree tau at B = 16, T = 0: 2.50 (2.30-2.70)" in findings and "the drafter itself" in findings
    assert "the GPU path" in findings and "the `math` recipe at the current defaults" in findings
    assert "the `code` recipe" not in findings
    code = text[text.index("## Recipe `code`"):text.index("## Recipe `math`")]
    assert code.index("Measured by the pooled evaluator") < code.index("fit-b") < code.index("Earlier results")
    assert code.index("Earlier results") < code.index("[fit-a](results/fit-a.json) ([command]")
    without = results_markdown.render_page([old], results_page.load_page(make_root(tmp_path, [old]) / "results"))
    assert "not measured with the pooled evaluator yet" in without  # an older fit alone is not quoted
    page = copy.deepcopy(PAGE)
    page["findings"]["answer"] = "Gains of 13 percent."
    with pytest.raises(ValueError, match="findings.answer: free text carries a figure"):
        results_page.load_page(make_root(tmp_path / "bad", [], page) / "results")


def test_page_shows_every_row_linked_to_its_json_and_command(tmp_path):
    run, _ = fake_run(tmp_path)
    res = results_page.summarize_fit_run(run, name="fit-a", command="python -m exittrain fit +recipe=code",
                                         commit="abc1234", host=HOST)
    text = results_markdown.render_page([res], results_page.load_page(make_root(tmp_path, [res]) / "results"))
    rows = [line for line in text.splitlines() if line.startswith("| [fit-a](results/fit-a.json) ([command](#fit-a))")
            and ("| warm start (block CE) |" in line or "| after ExitTrain |" in line)]
    assert len(rows) == len(res["tables"])
    for line, row in zip(rows, res["tables"]):
        lo, hi = row["ci95"]
        assert f"| {row['tau']:.2f} ({lo:.2f}-{hi:.2f}) |" in line and f"| {row['speedup']:.2f}x |" in line
    assert "| commit | `abc1234`" in text and "| date | 2026-12-01 |" in text and "`AVX2`" in text
    assert "### fit-a\n\n2026-12-01, commit `abc1234`:\n\n```bash\npython -m exittrain fit +recipe=code\n```" in text
    assert "## Recipe `math`\n\nNot measured at the current defaults" in text
    assert "No ablation result yet; bench exittrain asks its question now." in text
    assert "`python -m exittrain bench exittrain`" in text and "bench ablation" not in text
    assert "- The stage lowers tau. ([fit-a](results/fit-a.json), [old.md](docs/notebook/old.md))" in text


def test_fit_rows_show_the_serving_track_when_a_run_has_it(tmp_path):
    """A run with the chain tau and vLLM's acceptance gets both columns (a MISMATCH flagged); a page of
    older results keeps its columns as they were."""
    run, metrics = fake_run(tmp_path)
    plain = results_page.summarize_fit_run(run, name="fit-a", command="c", commit="abc1234", host=HOST)
    old_text = results_markdown.render_page([plain], results_page.load_page(make_root(tmp_path, [plain]) / "results"))
    assert "chain tau (K)" not in old_text and "vLLM tau" not in old_text
    for label, tau in (("warm_start", 1.6), ("exittrain", 2.1)):
        for row in metrics["tables"][label]:
            row.update(chain_tau=tau, chain_K=7)
    metrics["tables"]["served"] = [dict(metrics["tables"]["exittrain"][0],
                                        vllm={"vllm_tau": 2.05, "vllm_matches_plain": False})]
    write_json(run / "metrics.json", metrics)
    res = results_page.summarize_fit_run(run, name="fit-b", command="c", commit="abc1234", host=HOST)
    assert [r["label"] for r in res["tables"]][-1] == "served" and res["tables"][-1]["vllm_tau"] == 2.05
    text = results_markdown.render_page([res], results_page.load_page(make_root(tmp_path, [res]) / "results"))
    header = next(line for line in text.splitlines() if line.startswith("| result | host | drafter"))
    assert "| chain tau (K) | vLLM tau |" in header
    assert "| 1.60 (7) | - |" in text and "| 2.10 (7) | - |" in text
    assert "| DFlash export |" in text and "| 2.10 (7) | 2.05 MISMATCH |" in text
    assert "vLLM tau: vLLM's mean acceptance length" in text
    metrics["tables"]["served"][0]["vllm"] |= {"vllm_ci95": [1.9, 2.2], "vllm_per_prompt": [{"drafts": 1}]}
    write_json(run / "metrics.json", metrics)
    res = results_page.summarize_fit_run(run, name="fit-c", command="c", commit="abc1234", host=HOST)
    assert "vllm_per_prompt" not in res["tables"][-1]  # the page keeps the summary, not the counts
    text = results_markdown.render_page([res], results_page.load_page(make_root(tmp_path, [res]) / "results"))
    assert "| 2.10 (7) | 2.05 (1.90-2.20) MISMATCH |" in text


def test_an_emulated_capability_is_named_as_such(tmp_path):
    run, _ = fake_run(tmp_path)
    host = HOST | {"emulation": "ATEN_CPU_CAPABILITY=avx2 on an AVX512 CPU"}
    res = results_page.summarize_fit_run(run, name="fit-a", command="c", commit="abc1234", host=host)
    text = results_markdown.render_page([res], PAGE)
    assert "| hosts | Test CPU, `AVX2` (emulated: ATEN_CPU_CAPABILITY=avx2 on an AVX512 CPU) |" in text
    assert "| [fit-a](results/fit-a.json) | Test CPU | `AVX2` (emulated) |" in text


def test_header_takes_the_newest_result_and_the_page_is_deterministic(tmp_path):
    runs = []
    for name, date, commit in (("fit-b", "2026-12-02", "bbbbbbb"), ("fit-a", "2026-11-30", "aaaaaaa")):
        run, _ = fake_run(tmp_path, name, date=date)
        runs.append(results_page.summarize_fit_run(run, name=name, command="c", commit=commit, host=HOST))
    root = make_root(tmp_path, runs)
    first = results_page.write_page(root)
    assert "| commit | `bbbbbbb` (newest result: [fit-b]" in first and "| date | 2026-12-02 |" in first
    assert results_page.write_page(root, check=True) == first  # the same files give the same page
    assert first.index("[fit-a](results/fit-a.json) ([command]") < first.index("[fit-b](results/fit-b.json) ([command]")


def test_check_fails_on_a_stale_page_and_the_report_hook_writes_it(tmp_path, capsys):
    run, _ = fake_run(tmp_path)
    res = results_page.summarize_fit_run(run, name="fit-a", command="c", commit="abc1234", host=HOST)
    root = make_root(tmp_path, [res])
    with pytest.raises(SystemExit, match="is not what results/ gives"):
        report.main(["--results", "--root", str(root), "--check"])
    report.main(["--results", "--root", str(root)])
    assert (root / "RESULTS.md").read_text() == results_markdown.render_page([res], PAGE)
    report.main(["--results", "--root", str(root), "--check"])
    res2 = copy.deepcopy(res)
    res2["tables"][0]["tau"] += 0.5
    write_json(root / "results" / "fit-a.json", res2)
    with pytest.raises(SystemExit):
        report.main(["--results", "--root", str(root), "--check"])


def test_the_add_option_summarises_a_run_into_results(tmp_path):
    run, _ = fake_run(tmp_path)
    root = make_root(tmp_path, [])
    report.main(["--results", "--root", str(root), "--add", str(run), "--name", "fit-new", "--command",
                 "python -m exittrain fit +recipe=code", "--commit", "1234567", "--cpu-model", "Test CPU"])
    saved = json.loads((root / "results" / "fit-new.json").read_text())
    assert saved["schema"] == results_page.SCHEMA and saved["commit"] == "1234567"
    assert saved["host"]["cpu_model"] == "Test CPU" and saved["host"]["cpu_capability"] == "AVX2"
    assert "[fit-new](results/fit-new.json)" in (root / "RESULTS.md").read_text()


def test_an_ablation_result_gives_the_verdict_line(tmp_path):
    abl = tmp_path / "ablation.json"
    write_json(abl, {"settings": {"domains": ["code"]}, "summary": {
        "overall_tau_vs_control": {"baseline": 0.99, "control": 1.0, "exittrain-flow": 1.021},
        "analytic_vs_control": {"exittrain-flow": 1.001}, "best_weight_type": "exittrain-flow", "goal_met": False}})
    res = results_page.summarize_ablation(abl, name="ablation-code", command="python -m exittrain bench ablation",
                                          commit="abc1234", host=HOST, date="2026-12-01")
    text = results_markdown.render_page([res], PAGE)
    assert ("- 2026-12-01, [ablation-code](results/ablation-code.json) ([command](#ablation-code)): best ExitTrain "
            "arm **exittrain-flow**, decoded tau 1.021x the block-CE control") in text
    assert "goal 1.13x: **not met**" in text and "No ablation result yet." not in text


def _experiment_json(tmp_path, verdict):
    rows = [
        {"drafter": "warm start", "budget": 16, "temperature": t, "tau": 2.5 + t, "ci95": [2.4, 2.6],
         "vs_control": None, "vs_warm_start": None, **({"tau_oracle": 4.25} if t else {})} for t in (0.0, 1.0)
    ] + [
        {"drafter": "exittrain-soft-flow-l1-fresh", "budget": 16, "temperature": 1.0, "tau": 3.52, "ci95": [3.4, 3.6],
         "control": "control-soft-fresh", "vs_control": {"delta": 0.012, "ci95": [-0.004, 0.031]},
         "vs_warm_start": {"delta": 0.02, "ci95": [0.01, 0.03]},
         "tau_oracle": 4.25},
    ]
    path = tmp_path / "exittrain.json"
    write_json(path, {"domain": "code", "steps": 30, "warm_start": "W", "prompts": 64, "analytic_anchors": 8,
                      "rows": rows, "verdict": verdict, "train": {}})
    return path


def test_an_experiment_result_shows_its_verdict_and_paired_table(tmp_path):
    res = results_page.summarize_experiment_json(
        _experiment_json(tmp_path, []), name="exittrain-code", command="python -m exittrain bench exittrain",
        commit="abc1234", host=HOST, date="2026-12-01")
    text = results_markdown.render_page([res], PAGE)
    assert "## Does exit-guided training help?" in text
    assert "- none: no ExitTrain setting's paired interval against its matched control excludes 0." in text
    assert "no correction for the 1 comparisons made" in text  # one seed, one pair: labelled exploratory
    assert "| exittrain-soft-flow-l1-fresh | - | 3.520; +0.012 (-0.004 to +0.031); +0.020 (+0.010 to +0.030) |" in text
    assert "| oracle bound (same budget and law) | - | 4.250 |" in text
    assert "per-position and per-anchor means, on drafters with the n-gram copy branch" in text  # labelled
    # a result of the pooled evaluator: no anchors, its statistic named instead
    pooled = json.loads(_experiment_json(tmp_path, []).read_text())
    del pooled["analytic_anchors"]
    write_json(tmp_path / "pooled.json", {**pooled, "statistic": "total tokens / total rounds"})
    now = results_page.summarize_experiment_json(tmp_path / "pooled.json", name="e", command="c", commit="a",
                                                 host=HOST, date="2026-12-08")
    drawn = results_markdown.render_page([now], PAGE)
    assert "every tau pooled as a decode counts it (total tokens / total rounds)" in drawn
    assert "per-anchor" not in drawn.split("## Does exit-guided training help?")[1]
    # the list is drawn from the rows: lines an older result stored under 'verdict' are not shown
    stale = results_page.summarize_experiment_json(
        _experiment_json(tmp_path, ["exittrain-x beats control-x"]), name="e", command="c", commit="a", host=HOST,
        date="2026-12-01")
    assert "exittrain-x beats control-x" not in results_markdown.render_page([stale], PAGE)
    data = json.loads(_experiment_json(tmp_path, []).read_text())
    data["rows"][-1]["vs_control"] = {"delta": 0.03, "ci95": [0.01, 0.05]}
    write_json(tmp_path / "found.json", data)
    found = results_page.summarize_experiment_json(tmp_path / "found.json", name="e", command="c", commit="a",
                                                   host=HOST, date="2026-12-01")
    assert ("- exittrain-soft-flow-l1-fresh beats control-soft-fresh at B = 16, T = 1: +0.0300 (+0.0100 to +0.0500)"
            in results_markdown.render_page([found], PAGE))
    # the run's own CPU capability (an emulation changes it), not the summarising machine's; notes kept
    data = json.loads(_experiment_json(tmp_path, []).read_text())
    write_json(tmp_path / "emulated.json", {**data, "host": {**HOST, "cpu_capability": "AVX2"}})
    emulated = results_page.summarize_experiment_json(
        tmp_path / "emulated.json", name="e", command="c", commit="a", host={**HOST, "emulation": "ATEN..."},
        date="2026-12-01", notes=["Measured at one commit."])
    assert emulated["host"]["cpu_capability"] == "AVX2" and emulated["notes"] == ["Measured at one commit."]
    page = results_markdown.render_page([emulated], PAGE)
    assert "| `AVX2` (emulated) |" in page and "- Measured at one commit." in page
    write_json(tmp_path / "not_it.json", {"rows": []})
    with pytest.raises(ValueError, match="not a bench exittrain output"):
        results_page.summarize_experiment_json(tmp_path / "not_it.json", name="e", command="c", commit="a",
                                               host=HOST, date="2026-12-01")
    unnamed = copy.deepcopy(found)
    unnamed["summary"]["rows"][2].pop("control")
    with pytest.raises(ValueError, match=r"summary rows\[2\]: missing key 'control'"):
        results_page.check_result(unnamed, "results/e.json")
    broken = copy.deepcopy(res)
    broken["summary"]["rows"][0].pop("vs_control")
    with pytest.raises(ValueError, match=r"summary rows\[0\]: missing key 'vs_control'"):
        results_page.check_result(broken, "results/e.json")


def test_an_experiment_with_replicates_shows_each_settings_reading_under_the_sequence(tmp_path):
    from exittrain.bench.exittrain_report import replicate_verdicts

    data = json.loads(_experiment_json(tmp_path, []).read_text())
    rows = []
    for seed, (primary, greedy) in enumerate([(0.04, 0.05), (0.02, 0.06), (0.03, 0.04)]):
        for T, delta in ((0.6, primary), (0.0, greedy)):
            rows.append({"drafter": f"exittrain-soft-flow-l1-fresh@seed{seed}",
                         "control": f"control-soft-fresh@seed{seed}",
                         "budget": 16, "temperature": T, "tau": 3.0, "ci95": [2.9, 3.1], "vs_warm_start": None,
                         "vs_control": {"delta": delta, "ci95": [delta - 0.01, delta + 0.01]}})
    floor = {f"control-soft-fresh/16/{T:g}": {"spread": 0.01} for T in (0.6, 0.0)}
    data.update(rows=data["rows"] + rows, train_seeds=[0, 1, 2], replicates=replicate_verdicts(rows, floor))
    write_json(tmp_path / "reps.json", data)
    res = results_page.summarize_experiment_json(tmp_path / "reps.json", name="e", command="c", commit="a",
                                                 host=HOST, date="2026-12-01")
    text = results_markdown.render_page([res], PAGE)
    # the primary (every seed > 0, mean +0.03 >= 2 x the floor 0.01) is confirmed, so T = 0 is tested
    assert "| exittrain-soft-flow-l1-fresh | 16 | 0.6 | primary | +0.040 +0.020 +0.030 | +0.0300 | 0.0100 | " \
           "confirmed | confirmed |" in text
    assert "| exittrain-soft-flow-l1-fresh | 16 | 0 | secondary 1 | +0.050 +0.060 +0.040 | +0.0500 | 0.0100 | " \
           "confirmed | confirmed |" in text
    # the primary one seed weaker: inconclusive, and the secondary's own confirmation is only descriptive
    rows[2]["vs_control"]["delta"] = -0.001
    data.update(replicates=replicate_verdicts(rows, floor))
    write_json(tmp_path / "reps.json", data)
    res = results_page.summarize_experiment_json(tmp_path / "reps.json", name="e", command="c", commit="a",
                                                 host=HOST, date="2026-12-01")
    text = results_markdown.render_page([res], PAGE)
    assert "| primary | +0.040 -0.001 +0.030 | +0.0230 | 0.0100 | inconclusive | inconclusive |" in text
    assert "| secondary 1 | +0.050 +0.060 +0.040 | +0.0500 | 0.0100 | confirmed | descriptive |" in text


def test_an_experiment_on_the_chain_shows_the_chain_and_vllms_acceptance(tmp_path):
    """Chain rows get their own table (K, not a budget), and vLLM's acceptance of each export its own."""
    data = json.loads(_experiment_json(tmp_path, []).read_text())
    data["rows"].append({"drafter": "exittrain-soft-flow-l1-chain-fresh", "budget": 7, "shape": "chain",
                         "temperature": 0.0, "tau": 2.31, "ci95": [2.2, 2.4], "vs_warm_start": None,
                         "control": "control-soft-fresh", "vs_control": {"delta": 0.05, "ci95": [0.01, 0.09]}})
    data["vllm"] = {"prompts": 16, "max_new_tokens": 64, "vllm_version": "0.32.0", "drafters": {
        "exittrain-soft-flow-l1-chain-fresh": {"tau": 2.2, "ci95": [2.0, 2.4], "lossless": True, "K": 7,
                                               "vs_control": {"delta": 0.04, "ci95": [0.0, 0.08]},
                                               "vs_warm_start": None}}}
    write_json(tmp_path / "chain.json", data)
    res = results_page.summarize_experiment_json(tmp_path / "chain.json", name="e", command="c", commit="a",
                                                 host=HOST, date="2026-12-01")
    text = results_markdown.render_page([res], PAGE)
    assert "The greedy chain of K = 7 (what vLLM and SGLang verify):" in text and "B = 7:" not in text
    assert "| exittrain-soft-flow-l1-chain-fresh | 2.310; +0.050 (+0.010 to +0.090); - | - |" in text
    assert "vLLM 0.32.0's own acceptance length" in text
    assert "| exittrain-soft-flow-l1-chain-fresh | 2.200 | 2.000-2.400 | +0.040 (+0.000 to +0.080) | - | yes |" in text


@pytest.mark.parametrize("breakage, message", [
    (lambda r: r.pop("command"), "missing key 'command'"),
    (lambda r: r.update(date="1 Dec 2026"), "is not YYYY-MM-DD"),
    (lambda r: r.update(kind="notebook"), "kind 'notebook'"),
    (lambda r: r["host"].pop("cpu_capability"), "host: missing key 'cpu_capability'"),
    (lambda r: r["tables"][0].pop("ci95"), r"tables\[0\]: missing key 'ci95'"),
    (lambda r: r.update(name="other"), "differs from the file name"),
])
def test_a_broken_result_names_its_file_and_key(tmp_path, breakage, message):
    run, _ = fake_run(tmp_path)
    res = results_page.summarize_fit_run(run, name="fit-a", command="c", commit="abc1234", host=HOST)
    breakage(res)
    root = make_root(tmp_path, [])
    write_json(root / "results" / "fit-a.json", res)
    with pytest.raises(ValueError, match=message) as err:
        results_page.load_results(root / "results")
    assert "fit-a.json" in str(err.value)


@pytest.mark.parametrize("text, refused", [
    ("The stage lowers tau by 0.08.", True),
    ("It ran at B = 16.", True),
    ("The run of 2026-11-30 on AVX2 with bf16 (see [x](docs/notebook/2026-11-30-x.md)).", False),
])
def test_free_text_with_a_figure_is_refused(tmp_path, text, refused):
    page = copy.deepcopy(PAGE)
    page["negatives"][0]["text"] = text
    root = make_root(tmp_path, [], page)
    if refused:
        with pytest.raises(ValueError, match=r"negatives\[0\]\.text: free text carries a figure"):
            results_page.load_page(root / "results")
    else:
        assert results_page.load_page(root / "results")["negatives"][0]["text"] == text


def test_a_benchmark_output_in_results_is_named_and_left_off(tmp_path, caplog):
    run, _ = fake_run(tmp_path)
    res = results_page.summarize_fit_run(run, name="fit-a", command="c", commit="abc1234", host=HOST)
    root = make_root(tmp_path, [res])
    write_json(root / "results" / "bench_memory.json", {"rows": []})
    with caplog.at_level("WARNING"):
        assert [r["name"] for r in results_page.load_results(root / "results")] == ["fit-a"]
    assert "bench_memory.json: a benchmark's output" in caplog.text


def test_a_run_without_a_dated_log_is_refused(tmp_path):
    run, _ = fake_run(tmp_path)
    (run / "cli.log").write_text("no date here\n")
    with pytest.raises(ValueError, match="cli.log: no dated log line"):
        results_page.summarize_fit_run(run, name="fit-a", command="c", commit="abc1234", host=HOST)
