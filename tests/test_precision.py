"""``auto`` precision: each branch forced (fast and slow bf16 CPUs, CUDA with and without bf16, other
devices), explicit values untouched, the log line, the configs and objects that read ``auto``, the
precisions ``trainer=fsdp``'s strategy takes (pinned against Lightning's own Trainer), and the CPU's
timed choices recorded once per host type and reused (:mod:`exittrain.host_choices`)."""

from __future__ import annotations

import json
import logging
from typing import get_args

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from exittrain import host_choices, precision
from exittrain.configs import CONF_DIR, register_recipes
from exittrain.data.generation import GenerationConfig
from exittrain.data.regen_cache import cache_key
from exittrain.lit.sharding import DrafterFSDPStrategy
from exittrain.lit.trainer import build_trainer


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch, tmp_path):
    """Each test measures and logs anew (both are cached per process), with a host folder of its own
    for the recorded choices."""
    monkeypatch.setenv("EXITTRAIN_CACHE", str(tmp_path / "host"))
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


def new_process():
    """What a later process starts with: no measurement and no log line of this one."""
    precision.cpu_bf16_check.cache_clear()
    precision._log_once.cache_clear()


def forget_host_choices():
    """Delete this host's records (the documented way to measure again), then start a new process."""
    for record in host_choices.host_folder().glob(".auto-*.json"):
        record.unlink()
    new_process()


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
    said = (f"trainer.precision auto -> 32-true (CPU capability {capability}, no bf16 units in the CPU flags: "
            "bf16 matmul 140x slower than fp32; measured 20")
    assert any(line.startswith(said) and line.endswith(": delete it to measure again)") for line in lines), lines
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
    forget_host_choices()
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
    forget_host_choices()
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
    cache = tmp_path / "regen"
    fake_cpu(monkeypatch, bf16_s=0.1, flags=("avx512_bf16",))
    first = GenerationConfig(dtype="auto").resolved("cpu", remember_in=cache)
    new_process()
    fake_cpu(monkeypatch, bf16_s=3.0, flags=("avx512_bf16",))  # the same host type, timed while busy
    assert GenerationConfig(dtype="auto").resolved("cpu", remember_in=cache).dtype == first.dtype == "bfloat16"
    # the cache folder's record wins over the host's: shards on machines of one identity agree with it
    (host_record,) = host_choices.host_folder().glob(".auto-data.generation.dtype-*.json")
    host_record.unlink()
    new_process()
    assert GenerationConfig(dtype="auto").resolved("cpu", remember_in=cache).dtype == "bfloat16"
    assert host_record.is_file()  # copied back from the cache folder's
    # another host type (no bf16 units) decides for itself
    new_process()
    fake_cpu(monkeypatch, bf16_s=140.0, flags=("avx2",))
    assert GenerationConfig(dtype="auto").resolved("cpu", remember_in=cache).dtype is None
    assert len(list(cache.glob(".auto-data.generation.dtype-*.json"))) == 2
    assert not list(cache.glob("*.tmp-*"))


def test_a_recorded_choice_outlives_the_process_and_the_load_of_the_host(monkeypatch, caplog):
    """One AVX512-BF16 host type timed bf16 faster one day and slower under load another: the first
    measurement is recorded, and a later process on that host type reads it and times nothing."""
    fake_cpu(monkeypatch, bf16_s=0.5, flags=("avx512_bf16",))
    first = precision.generation_dtype_choice("auto", "cpu")
    trainer = precision.trainer_precision_choice("auto", "cpu")
    assert (first.value, trainer.value) == ("bfloat16", "bf16-mixed") and first.measured_now and trainer.measured_now
    new_process()
    calls = fake_cpu(monkeypatch, bf16_s=2.0, flags=("avx512_bf16",))  # the same host type, busy
    with caplog.at_level(logging.INFO, logger="exittrain"):
        again = precision.generation_dtype_choice("auto", "cpu")
        assert precision.trainer_precision("auto", "cpu") == "bf16-mixed"
    assert calls == [] and again.value == "bfloat16" and not again.measured_now
    assert (again.records, again.decided, again.reason) == (first.records, first.decided, first.reason)
    assert "bf16 matmul 2.0x faster than fp32" in again.reason
    (record,) = again.records
    assert any(record in line and "delete it to measure again" in line for line in caplog.messages)
    saved = json.loads(open(record).read())
    assert saved["choice"] == "bfloat16" and saved["device"] == precision.device_identity("cpu") == again.host
    assert again.as_dict()["records"] == [record] and again.as_dict()["setting"] == "auto"
    # the documented way to measure again: delete the record
    forget_host_choices()
    assert precision.generation_dtype("auto", "cpu") is None and calls == [torch.bfloat16, torch.float32]


def test_another_torch_or_cpu_identity_measures_for_itself(monkeypatch):
    fake_cpu(monkeypatch, bf16_s=0.5, flags=("avx512_bf16",))
    assert precision.trainer_precision("auto", "cpu") == "bf16-mixed"
    new_process()
    monkeypatch.setattr(torch, "__version__", "99.0")  # a torch upgrade on the same CPU
    calls = fake_cpu(monkeypatch, bf16_s=2.0, flags=("avx512_bf16",))
    assert precision.trainer_precision("auto", "cpu") == "32-true" and calls == [torch.bfloat16, torch.float32]
    assert len(list(host_choices.host_folder().glob(".auto-trainer.precision-*.json"))) == 2


def test_an_explicit_setting_measures_and_records_nothing_and_is_compared_with_the_record(monkeypatch):
    calls = fake_cpu(monkeypatch, bf16_s=0.5)
    assert precision.trainer_precision_choice("32-true", "cpu").reason == "set in the config"
    explicit = precision.generation_dtype_choice("float32", "cpu")
    assert (explicit.setting, explicit.value, explicit.records) == ("float32", "float32", ())
    assert explicit.reason == "as set; no auto choice is recorded for this host type"
    assert calls == [] and not host_choices.host_folder().exists()
    # once auto is recorded, a value as given (set, or auto resolved by a caller: the same entry) names it
    auto = precision.generation_dtype_choice("auto", "cpu")
    same = GenerationConfig(dtype="bfloat16").dtype_choice("cpu")
    assert same.value == "bfloat16" and same.records == auto.records and same.decided == auto.decided
    assert same.reason.startswith("as set; this host type's recorded auto choice is the same (CPU capability")
    assert "recorded auto choice is 'bfloat16'" in precision.generation_dtype_choice("float32", "cpu").reason


def test_a_broken_record_names_its_file_and_the_fix(monkeypatch):
    fake_cpu(monkeypatch, bf16_s=0.5)
    (record,) = precision.trainer_precision_choice("auto", "cpu").records
    open(record, "w").write("{not json")
    new_process()
    with pytest.raises(ValueError, match=r"\.auto-trainer\.precision-.*\.json: not a recorded choice.*delete the file"):
        precision.trainer_precision("auto", "cpu")


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
