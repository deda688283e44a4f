# The README's two commands: `make demo` and `make test`. Both create/refresh .venv first.
# Tiers: `make test-unit` (-m unit: pure functions and in-process models, no slow test and no other
# process; tests/tier_guard.py refuses both), `make test` (everything but the slow tier: unit +
# integration), `make test-slow`, `make test-all`, `make test-gpu` (GPU host, its own python3 and
# torch), `make wheelhouse` (the GPU node's offline install, docs/gpu.md).
PYTHON ?= python3.11
NODE_PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEMO   := demo_out
PYTEST_ARGS ?= -m "not slow"

.PHONY: install demo lint test test-unit test-slow test-all test-gpu wheelhouse clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch (a bare `torch` requirement would pull a multi-GB CUDA build).
	$(PY) -m pip install -q "torch==2.13.0"
	# No torchvision: PyPI's Linux wheels of it are CUDA builds that do not import beside this CPU
	# torch. Only transformers' AutoProcessor on a LLaVA-OV export needs one (docs/conversion.md).
	$(PY) -m pip install -q -e ".[test]"
	# Byte-compile our own packages once: an editable install leaves that to the first import, and
	# with PYTHONDONTWRITEBYTECODE set every process (each Ray worker, each test subprocess) would
	# compile them from source again.
	PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q mmdata mmtrain > /dev/null
	touch $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/demo.sh $(DEMO)

# pyflakes, error-prone pycodestyle rules, 120 columns and bugbear (the rule set is in pyproject.toml),
# `ruff format`'s layout, then mypy
# on the training runtime and the Ray jobs' stage runner ([tool.mypy]; each `type: ignore` says why).
lint: $(STAMP)
	$(PY) -m ruff check mmdata mmtrain tests benchmarks scripts
	$(PY) -m ruff format --check mmdata mmtrain tests benchmarks scripts
	$(PY) -m mypy mmtrain/runtime mmdata/stage_runner.py

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest -m unit

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

test-all: $(STAMP)
	$(PY) -m pytest -m "slow or not slow"

# The GPU tier (tests/gpu/, about 10 min on one H200): CUDA stays visible (tests/conftest.py hides
# it otherwise); on a host without CUDA every test is skipped with the reason. It runs with the
# node's own interpreter and its installed (CUDA) torch: no venv, no install (docs/gpu.md installs
# the project beside that torch from the wheelhouse). NODE_PYTHON=... picks another interpreter.
test-gpu:
	MMTRAIN_GPU_TESTS=1 $(NODE_PYTHON) -m pytest -m gpu tests/gpu

# The wheels a GPU node needs beside its own torch, transformers and pytest, for cp311 and cp312
# manylinux x86_64, into wheelhouse/ (scripts/wheelhouse.py; needs the package index).
wheelhouse: $(STAMP)
	$(PY) scripts/wheelhouse.py --out wheelhouse

clean:
	rm -rf $(DEMO) .pytest_cache .mypy_cache
