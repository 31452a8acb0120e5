"""The memory benchmark measures torch's CPU allocations, and chunked tree scoring lowers the peak.

Runs the benchmark's own code path (one fresh subprocess per point) on its random tiny target:
T = 256, A = 32 anchors, B = 64, so one unchunked forward scores 2080 tree rows against 2336 keys.
Its additive attention mask alone is 2080 x 2336 x 4 bytes = 18.5 MiB; chunks of 4 anchors
(260 rows) shrink every rows-dependent buffer about 8x, while the returned logits (4 MiB) stay.
"""

from __future__ import annotations

import json

from exittrain.bench import scoring_memory as bench_memory
from exittrain.bench.registry import BENCHES
from exittrain.tables import write_results

LENGTH, BUDGET, ANCHORS, CHUNK = 256, 64, 32, 4


def test_memory_bench_is_registered():
    assert BENCHES["memory"] == "exittrain.bench.scoring_memory"


def test_grid_is_a_cross_of_budgets_and_lengths_with_and_without_chunks():
    points = bench_memory.grid([16, 32, 64], [256, 512, 1024], anchors=8, chunk=2, full=False)
    pairs = [(p["length"], p["budget"]) for p in points if p["chunk"] is None]
    assert pairs == [(512, 16), (512, 32), (512, 64), (256, 32), (1024, 32)]
    assert [p["chunk"] for p in points] == [None, 2] * 5
    assert len(bench_memory.grid([16, 32], [256, 512], anchors=8, chunk=2, full=True)) == 8


def test_chunked_scoring_has_a_lower_peak(tmp_path):
    points = [{"length": LENGTH, "budget": BUDGET, "anchors": ANCHORS, "chunk": c} for c in (None, CHUNK)]
    result = bench_memory.run(points, tiny=True, target=None, device="cpu", dtype="float32", threads=1)
    full, chunked = result["rows"]
    assert (full["rows_per_forward"], chunked["rows_per_forward"]) == (ANCHORS * (BUDGET + 1), CHUNK * (BUDGET + 1))
    assert full["method"] == chunked["method"] == "vmhwm"  # Linux: the peak-RSS mark was reset before the call
    # the measurement sees torch's allocations: at least the unchunked forward's additive mask
    rows = ANCHORS * (BUDGET + 1)
    mask_mb = rows * (LENGTH + rows) * 4 / 2**20
    assert full["peak_mb"] > mask_mb, (full, mask_mb)
    # chunking bounds the rows-dependent part: well under half the unchunked peak
    assert chunked["peak_mb"] < 0.5 * full["peak_mb"], (chunked, full)
    assert full["logits_mb"] == chunked["logits_mb"] == rows * bench_memory.TINY["vocab_size"] * 4 / 2**20

    write_results(str(tmp_path / "mem"), result, bench_memory.to_markdown(result))
    assert json.loads((tmp_path / "mem.json").read_text())["rows"][1]["chunk"] == CHUNK
    assert "| 256 | 64 | 32 | all | 2080 |" in (tmp_path / "mem.md").read_text()
