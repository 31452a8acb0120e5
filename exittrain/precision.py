"""``auto`` precision: compute dtypes chosen from the hardware the run actually has.

bf16 pays only on hardware with bf16 units: CUDA GPUs that support it, and CPUs whose bf16 matrix
products run on AMX or AVX512-BF16 instructions. Elsewhere (an AVX2-only CPU, for one) torch runs a
bf16 matmul through conversion loops, and it is slower than fp32 by two orders of magnitude, so a
bf16 default that is right on one host makes a run 100 times slower on another.

Every config key that takes a compute dtype accepts ``auto``:

- ``trainer.precision`` (:func:`trainer_precision_choice`): ``bf16-mixed`` on a CUDA device with bf16
  or a CPU with fast bf16; on a CUDA device without bf16 (a V100, a T4) ``16-mixed``, or ``32-true``
  under a sharded strategy (``trainer=fsdp``: Lightning's ``ModelParallelStrategy`` refuses
  ``16-mixed``, :data:`SHARDED_PRECISIONS`); ``32-true`` otherwise;
- ``data.generation.dtype`` (:func:`generation_dtype_choice`): ``bfloat16`` where bf16 is fast, else
  ``None`` (answer with the target as loaded);
- ``target.dtype`` (:func:`target_dtype`): fp32 on a CPU (the target's batch-1 decode is faster
  in fp32 even with AMX), bf16 or fp16 on a CUDA device.

On a CPU the decision is measured, not guessed from a model name: :func:`cpu_bf16_check` times
one bf16 and one fp32 matrix product (a few milliseconds where bf16 is fast, longer where it is not)
and calls bf16 fast when it is at least :data:`FAST_RATIO` times faster than fp32. The CPU flags
that explain the answer (``amx_bf16``, ``avx512_bf16``) and torch's ``get_cpu_capability()`` are
reported beside it. A timing follows the host's load (one AVX512-BF16 host type timed bf16 "2x
slower" one day and "3x faster" another), so the two settings it decides, the answers' dtype and
the trainer's precision, are measured once per host type and recorded
(:mod:`exittrain.host_choices`): every later run on that host type reads the record, logs it with
the file it came from, and reports it (a regenerated entry's metadata, ``metrics.json``'s
``choices``). A CUDA device's choice needs no timing and no record. An explicit value is returned
unchanged (nothing is measured, read or recorded).

Limits: MPS and other accelerators get fp32. The first measurement uses the threads torch has at the
time, on a host that may be busy: delete its record (the log names it) to measure again.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from exittrain.host_choices import HostChoice, host_folder, lookup, recorded_choice

log = logging.getLogger("exittrain")

AUTO = "auto"
FAST_RATIO = 1.25
"""bf16 counts as fast on a CPU when its matmul is at least this many times faster than fp32's."""

# (M, K, N) of the probe: the shape of a small model's MLP product (rows x hidden x intermediate)
_PROBE_SHAPE = (256, 576, 1536)

PRECISIONS = ("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
              "32-true", "64-true")
"""Lightning's ``precision`` values (``_PRECISION_INPUT_STR`` of lightning.fabric.plugins.precision.precision;
tests/test_precision.py pins the copy). Its older spellings name the same ones: :data:`_ALIASES`."""
_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}  # 16 and "16" alike

SHARDED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
"""The precisions Lightning's ``ModelParallelStrategy`` (``trainer=fsdp``'s ``DrafterFSDPStrategy``)
accepts: its Trainer refuses any other one, ``16-mixed`` included, when it is built
(``_validate_precision_choice`` in lightning/pytorch/trainer/connectors/accelerator_connector.py;
tests/test_precision.py builds one with every value)."""


@dataclass(frozen=True)
class Bf16Check:
    """Whether bf16 is fast on a device, and why: ``reason`` is one line for the log."""

    fast: bool
    reason: str


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` of /proc/cpuinfo, or None (no such field, or no file, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name):
            return line.partition(":")[2].strip()
    return None


def _cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    return set((_cpuinfo_field("flags") or "").split())


def cpu_model() -> str:
    """The CPU's model name, for the host line of every reported figure (platform's name where
    /proc/cpuinfo has none)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


def _matmul_seconds(dtype: torch.dtype, repeats: int = 3) -> float:
    """Best-of-``repeats`` wall time of one probe product in ``dtype`` on the CPU (after a warm-up)."""
    m, k, n = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    a @ b  # warm-up: oneDNN picks and caches its kernel on the first call
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=1)
def cpu_bf16_check() -> Bf16Check:
    """Measure bf16 against fp32 on this CPU, once per process (the settings it decides are recorded:
    :func:`generation_dtype_choice`, :func:`trainer_precision_choice`)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = _cpu_flags()
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    with torch.inference_mode():
        ratio = _matmul_seconds(torch.bfloat16) / _matmul_seconds(torch.float32)
    fast = ratio * FAST_RATIO <= 1.0
    speed = (f"{1 / ratio:.1f}x faster than fp32" if ratio < 1
             else f"{ratio:.{1 if ratio < 10 else 0}f}x slower than fp32")
    units_text = f", {'+'.join(units)}" if units else ", no bf16 units in the CPU flags" if flags else ""
    return Bf16Check(fast, f"CPU capability {capability}{units_text}: bf16 matmul {speed}")


def _cuda_bf16_check(device: torch.device) -> Bf16Check:
    name = torch.cuda.get_device_name(device)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return Bf16Check(True, f"CUDA device {name} supports bf16")
    return Bf16Check(False, f"CUDA device {name} has no bf16 units")


def bf16_check(device: str | torch.device) -> Bf16Check:
    """Whether bf16 is fast on ``device`` (``cpu``, ``cuda[:i]``; anything else: not checked, fp32)."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_bf16_check()
    if device.type == "cuda":
        return _cuda_bf16_check(device)
    return Bf16Check(False, f"device type {device.type!r}: bf16 speed is not checked there")


@functools.cache
def _log_once(message: str) -> None:
    log.info("%s", message)


def _announced(choice: HostChoice) -> HostChoice:
    """``choice``, its line logged once per process."""
    _log_once(choice.line())
    return choice


def _accelerator_device(accelerator: str | None) -> torch.device:
    """The device a Lightning ``accelerator`` setting trains on (its first one)."""
    name = str(accelerator or "auto").lower()
    if name in ("gpu", "cuda") or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    if name == "cpu" or name == "auto":
        return torch.device("cpu")
    return torch.device(name)


def lightning_precision(value: str | int, *, key: str = "trainer.precision") -> str:
    """``value`` as Lightning names it (``16`` and ``"16"`` are ``16-mixed``, ``"bf16"`` is ``bf16-mixed``);
    ValueError naming ``key`` for a value that is neither ``auto`` nor one of Lightning's."""
    name = str(value)
    name = _ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(f"{key}={value!r} is not a Lightning precision: set it to auto (chosen from the hardware) "
                         f"or one of {', '.join(PRECISIONS)}")
    return name


def check_sharded_precision(value: str | int, *, key: str = "trainer.precision") -> None:
    """ValueError naming ``key`` and the fix when Lightning's ``ModelParallelStrategy`` (``trainer=fsdp``)
    would refuse ``value``: anything outside :data:`SHARDED_PRECISIONS`, fp16 autocast (``16-mixed``)
    above all. ``auto`` passes (:func:`trainer_precision` picks an accepted value)."""
    if value == AUTO:
        return
    name = lightning_precision(value, key=key)
    if name not in SHARDED_PRECISIONS:
        raise ValueError(
            f"{key}={value!r}: trainer=fsdp (Lightning's ModelParallelStrategy) refuses {name} and accepts only "
            f"{', '.join(SHARDED_PRECISIONS)}. Set {key}=auto (bf16-mixed on a GPU with bf16, 32-true on one "
            f"without, such as a V100 or T4) or {key}=32-true; or train with trainer=ddp, which takes 16-mixed"
        )


def trainer_precision_choice(
    value: str | int | None, accelerator: str | None = "cpu", *, sharded: bool = False, key: str = "trainer.precision",
) -> HostChoice:
    """Lightning's ``precision`` for ``value`` and how it was chosen; ``auto`` is decided from
    ``accelerator``'s device.

    ``bf16-mixed`` where bf16 is fast. On a CUDA device without it: ``16-mixed`` (fp16 autocast with
    loss scaling), or ``32-true`` when ``sharded`` (the trainer's strategy is Lightning's
    ``ModelParallelStrategy``, which refuses ``16-mixed``; its ``16-true`` would keep the AdamW
    states in fp16 with no loss scaling). ``32-true`` otherwise. On a CPU the choice is the host's
    recorded one (:mod:`exittrain.host_choices`). Any other value is returned unchanged, after
    :func:`check_sharded_precision` when ``sharded`` (ValueError naming ``key``).
    """
    if value != AUTO:
        if sharded:
            check_sharded_precision(value, key=key)
        return HostChoice(key, value, value, "set in the config")
    device = _accelerator_device(accelerator)
    if device.type == "cpu":
        def decide():
            check = cpu_bf16_check()
            return ("bf16-mixed" if check.fast else "32-true"), check.reason

        return _announced(recorded_choice(key, device_identity(device), decide, [host_folder()]))
    check = bf16_check(device)
    reason = check.reason
    if check.fast:
        choice = "bf16-mixed"
    elif device.type == "cuda" and sharded:
        choice = "32-true"
        reason += "; trainer=fsdp (Lightning's ModelParallelStrategy) refuses 16-mixed"
    elif device.type == "cuda":
        choice = "16-mixed"
    else:
        choice = "32-true"
    return _announced(HostChoice(key, AUTO, choice, reason))


def trainer_precision(
    value: str | int | None, accelerator: str | None = "cpu", *, sharded: bool = False, key: str = "trainer.precision",
):
    """The value of :func:`trainer_precision_choice`: what the Trainer gets."""
    return trainer_precision_choice(value, accelerator, sharded=sharded, key=key).value


def bf16_units() -> str:
    """The CPU's bf16 and AMX flags, joined by "+" (empty where it has none): the flags that explain
    a host's matrix-product speed, reported beside every figure."""
    return "+".join(sorted(f for f in _cpu_flags() if "bf16" in f or f.startswith("amx")))


def device_identity(device: str | torch.device) -> str:
    """What a timed decision on ``device`` depends on: the CUDA device's name, or the CPU's model,
    capability and bf16 flags; with torch's version."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}; torch {torch.__version__}"
    units = bf16_units()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")  # an emulated AVX2 host keeps its flags but not its bf16 kernels
    return (f"{device.type} {cpu_model()}; {torch.backends.cpu.get_cpu_capability()} {units} {isa}; "
            f"torch {torch.__version__}")


def generation_dtype_choice(
    value: str | None, device: str | torch.device = "cpu", *, key: str = "data.generation.dtype",
    remember_in: str | os.PathLike | None = None,
) -> HostChoice:
    """The dtype the regeneration answers in, and how it was chosen: ``auto`` gives ``"bfloat16"``
    where bf16 is fast on ``device`` and None (the target as loaded) elsewhere; any other value is
    returned unchanged.

    On a CPU ``auto`` is the recorded choice of this host type (:mod:`exittrain.host_choices`), read
    from ``remember_in`` (the answers' cache folder: the choice keys its entries, so every shard and
    a later ``fit`` must agree), else from the host's folder, else measured now and recorded in both.

    A value given as it is (set in the config, or ``auto`` already resolved by a caller: both key the
    same entry) is compared with this host type's recorded ``auto`` choice, if one exists; nothing
    is measured or recorded for it."""
    device = torch.device(device)
    folders = [*([remember_in] if remember_in is not None else []), host_folder()]
    if value != AUTO:
        recorded = lookup(key, device_identity(device), folders) if device.type == "cpu" else None
        if recorded is None:
            return HostChoice(key, value, value, "as set; no auto choice is recorded for this host type")
        same = "the same" if recorded.value == value else f"{recorded.value!r}"
        return HostChoice(key, value, value, f"as set; this host type's recorded auto choice is {same} "
                          f"({recorded.reason}; measured {recorded.decided})", records=recorded.records,
                          decided=recorded.decided, host=recorded.host)
    if device.type != "cpu":
        check = bf16_check(device)
        return _announced(HostChoice(key, AUTO, "bfloat16" if check.fast else None, check.reason))

    def decide():
        check = cpu_bf16_check()
        return ("bfloat16" if check.fast else None), check.reason

    return _announced(recorded_choice(key, device_identity(device), decide, folders))


def generation_dtype(
    value: str | None, device: str | torch.device = "cpu", *, key: str = "data.generation.dtype",
    remember_in: str | os.PathLike | None = None,
):
    """The value of :func:`generation_dtype_choice`: the dtype the answers are generated in."""
    return generation_dtype_choice(value, device, key=key, remember_in=remember_in).value


def target_dtype(value: torch.dtype | str, device: str | torch.device = "cpu", *, key: str = "target.dtype"):
    """The dtype a target loads in: ``auto`` gives fp32 on a CPU (its batch-1 decode is faster in fp32
    even on AMX hosts), bf16 on a CUDA device with bf16 and fp16 on one without; others unchanged."""
    if value != AUTO:
        return value
    device = torch.device(device)
    if device.type == "cuda":
        check = bf16_check(device)
        choice, why = ("bfloat16" if check.fast else "float16"), check.reason
    else:
        choice, why = "float32", f"device {device.type}: a batch-1 decode runs fastest in fp32"
    _announced(HostChoice(key, AUTO, choice, why))
    return choice
