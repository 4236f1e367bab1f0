# Two commands a user needs (README): `make run` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

# torch: reuse one that is already importable (GPU machines); otherwise install the CPU build
# first, so the bare `torch` requirement below never pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	@if python3 -c "import torch" 2>/dev/null; then \
	  python3 -m venv --system-site-packages $(VENV); \
	else \
	  python3 -m venv $(VENV) && $(PY) -m pip install -q "torch==2.13.0"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

run: setup
	$(PY) -m testbed.run $(ARGS)

test: setup
	$(PY) -m pytest $(ARGS)

bench: setup
	$(PY) -m experiments.benchmarks.cache $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .hypothesis
