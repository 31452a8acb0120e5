"""The vLLM answering backend without vLLM: the server client against a protocol stand-in, the
soft-label extraction, resolve_engine's errors and the offline worker's failure path.

``StandIn`` is NOT vLLM. It is a tiny ``http.server`` that answers ``/version`` and
``/v1/completions`` in the format vLLM 0.32's OpenAI server uses for token-id prompts (read from
``vllm/entrypoints/openai/completion/serving.py``): ``choices[i].token_ids`` with
``return_token_ids``, ``logprobs.top_logprobs`` as one dict per generated token keyed
``"token_id:N"`` with ``return_tokens_as_token_ids``, the sampled token listed first and then the
top k, and errors as ``{"error": {"message", "type", "param", "code"}}`` with HTTP 400. Its
"model" is a seeded random distribution over a small vocabulary; it exists to drive the client's
fault paths (retries, rejected prompts, the max-logprobs limit), EOS handling and top-k ordering.
The real engine is tested in tests/test_vllm_answers.py (slow).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from exittrain.data.generation import GenerationConfig
from exittrain.data.vllm_backend import OfflineAnswerer, ServerAnswerer, open_answerer, resolve_engine
from exittrain.data.vllm_outputs import make_answer, top_k_rows

VOCAB, EOS = 50, 7


def position_logprobs(prompt: list[int], j: int) -> torch.Tensor:
    """The stand-in model's log-probabilities (VOCAB,) at response position ``j`` of ``prompt``."""
    g = torch.Generator().manual_seed(1000 * sum(prompt) + j)
    return torch.log_softmax(torch.randn(VOCAB, generator=g) * 3, -1)


class StandIn:
    """A protocol stand-in for ``vllm serve`` (see the module docstring), on a free local port.

    Prompt rules: a prompt longer than ``max_model_len`` is rejected (HTTP 400); a prompt whose
    first token is 1 answers ``[3, 4, EOS]`` then stops (vLLM stops at a stop token and keeps it);
    first token 2 answers two tokens and "length" (cut by the context limit); others answer
    ``max_tokens`` tokens with no EOS. With ``temperature > 0`` the "sampled" token
    is the 3 + k-th most likely one, outside the top k, as vLLM lists it: first, an extra entry.
    ``fail_first`` requests get HTTP 503 before it answers.
    """

    def __init__(self, max_model_len: int = 64, max_logprobs: int = 20, fail_first: int = 0):
        self.max_model_len, self.max_logprobs, self.fail_first = max_model_len, max_logprobs, fail_first
        self.requests: list[dict] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/version":
                    self._send(200, {"version": "0.32.0"})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "NotFoundError", "code": 404}})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append(payload)
                if stand_in.fail_first > 0:
                    stand_in.fail_first -= 1
                    self._send(503, {"error": {"message": "starting", "type": "ServiceUnavailable", "code": 503}})
                    return
                status, body = stand_in.complete(payload)
                self._send(status, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def _error(message: str) -> tuple[int, dict]:
        return 400, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}

    def complete(self, payload: dict) -> tuple[int, dict]:
        k = payload.get("logprobs")
        if k is not None and k > self.max_logprobs:  # vLLM's SamplingParams._validate_logprobs wording
            return self._error(f"Requested sample logprobs of {k}, which is greater than max allowed: "
                               f"{self.max_logprobs}")
        prompts = payload["prompt"] if isinstance(payload["prompt"][0], list) else [payload["prompt"]]
        choices = []
        for index, prompt in enumerate(prompts):
            if len(prompt) > self.max_model_len:
                return self._error(f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                                   f"length of {self.max_model_len}.")
            script = [3, 4, EOS] if prompt[0] == 1 else [5 + (j % 2) * 3 + 1 for j in range(payload["max_tokens"])]
            if prompt[0] == 2:  # cut by the context limit: "length" before max_tokens
                script = [6, 9]
            token_ids, top = [], []
            for j, scripted in enumerate(script[: payload["max_tokens"]]):
                logp = position_logprobs(prompt, j)
                order = logp.argsort(descending=True).tolist()
                sampled = scripted if payload["temperature"] == 0 else order[k + 3]
                token_ids.append(sampled)
                top_k = order[:k]
                entries = {f"token_id:{sampled}": logp[sampled].item()}  # the sampled token first
                for t in reversed(top_k):  # then the top k, here in ascending order: the client must sort
                    entries[f"token_id:{t}"] = logp[t].item()
                top.append(entries)
            logprobs = {"tokens": [f"token_id:{t}" for t in token_ids], "top_logprobs": top} if k else None
            finish = "stop" if token_ids[-1] == EOS else "length"  # a scripted cut ends for length too
            choices.append({"index": index, "token_ids": token_ids, "logprobs": logprobs, "finish_reason": finish})
        return 200, {"id": "cmpl-1", "object": "text_completion", "choices": choices}


def _gen(url: str, **kw) -> GenerationConfig:
    return GenerationConfig(backend="vllm", server_url=url, max_new_tokens=6, batch_size=4, **kw)


def test_server_answers_keep_eos_and_sorted_top_k():
    with StandIn() as server:
        gen = resolve_engine(_gen(server.url))
        assert gen.engine_version == "vllm 0.32.0"
        answerer = ServerAnswerer(gen, top_logprobs=4, eos_ids=[EOS], backoff_s=0.01)
        prompts = [[1, 2, 3], [9, 9], [1, 5]]
        answers = answerer.answer(prompts, batch_index=3)
        sent = server.requests[-1]
    assert sent["prompt"] == prompts and sent["stop_token_ids"] == [EOS] and sent["logprobs"] == 4
    assert sent["temperature"] == 0.0 and sent["seed"] == 3  # greedy; the batch's seed
    assert sent["return_token_ids"] and sent["return_tokens_as_token_ids"]
    first, second, third = answers
    assert first.response == [3, 4, EOS] and first.finished and first.error is None
    assert not second.finished and len(second.response) == 6 and EOS not in second.response
    assert third.finished and first.features is None
    for prompt, a in zip(prompts, answers):
        assert a.top_ids.shape == (len(a.response), 4) and a.top_ids.dtype == torch.int32
        for j in range(len(a.response)):
            values, ids = position_logprobs(prompt, j).topk(4)
            assert a.top_ids[j].tolist() == ids.tolist()
            torch.testing.assert_close(a.top_logprobs[j], values, rtol=0, atol=1e-6)
    assert answerer.describe()["url"] == server.url and answerer.describe()["engine"] == "server"


def test_sampled_token_outside_top_k_is_dropped_and_seed_follows_the_batch():
    with StandIn() as server:
        gen = _gen(server.url, do_sample=True, temperature=0.7, top_p=0.9, seed=10)
        answerer = ServerAnswerer(gen, top_logprobs=3, eos_ids=[EOS], backoff_s=0.01)
        (answer,) = answerer.answer([[9, 9]], batch_index=2)
        sent = server.requests[-1]
    assert (sent["temperature"], sent["top_p"], sent["seed"]) == (0.7, 0.9, 12)
    for j, token in enumerate(answer.response):
        assert token not in answer.top_ids[j].tolist()  # the extra entry vLLM adds is not a soft label
        assert answer.top_ids[j].tolist() == position_logprobs([9, 9], j).topk(3).indices.tolist()


def test_rejected_prompt_becomes_an_error_answer_and_the_rest_are_answered():
    with StandIn(max_model_len=4) as server:
        answerer = ServerAnswerer(_gen(server.url, engine_version="vllm 0.32.0"), top_logprobs=2, eos_ids=[EOS])
        answers = answerer.answer([[1, 2], [9] * 5, [9, 8], [2, 2]], batch_index=0)
        n_requests = len(server.requests)
    assert answers[1].error is not None and "length 5" in answers[1].error and answers[1].response == []
    assert answers[0].error is None and answers[0].finished and answers[2].error is None
    assert "at 2 of max_tokens=6" in answers[3].error and answers[3].response == []  # cut short: no answer
    assert n_requests == 5  # the batch, then each prompt alone


def test_too_many_logprobs_names_the_setting_and_the_server_flag():
    with StandIn(max_logprobs=8) as server:
        answerer = ServerAnswerer(_gen(server.url, engine_version="vllm 0.32.0"), top_logprobs=16, eos_ids=[EOS])
        with pytest.raises(ValueError, match=r"(?s)soft_label_top_k.*--max-logprobs 16"):
            answerer.answer([[1, 2]], batch_index=0)


def test_busy_server_is_retried_and_a_dead_url_names_itself():
    with StandIn(fail_first=2) as server:
        answerer = ServerAnswerer(_gen(server.url, engine_version="v"), top_logprobs=0, eos_ids=[EOS], backoff_s=0.01)
        (answer,) = answerer.answer([[1, 2]], batch_index=0)
        assert answer.response == [3, 4, EOS] and answer.top_ids is None
        assert len(server.requests) == 3
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConnectionError, match=f"{dead}/version unreachable after 3 attempts"):
        resolve_engine(_gen(dead), retries=2, backoff_s=0.01)


def test_resolve_engine_errors_name_the_fix(tmp_path):
    hf = GenerationConfig()
    assert resolve_engine(hf) is hf
    with pytest.raises(ValueError, match=r"engine_python.*make vllm-setup"):
        resolve_engine(GenerationConfig(backend="vllm", engine_python=str(tmp_path / "nope" / "python")))
    if sys.modules.get("vllm") is None:
        with pytest.raises(ValueError, match="has no vLLM installed"):
            resolve_engine(GenerationConfig(backend="vllm", engine_python=sys.executable))
    # no engine_python: the one default every vLLM caller uses, $EXITTRAIN_VLLM_PYTHON first
    missing = tmp_path / "env" / "python"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXITTRAIN_VLLM_PYTHON", str(missing))
        with pytest.raises(ValueError, match=rf"engine_python=None \({missing}\): no such interpreter"):
            resolve_engine(GenerationConfig(backend="vllm"))
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        resolve_engine(_gen("localhost:8000"))
    with pytest.raises(ValueError, match="backend=vllm"):
        open_answerer(hf, target_name="t", tokenizer=None, model=None, top_logprobs=0, eos_ids=[EOS])


def test_offline_worker_failure_carries_its_log(tmp_path):
    """Our own interpreter has no vLLM: the worker reports the import failure and the error carries the log."""
    gen = GenerationConfig(backend="vllm", engine_python=sys.executable)
    with pytest.raises(RuntimeError, match=r"(?s)did not start: ModuleNotFoundError.*No module named 'vllm'"):
        OfflineAnswerer(gen, model_path="unused", dtype="float32", top_logprobs=4, eos_ids=[EOS],
                        startup_timeout_s=60, work_root=tmp_path)
    (log,) = tmp_path.glob("exittrain-vllm-*/vllm_worker.log")  # kept for the reader of the error
    assert "No module named 'vllm'" in log.read_text()


def test_top_k_rows_and_make_answer():
    # vLLM's order: the sampled token, then the top k (it repeats when it is one of them)
    positions = [[(5, -3.0), (1, -0.5), (2, -1.0), (5, -3.0)], [(9, -4.0), (3, -0.1), (4, -0.2)]]
    ids, logp = top_k_rows(positions, 2)
    assert ids.tolist() == [[1, 2], [3, 4]] and logp.dtype == torch.float32
    torch.testing.assert_close(logp, torch.tensor([[-0.5, -1.0], [-0.1, -0.2]]))
    with pytest.raises(RuntimeError, match="fewer than the 3"):
        top_k_rows([[(1, -0.1), (2, -0.2)]], 3)
    answer = make_answer([3, EOS, 4], positions + [[(4, -0.3), (3, -0.4)]], 2, [EOS])
    assert answer.response == [3, EOS] and answer.finished and answer.top_ids.shape == (2, 2)
    with pytest.raises(RuntimeError, match="for 1 of 2 response tokens"):
        make_answer([3, EOS], positions[:1], 2, [EOS])


def test_engine_dtype_and_kv_cache_size():
    from types import SimpleNamespace

    from exittrain.data.vllm_backend import kv_cache_bytes, vllm_dtype

    model = torch.nn.Linear(2, 2)  # fp32 parameters
    assert vllm_dtype(GenerationConfig(backend="vllm"), model) == "float32"  # None: the model's own dtype
    assert vllm_dtype(GenerationConfig(backend="vllm", dtype="bfloat16"), model) == "bfloat16"
    config = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, every layer, fp32
    assert kv_cache_bytes(config, "float32", 20_000) == int(per_token * 20_000 * 1.25)
    assert kv_cache_bytes(config, "float32", 1) == 64 * 2**20  # a floor for tiny batches
    assert kv_cache_bytes(None, "float32", 1000) is None  # no shape: vLLM's memory fraction decides
