"""`bench vllm`: its arguments and table (fast), the export of a saved drafter, and (slow) vLLM itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exittrain.bench.vllm_acceptance import dflash_folder, parse_args, to_markdown
from exittrain.models import new_drafter
from exittrain.models.dflash_format import is_dflash_folder

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("EXITTRAIN_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["a", "b", "--labels", "x"], "--labels names 1 drafters, but 2"),
     (["a", "b", "--labels", "x", "x"], "distinct"),
     (["a", "--prompts", "0"], "--prompts >= 1"),
     (["a", "--vllm-python", "/nope/python"], "make vllm-setup")],
)
def test_bad_arguments_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


def test_a_saved_drafter_is_exported_and_a_folder_that_is_neither_is_refused(tiny_llama_target, tmp_path):
    from exittrain.lit import save_drafter

    drafter = new_drafter(tiny_llama_target, block_size=4, num_layers=1, num_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=48, layer_ids=[0, 1], mask_token_id=5, learned_mask=False)
    saved = save_drafter(drafter, tmp_path / "drafter")
    folder = dflash_folder(saved, "mine", tmp_path / "work", tiny_llama_target)
    assert folder == tmp_path / "work" / "mine" / "drafter_dflash" and is_dflash_folder(folder)
    assert dflash_folder(folder, "again", tmp_path / "work", tiny_llama_target) == folder  # used as it is
    with pytest.raises(ValueError, match="no config.json"):
        dflash_folder(tmp_path, "empty", tmp_path / "work", tiny_llama_target)
    windowed = new_drafter(tiny_llama_target, block_size=4, num_layers=1, num_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=48, layer_ids=[0, 1], mask_token_id=5, context_window=4)
    with pytest.raises(ValueError, match="cannot hold this drafter.*context_window"):
        dflash_folder(save_drafter(windowed, tmp_path / "windowed"), "w", tmp_path / "work", tiny_llama_target)


def test_the_table_flags_a_lossy_drafter_and_pairs_against_the_first():
    result = {"vllm_version": "0.32.0", "prompts": 2, "domain": "code", "skip": 0, "max_new_tokens": 8, "drafters": {
        "a": {"K": 7, "tau": 1.5, "ci95": [1.2, 1.8], "vs_first": None, "drafts": 10, "lossless": True,
              "prompts_equal": 2},
        "b": {"K": 7, "tau": 1.7, "ci95": [1.3, 2.1], "vs_first": {"delta": 0.2, "ci95": [0.1, 0.3]}, "drafts": 9,
              "lossless": False, "prompts_equal": 1}}}
    text = to_markdown(result)
    assert "| a | 7 | 1.500 | 1.200-1.800 | - | 10 | yes |" in text
    assert "| b | 7 | 1.700 | 1.300-2.100 | +0.200 (+0.100 to +0.300) | 9 | NO (1/2 prompts equal) |" in text


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"needs vLLM's own venv at {VLLM_PYTHON} (make vllm-setup)")
def test_vllm_counts_each_prompt_and_one_drafter_twice_pairs_to_zero(tmp_path):
    """A random DFlash drafter measured twice under two labels: one shared plain run, lossless,
    identical per-prompt counts (vLLM's greedy decoding is deterministic), a paired difference of 0."""
    from exittrain.models.target_loading import convert_embedded_target
    from exittrain.serve.dflash_reference import write_random_dflash_drafter

    drafter = write_random_dflash_drafter(convert_embedded_target(), tmp_path / "random")
    out = tmp_path / "vllm"
    cmd = [sys.executable, "-m", "exittrain", "bench", "vllm", str(drafter), str(drafter), "--labels", "one", "two",
           "--prompts", "3", "--max-new-tokens", "12", "--vllm-python", str(VLLM_PYTHON), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.with_suffix(".json").read_text())
    one, two = result["drafters"]["one"], result["drafters"]["two"]
    assert one["lossless"] and two["lossless"] and one["K"] == 7
    assert len(one["per_prompt"]) == 3 and one["per_prompt"] == two["per_prompt"]
    assert one["drafts"] == sum(c["drafts"] for c in one["per_prompt"]) > 0
    assert 1.0 <= one["tau"] <= 8.0 and one["ci95"][0] <= one["tau"] <= one["ci95"][1]
    assert one["vs_first"] is None and two["vs_first"] == {"delta": 0.0, "ci95": [0.0, 0.0]}
    assert not (out.parent / "vllm_work" / "two" / "vllm_plain.log").exists()  # the plain run is shared
