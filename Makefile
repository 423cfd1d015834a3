# Quick start: `make demo` and `make test` on a fresh machine (no GPU needed).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-wheel test-gpu clean

setup: $(STAMP)

# torch==2.13.0 resolves to the local CPU build here; it must come first so that nothing
# pulls the multi-GB CUDA build. The `eval` extra (lm-eval and its pinned transformers and
# datasets, math-verify) is installed so that the lm-eval backend test runs in CI.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[fla,test,eval]'
	touch $(STAMP)

demo: setup
	$(BIN)/python -m k3batch.demo

# Two pytest-xdist workers, each given whole test files, and tests/kernels whole to one of them
# (--dist loadfile and tests/conftest.py: a module's shared fixtures, its model, reference run
# and Ray cluster, are built once; the sm_90 compile check sees every kernel launch). Much of
# the suite waits on Ray processes starting; the other worker uses that time. Each worker
# starts its own Ray head (own temp dir, ports and token: tests/conftest.py).
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The built wheel, installed in a fresh venv, runs a tiny job (offline; about a minute, so it is
# marked slow and kept out of `make test`, which still builds, installs and imports it).
test-wheel: setup
	$(BIN)/python -m pytest -q -m slow tests/test_wheel.py

# On a CUDA host with torch, triton and fla installed.
test-gpu:
	python3 -m pytest -q -m gpu

clean:
	rm -rf $(VENV) out
