"""vLLM's own acceptance length for several drafters on the same prompts, paired, with intervals.

``python -m exittrain bench vllm DRAFTER [DRAFTER ...] [--labels A B ...] [--domain code]
[--prompts 16] [--skip 0] [--max-new-tokens 64] [--out results/vllm_acceptance]``

Each ``DRAFTER`` is a DFlash-format folder (``RUN_DIR/drafter_dflash``, what a user ships) or a
saved exittrain drafter (``RUN_DIR/drafter``), exported here to ``<out>_work/<label>/drafter_dflash``
as ``fit`` exports it (a drafter the format cannot hold is refused with the reason).

**What runs.** The embedded target, converted to an HF folder, decodes the recipe's evaluation
prompts ``skip .. skip + prompts``, read as ``fit`` and ``eval`` read them
(:func:`exittrain.bench.recipe.heldout_prompts`; ``fit``'s table decodes the first ``eval.num_prompts`` = 16:
``--skip 0 --prompts 16 --max-new-tokens 64`` are its prompts) greedily in vLLM, in fp32, one
prompt at a time: once without speculation, then once per drafter with DFlash speculation of K =
``block_size - 1`` tokens (:func:`exittrain.serve.vllm_run.run_vllm`, each run a fresh worker of
``.venv-vllm``). vLLM's counters after each prompt give that prompt's drafts and accepted tokens.

**What it reports,** per drafter: vLLM's mean acceptance length ``1 + accepted / drafts`` pooled
over the prompts, its 95% interval (bootstrapping prompts), the paired difference from the first
drafter (the same resampled prompts on both sides) and whether vLLM's outputs with speculation
equal its outputs without (``lossless``; a mismatch is flagged, not hidden). Writes
``<out>.json`` and ``<out>.md``; worker logs under ``<out>_work/``.

Limits: greedy only (vLLM's DFlash drafts are greedy, and the check compares outputs token for
token); one worker start per drafter (tens of seconds each on a CPU); drafters of another K than
the first's get no paired difference (they draft other blocks, though on the same prompts they
are still comparable as acceptance lengths).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from exittrain.tables import markdown_table, paired_cell, write_results

__all__ = ["dflash_folder", "main", "measure_vllm", "parse_args", "run", "to_markdown"]

log = logging.getLogger(__name__)


def dflash_folder(path: str | Path, label: str, work: Path, target) -> Path:
    """``path`` itself when it is a DFlash-format folder; a saved exittrain drafter is exported to
    ``work/<label>/drafter_dflash`` (:func:`exittrain.export.export_beside`). ``ValueError`` names a
    folder that is neither, or a drafter the format cannot hold, with the reason."""
    from exittrain.export import export_beside
    from exittrain.models import load_drafter
    from exittrain.models.dflash_format import is_dflash_folder

    path = Path(path)
    if is_dflash_folder(path):
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; pass a DFlash folder (RUN_DIR/drafter_dflash) or a saved "
                         "exittrain drafter (RUN_DIR/drafter)")
    exported = export_beside(load_drafter(path, target), work / label, target)
    if exported["path"] is None:
        raise ValueError(f"{path}: the DFlash format cannot hold this drafter ({exported['why']}); vLLM cannot "
                         "serve it")
    return Path(exported["path"])


def measure_vllm(vllm_python: str, target_dir: str, dflash_dirs: dict[str, Path], prompts: list[list[int]], *,
                 max_new_tokens: int, workdir: Path, max_model_len: int = 2048) -> dict:
    """vLLM's per-prompt acceptance of every DFlash folder in ``dflash_dirs`` (label -> folder, the
    first is the reference of the paired differences) on ``prompts``, with one shared plain run.

    Returns ``{"drafters": {label: {"tau", "ci95", "vs_first", "lossless", "prompts_equal", "K",
    "per_prompt", "seconds"}}, "plain_s", "vllm_version"}``.
    """
    from exittrain.serve.compare import acceptance_interval, paired_acceptance
    from exittrain.serve.vllm_run import run_vllm

    out, plain, first = {}, None, None
    version = None
    for label, folder in dflash_dirs.items():
        t0 = time.perf_counter()
        result = run_vllm(vllm_python, target_dir, folder, prompts, max_tokens=max_new_tokens,
                          workdir=workdir / label, max_model_len=max_model_len, per_prompt=True, plain=plain)
        plain, version = result["plain"], result["vllm_version"]
        counts, K = result["per_prompt"], result["num_speculative_tokens"]
        interval = acceptance_interval(counts)
        same_k = first is not None and first[1] == K
        out[label] = {
            "tau": interval["mean"], "ci95": interval["ci95"], "drafts": interval["drafts"], "K": K,
            "vs_first": paired_acceptance(counts, first[0]) if same_k else None,
            "lossless": result["agreement"]["equal"], "prompts_equal": result["agreement"]["prompts_equal"],
            "per_prompt": counts, "seconds": time.perf_counter() - t0,
        }
        first = first or (counts, K)
        if not result["agreement"]["equal"]:
            log.error("%s: vLLM's greedy outputs with DFlash speculation differ from those without on %d of %d "
                      "prompts; see %s", label, len(prompts) - result["agreement"]["prompts_equal"], len(prompts),
                      workdir / label)
        log.info("%s: vLLM acceptance %.3f (%.3f-%.3f), K=%d, lossless=%s (%.0f s)", label, interval["mean"],
                 *interval["ci95"], K, result["agreement"]["equal"], out[label]["seconds"])
    return {"drafters": out, "plain_s": plain["generate_s"] if plain else None, "vllm_version": version}


def run(args: argparse.Namespace) -> dict:
    from exittrain.bench.recipe import compose_fit_config, heldout_prompts
    from exittrain.heldout.serving_track import target_folder
    from exittrain.models import load_target
    from exittrain.report.results_page import host_info

    target = load_target(None)
    work = Path(f"{args.out}_work")
    labels = args.labels or [Path(d).parent.name + "/" + Path(d).name for d in args.drafters]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two drafters share the label PARENT/FOLDER ({labels}); name them with --labels")
    folders = {label: dflash_folder(path, label.replace("/", "_"), work, target)
               for label, path in zip(labels, args.drafters)}
    prompts = heldout_prompts(compose_fit_config(args.domain, work), target, args.prompts, skip=args.skip)
    positions = getattr(target.model.config, "max_position_embeddings", None) or 2048
    measured = measure_vllm(args.vllm_python, target_folder(target, None), folders, prompts,
                            max_new_tokens=args.max_new_tokens, workdir=work, max_model_len=min(2048, int(positions)))
    return {"domain": args.domain, "prompts": len(prompts), "skip": args.skip, "max_new_tokens": args.max_new_tokens,
            "folders": {k: str(v) for k, v in folders.items()}, "host": host_info(), **measured}


def to_markdown(result: dict) -> str:
    header = ["drafter", "K", "vLLM acceptance length", "95% CI", "vs the first (paired 95% CI)", "drafts",
              "lossless (= vLLM without speculation)"]
    body = [[label, r["K"], f"{r['tau']:.3f}", f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}", paired_cell(r["vs_first"]),
             r["drafts"], "yes" if r["lossless"] else f"NO ({r['prompts_equal']}/{result['prompts']} prompts equal)"]
            for label, r in result["drafters"].items()]
    lines = [
        f"vLLM {result['vllm_version']}, DFlash speculation, greedy, fp32: {result['prompts']} {result['domain']} "
        f"evaluation prompts (from #{result['skip']}), up to {result['max_new_tokens']} new tokens, one prompt at a "
        f"time. Acceptance length = 1 + accepted / drafts, pooled over prompts; intervals bootstrap prompts.",
        "",
        *markdown_table(header, body),
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    from exittrain.vllm_interpreter import default_vllm_python

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+", help="DFlash folders or saved exittrain drafters (the first: reference)")
    parser.add_argument("--labels", nargs="+", help="one name per drafter (default: PARENT/FOLDER)")
    parser.add_argument("--domain", default="code", choices=["code", "dialogue", "math"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--skip", type=int, default=0, help="evaluation prompts to leave out first (0: fit's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--vllm-python", default=default_vllm_python(),
                        help="the vLLM interpreter (default: $EXITTRAIN_VLLM_PYTHON, else .venv-vllm/bin/python)")
    parser.add_argument("--out", default="results/vllm_acceptance")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.drafters):
        parser.error(f"--labels names {len(args.labels)} drafters, but {len(args.drafters)} were given")
    if args.labels is not None and len(set(args.labels)) != len(args.labels):
        parser.error("--labels must be distinct")
    if args.prompts < 1 or args.skip < 0 or args.max_new_tokens < 2:
        parser.error("need --prompts >= 1, --skip >= 0 and --max-new-tokens >= 2 (the prefill's token and a round)")
    if not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python {args.vllm_python}: no such interpreter; build it with `make vllm-setup`")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    result = run(args)
    write_results(args.out, result, to_markdown(result))


if __name__ == "__main__":
    main()
