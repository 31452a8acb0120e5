"""The target's answers from vLLM: its offline engine in its own venv, or a running vLLM server.

``data.generation.backend=vllm`` answers the regeneration's prompts with vLLM instead of Hugging
Face ``generate`` (:func:`exittrain.data.generation.generate_batch`). Two engines, one contract:

- **offline** (``server_url`` None): one persistent worker process for the whole run,
  ``gen.engine_python`` running :mod:`exittrain.data.vllm_answer_worker` (vLLM pins an older
  transformers than exittrain, so it has its own venv: ``make vllm-setup``). Batches travel as JSON
  lines over two dedicated pipes; vLLM's logs go to a log file whose tail any failure carries.
- **server** (``server_url``): the OpenAI-compatible ``/v1/completions`` endpoint of ``vllm serve``
  with token-id prompts, through the standard library (``urllib``).

Each answer follows :func:`~exittrain.data.generation.split_response`: the response runs up to
and including the first EOS (``eos_ids``, also vLLM's stop tokens) and ``finished`` is True iff it
ends with one (both engines read their outputs with :mod:`exittrain.data.vllm_outputs`). Greedy,
or ``gen``'s sampling (``temperature``, ``top_p``) with the seed ``gen.seed + batch_index``, so a
resumed batch draws the same. With ``top_logprobs`` k > 0,
``top_ids`` / ``top_logprobs`` (r, k) are the k most likely next tokens and their log-probabilities
at each response position, sorted descending, from the raw distribution before any sampling warp
(vLLM's default ``logprobs_mode="raw_logprobs"``). vLLM adds the sampled token to its top k as an
extra entry; it is kept only where it is one of the k. ``features`` is always None: vLLM returns
no hidden states, so the drafter's features come from a teacher-forced target pass.

A prompt the engine rejects (one that with ``max_new_tokens`` exceeds its ``max_model_len``, an
HTTP 400 for that prompt), and an answer the engine cut at its ``max_model_len`` before
``max_new_tokens``, become ``Answer(error=reason)``; the caller counts them. Limits: vLLM's kernels differ from Hugging
Face's, so answers agree with ``generate_batch``'s token for token only mostly, even in fp32
(``tests/test_vllm_answers.py`` measures it); a server's model, dtype and ``--max-logprobs`` are
whatever it was started with (the describe record names its URL and version, not its weights).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exittrain.data.generation import GENERATION_DTYPES, Answer, GenerationConfig
from exittrain.data.vllm_outputs import cut_short, make_answer
from exittrain.vllm_interpreter import default_vllm_python

# Shapes: r = response length, k = top log-probabilities kept per response position.

WORKER = Path(__file__).with_name("vllm_answer_worker.py")
SETUP_HINT = (
    "run `make vllm-setup` (builds .venv-vllm), or set data.generation.engine_python to the python of an "
    "environment with vLLM, or data.generation.server_url=http://HOST:PORT for a running `vllm serve`"
)
TOP_K_KEYS = "objective.soft_label_top_k (data.top_logprobs)"
DEFAULT_MAX_LOGPROBS = 20
"""vLLM's own default ``max_logprobs``; the offline engine raises it to k when k is larger."""
_VERSION_PROBE = (
    "import importlib.metadata as m; d = m.packages_distributions().get('vllm'); "
    "print(m.version(d[0]) if d else '')"
)


def _version_tag(version: str) -> str:
    """The engine version as it keys the cache: the same for the offline engine and a server."""
    return f"vllm {version}"


def _engine_python(gen: GenerationConfig) -> str:
    """``gen.engine_python`` as an absolute path (not resolved: a venv's python is a symlink whose
    target would lose the venv); ValueError with the fix when there is no such interpreter."""
    python = os.path.abspath(gen.engine_python or default_vllm_python())
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ValueError(f"data.generation.engine_python={gen.engine_python!r} ({python}): no such interpreter; "
                         f"{SETUP_HINT}")
    return python


def _clean_env() -> dict[str, str]:
    """Our environment without what would point the vLLM venv's python at exittrain's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def resolve_engine(gen: GenerationConfig, *, retries: int = 4, backoff_s: float = 0.5) -> GenerationConfig:
    """``gen`` with ``engine_version`` filled in (part of the cache key); ``gen`` itself for ``backend="hf"``.

    Offline engine: the installed vLLM distribution's version, read by ``gen.engine_python`` from
    its package metadata (no vLLM import: ~1 s). Server: its ``GET /version``, with the retries of
    :class:`ServerAnswerer`. A missing interpreter, or one without vLLM, raises ValueError with the fix.
    """
    if gen.backend != "vllm":
        return gen
    if gen.server_url is not None:
        body = _request_json(_base_url(gen.server_url) + "/version", None, timeout_s=30, retries=retries,
                             backoff_s=backoff_s)
        version = body.get("version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            raise ValueError(f"{gen.server_url}/version answered {body!r}, not vLLM's {{\"version\": ...}}; is "
                             "data.generation.server_url a vLLM server?")
        return dataclasses.replace(gen, engine_version=_version_tag(version))
    python = _engine_python(gen)
    proc = subprocess.run([python, "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=120,
                          env=_clean_env(), check=False)
    version = proc.stdout.strip()
    if proc.returncode != 0 or not version:
        raise ValueError(
            f"data.generation.engine_python={gen.engine_python!r} has no vLLM installed (exit {proc.returncode}: "
            f"{proc.stderr.strip()[-300:]}); {SETUP_HINT}"
        )
    return dataclasses.replace(gen, engine_version=_version_tag(version))


def _sampling(gen: GenerationConfig, batch_index: int) -> dict[str, Any]:
    """Greedy, or ``gen``'s sampling with the batch's own seed (a resumed batch draws the same)."""
    if not gen.do_sample:
        return {"temperature": 0.0, "top_p": 1.0, "seed": gen.seed + batch_index}
    return {"temperature": gen.temperature, "top_p": gen.top_p, "seed": gen.seed + batch_index}


def _too_many_logprobs(message: str, k: int, where: str) -> ValueError:
    return ValueError(
        f"{TOP_K_KEYS}={k} is more log-probabilities than the vLLM engine at {where} allows ({message.strip()}); "
        f"lower {TOP_K_KEYS}, or restart the server with `vllm serve ... --max-logprobs {k}`"
    )


# ----------------------------------------------------------------------------------------------
# The answerers
# ----------------------------------------------------------------------------------------------


class Answerer:
    """Answers batches of templated prompts; a context manager that closes the engine on exit.

    ``answer(prompt_ids, batch_index)`` returns one :class:`Answer` per prompt, in order (an
    ``error`` for a prompt the engine rejected); ``describe()`` is a plain dict for logs and metadata.
    """

    def answer(self, prompt_ids: list[list[int]], batch_index: int) -> list[Answer]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine; idempotent."""

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def __enter__(self) -> Answerer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _base_url(url: str) -> str:
    if not re.match(r"^https?://", url):
        raise ValueError(f"data.generation.server_url={url!r}: write http://HOST:PORT (the vLLM server's base URL)")
    return url.rstrip("/").removesuffix("/v1")


class ServerRejected(Exception):
    """An HTTP 4xx from the server: the request (or a prompt in it) is refused, not the connection."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def _request_json(url: str, payload: dict | None, *, timeout_s: float, retries: int, backoff_s: float) -> Any:
    """GET (``payload`` None) or POST JSON; the decoded JSON answer.

    Connection errors, timeouts and HTTP 502/503/504 (a server starting or overloaded) are retried
    ``retries`` times with doubling waits, then raise ConnectionError naming the URL. An HTTP 4xx
    raises :class:`ServerRejected` with the server's message; another 5xx, RuntimeError.
    """
    data = None if payload is None else json.dumps(payload).encode()
    headers = {} if payload is None else {"Content-Type": "application/json"}
    last: BaseException | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            try:  # vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}
                message = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = body[:500]
            if 400 <= e.code < 500:
                raise ServerRejected(e.code, message) from None
            if e.code not in (502, 503, 504):
                raise RuntimeError(f"vLLM server {url} failed: HTTP {e.code}: {message}") from None
            last = e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            last = e
    raise ConnectionError(
        f"vLLM server {url} unreachable after {retries + 1} attempts ({last}); start it (`vllm serve MODEL "
        "--port PORT`) or fix data.generation.server_url, or drop server_url to run the offline engine"
    )


class ServerAnswerer(Answerer):
    """Batches through a running vLLM server's ``/v1/completions`` (token-id prompts, one request per batch).

    A batch the server refuses with a 4xx is retried prompt by prompt: the prompts it refuses alone
    get ``Answer(error=...)``, the others their answers. Asking for more log-probabilities than the
    server's ``--max-logprobs`` raises ValueError naming the setting and the flag.
    """

    def __init__(self, gen: GenerationConfig, *, top_logprobs: int, eos_ids: Sequence[int], retries: int = 4,
                 backoff_s: float = 0.5, timeout_s: float = 3600.0):
        self.gen, self.k, self.eos_ids = gen, int(top_logprobs), [int(e) for e in eos_ids]
        self.url = _base_url(gen.server_url or "")
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        if gen.engine_version is None:
            gen = resolve_engine(gen, retries=retries, backoff_s=backoff_s)
        self.engine_version = gen.engine_version

    def _payload(self, prompt: list[int] | list[list[int]], batch_index: int) -> dict[str, Any]:
        payload = {
            "prompt": prompt,
            "max_tokens": self.gen.max_new_tokens,
            "stop_token_ids": self.eos_ids,
            "return_token_ids": True,  # choices carry token_ids: no detokenized text to map back
            "return_tokens_as_token_ids": True,  # logprob keys read "token_id:N"
            "skip_special_tokens": False,
            **_sampling(self.gen, batch_index),
        }
        if self.k > 0:
            payload["logprobs"] = self.k
        return payload

    def _post(self, prompt: list[int] | list[list[int]], batch_index: int) -> list[dict]:
        body = _request_json(self.url + "/v1/completions", self._payload(prompt, batch_index),
                             timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s)
        return sorted(body["choices"], key=lambda c: c["index"])

    def _answer_of(self, choice: dict) -> Answer:
        token_ids = choice.get("token_ids")
        logprobs = choice.get("logprobs")
        if token_ids is None:
            raise RuntimeError(f"vLLM server {self.url} returned no token_ids; it must support return_token_ids "
                               "(vLLM >= 0.10)")
        cut = cut_short(choice.get("finish_reason"), len(token_ids), self.gen.max_new_tokens)
        if cut is not None:
            return Answer([], False, error=cut)
        positions = None
        if self.k > 0:
            if not logprobs or logprobs.get("top_logprobs") is None:
                raise RuntimeError(f"vLLM server {self.url} returned no logprobs for logprobs={self.k}")
            positions = [
                [(int(key.removeprefix("token_id:")), float(lp)) for key, lp in (entry or {}).items()]
                for entry in logprobs["top_logprobs"]
            ]
        return make_answer(token_ids, positions, self.k, self.eos_ids)

    def _check_logprob_limit(self, rejected: ServerRejected) -> None:
        if "logprobs" in rejected.message and "max allowed" in rejected.message:
            raise _too_many_logprobs(rejected.message, self.k, self.url) from None

    def answer(self, prompt_ids: list[list[int]], batch_index: int) -> list[Answer]:
        try:
            choices = self._post([list(p) for p in prompt_ids], batch_index)
        except ServerRejected as batch_rejected:
            self._check_logprob_limit(batch_rejected)
            answers = []
            for prompt in prompt_ids:  # find which prompts the server refuses
                try:
                    (choice,) = self._post(list(prompt), batch_index)
                    answers.append(self._answer_of(choice))
                except ServerRejected as e:
                    self._check_logprob_limit(e)
                    answers.append(Answer([], False, error=str(e)))
            return answers
        if len(choices) != len(prompt_ids):
            raise RuntimeError(f"vLLM server {self.url} answered {len(choices)} choices for {len(prompt_ids)} prompts")
        return [self._answer_of(c) for c in choices]

    def describe(self) -> dict[str, Any]:
        return {"backend": "vllm", "engine": "server", "engine_version": self.engine_version, "url": self.url,
                "startup_s": 0.0}


def vllm_dtype(gen: GenerationConfig, model: Any) -> str:
    """vLLM's ``dtype`` for ``gen.dtype``: its name, or the model's own dtype for None (``"auto"``
    is decided for the model's device first, like :meth:`GenerationConfig.resolved`)."""
    device = next(model.parameters()).device
    dtype = gen.resolved(device).dtype
    if dtype is None:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dtype not in GENERATION_DTYPES:
        raise ValueError(f"data.generation.dtype={gen.dtype!r}: vLLM answers in one of {sorted(GENERATION_DTYPES)}")
    return dtype


def kv_cache_bytes(model_config: Any, dtype: str, tokens: int) -> int | None:
    """A KV cache for ``tokens`` tokens of this model (K and V of every layer), with a quarter spare;
    None where the config does not say its shape (vLLM's memory fraction sizes it then)."""
    try:
        heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None)
        head_dim = head_dim or model_config.hidden_size // model_config.num_attention_heads
        per_token = 2 * model_config.num_hidden_layers * heads * head_dim * GENERATION_DTYPES[dtype].itemsize
    except (AttributeError, TypeError):
        return None
    return max(int(per_token * tokens * 1.25), 64 * 2**20)


class OfflineAnswerer(Answerer):
    """vLLM's offline engine in one persistent worker process (:mod:`exittrain.data.vllm_answer_worker`).

    Starts the worker and waits for its engine (~30 s on a CPU). A worker that dies, or answers
    nothing within ``timeout_s``, raises RuntimeError carrying the tail of its log. The worker runs
    in a fresh folder under ``work_root`` (default: the system's temp dir), which :meth:`close`
    removes unless the worker failed (its log stays for the error's reader).
    """

    def __init__(self, gen: GenerationConfig, *, model_path: str, dtype: str, top_logprobs: int,
                 eos_ids: Sequence[int], kv_bytes: int | None = None, memory_fraction: float = 0.5,
                 startup_timeout_s: float = 1800.0, timeout_s: float = 3600.0,
                 work_root: str | os.PathLike | None = None):
        self.gen, self.k, self.eos_ids = gen, int(top_logprobs), [int(e) for e in eos_ids]
        self.python, self.model_path, self.timeout_s = _engine_python(gen), str(model_path), timeout_s
        self.max_model_len = gen.max_prompt_tokens + gen.max_new_tokens
        self.workdir = Path(tempfile.mkdtemp(prefix="exittrain-vllm-", dir=work_root))
        self.log_path = self.workdir / "vllm_worker.log"
        self._buffer, self._failed, self.proc = b"", False, None
        engine = {
            "model": self.model_path, "dtype": dtype, "max_model_len": self.max_model_len,
            "max_logprobs": max(DEFAULT_MAX_LOGPROBS, self.k), "memory_fraction": memory_fraction,
            "kv_cache_bytes": kv_bytes,
        }
        request_r, self._request_w = os.pipe()
        self._response_r, response_w = os.pipe()
        start = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.python, str(WORKER), str(request_r), str(response_w), json.dumps(engine)],
                pass_fds=(request_r, response_w), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.workdir, env=_clean_env(), start_new_session=True,  # its own group: close() can end it all
            )
        os.close(request_r)
        os.close(response_w)
        self._requests = os.fdopen(self._request_w, "w", encoding="utf-8")
        ready = self._receive(startup_timeout_s, "starting")
        if "fatal" in ready:
            self._fail(f"vLLM engine did not start: {ready['fatal']}")
        self.startup_s = time.perf_counter() - start
        self.engine_version = _version_tag(ready["vllm_version"])

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _fail(self, what: str) -> None:
        self._failed = True
        self.close()
        raise RuntimeError(f"{what}; {self.log_path} ends with:\n{self._log_tail()}")

    def _receive(self, timeout_s: float, doing: str) -> dict:
        """The worker's next JSON line; RuntimeError with the log's tail if it dies or times out."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            if time.monotonic() > deadline:
                self._fail(f"vLLM worker {doing}: no answer within {timeout_s:.0f} s")
            ready, _, _ = select.select([self._response_r], [], [], 1.0)
            if ready:
                chunk = os.read(self._response_r, 1 << 20)
                if chunk:
                    self._buffer += chunk
                    continue
            if not ready and self.proc.poll() is None:
                continue
            self._fail(f"vLLM worker died while {doing} (exit {self.proc.wait()})")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def answer(self, prompt_ids: list[list[int]], batch_index: int) -> list[Answer]:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("the vLLM worker is closed; open a new answerer")
        request = {"prompts": [list(map(int, p)) for p in prompt_ids], "max_tokens": self.gen.max_new_tokens,
                   "logprobs": self.k if self.k > 0 else None, "stop_token_ids": self.eos_ids,
                   **_sampling(self.gen, batch_index)}
        try:
            self._requests.write(json.dumps(request) + "\n")
            self._requests.flush()
        except BrokenPipeError:
            self._fail(f"vLLM worker died before batch {batch_index} reached it")
        outputs = self._receive(self.timeout_s, f"answering batch {batch_index}")["outputs"]
        if len(outputs) != len(prompt_ids):
            self._fail(f"vLLM worker answered {len(outputs)} of {len(prompt_ids)} prompts of batch {batch_index}")
        answers = []
        for out in outputs:
            error = out.get("error") or cut_short(out["finish_reason"], len(out["token_ids"]), request["max_tokens"])
            if error is not None:
                answers.append(Answer([], False, error=error))
            else:
                positions = None if out["top"] is None else [[(t, lp) for t, lp in pos] for pos in out["top"]]
                answers.append(make_answer(out["token_ids"], positions, self.k, self.eos_ids))
        return answers

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                try:
                    self._requests.write(json.dumps({"close": True}) + "\n")
                    self._requests.flush()
                    proc.wait(timeout=60)
                except (BrokenPipeError, subprocess.TimeoutExpired):
                    pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        finally:
            for closer in (self._requests.close, lambda: os.close(self._response_r)):
                try:
                    closer()
                except OSError:
                    pass
            if not self._failed:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        return {"backend": "vllm", "engine": "offline", "engine_version": self.engine_version,
                "interpreter": self.python, "model": self.model_path, "startup_s": round(self.startup_s, 1),
                "max_model_len": self.max_model_len}


def open_answerer(gen: GenerationConfig, *, target_name: str, tokenizer: Any, model: Any, top_logprobs: int,
                  eos_ids: Sequence[int], cache_dir: str | os.PathLike | None = None) -> Answerer:
    """The answerer of ``gen`` (``backend="vllm"``): the server at ``gen.server_url``, else the offline engine.

    The offline engine serves ``target_name`` as an HF folder: the embedded target is converted
    once (:func:`exittrain.models.target_loading.convert_embedded_target`, into ``cache_dir`` or the
    default cache), any other name is handed to vLLM as given (a local folder or a hub id). Its dtype
    is ``gen.dtype`` or the model's own; its KV cache is sized for one batch of the longest prompts
    plus ``max_new_tokens`` from ``model.config``. ``tokenizer`` is not used by vLLM (prompts arrive
    templated) and is taken for the HF backend's signature.
    """
    del tokenizer
    if gen.backend != "vllm":
        raise ValueError(f"open_answerer serves data.generation.backend=vllm, got {gen.backend!r}: the hf backend "
                         "answers in this process (exittrain.data.generation.generate_batch)")
    if gen.server_url is not None:
        return ServerAnswerer(gen, top_logprobs=top_logprobs, eos_ids=eos_ids)
    from exittrain.models.target_loading import EMBEDDED_TARGET_NAME, convert_embedded_target

    model_path = str(convert_embedded_target(cache_dir)) if target_name == EMBEDDED_TARGET_NAME else target_name
    dtype = vllm_dtype(gen, model)
    tokens = gen.batch_size * (gen.max_prompt_tokens + gen.max_new_tokens)
    return OfflineAnswerer(gen, model_path=model_path, dtype=dtype, top_logprobs=top_logprobs, eos_ids=eos_ids,
                           kv_bytes=kv_cache_bytes(getattr(model, "config", None), dtype, tokens))


__all__ = [
    "Answerer", "OfflineAnswerer", "ServerAnswerer", "ServerRejected", "kv_cache_bytes", "open_answerer",
    "resolve_engine", "vllm_dtype",
]
