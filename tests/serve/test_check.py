"""The serving check: its argument checks, the worker's request and failure paths, and (slow) vLLM end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exittrain.serve.check import parse_args
from exittrain.serve.dflash_reference import read_dflash_config
from exittrain.serve.vllm_run import WORKER, run_worker

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("EXITTRAIN_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _worker_module():
    spec = importlib.util.spec_from_file_location("vllm_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the worker imports vLLM only inside run(): loading it needs none
    return module


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--prompts", "0"], "--prompts 0"),
        (["--max-tokens", "1"], "--max-tokens 1"),
        (["--memory-fraction", "1.5"], "--memory-fraction"),
        (["--num-speculative-tokens", "0"], "K >= 1"),
        (["--timeout", "0"], "--timeout"),
        (["--kv-cache-gib", "-1"], "--kv-cache-gib"),
    ],
)
def test_bad_arguments_name_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        parse_args(["--vllm-python", sys.executable, *flags])


def test_missing_vllm_venv_and_drafter_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="make vllm-setup"):
        parse_args(["--vllm-python", str(tmp_path / "nope" / "python")])
    with pytest.raises(ValueError, match="no config.json"):
        parse_args(["--vllm-python", sys.executable, "--drafter", str(tmp_path)])
    args = parse_args(["--vllm-python", sys.executable])
    assert args.prompts == 4 and args.drafter is None


def test_worker_request_checks(tmp_path):
    worker = _worker_module()
    path = tmp_path / "request.json"
    path.write_text(json.dumps({"target": "t", "prompts": [[1, 2]]}))
    with pytest.raises(ValueError, match="request lacks"):
        worker._read_request(str(path))
    full = {"target": "t", "drafter": "d", "prompts": [[1]], "max_tokens": 4, "max_model_len": 64,
            "memory_fraction": 0.5, "dtype": "float32"}
    path.write_text(json.dumps(full))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        worker._read_request(str(path))
    path.write_text(json.dumps({**full, "num_speculative_tokens": 7}))
    assert worker._read_request(str(path))["num_speculative_tokens"] == 7


def test_a_failing_worker_reports_its_log(tmp_path):
    """Our own interpreter has no vLLM: the worker fails and the error carries the log's tail."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vLLM; the failure path needs one without it")
    request = {"target": "t", "drafter": None, "prompts": [[1]], "max_tokens": 2, "max_model_len": 64,
               "memory_fraction": 0.5, "dtype": "float32"}
    with pytest.raises(RuntimeError, match="(?s)vllm_plain run failed.*No module named 'vllm'"):
        run_worker(sys.executable, request, tmp_path, "vllm_plain", timeout=60)


def test_dflash_config_reader_names_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BlockDrafter"]}))
    with pytest.raises(ValueError, match="export RUN_DIR/drafter OUT --format dflash"):
        read_dflash_config(tmp_path)
    base = {"architectures": ["DFlashDraftModel"], "block_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(base))
    with pytest.raises(ValueError, match="dflash_config must be an object"):
        read_dflash_config(tmp_path)
    empty = {"target_layer_ids": [], "mask_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps({**base, "dflash_config": empty}))
    with pytest.raises(ValueError, match="target_layer_ids"):
        read_dflash_config(tmp_path)
    good = {**base, "dflash_config": {"target_layer_ids": [2, 15], "mask_token_id": 0}}
    (tmp_path / "config.json").write_text(json.dumps({**good, "block_size": 1}))
    with pytest.raises(ValueError, match="block_size"):
        read_dflash_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(good))
    assert read_dflash_config(tmp_path)["dflash_config"]["target_layer_ids"] == [2, 15]


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(
    not VLLM_PYTHON.is_file(),
    reason=f"needs vLLM's own venv at {VLLM_PYTHON} (build it with `make vllm-setup`, ~3.5 GB; CI does not have "
    "it) or EXITTRAIN_VLLM_PYTHON pointing at one",
)
def test_serve_check_end_to_end(tmp_path):
    """vLLM serves the embedded target with a DFlash drafter: greedy outputs equal vLLM's plain ones,
    and its acceptance counters agree with our chain decoder's on the same prompts."""
    out = tmp_path / "serve_check"
    cmd = [sys.executable, "-m", "exittrain.serve.check", "--vllm-python", str(VLLM_PYTHON),
           "--prompts", "2", "--max-tokens", "24", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.with_suffix(".json").read_text())
    agree = result["agreement"]
    assert agree["vllm_dflash_vs_plain"]["equal"]
    assert result["drafter_kind"] == "random weights"
    K = result["num_speculative_tokens"]
    vllm_acc = result["vllm_acceptance"]
    assert vllm_acc["drafts"] > 0 and len(vllm_acc["accepted_per_position"]) == K
    assert 1.0 <= vllm_acc["mean_acceptance_length"] <= K + 1
    assert set(result["ours"]["runs"]) == {"exittrain", "reference"}
    for kind, run in result["ours"]["runs"].items():
        assert agree[f"ours_{kind}_vs_hf_greedy"]["equal"], kind  # our decoder is exact against our own target
        assert run["acceptance"]["drafts"] > 0
    assert "| vLLM DFlash |" in out.with_suffix(".md").read_text()


def test_run_vllm_checks_before_starting_vllm(tmp_path):
    """What fit's finish calls: a missing interpreter, another K than the drafter's block and no prompts
    are refused before any worker starts."""
    from exittrain.serve.vllm_run import run_vllm

    drafter = tmp_path / "drafter_dflash"
    drafter.mkdir()
    config = {"architectures": ["DFlashDraftModel"], "block_size": 8,
              "dflash_config": {"target_layer_ids": [1], "mask_token_id": 0}}
    (drafter / "config.json").write_text(json.dumps(config))
    common = dict(max_tokens=4, workdir=tmp_path / "work")
    with pytest.raises(ValueError, match="make vllm-setup"):
        run_vllm(tmp_path / "nope" / "python", "t", drafter, [[1, 2]], **common)
    with pytest.raises(ValueError, match="num_speculative_tokens=3: the drafter's block holds K = 7"):
        run_vllm(sys.executable, "t", drafter, [[1, 2]], num_speculative_tokens=3, **common)
    with pytest.raises(ValueError, match="no prompts"):
        run_vllm(sys.executable, "t", drafter, [], **common)
    assert not (tmp_path / "work").exists()
