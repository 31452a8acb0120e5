"""Micro-benchmarks of the pure core, measured side by side in one run.

``python -m exittrain.bench.core [--quick] [--device cpu|cuda] [--out results/bench_core]``

- tree construction: batched builder vs the heap reference (the heap's host transfer and its
  Python loop are counted), N in {1, 256}, K = 15, V = 49152, B in {32, 64, 128};
- exit law: vectorised vs a per-anchor loop (one call per tree) vs the node-by-node loop twin;
- verifier decision: TEV vs sequential residual vs predraw-and-follow, B = 64, 1 and 64 trees,
  V = 49152, temperature 1, on trees whose target agrees with the drafter often enough that
  walks go a few levels deep.

Reports medians over repeats and the ratios; writes ``<out>.md`` and ``<out>.json``.
These are wall-clock figures on a shared machine: compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from exittrain.core import build_tree, build_tree_reference, exit_law, exit_law_reference
from exittrain.core.verify import verify_predraw, verify_sequential, verify_tev
from exittrain.tables import markdown_table, write_results


def median_seconds(fn, repeats: int, warmup: int = 1, sync=lambda: None) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def drafter_logprobs(N: int, K: int, V: int, device, generator) -> torch.Tensor:
    """Peaked, drafter-like distributions: three likely tokens per position (about 0.6, 0.14 and
    0.05 of the mass) over a noisy tail, so trees grow several levels deep."""
    logits = torch.randn(N, K, V, generator=generator, device=device)
    spikes = torch.randint(0, V, (N, K, 3), generator=generator, device=device)
    boost = torch.tensor([12.5, 11.0, 10.0], device=device).expand(N, K, 3)
    return torch.log_softmax(logits.scatter_add(2, spikes, boost), -1)


def agreeing_target_logits(tree, V: int, generator, boost: float = 13.0) -> torch.Tensor:
    """Target logits per row that favour the row's first child, so walks go several levels deep."""
    N, B = tree.tokens.shape
    logits = torch.randn(N, B + 1, V, generator=generator, device=tree.tokens.device)
    first_child = tree.valid & (tree.sibling_rank == 0)
    index = torch.where(first_child, tree.parents * V + tree.tokens, 0)
    bump = torch.zeros(N, (B + 1) * V, device=logits.device).scatter_add_(1, index, first_child.float() * boost)
    return logits + bump.view(N, B + 1, V)


def run(quick: bool, device: str) -> dict:
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    K, V = 15, 49152
    rows: dict[str, list] = {"tree": [], "exit_law": [], "verify": []}

    for N in (1, 256):
        lp = drafter_logprobs(N, K, V, dev, g)
        for B in (32, 64, 128):
            reps = 3 if N > 1 else 20
            if quick:
                reps = max(1, reps // 3)
            fast = median_seconds(lambda lp=lp, B=B: build_tree(lp, B, validate=False), reps, sync=sync)
            heap = median_seconds(lambda lp=lp, B=B: build_tree_reference(lp, B), reps, sync=sync)
            rows["tree"].append({"N": N, "B": B, "batched_ms": fast * 1e3, "heap_ms": heap * 1e3,
                                 "speedup": heap / fast})
            print(f"tree  N={N:<4d} B={B:<4d} batched {fast * 1e3:8.2f} ms  heap {heap * 1e3:8.2f} ms"
                  f"  x{heap / fast:.2f}", flush=True)

    N, B, V_law = 256, 64, 4096
    lp = drafter_logprobs(N, K, V_law, dev, g)
    tree = build_tree(lp, B)
    probs = torch.softmax(torch.randn(N, B + 1, V_law, generator=g, device=dev), -1)
    vec = median_seconds(lambda: exit_law(tree, probs, validate=False), 5, sync=sync)

    def per_anchor():
        for n in range(N):
            sub = tree.index(slice(n, n + 1))
            exit_law(sub, probs[n : n + 1], validate=False)

    loop = median_seconds(per_anchor, 1 if quick else 3, sync=sync)
    node_loop = median_seconds(lambda: exit_law_reference(tree.index(slice(0, 16)), probs[:16]), 1, warmup=0)
    node_loop *= N / 16  # the node-by-node twin is timed on 16 trees and scaled: it is linear in N
    rows["exit_law"].append({"N": N, "B": B, "V": V_law, "vectorised_ms": vec * 1e3,
                             "per_anchor_loop_ms": loop * 1e3, "node_loop_ms": node_loop * 1e3,
                             "speedup_vs_per_anchor": loop / vec, "speedup_vs_node_loop": node_loop / vec})
    print(f"exit law N={N} B={B}: vectorised {vec * 1e3:.2f} ms, per-anchor loop {loop * 1e3:.1f} ms "
          f"(x{loop / vec:.1f}), node loop ~{node_loop * 1e3:.0f} ms (x{node_loop / vec:.0f})", flush=True)

    B = 64
    for N in (1, 64):
        lp = drafter_logprobs(N, K, V, dev, g)
        tree = build_tree(lp, B)
        logits = agreeing_target_logits(tree, V, g)
        reps = 30 if N == 1 else 5
        if quick:
            reps = max(2, reps // 3)
        gen = torch.Generator(device=dev).manual_seed(1)
        result = {"N": N, "B": B}
        lengths = {}
        for name, fn in (("tev", verify_tev), ("sequential", verify_sequential), ("predraw", verify_predraw)):
            # a fresh tree object per call: the ancestor mask is built inside the timed region
            def call(fn=fn, tree=tree, logits=logits, gen=gen):
                return fn(tree.index(slice(None)), logits, generator=gen, validate=False)

            result[f"{name}_ms"] = median_seconds(call, reps, sync=sync) * 1e3
            lengths[name] = float(call().block_length.float().mean())
        result["sequential_over_tev"] = result["sequential_ms"] / result["tev_ms"]
        result["predraw_over_tev"] = result["predraw_ms"] / result["tev_ms"]
        result["mean_block_length"] = lengths
        rows["verify"].append(result)
        print(f"verify N={N:<3d} B={B}: tev {result['tev_ms']:.2f} ms, sequential {result['sequential_ms']:.2f} ms "
              f"(x{result['sequential_over_tev']:.2f}), predraw {result['predraw_ms']:.2f} ms "
              f"(x{result['predraw_over_tev']:.2f}); block lengths {lengths}", flush=True)
    return rows


def to_markdown(rows: dict, meta: dict) -> str:
    out = [f"# Core micro-benchmarks ({meta['device']}, torch {meta['torch']}, {meta['threads']} threads)", ""]
    out += ["## Tree construction (K = 15, V = 49152)", ""]
    out += markdown_table(
        ["N", "B", "batched (ms)", "heap (ms)", "heap / batched"],
        ([r["N"], r["B"], f"{r['batched_ms']:.2f}", f"{r['heap_ms']:.2f}", f"{r['speedup']:.2f}x"]
         for r in rows["tree"]),
    )
    r = rows["exit_law"][0]
    out += ["", f"## Exit law (N = {r['N']}, B = {r['B']}, V = {r['V']})", ""]
    out += markdown_table(
        ["vectorised (ms)", "per-anchor loop (ms)", "node loop (ms, from 16 trees)", "vs per-anchor", "vs node loop"],
        [[f"{r['vectorised_ms']:.2f}", f"{r['per_anchor_loop_ms']:.1f}", f"{r['node_loop_ms']:.0f}",
          f"{r['speedup_vs_per_anchor']:.1f}x", f"{r['speedup_vs_node_loop']:.0f}x"]],
    )
    out += ["", "## Verifier decision (B = 64, V = 49152, temperature 1)", ""]
    out += markdown_table(
        ["N", "TEV (ms)", "sequential (ms)", "predraw (ms)", "sequential / TEV", "predraw / TEV", "mean block length"],
        ([r["N"], f"{r['tev_ms']:.2f}", f"{r['sequential_ms']:.2f}", f"{r['predraw_ms']:.2f}",
          f"{r['sequential_over_tev']:.2f}x", f"{r['predraw_over_tev']:.2f}x",
          ", ".join(f"{k} {v:.2f}" for k, v in r["mean_block_length"].items())] for r in rows["verify"]),
    )
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="results/bench_core")
    args = parser.parse_args(argv)
    meta = {"device": args.device if args.device != "cpu" else f"cpu ({platform.processor() or platform.machine()})",
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    rows = run(args.quick, args.device)
    write_results(args.out, {"meta": meta, **rows}, to_markdown(rows, meta))


if __name__ == "__main__":
    main()
