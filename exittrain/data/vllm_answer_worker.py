"""vLLM's offline engine answering batches for the regeneration, run by the ``.venv-vllm`` interpreter.

``.venv-vllm/bin/python exittrain/data/vllm_answer_worker.py REQUEST_FD RESPONSE_FD ENGINE_JSON``

vLLM pins an older transformers than exittrain, so it lives in its own virtual environment and
this file runs there as a plain script: it imports the standard library and vLLM only, never
``exittrain``. :class:`exittrain.data.vllm_backend.OfflineAnswerer` starts it once per run (the
engine takes ~30 s to start) and sends it one batch at a time.

**Channel.** JSON lines on two pipes the parent passes as file descriptors: requests arrive on
``REQUEST_FD``, answers leave on ``RESPONSE_FD``. vLLM and its worker processes log to stdout and
stderr, which the parent sends to a log file, so no log line can corrupt an answer.

``ENGINE_JSON`` (object): ``model`` (HF folder or hub id), ``dtype`` (vLLM's: "float32",
``"bfloat16"``, ``"float16"``), ``max_model_len``, ``max_logprobs``, ``memory_fraction`` (vLLM's
``gpu_memory_utilization``; on a CPU the share of host memory it reserves), ``kv_cache_bytes``
(a fixed KV cache size, or null to let the fraction size it).

Messages on ``RESPONSE_FD``: first ``{"ready": true, "vllm_version", "startup_s"}`` (or
``{"fatal": reason}`` and exit 1), then one answer line per request line.

Request: ``{"prompts": [[ids]], "max_tokens", "temperature" (0 = greedy), "top_p", "seed",
"logprobs" (k or null), "stop_token_ids"}``; ``{"close": true}`` ends the worker. Answer:
``{"outputs": [...]}``, one per prompt in order, each ``{"token_ids", "finish_reason", "top"}``
(``top``: per generated token, the ``[id, logprob]`` pairs vLLM returned: its top k plus the sampled
token, unsorted; null without logprobs) or ``{"error": reason}`` for a prompt the engine rejected.
A batch vLLM refuses is retried prompt by prompt so that only the rejected prompts get an error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _start_engine(engine: dict):
    from vllm import LLM

    kwargs = {}
    if engine.get("kv_cache_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(engine["kv_cache_bytes"])
    return LLM(
        model=engine["model"],
        dtype=engine["dtype"],
        enforce_eager=True,
        gpu_memory_utilization=engine["memory_fraction"],
        max_model_len=engine["max_model_len"],
        max_logprobs=engine["max_logprobs"],
        seed=0,
        **kwargs,
    )


def _output_record(output) -> dict:
    """One finished request as JSON: its token ids, finish reason and the logprob entries per token."""
    completion = output.outputs[0]
    top = None
    if completion.logprobs is not None:
        # each position is {token_id: Logprob}: the sampled token first, then vLLM's top k
        top = [[[int(t), float(lp.logprob)] for t, lp in position.items()] for position in completion.logprobs]
    return {"token_ids": [int(t) for t in completion.token_ids], "finish_reason": completion.finish_reason, "top": top}


def _answer(llm, request: dict, max_model_len: int) -> dict:
    from vllm import SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMClientError

    rejected = (ValueError, TypeError, VLLMClientError)  # what vLLM raises for a request it refuses

    params = SamplingParams(
        temperature=float(request["temperature"]),
        top_p=float(request["top_p"]),
        seed=request["seed"],
        max_tokens=int(request["max_tokens"]),
        logprobs=request["logprobs"],
        stop_token_ids=list(request["stop_token_ids"]),
        detokenize=False,  # the caller reads token ids only
    )
    prompts = request["prompts"]
    outputs: list[dict | None] = [None] * len(prompts)
    todo = []
    room = max_model_len - int(request["max_tokens"])
    for i, ids in enumerate(prompts):
        # vLLM refuses a prompt with no room for a new token and silently cuts an answer at
        # max_model_len; either way the answer would not be the target's: name it instead
        if not ids or len(ids) > room:
            outputs[i] = {
                "error": f"prompt of {len(ids)} tokens: this engine answers 1 to {room} (max_model_len "
                f"{max_model_len} less max_tokens {request['max_tokens']})"
            }
        else:
            todo.append(i)
    try:
        done = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in todo], params, use_tqdm=False)
        for i, out in zip(todo, done):
            outputs[i] = _output_record(out)
    except rejected as batch_error:  # a rejected prompt fails the whole call: find which
        sys.stderr.write(f"batch rejected ({batch_error}); retrying its {len(todo)} prompts one by one\n")
        for i in todo:
            try:
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompts[i])], params, use_tqdm=False)
                outputs[i] = _output_record(out)
            except rejected as e:
                outputs[i] = {"error": f"{type(e).__name__}: {e}"}
    return {"outputs": outputs}


def serve(request_fd: int, response_fd: int, engine: dict) -> int:
    with open(request_fd, encoding="utf-8") as requests, open(response_fd, "w", encoding="utf-8") as responses:

        def send(message: dict) -> None:
            responses.write(json.dumps(message) + "\n")
            responses.flush()

        start = time.perf_counter()
        try:
            import vllm

            llm = _start_engine(engine)
        except Exception as e:  # the parent reads the reason; the traceback goes to the log
            traceback.print_exc()
            send({"fatal": f"{type(e).__name__}: {e}"})
            return 1
        send({"ready": True, "vllm_version": vllm.__version__, "startup_s": time.perf_counter() - start})
        for line in requests:
            request = json.loads(line)
            if request.get("close"):
                break
            send(_answer(llm, request, int(engine["max_model_len"])))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: vllm_answer_worker.py REQUEST_FD RESPONSE_FD ENGINE_JSON\n")
        return 2
    request_fd, response_fd = int(argv[0]), int(argv[1])
    for fd in (request_fd, response_fd):  # vLLM's own subprocesses must not hold the channel open
        os.set_inheritable(fd, False)
    return serve(request_fd, response_fd, json.loads(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
