"""vLLM's greedy decoding with and without a DFlash drafter, each run in a fresh worker process of
``.venv-vllm``'s interpreter: the library function that the serving check
(:mod:`exittrain.serve.check`), fit's finish (:mod:`exittrain.heldout.serving_track`) and the vLLM
bench call.

:func:`run_worker` runs :mod:`exittrain.serve.vllm_worker` once on a request; :func:`run_vllm`
runs it twice on the same prompts (plain, then DFlash speculative decoding) and compares the two.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

__all__ = ["VLLM_SETUP", "WORKER", "run_vllm", "run_worker"]

WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_SETUP = "make vllm-setup"
"""The command that builds ``.venv-vllm``, named by every error about a missing vLLM interpreter."""


def run_worker(vllm_python: str, request: dict, workdir: Path, name: str, timeout: float) -> dict:
    """Run :mod:`exittrain.serve.vllm_worker` on ``request`` in a fresh process; its result dict.

    The worker's output goes to ``workdir/<name>.log``; a failure raises ``RuntimeError`` with
    the log's tail.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    req, res, log = workdir / f"{name}_request.json", workdir / f"{name}_result.json", workdir / f"{name}.log"
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # absolute, not resolved: a venv's python is a symlink whose target would lose the venv
    python = os.path.abspath(vllm_python)
    with open(log, "w") as out:
        proc = subprocess.run(
            [python, str(WORKER), str(req), str(res)],
            stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=env, timeout=timeout, check=False,
        )
    if proc.returncode != 0 or not res.is_file():
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"vLLM {name} run failed (exit {proc.returncode}); {log} ends with:\n" + "\n".join(tail))
    return json.loads(res.read_text())


def run_vllm(
    vllm_python: str | os.PathLike,
    target_dir: str | os.PathLike,
    drafter_dir: str | os.PathLike,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    workdir: Path,
    timeout: float = 1800.0,
    num_speculative_tokens: int | None = None,
    max_model_len: int = 2048,
    memory_fraction: float = 0.5,
    kv_cache_gib: float = 1.0,
    per_prompt: bool = False,
    plain: dict | None = None,
) -> dict:
    """vLLM's greedy decoding of ``prompts`` (token ids) twice, plain and with the DFlash drafter in
    ``drafter_dir``, each in a fresh ``vllm_python`` worker process (what ``fit``'s finish calls).

    K (``num_speculative_tokens``) defaults to the drafter's ``block_size - 1``; another K raises
    ValueError (vLLM would draft a block the drafter never saw). Returns ``plain`` and ``dflash``
    (the workers' results), ``agreement`` (:func:`~exittrain.serve.compare.compare_outputs` of the
    two: ``equal`` is the check that speculation changed no output), ``acceptance``
    (:func:`~exittrain.serve.compare.acceptance_from_metrics`: ``mean_acceptance_length``),
    ``num_speculative_tokens`` and ``vllm_version``. Worker logs go to ``workdir``.

    ``per_prompt``: both runs generate one prompt at a time (batches of one, so plain and
    speculative decoding see the same batch shapes), and the result adds ``per_prompt`` (each
    prompt's drafts and accepted tokens, :func:`~exittrain.serve.compare.per_prompt_counts`), from
    which intervals and paired differences follow. ``plain``: the ``plain`` of an earlier call on
    the same prompts, target and settings, reused instead of a second plain run (comparing several
    drafters needs one).
    """
    from exittrain.serve.compare import acceptance_from_metrics, compare_outputs, per_prompt_counts
    from exittrain.serve.dflash_reference import read_dflash_config

    python = Path(vllm_python)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise ValueError(f"vLLM interpreter {python}: no such executable; build the vLLM venv with `{VLLM_SETUP}`")
    block_k = int(read_dflash_config(Path(drafter_dir))["block_size"]) - 1
    K = block_k if num_speculative_tokens is None else int(num_speculative_tokens)
    if K != block_k:
        raise ValueError(
            f"num_speculative_tokens={K}: the drafter's block holds K = {block_k}; vLLM drafts a block of root + K "
            "masks, so another K runs a block the drafter never saw"
        )
    if not prompts:
        raise ValueError("no prompts for vLLM: pass at least one list of token ids")
    request = {
        "target": str(target_dir), "prompts": [list(p) for p in prompts], "max_tokens": int(max_tokens),
        "max_model_len": max_model_len, "memory_fraction": memory_fraction, "dtype": "float32",
        "kv_cache_gib": kv_cache_gib or None, "per_prompt": bool(per_prompt),
    }
    workdir = Path(workdir)
    if plain is None:
        plain = run_worker(str(python), {**request, "drafter": None}, workdir, "vllm_plain", timeout)
    elif len(plain["outputs"]) != len(prompts):
        raise ValueError(f"the reused plain run answered {len(plain['outputs'])} prompts, not these {len(prompts)}")
    spec = run_worker(
        str(python), {**request, "drafter": str(Path(drafter_dir).resolve()), "num_speculative_tokens": K},
        workdir, "vllm_dflash", timeout,
    )
    return {
        "plain": plain,
        "dflash": spec,
        "agreement": compare_outputs(plain["outputs"], spec["outputs"]),
        "acceptance": acceptance_from_metrics(spec["metrics"]),
        "num_speculative_tokens": K,
        "vllm_version": spec["vllm_version"],
        **({"per_prompt": per_prompt_counts(spec["metrics_after_prompt"])} if per_prompt else {}),
    }
