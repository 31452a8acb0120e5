"""Memory benchmark of target tree scoring: peak memory against budget, sequence length and chunk size.

``python -m exittrain bench memory [--tiny] [--budgets 16 32 64 128] [--lengths 256 512 1024]
[--anchors 8] [--chunk 2] [--full] [--device cpu|cuda] [--target NAME_OR_PATH --dtype bfloat16]``

What one point measures: :meth:`TargetModel.score_trees` in exact mode (the training path) under
``no_grad``, on one sequence of T random tokens with A anchors evenly spaced over its second half,
each carrying a random DDTree tree of budget B and depth K = 7, with ``chunk_size`` = None (all
A anchors in one forward over the prefix cache) or c (c anchors per forward). The grid is a
cross: every budget at the middle length and every length at the second budget, each with and
without chunking (``--full``: the whole product).

How peak memory is measured:

- CPU: one fresh subprocess per point, because a process's allocator keeps what it freed and
  ``tracemalloc`` does not see torch's allocations. The child loads the target, runs one small
  scoring call (which also pages in weights that loading only mapped), returns freed heap to the
  kernel (``malloc_trim``), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``, Linux),
  and reports ``VmHWM - VmRSS`` across the call: the resident memory the call added at its peak.
  Without ``clear_refs`` it falls back to the growth of ``ru_maxrss`` (a lower bound: 0 if loading
  peaked higher), flagged in the result.
- CUDA: one process; ``torch.cuda.max_memory_allocated`` above the memory allocated before the
  call, after ``reset_peak_memory_stats``.

Also reported per point: the rows one target forward scores (``chunk * (B + 1)``, or ``A * (B + 1)``)
and the size of the returned logits, ``A * (B + 1) * V * itemsize``. Chunking bounds the part that
grows with the rows of one forward (attention scores and mask ~ rows x (T + rows), activations ~
rows x width); it cannot bound the returned logits, which every chunk contributes to
(``score_trees`` copies each chunk into the preallocated result, so one chunk coexists with it).

Writes ``<out>.json`` and ``<out>.md``. The default run (embedded SmolLM2-135M, 12 points) takes
about 2 minutes on 2 CPU cores; ``--tiny`` (a random 4-layer model) takes seconds per point.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from exittrain.tables import markdown_table, write_results

DEPTH = 7  # K, the tree depth: drafted tokens per block (block_size 8, the drafter default)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)


# ----------------------------------------------------------------------------------------------
# one point


def build_target(tiny: bool, name_or_path: str | None, device: str, dtype: str):
    """The target to measure: a random tiny Llama (``tiny``), else :func:`load_target`."""
    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        from exittrain.models import TargetModel

        torch.manual_seed(0)
        config = LlamaConfig(**TINY, num_key_value_heads=2, max_position_embeddings=8192, attn_implementation="sdpa")
        return TargetModel(LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)), name="tiny-llama")
    from exittrain.models import load_target

    return load_target(name_or_path, device=device, dtype=dtype)


def make_inputs(target, length: int, budget: int, anchors: int, seed: int = 0):
    """(input_ids (1, T), anchors (1, A), trees of budget B) for one point; trees from random drafts."""
    from exittrain.core import build_tree

    if length < 2 * (DEPTH + 2) or anchors > length // 2 - DEPTH - 1:
        raise ValueError(f"length={length} is too short for {anchors} anchors of depth {DEPTH} in its second half")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, target.vocab_size, (1, length), generator=g)
    positions = torch.linspace(length // 2, length - DEPTH - 1, anchors).round().long().view(1, anchors)
    logits = torch.randn(anchors, DEPTH, target.vocab_size, generator=g) * 3.0
    trees = build_tree(torch.log_softmax(logits, dim=-1), budget)
    return ids, positions, trees


def _status_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _reset_peak_rss() -> bool:
    """Set the kernel's peak-RSS mark (VmHWM) to the current RSS; False where that is unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kb("VmHWM") <= _status_kb("VmRSS") + 1024
    except (OSError, AttributeError):
        return False


def _trim_heap() -> None:
    """Give freed heap pages back to the kernel (glibc), so reusing them during the call counts as growth."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def measure(target, point: dict) -> dict:
    """Peak memory (MB) that one ``score_trees`` call adds, and its time; see the module docstring."""
    ids, anchors, trees = make_inputs(target, point["length"], point["budget"], point["anchors"])
    cuda = target.device.type == "cuda"
    with torch.no_grad():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            _trim_heap()
            hwm_reset = _reset_peak_rss()
            base = _status_kb("VmRSS") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        scores = target.score_trees(ids, anchors, trees, mode="exact", chunk_size=point["chunk"])
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if cuda:
            peak_mb, method = (torch.cuda.max_memory_allocated() - base) / 2**20, "cuda_max_allocated"
        elif hwm_reset:
            peak_mb, method = (_status_kb("VmHWM") - base) / 1024, "vmhwm"
        else:
            peak_mb, method = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024, "ru_maxrss"
    logits = scores.logits
    A, B1 = point["anchors"], point["budget"] + 1
    return {
        **point,
        "rows_per_forward": (point["chunk"] or A) * B1,
        "peak_mb": peak_mb,
        "logits_mb": logits.numel() * logits.element_size() / 2**20,
        "seconds": seconds,
        "method": method,
    }


def _warm_up(target) -> None:
    ids, anchors, trees = make_inputs(target, 4 * DEPTH, 2, 1)
    with torch.no_grad():
        target.score_trees(ids, anchors, trees, mode="exact")


# ----------------------------------------------------------------------------------------------
# the grid


def grid(budgets: list[int], lengths: list[int], anchors: int, chunk: int, full: bool) -> list[dict]:
    """Points: every budget at the middle length and every length at the second budget (or the product)."""
    if full:
        pairs = [(t, b) for t in lengths for b in budgets]
    else:
        t_mid, b_mid = lengths[len(lengths) // 2], budgets[min(1, len(budgets) - 1)]
        pairs = [(t_mid, b) for b in budgets] + [(t, b_mid) for t in lengths if t != t_mid]
    return [
        {"length": t, "budget": b, "anchors": anchors, "chunk": c} for t, b in pairs for c in (None, chunk)
    ]  # fmt: skip


def _run_point_subprocess(point: dict, settings: dict) -> dict:
    """One CPU point in a fresh interpreter (``--point``); returns its JSON line."""
    cmd = [sys.executable, "-m", "exittrain.bench.scoring_memory", "--point", json.dumps(point)]
    cmd += ["--device", "cpu", "--dtype", settings["dtype"]]
    if settings["tiny"]:
        cmd.append("--tiny")
    if settings["target"]:
        cmd += ["--target", settings["target"]]
    if settings["threads"]:
        cmd += ["--threads", str(settings["threads"])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory point {point} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(points: list[dict], *, tiny: bool, target: str | None, device: str, dtype: str, threads: int | None) -> dict:
    """Measure every point (CPU: a subprocess each; CUDA: in this process) and collect the rows."""
    settings = {"tiny": tiny, "target": target, "dtype": dtype, "threads": threads}
    if device == "cpu":
        rows = [_run_point_subprocess(p, settings) for p in points]
        name = "tiny-llama" if tiny else (target or "SmolLM2-135M-Instruct (embedded)")
    else:
        model = build_target(tiny, target, device, dtype)
        _warm_up(model)
        rows = []
        for p in points:
            rows.append(measure(model, p))
            gc.collect()
        name = model.name
    return {"target": name, "device": device, "dtype": dtype, "threads": threads or torch.get_num_threads(),
            "depth": DEPTH, "rows": rows}  # fmt: skip


def to_markdown(result: dict) -> str:
    unit = "peak GPU memory allocated" if result["device"] != "cpu" else "peak RSS growth"
    rows = (
        [r["length"], r["budget"], r["anchors"], r["chunk"] if r["chunk"] is not None else "all", r["rows_per_forward"],
         f"{r['peak_mb']:.0f}", f"{r['logits_mb']:.0f}", f"{r['seconds']:.1f}"]
        for r in result["rows"]
    )
    lines = [
        f"Exact tree scoring on {result['target']} ({result['device']}, {result['dtype']}, "
        f"{result['threads']} threads): {unit} of one `score_trees` call over 1 sequence, trees of depth "
        f"{result['depth']}. rows = tree rows per target forward; logits = the returned (A, B+1, V) tensor.",
        "",
        *markdown_table(["T", "B", "A", "chunk", "rows", "peak (MB)", "logits (MB)", "time (s)"], rows),
    ]
    methods = sorted({r["method"] for r in result["rows"]})
    lines += ["", f"Measured with: {', '.join(methods)}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a random 4-layer target (seconds per point)")
    parser.add_argument("--target", default=None, help="load_target name or path (default: embedded SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--anchors", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=2, help="anchors per forward in the chunked points")
    parser.add_argument("--full", action="store_true", help="every (length, budget) pair, not the cross")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="results/bench_memory")
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)  # internal: one CPU point, JSON
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.point is not None:
        target = build_target(args.tiny, args.target, args.device, args.dtype)
        _warm_up(target)
        print(json.dumps(measure(target, json.loads(args.point))))
        return
    if args.chunk < 1 or args.anchors < 1:
        raise SystemExit("--chunk and --anchors must be >= 1")
    points = grid(args.budgets, args.lengths, args.anchors, args.chunk, args.full)
    result = run(points, tiny=args.tiny, target=args.target, device=args.device, dtype=args.dtype,
                 threads=args.threads)  # fmt: skip
    write_results(args.out, result, to_markdown(result))


if __name__ == "__main__":
    main()
