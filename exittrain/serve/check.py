"""Serve the embedded target with a DFlash-format drafter in vLLM; check it against itself and us.

``python -m exittrain.serve.check --vllm-python .venv-vllm/bin/python [--drafter DIR] [--out PATH]``
(``make serve-check``; ``make vllm-setup`` builds ``.venv-vllm``).

Steps, on the same held-out prompts (the domain's evaluation set, HumanEval for ``code``, in the
target's chat template, passed to vLLM as token ids):

1. convert the embedded SmolLM2 target to an HF folder
   (:func:`~exittrain.models.target_loading.convert_embedded_target`);
2. take the drafter folder, or write a random-weight DFlash drafter for that target into the
   output folder (:func:`~exittrain.serve.dflash_reference.write_random_dflash_drafter`);
3. run vLLM twice in ``.venv-vllm`` (:func:`~exittrain.serve.vllm_run.run_vllm`), each a fresh
   subprocess of :mod:`exittrain.serve.vllm_worker`: plain greedy decoding, then DFlash speculative decoding
   with ``num_speculative_tokens`` K = block_size - 1 (the block the drafter was trained on);
4. in this process: the target's own greedy decoding, and our chain decoder
   (:class:`~exittrain.decoding.chain_decoder.ChainDecoder`, a chain of budget K with the greedy verifier)
   running the same drafter folder twice (``--ours``): read into exittrain's own drafter by
   :func:`~exittrain.models.load_drafter`, and through the ``dflash`` package's module
   (:class:`~exittrain.serve.dflash_reference.ReferenceDFlashDrafter`).
   vLLM emits the first new token from the prefill without drafting, so our decoder starts from
   the prompt plus that token and both sides draft from the same roots;
5. write ``<out>.json`` and ``<out>.md``: agreement of vLLM with and without speculation (the
   check: exit status 1 when they differ), of our decoder and our target's greedy decoding with
   vLLM, vLLM's mean acceptance length next to ours (:mod:`exittrain.serve.compare`), vLLM's
   startup times and the host.

**Limits.** Greedy (T = 0) only; batch of prompts in vLLM, one at a time in ours. Our target
runs through Hugging Face attention and vLLM through its CPU kernels: both are fp32, but a near
tie between two tokens can still resolve differently, which the table shows as a mismatch of
ours against vLLM rather than hiding it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from exittrain.serve.vllm_run import VLLM_SETUP, run_vllm
from exittrain.vllm_interpreter import default_vllm_python

__all__ = ["check_args", "main", "parse_args", "run"]

# exittrain: our BlockDrafter reading the DFlash folder; reference: the dflash package's module
OURS = ("exittrain", "reference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=default_vllm_python(),
                        help="the vLLM interpreter (default: $EXITTRAIN_VLLM_PYTHON, else .venv-vllm/bin/python)")
    parser.add_argument("--drafter", default=None, help="DFlash-format drafter folder (default: random weights)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: block_size - 1)")
    parser.add_argument(
        "--ours", nargs="+", default=list(OURS), choices=OURS,
        help="drafter implementations our chain decoder runs the folder with (default: both)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--domain", default="code", help="prompt domain; its evaluation set is used")
    parser.add_argument("--memory-fraction", type=float, default=0.5, help="vLLM gpu_memory_utilization")
    parser.add_argument(
        "--kv-cache-gib", type=float, default=1.0,
        help="vLLM's KV cache in GiB, sized for these few prompts (0: let --memory-fraction size it)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per vLLM run")
    parser.add_argument("--out", default="results/serve_check", help="writes <out>.json, <out>.md, <out>_work/")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Validate the arguments before any model loads; ``ValueError`` names the flag and the fix."""
    python = Path(args.vllm_python)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise ValueError(f"--vllm-python {python}: no such interpreter; build the vLLM venv with `{VLLM_SETUP}`")
    if not isinstance(args.prompts, int) or args.prompts < 1:
        raise ValueError(f"--prompts {args.prompts}: need at least 1 prompt")
    if not isinstance(args.max_tokens, int) or args.max_tokens < 2:
        raise ValueError(f"--max-tokens {args.max_tokens}: need at least 2 (the prefill's token and one round)")
    if not 0.0 < args.memory_fraction <= 1.0:
        raise ValueError(f"--memory-fraction {args.memory_fraction}: vLLM's share of memory must lie in (0, 1]")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens {args.num_speculative_tokens}: need K >= 1")
    if args.kv_cache_gib < 0:
        raise ValueError(f"--kv-cache-gib {args.kv_cache_gib}: need a size >= 0 (0 = from --memory-fraction)")
    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout}: need a positive number of seconds")
    if args.drafter is not None and not Path(args.drafter, "config.json").is_file():
        raise ValueError(f"--drafter {args.drafter}: no config.json there; pass a DFlash-format drafter folder")


def _host() -> dict:
    import torch

    from exittrain.precision import cpu_model

    capability, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    return {"cpu": cpu_model(), "capability": capability, "threads": threads}


def _load_drafter(kind: str, drafter_dir: Path, target):
    """The drafter folder as our decoder runs it: exittrain's own drafter, or the reference module."""
    if kind == "exittrain":
        from exittrain.models import load_drafter

        return load_drafter(str(drafter_dir), target)  # reads a DFlash folder into a BlockDrafter
    from exittrain.serve.dflash_reference import ReferenceDFlashDrafter

    return ReferenceDFlashDrafter(drafter_dir).attach_target(target)


def _ours(drafter_dir: Path, prompts: list[list[int]], max_tokens: int, K: int, kinds: list[str]) -> dict:
    """Our target's greedy decoding, then our chain decoder with each drafter implementation."""
    from exittrain.decoding import autoregressive_generate
    from exittrain.decoding.chain_decoder import ChainDecoder, decode_after_prefill
    from exittrain.models import load_target

    target = load_target(None)
    start = time.perf_counter()
    greedy = [autoregressive_generate(target, ids, max_tokens).tokens for ids in prompts]
    result = {"greedy": greedy, "greedy_seconds": time.perf_counter() - start, "runs": {}}
    for kind in kinds:
        # the reference module re-reads its whole context each round: it has no context K/V cache
        decoder = ChainDecoder(
            target, _load_drafter(kind, drafter_dir, target), budget=K, verifier="greedy",
            drafter_cache=kind == "exittrain",
        )
        chain, accepts = [], []
        start = time.perf_counter()
        for ids, plain in zip(prompts, greedy):
            tokens, rounds = decode_after_prefill(decoder, ids, plain[0], max_tokens, target.eos_token_ids)
            chain.append(tokens)
            accepts.append([r.accept_length for r in rounds])
        result["runs"][kind] = {"chain": chain, "accept_lengths": accepts, "seconds": time.perf_counter() - start}
    return result


def run(args: argparse.Namespace) -> dict:
    """The whole check (see the module docstring); returns the result dict."""
    from exittrain.data import chat_prompt_ids, load_domain
    from exittrain.models.target_loading import EMBEDDED_TARGET_NAME, convert_embedded_target
    from exittrain.serve.compare import compare_outputs, our_acceptance
    from exittrain.serve.dflash_reference import read_dflash_config, write_random_dflash_drafter

    out = Path(args.out)
    workdir = out.parent / f"{out.name}_work"
    target_dir = convert_embedded_target()
    if args.drafter is None:
        drafter_dir, kind = write_random_dflash_drafter(target_dir, workdir / "random_dflash_drafter"), "random weights"
    else:
        drafter_dir, kind = Path(args.drafter), "given"
    config = read_dflash_config(drafter_dir)
    block_k = int(config["block_size"]) - 1
    K = block_k if args.num_speculative_tokens is None else args.num_speculative_tokens
    if K != block_k:
        raise ValueError(
            f"--num-speculative-tokens {K}: the drafter's block is {config['block_size']} (K = {block_k}); vLLM "
            "drafts a block of root + K masks, so another K runs a block the drafter never saw and no comparison holds"
        )

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    texts = load_domain(args.domain).eval[: args.prompts]
    if len(texts) < args.prompts:
        raise ValueError(f"--prompts {args.prompts}: the {args.domain} evaluation set has only {len(texts)}")
    prompts = [chat_prompt_ids(tokenizer, t) for t in texts]
    vllm = run_vllm(
        args.vllm_python, str(target_dir), drafter_dir, prompts, max_tokens=args.max_tokens, workdir=workdir,
        timeout=args.timeout, num_speculative_tokens=K, max_model_len=args.max_model_len,
        memory_fraction=args.memory_fraction, kv_cache_gib=args.kv_cache_gib,
    )
    plain, spec = vllm["plain"], vllm["dflash"]
    ours = _ours(drafter_dir, prompts, args.max_tokens, K, args.ours)
    agreement = {
        "vllm_dflash_vs_plain": vllm["agreement"],
        "hf_greedy_vs_vllm_plain": compare_outputs(plain["outputs"], ours["greedy"]),
    }
    for impl, run_ in ours["runs"].items():
        agreement[f"ours_{impl}_vs_vllm_plain"] = compare_outputs(plain["outputs"], run_["chain"])
        agreement[f"ours_{impl}_vs_hf_greedy"] = compare_outputs(ours["greedy"], run_["chain"])
        run_["acceptance"] = our_acceptance(run_["accept_lengths"], K)
    return {
        "target": EMBEDDED_TARGET_NAME,
        "target_dir": str(target_dir),
        "drafter": str(drafter_dir),
        "drafter_kind": kind,
        "target_layer_ids": config["dflash_config"]["target_layer_ids"],
        "domain": args.domain,
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": K,
        "vllm_version": spec["vllm_version"],
        "command": " ".join([Path(sys.executable).name, "-m", "exittrain.serve.check", *sys.argv[1:]]),
        "host": _host(),
        "agreement": agreement,
        "vllm_acceptance": vllm["acceptance"],
        "ours": ours,
        "vllm_plain": {k: plain[k] for k in ("startup_s", "generate_s", "outputs", "finish_reasons")},
        "vllm_dflash": {k: spec[k] for k in ("startup_s", "generate_s", "outputs", "finish_reasons",
                                             "speculative_config")},
    }


def main(argv: list[str] | None = None) -> int:
    from exittrain.serve.compare import to_markdown
    from exittrain.tables import write_results

    args = parse_args(argv)
    result = run(args)
    write_results(args.out, result, to_markdown(result))
    if not result["agreement"]["vllm_dflash_vs_plain"]["equal"]:
        sys.stderr.write("serve check FAILED: vLLM's greedy outputs with DFlash differ from those without it\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
