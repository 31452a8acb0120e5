"""One offline vLLM generation for the serving check, run by the ``.venv-vllm`` interpreter.

``.venv-vllm/bin/python exittrain/serve/vllm_worker.py REQUEST.json RESULT.json``

vLLM pins an older transformers than exittrain, so it lives in its own virtual environment and
this file runs there as a plain script: it imports the standard library and vLLM only, never
``exittrain`` (whose stack that venv lacks). :mod:`exittrain.serve.vllm_run` writes the request,
starts this script once per mode and reads the result.

Request (JSON object): ``target`` (HF folder), ``drafter`` (DFlash-format folder, or null for
plain decoding), ``num_speculative_tokens`` (K, with a drafter), ``prompts`` (lists of token
ids), ``max_tokens``, ``max_model_len``, ``memory_fraction`` (vLLM's
``gpu_memory_utilization``: on a CPU the share of host memory it reserves),
``kv_cache_gib`` (optional: a fixed KV cache size, which then replaces that share's KV part),
``dtype``, ``per_prompt`` (optional, default false: generate the prompts one at a time, each its
own batch of one, and keep the metrics after each; the per-prompt acceptance counters are their
differences).

Result (JSON object): ``mode`` ("plain" or "dflash"), ``vllm_version``, ``startup_s`` (the
``LLM(...)`` constructor: load, warm-up, worker start), ``generate_s``, ``outputs`` (new token
ids per prompt, EOS kept), ``finish_reasons`` and ``metrics`` (every sample of
``llm.get_metrics()``: ``name``, ``kind``, ``labels`` and ``value`` or ``values``), which the
orchestrator parses; with ``per_prompt``, also ``metrics_after_prompt`` (the cumulative metric
records after each prompt, in prompt order).

Greedy only (temperature 0): the check compares outputs token for token. vLLM's offline engine
starts worker processes, so the work runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import sys
import time

REQUIRED = ("target", "drafter", "prompts", "max_tokens", "max_model_len", "memory_fraction", "dtype")


def _read_request(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        request = json.load(f)
    if not isinstance(request, dict):
        raise ValueError(f"{path}: the request must be a JSON object")
    missing = [k for k in REQUIRED if k not in request]
    if missing:
        raise ValueError(f"{path}: request lacks {missing}; exittrain.serve.vllm_run writes all of {list(REQUIRED)}")
    if request["drafter"] is not None and not isinstance(request.get("num_speculative_tokens"), int):
        raise ValueError(f"{path}: a request with a drafter needs an integer num_speculative_tokens")
    return request


def _metric_record(metric) -> dict:
    """One vLLM metric sample as plain JSON; the kind is the reader's class name."""
    record = {"name": metric.name, "kind": type(metric).__name__, "labels": dict(metric.labels)}
    if hasattr(metric, "values"):
        record["values"] = [int(v) for v in metric.values]
    elif hasattr(metric, "value"):
        record["value"] = metric.value
    elif hasattr(metric, "count"):
        record["value"] = {"count": metric.count, "sum": metric.sum}
    return record


def run(request: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    speculative = None
    if request["drafter"] is not None:
        speculative = {
            "method": "dflash",
            "model": request["drafter"],
            "num_speculative_tokens": request["num_speculative_tokens"],
        }
    kv_bytes = None if request.get("kv_cache_gib") is None else int(request["kv_cache_gib"] * 2**30)
    start = time.perf_counter()
    llm = LLM(
        model=request["target"],
        speculative_config=speculative,
        dtype=request["dtype"],
        enforce_eager=True,
        gpu_memory_utilization=request["memory_fraction"],
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=request["max_model_len"],
        disable_log_stats=False,  # the acceptance counters are stats
        seed=0,
    )
    startup_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in request["prompts"]]
    start = time.perf_counter()
    snapshots = None
    if request.get("per_prompt"):
        # one prompt per call: vLLM's counters are cumulative, so a snapshot after each call gives
        # that prompt's drafts and accepted tokens by difference
        outputs, snapshots = [], []
        for prompt in prompts:
            outputs += llm.generate([prompt], params, use_tqdm=False)
            snapshots.append([_metric_record(m) for m in llm.get_metrics()])
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    return {
        "mode": "plain" if speculative is None else "dflash",
        "vllm_version": vllm.__version__,
        "speculative_config": speculative,
        "startup_s": startup_s,
        "generate_s": generate_s,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "metrics": [_metric_record(m) for m in llm.get_metrics()],
        **({} if snapshots is None else {"metrics_after_prompt": snapshots}),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: vllm_worker.py REQUEST.json RESULT.json\n")
        return 2
    result = run(_read_request(argv[0]))
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
