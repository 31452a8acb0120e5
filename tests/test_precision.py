"""``auto`` precision: each branch forced (fast and slow bf16 CPUs, CUDA with and without bf16, other
devices), explicit values untouched, the log line, the configs and objects that read ``auto``, and the
precisions ``trainer=fsdp``'s strategy takes (pinned against Lightning's own Trainer)."""

from __future__ import annotations

import logging
from typing import get_args

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from exittrain import precision
from exittrain.configs import CONF_DIR, register_recipes
from exittrain.data.generation import GenerationConfig
from exittrain.data.regen_cache import cache_key
from exittrain.lit.sharding import DrafterFSDPStrategy
from exittrain.lit.trainer import build_trainer


@pytest.fixture(autouse=True)
def fresh_checks():
    """Each test measures and logs anew (both are cached per process)."""
    precision.cpu_bf16_check.cache_clear()
    precision._log_once.cache_clear()
    yield
    precision.cpu_bf16_check.cache_clear()
    precision._log_once.cache_clear()


def fake_cpu(monkeypatch, bf16_s: float, fp32_s: float = 1.0, flags=("avx2",)):
    """A CPU whose probe product takes ``bf16_s`` / ``fp32_s`` seconds; counts the probes."""
    calls = []

    def seconds(dtype, repeats=3):
        calls.append(dtype)
        return bf16_s if dtype == torch.bfloat16 else fp32_s

    monkeypatch.setattr(precision, "_matmul_seconds", seconds)
    monkeypatch.setattr(precision, "_cpu_flags", lambda: set(flags))
    return calls


def fake_cuda(monkeypatch, bf16: bool):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_an_avx2_cpu_trains_and_answers_in_fp32_and_says_why(monkeypatch, caplog):
    fake_cpu(monkeypatch, bf16_s=140.0)
    capability = torch.backends.cpu.get_cpu_capability()
    with caplog.at_level(logging.INFO, logger="exittrain"):
        assert precision.trainer_precision("auto", "cpu") == "32-true"
        assert precision.generation_dtype("auto", "cpu") is None
        assert precision.target_dtype("auto", "cpu") == "float32"
    lines = [r.getMessage() for r in caplog.records]
    assert (
        f"trainer.precision auto -> 32-true (CPU capability {capability}, no bf16 units in the CPU flags: "
        "bf16 matmul 140x slower than fp32)" in lines
    )
    assert any(line.startswith("data.generation.dtype auto -> null (the target as loaded)") for line in lines)


def test_a_cpu_with_fast_bf16_trains_under_bf16_autocast_and_answers_in_bf16(monkeypatch, caplog):
    fake_cpu(monkeypatch, bf16_s=0.25, flags=("avx2", "avx512_bf16", "amx_bf16"))
    with caplog.at_level(logging.INFO, logger="exittrain"):
        assert precision.trainer_precision("auto", "cpu") == "bf16-mixed"
        assert precision.generation_dtype("auto") == "bfloat16"
        assert precision.target_dtype("auto") == "float32"  # a batch-1 decode stays fp32 even here
    assert any("amx_bf16+avx512_bf16: bf16 matmul 4.0x faster than fp32" in r.getMessage() for r in caplog.records)


def test_bf16_must_be_clearly_faster_not_merely_as_fast(monkeypatch):
    fake_cpu(monkeypatch, bf16_s=0.9)  # 1.1x faster: under FAST_RATIO, the fp32 numerics win
    assert precision.trainer_precision("auto", "cpu") == "32-true"
    precision.cpu_bf16_check.cache_clear()
    fake_cpu(monkeypatch, bf16_s=1.0 / precision.FAST_RATIO)
    assert precision.trainer_precision("auto", "cpu") == "bf16-mixed"


def test_the_cpu_is_measured_once_per_process_and_logged_once_per_key(monkeypatch, caplog):
    calls = fake_cpu(monkeypatch, bf16_s=50.0)
    with caplog.at_level(logging.INFO, logger="exittrain"):
        for _ in range(3):
            precision.trainer_precision("auto", "cpu")
            precision.generation_dtype("auto", "cpu")
    assert calls == [torch.bfloat16, torch.float32]
    keys = [r.getMessage().split(" auto ->")[0] for r in caplog.records]
    assert keys == ["trainer.precision", "data.generation.dtype"]


@pytest.mark.parametrize("value", ["32-true", "bf16-mixed", "16-mixed", 32, None])
def test_an_explicit_precision_wins_and_measures_nothing(monkeypatch, value):
    calls = fake_cpu(monkeypatch, bf16_s=0.1)
    assert precision.trainer_precision(value, "cpu") == value
    assert precision.generation_dtype("float32") == "float32" and precision.generation_dtype(None) is None
    assert precision.target_dtype(torch.bfloat16) is torch.bfloat16
    assert calls == []


def test_a_cuda_device_with_bf16_gets_bf16(monkeypatch, caplog):
    fake_cuda(monkeypatch, bf16=True)
    calls = fake_cpu(monkeypatch, bf16_s=140.0)  # the host CPU is not asked about a GPU run
    with caplog.at_level(logging.INFO, logger="exittrain"):
        assert precision.trainer_precision("auto", "gpu") == "bf16-mixed"
        assert precision.trainer_precision("auto", "auto") == "bf16-mixed"
        assert precision.generation_dtype("auto", "cuda:0") == "bfloat16"
        assert precision.target_dtype("auto", "cuda:1") == "bfloat16"
    assert calls == []
    assert "trainer.precision auto -> bf16-mixed (CUDA device Fake GPU supports bf16)" in caplog.messages


def test_a_cuda_device_without_bf16_gets_fp16_mixed(monkeypatch):
    fake_cuda(monkeypatch, bf16=False)
    assert precision.trainer_precision("auto", "cuda") == "16-mixed"
    assert precision.generation_dtype("auto", "cuda") is None
    assert precision.target_dtype("auto", "cuda") == "float16"


def test_other_accelerators_train_in_fp32(monkeypatch):
    calls = fake_cpu(monkeypatch, bf16_s=0.1)
    assert precision.trainer_precision("auto", "mps") == "32-true"
    assert precision.generation_dtype("auto", "mps") is None
    assert calls == []


def test_the_real_probe_of_this_host_names_its_capability():
    check = precision.cpu_bf16_check()
    assert check.reason.startswith(f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    assert ("faster than fp32" in check.reason) or ("slower than fp32" in check.reason)
    if check.fast:
        assert "faster" in check.reason


def test_generation_auto_resolves_before_it_keys_the_cache(monkeypatch):
    fake_cpu(monkeypatch, bf16_s=140.0)
    gen = GenerationConfig(max_new_tokens=8, batch_size=2, dtype="auto")
    with pytest.raises(ValueError, match=r"resolved.*gen.resolved\(device\)"):
        cache_key("tiny", "set", ["a"], gen)
    slow = gen.resolved("cpu")
    assert slow.dtype is None
    # an AVX2 host's auto entry is the entry of an explicit null: a cached fp32 run is reused
    assert cache_key("tiny", "set", ["a"], slow) == cache_key("tiny", "set", ["a"], GenerationConfig(8, 2))
    precision.cpu_bf16_check.cache_clear()
    fake_cpu(monkeypatch, bf16_s=0.1)
    assert gen.resolved("cpu").dtype == "bfloat16"
    with pytest.raises(ValueError, match="auto"):
        GenerationConfig(dtype="bf16")


def test_the_datamodule_resolves_generation_auto_for_its_device(monkeypatch, tmp_path):
    from exittrain.data import ExitTrainDataModule

    fake_cpu(monkeypatch, bf16_s=140.0)
    dm = ExitTrainDataModule("code", generation={"dtype": "auto"}, device="cpu", cache_dir=tmp_path)
    assert dm.generation.dtype is None
    fake_cuda(monkeypatch, bf16=True)
    cuda = ExitTrainDataModule("code", generation={"dtype": "auto"}, device="cuda:0", cache_dir=tmp_path)
    assert cuda.generation.dtype == "bfloat16"


def test_a_cache_folder_keeps_the_first_auto_decision_of_a_host_type(monkeypatch, tmp_path):
    """Shards of one entry, and the fit after a prepare, key the same entry even when a busy host
    would time bf16 the other way: the first process's choice is kept in the cache folder."""
    fake_cpu(monkeypatch, bf16_s=0.1, flags=("avx512_bf16",))
    first = GenerationConfig(dtype="auto").resolved("cpu", remember_in=tmp_path)
    precision.cpu_bf16_check.cache_clear()
    fake_cpu(monkeypatch, bf16_s=3.0, flags=("avx512_bf16",))  # the same host type, timed while busy
    assert GenerationConfig(dtype="auto").resolved("cpu", remember_in=tmp_path).dtype == first.dtype == "bfloat16"
    assert GenerationConfig(dtype="auto").resolved("cpu").dtype is None  # without the folder: decided anew
    # another host type (no bf16 units) decides for itself
    precision.cpu_bf16_check.cache_clear()
    fake_cpu(monkeypatch, bf16_s=140.0, flags=("avx2",))
    assert GenerationConfig(dtype="auto").resolved("cpu", remember_in=tmp_path).dtype is None
    assert len(list(tmp_path.glob(".auto-data.generation.dtype-*.json"))) == 2
    assert not list(tmp_path.glob("*.tmp-*"))


def test_build_trainer_turns_auto_into_a_lightning_precision(monkeypatch, tmp_path):
    fake_cpu(monkeypatch, bf16_s=140.0)
    node = OmegaConf.create(
        {"_target_": "lightning.Trainer", "_partial_": True, "accelerator": "cpu", "precision": "auto", "devices": 1}
    )
    kwargs = dict(max_steps=1, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    assert build_trainer(node, **kwargs).precision == "32-true"
    assert build_trainer(node, precision="bf16-mixed", **kwargs).precision == "bf16-mixed"


# -- trainer=fsdp: Lightning's ModelParallelStrategy refuses 16-mixed ------------------------------


def trainer_arguments(trainer: str, tmp_path, *overrides: str):
    """The shipped ``conf/trainer/<trainer>.yaml`` with a recorder (``dict``) in place of
    ``lightning.Trainer``: :func:`build_trainer` returns the arguments it would give the Trainer, so
    a GPU trainer is checked on a host without one."""
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("fit", overrides=["+recipe=code", f"trainer={trainer}", f"paths.output_dir={tmp_path}",
                                         *overrides])
    node = cfg.trainer
    node._target_ = "builtins.dict"
    return node


# ids that are not the bare word "gpu": tests/conftest.py skips items with that keyword on a host without CUDA
@pytest.mark.parametrize("accelerator", ["gpu", "auto"], ids=["accelerator-is-gpu", "accelerator-is-auto"])
def test_fsdp_on_a_cuda_device_without_bf16_trains_in_fp32_and_says_why(monkeypatch, caplog, tmp_path, accelerator):
    """A V100 or T4: 16-mixed would stop Lightning's Trainer at start-up under trainer=fsdp, so auto gives 32-true."""
    fake_cuda(monkeypatch, bf16=False)
    with caplog.at_level(logging.INFO, logger="exittrain"):
        args = build_trainer(trainer_arguments("fsdp", tmp_path, f"trainer.accelerator={accelerator}"), max_steps=1)
    assert isinstance(args["strategy"], DrafterFSDPStrategy)
    assert args["precision"] == "32-true" and args["precision"] in precision.SHARDED_PRECISIONS
    assert ("trainer.precision auto -> 32-true (CUDA device Fake GPU has no bf16 units; trainer=fsdp (Lightning's "
            "ModelParallelStrategy) refuses 16-mixed)") in caplog.messages


def test_fsdp_on_a_cuda_device_with_bf16_and_other_trainers_without_it_keep_mixed_precision(monkeypatch, tmp_path):
    """Negative controls: only the sharded strategy on a GPU without bf16 changes its choice."""
    fake_cuda(monkeypatch, bf16=True)
    assert build_trainer(trainer_arguments("fsdp", tmp_path), max_steps=1)["precision"] == "bf16-mixed"
    fake_cuda(monkeypatch, bf16=False)
    assert build_trainer(trainer_arguments("gpu", tmp_path), max_steps=1)["precision"] == "16-mixed"
    assert build_trainer(trainer_arguments("ddp", tmp_path), max_steps=1)["precision"] == "16-mixed"
    # a strategy passed at run time counts, not only the config's
    node = trainer_arguments("gpu", tmp_path)
    assert build_trainer(node, strategy=DrafterFSDPStrategy(), max_steps=1)["precision"] == "32-true"


@pytest.mark.parametrize("value", ["16-mixed", 16, "16", "64-true"], ids=["16-mixed", "int-16", "str-16", "64-true"])
def test_fsdp_refuses_an_explicit_precision_its_strategy_refuses_before_the_trainer_is_built(tmp_path, value):
    fake = trainer_arguments("fsdp", tmp_path)
    with pytest.raises(ValueError) as err:
        build_trainer(fake, precision=value, max_steps=1)
    message = str(err.value)
    assert f"trainer.precision={value!r}" in message
    assert "trainer.precision=auto" in message and "trainer.precision=32-true" in message and "trainer=ddp" in message


@pytest.mark.parametrize("value", precision.PRECISIONS)
def test_the_sharded_precisions_are_those_lightnings_model_parallel_trainer_accepts(value):
    """Pins SHARDED_PRECISIONS to Lightning: its Trainer, given trainer=fsdp's strategy (on the CPU), is
    built with each accepted value and refuses each other one."""
    make = dict(accelerator="cpu", devices=1, strategy=DrafterFSDPStrategy(), precision=value, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    if value in precision.SHARDED_PRECISIONS:
        assert L.Trainer(**make).strategy.precision_plugin is not None
        precision.check_sharded_precision(value)
    else:
        with pytest.raises(ValueError, match="ModelParallelStrategy"):
            L.Trainer(**make)
        with pytest.raises(ValueError, match="trainer=fsdp"):
            precision.check_sharded_precision(value)


def test_the_precision_names_are_lightnings():
    from lightning.fabric.plugins.precision.precision import (
        _PRECISION_INPUT_STR,
        _PRECISION_INPUT_STR_ALIAS_CONVERSION,
    )

    assert precision.PRECISIONS == get_args(_PRECISION_INPUT_STR)
    assert precision._ALIASES == _PRECISION_INPUT_STR_ALIAS_CONVERSION
    assert precision.lightning_precision(16) == precision.lightning_precision("16") == "16-mixed"
    assert precision.lightning_precision("bf16") == "bf16-mixed" and precision.lightning_precision(32) == "32-true"
    with pytest.raises(ValueError, match=r"trainer\.precision='banana' is not a Lightning precision: set it to auto"):
        precision.lightning_precision("banana")
