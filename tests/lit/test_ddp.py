"""DDP on 2 CPU processes (gloo) equals one process with the same global batch; only rank 0 writes.

The DDP run is ``tests/lit/ddp_driver.py`` in a subprocess (Lightning's ``strategy="ddp"``
launcher re-runs that command for rank 1); the single-process reference runs in this process
on the rows the two ranks saw together, in the same order.

Why the two runs must agree, step by step, to float rounding (the comparison is exact in
expectation, not only statistically):

1. **Same rows per optimizer step.** The ranks split each global batch of 4 rows (checked:
   disjoint, covering every row once); the reference takes those 4 rows as one batch.
2. **Same anchors.** Anchors are drawn per ``(seed, step, rank)``, so the two runs draw
   differently. But every row has the same length and loss mask, hence exactly 10 anchor
   candidates, and ``anchors_per_seq=10`` takes all of them: the anchor *set* is fixed, only its
   order depends on the draw, and every loss is a sum over anchors divided by a count.
3. **Equal denominators.** A rank's loss is its block CE (mean over 2 rows x 10 anchors x K
   labels) plus the node loss (mean over 2 x 10 trees x B nodes: every tree is full, with
   vocabulary 64, K = 3 and B = 8). Both ranks divide by the same counts, so the average of
   the two ranks' gradients, which DDP all-reduces, is the gradient of the global mean: the
   reference's gradient. The step's mean loss is likewise the mean of the ranks' losses.
4. Nothing else differs: fp32, no dropout, the frozen target built from the same seed on every
   rank, the drafter initialised from a seed, the same AdamW and schedule.

AdamW is nearly invariant to the scale of the gradient, so a summed (not averaged) gradient
would still give almost the same weights: the test compares the gradients themselves at every
step (taken after the all-reduce), and the weights only as a second check.

Writes are observed through a ``sys.audit`` hook in each process (any file opened for writing,
any folder made, any rename under the run directory), so "only rank 0 writes" covers the
logger, checkpoints, the drafter export and metrics_exittrain.json without trusting their own guards.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.lit import ddp_driver
from tests.lit.launch_helpers import REPO, run_group

pytestmark = [
    pytest.mark.slow,  # two ranks in subprocesses plus a reference fit: the slow tier (make test-slow)
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:The '.*_dataloader' does not have many workers"),
]

TIMEOUT_S = 240
# Relative errors in the norm of each tensor. Step 0 differs only by summation order (measured
# < 1e-6). AdamW's first update, lr * g / (|g| + eps), turns the rounding of gradient entries near
# zero into weight differences of up to ~1e-4 * lr, so later steps and the weights agree to a
# measured ~5e-5: 1e-3 keeps a 20x margin and still rejects a summed gradient (100% off).
# Gradients after the first update are computed at those slightly different weights, and a
# gradient's relative error grows where its norm is small: measured up to 1.2e-3 (FSDP, the
# resumed step's q_proj) on an Intel Xeon with torch's AVX2 kernels, under 1e-3 with its AVX512
# kernels. 1e-2 rejects a summed gradient by 100x and does not depend on which kernels the host runs.
STEP0_TOL, LATER_TOL, LATER_GRAD_TOL = 1e-5, 1e-3, 1e-2


def run_two_ranks(module: str, out: Path, *args: str, label: str) -> tuple[list[dict], list[dict]]:
    """``python -m <module> --out OUT --devices 2 ARGS`` (Lightning's launcher starts rank 1); returns
    the records each rank wrote, ``([rank0.json, rank1.json], [rank0.pt, rank1.pt])``. On timeout
    the whole process group, rank 1 included, is killed and the test fails with the output's tail."""
    cmd = [sys.executable, "-m", module, "--out", str(out), "--devices", "2", *args]
    run_group(cmd, REPO, f"{label} driver", TIMEOUT_S)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    tensors = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    return ranks, tensors


def global_order(rows_rank0: list[list[int]], rows_rank1: list[list[int]]) -> list[int]:
    """The rows in global order: step s's batch is rank 0's rows then rank 1's (any order gives the same sums)."""
    return [i for step in zip(rows_rank0, rows_rank1) for rows in step for i in rows]


def reference_run(train, out: Path) -> tuple[dict, dict]:
    """``train()`` (a single-process driver run writing into ``out``) and its ``rank0.pt``; the driver
    sets 1 thread like each rank, and this process's thread count is restored after."""
    threads = torch.get_num_threads()
    try:
        ref = train()
    finally:
        torch.set_num_threads(threads)
    return ref, torch.load(out / "rank0.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The DDP run's per-rank records and the single-process reference on the same global batches."""
    out = tmp_path_factory.mktemp("ddp")
    t0 = time.perf_counter()
    ranks, tensors = run_two_ranks("tests.lit.ddp_driver", out, "--batch-size", "2", label="DDP")
    order = global_order(ranks[0]["row_ids"], ranks[1]["row_ids"])
    ref_out = tmp_path_factory.mktemp("single")
    ref, ref_tensors = reference_run(
        lambda: ddp_driver.train(1, ddp_driver.GLOBAL_BATCH, ref_out, order=order), ref_out
    )
    print(f"DDP driver {time.perf_counter() - t0:.1f} s (both runs)")
    return {"out": out, "ranks": ranks, "tensors": tensors, "ref": ref, "ref_tensors": ref_tensors, "order": order}


def test_each_rank_sees_different_rows(runs):
    r0, r1 = runs["ranks"]
    assert (r0["rank"], r1["rank"], r0["world_size"], r1["world_size"]) == (0, 1, 2, 2)
    assert r0["global_step"] == r1["global_step"] == ddp_driver.STEPS
    seen0 = [i for rows in r0["row_ids"] for i in rows]
    seen1 = [i for rows in r1["row_ids"] for i in rows]
    assert len(r0["row_ids"]) == len(r1["row_ids"]) == ddp_driver.STEPS
    assert all(len(rows) == ddp_driver.GLOBAL_BATCH // 2 for rows in r0["row_ids"] + r1["row_ids"])
    assert not set(seen0) & set(seen1), "both ranks trained on the same rows: the data is not split"
    assert sorted(seen0 + seen1) == list(range(ddp_driver.STEPS * ddp_driver.GLOBAL_BATCH)), "every row exactly once"
    assert runs["ref"]["row_ids"] == [
        runs["order"][s : s + ddp_driver.GLOBAL_BATCH] for s in range(0, len(runs["order"]), ddp_driver.GLOBAL_BATCH)
    ]


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``|x - ref| / |ref|`` in the Frobenius norm (0 when both are 0)."""
    scale = float(ref.norm())
    return float((x - ref).norm()) / scale if scale > 0 else float(x.norm())


def test_gradients_are_averaged_like_one_process_with_the_global_batch(runs):
    (t0, t1), ref = runs["tensors"], runs["ref_tensors"]
    # the premise of the comparison (point 2): every candidate is a valid anchor, on every rank
    per_row = ddp_driver.ANCHOR_CANDIDATES
    assert all(n == 2 * per_row for r in runs["ranks"] for n in r["anchors"]), [r["anchors"] for r in runs["ranks"]]
    assert runs["ref"]["anchors"] == [4 * per_row] * ddp_driver.STEPS
    assert len(t0["grads"]) == len(t1["grads"]) == len(ref["grads"]) == ddp_driver.STEPS
    for step, (g0, g1, g_ref) in enumerate(zip(t0["grads"], t1["grads"], ref["grads"])):
        assert g0.keys() == g_ref.keys()
        tol = STEP0_TOL if step == 0 else LATER_GRAD_TOL
        for name in g_ref:
            assert torch.equal(g0[name], g1[name]), f"step {step}: ranks hold different reduced gradients ({name})"
            assert _rel_err(g0[name], g_ref[name]) < tol, (step, name, _rel_err(g0[name], g_ref[name]))
    # the check can fail: a summed gradient (2x) is 100% off, far beyond the tolerance
    g0, g_ref = t0["grads"][0], ref["grads"][0]
    assert sum(float(g.norm()) for g in g_ref.values()) > 1e-2
    assert max(_rel_err(2 * g0[n], g_ref[n]) for n in g_ref) > 0.5


def test_weights_and_losses_match_the_single_process_run(runs):
    (t0, t1), ref = runs["tensors"], runs["ref_tensors"]
    start = _initial_drafter_state()
    for name, value in ref["state"].items():
        assert torch.equal(t0["state"][name], t1["state"][name]), f"replicas diverged: {name}"
        assert _rel_err(t0["state"][name], value) < LATER_TOL, (name, _rel_err(t0["state"][name], value))
    moved = max(_rel_err(ref["state"][n], start[n]) for n in start)
    assert moved > 100 * LATER_TOL, "training must move the weights far beyond the tolerance"
    r0, r1 = runs["ranks"]
    mean_loss = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    assert mean_loss == pytest.approx(runs["ref"]["losses"], rel=LATER_TOL)
    assert r0["losses"] != pytest.approx(r1["losses"], rel=1e-2), "the ranks' own losses differ (different rows)"
    # validation logs with sync_dist: every rank reports the global value, equal to one process's
    assert r0["val_loss_tok"] == r1["val_loss_tok"] == pytest.approx(runs["ref"]["val_loss_tok"], rel=LATER_TOL)


def test_only_rank_zero_writes(runs):
    r0, r1 = runs["ranks"]
    assert r1["writes"] == [], f"rank 1 wrote under the run directory: {r1['writes']}"
    written = {path for _, path in r0["writes"]}
    for expected in ("logs/csv/version_0/metrics.csv", "ckpt/last.ckpt", "metrics_exittrain.json"):
        assert expected in written, (expected, sorted(written))
    assert any(path.startswith("export/") for path in written)
    run = runs["out"] / "run"
    assert (run / "export" / "drafter" / "config.json").is_file()
    assert (run / "ckpt" / "last.ckpt").is_file()
    assert len(list((run / "logs" / "csv").iterdir())) == 1, "one logger version: a second rank would add one"
    metrics = json.loads((run / "metrics_exittrain.json").read_text())
    assert metrics["global_step"] == ddp_driver.STEPS and metrics["decode_eval"]["history"]


def _initial_drafter_state() -> dict[str, torch.Tensor]:
    """The drafter's weights before training (the driver's construction and seed)."""
    from tests.lit.helpers import make_module
    from tests.models.helpers import tiny_target

    module = make_module(tiny_target("llama"), anchors_per_seq=ddp_driver.ANCHOR_CANDIDATES)
    return {k: v.detach().clone() for k, v in module.drafter.state_dict().items()}
