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
	$(BIN)/python -m pip install --quiet -e ".[tpu,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fp8kv demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
