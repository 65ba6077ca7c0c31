# Every target creates .venv and installs on first use (torch pinned: the local CPU wheel).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.subclass_ca-installed

.PHONY: setup demo test test-fast bench check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,demo,torchao]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m subclass_ca demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not inductor and not distributed and not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m subclass_ca bench $(BENCH_ARGS)

check: $(STAMP)
	$(PY) -m subclass_ca check $(CHECK_ARGS)

clean:
	rm -rf $(VENV) demo-out .pytest_cache
