"""The CPU decode lab reaches the runs only as an explicit argument: the entry layer binds it for
``eval.decode=auto`` alone, and a run asked for ``eval.decode=auto`` without it stops before the
target loads, naming the fix."""

from __future__ import annotations

import sys

import pytest
from hydra import compose, initialize_config_dir

from exittrain import cli
from exittrain.configs import CONF_DIR, register_recipes
from exittrain.cpu_decode.auto_settings import auto_probe
from exittrain.cpu_decode.decode_lab import DecodeLab
from exittrain.cpu_decode.draft_vocab import count_answer_tokens, save_token_counts
from exittrain.evaluate import run_eval


def _compose(name: str, *overrides: str):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=["+recipe=code", *overrides])


def _no_target():
    raise AssertionError("the target loaded before the check")


def test_the_default_lab_is_the_cpu_decode_functions():
    lab = DecodeLab()
    assert (lab.auto_probe, lab.count_answer_tokens, lab.save_token_counts) == (
        auto_probe, count_answer_tokens, save_token_counts)


@pytest.mark.parametrize("command", ["fit", "eval"])
def test_the_entry_layer_binds_the_lab_only_for_decode_auto(tmp_path, command):
    extra = [f"drafter_path={tmp_path}"] if command == "eval" else []
    fixed = _compose(command, *extra)
    assert fixed.eval.decode == "fixed" and cli.lab_arguments(command, fixed) == {}
    auto = _compose(command, "eval.decode=auto", *extra)
    assert cli.lab_arguments(command, auto) == {"lab": DecodeLab()}
    assert cli.lab_arguments("prepare", auto) == {}  # the data step decodes nothing


@pytest.mark.slow  # a fresh interpreter imports torch, transformers and Lightning: about 15 s
def test_a_fixed_decode_fit_never_imports_the_lab(tmp_path):
    """In a fresh interpreter, through the entry layer: a ``decode=fixed`` fit (stopped at its first
    check) has imported no module of exittrain.cpu_decode; the same fit at ``decode=auto`` has (the
    control: the check sees the lab where it is bound)."""
    import subprocess

    script = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from exittrain import cli\n"
        "from exittrain.configs import CONF_DIR, register_recipes\n"
        "register_recipes()\n"
        "for decode in ('fixed', 'auto'):\n"
        "    with initialize_config_dir(config_dir=str(CONF_DIR), version_base='1.3'):\n"
        "        cfg = compose('fit', overrides=['+recipe=code', 'eval.budgets=[0]', f'eval.decode={decode}', "
        f"'paths.output_dir={tmp_path}'])\n"
        "    try:\n"
        "        cli.run_command('fit', cfg)\n"
        "    except ValueError as err:\n"
        "        assert 'eval.budgets' in str(err), err\n"
        "    print(decode, sorted(m for m in sys.modules if m.startswith('exittrain.cpu_decode')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    fixed, auto = out.stdout.strip().splitlines()[-2:]
    assert fixed == "fixed []"
    assert "'exittrain.cpu_decode.decode_lab'" in auto


def test_eval_at_decode_auto_without_the_lab_names_the_fix(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")  # a drafter folder as far as the check reads it
    cfg = _compose("eval", "eval.decode=auto", f"drafter_path={drafter}", f"paths.output_dir={tmp_path / 'out'}")
    with pytest.raises(ValueError, match=r"eval.decode=auto needs the CPU decode lab.*lab=DecodeLab\(\)"):
        run_eval(cfg, target=_no_target)
