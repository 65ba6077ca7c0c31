# Every target creates its venv and installs on first use. One venv per torch lane:
#   make test                  -> torch 2.13.0 in .venv (the default lane; the local CPU wheel)
#   make test TORCH=2.14.1     -> .venv-2.14.1 (local package index)
#   make test TORCH=2.15.0     -> .venv-2.15.0 (public index; that venv's pip ignores the machine's torch cap)
PYTHON ?= python3
TORCH  ?= 2.13.0
LANES  ?= 2.13.0 2.14.1 2.15.0
ifeq ($(TORCH),2.13.0)
VENV   ?= .venv
else
VENV   ?= .venv-$(TORCH)
endif
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.subclass_ca-installed
# This machine's pip config caps torch at 2.14.1 (/etc/xdg/pip); a newer lane lifts it for its own pip only.
PIP    := $(if $(filter 2.15.%,$(TORCH)),PIP_CONFIG_FILE=/dev/null,) $(PY) -m pip

.PHONY: setup demo test test-fast test-lanes bench bench-quick check versions gpu-check gpu-check-dry clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH)
	$(PIP) install -q -e '.[test,demo,torchao]'
	@# installing subclass_ca must never replace the lane's torch (pyproject admits >=2.13,<2.16)
	$(PY) -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$(TORCH)' else f'installing subclass_ca changed torch $(TORCH) -> {v}')"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m subclass_ca demo $(DEMO_ARGS)

# SUITE=full (default): every test; SUITE=lane: what CI runs on the other torch lanes (Note [The lane suite]
# in tests/conftest.py). Two pytest-xdist workers, one torch thread each (2 cores; WORKERS=0 runs in-process).
SUITE   ?= full
WORKERS ?= 2
XDIST   := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist worksteal)
test: $(STAMP)
	OMP_NUM_THREADS=1 SUBCLASS_CA_SUITE=$(SUITE) $(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not inductor and not distributed and not slow" $(PYTEST_ARGS)

# what CI runs: the full suite on the default lane, the lane suite on the others
test-lanes:
	set -e; for torch in $(LANES); do $(MAKE) --no-print-directory test TORCH=$$torch \
	  SUITE=$$( [ $$torch = 2.13.0 ] && echo full || echo lane ); done

# the full benchmark (<= 10 min on a 2-core machine): RESULTS.md, results.json, bench.png in benchmarks/
BENCH_ARGS ?= --threads 1 --no-progress --tp --fsdp2 --append benchmarks/analysis.md
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m subclass_ca bench $(BENCH_ARGS)

# the CI smoke run of the same pipeline (<= 2 min)
bench-quick: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m subclass_ca bench --quick --threads 1 --no-progress --no-plot --out-dir build/bench-quick

check: $(STAMP)
	$(PY) -m subclass_ca check $(CHECK_ARGS)

# the support table (docs/versions.md) from real runs on every lane
versions:
	set -e; for torch in $(LANES); do $(MAKE) --no-print-directory setup TORCH=$$torch; \
	  venv=$$( [ $$torch = 2.13.0 ] && echo .venv || echo .venv-$$torch ); \
	  $$venv/bin/python -m subclass_ca versions run --json build/versions/$$torch.json; done
	$(PY) -m subclass_ca versions render build/versions/*.json --out docs/versions.md

# One command that verifies the library on one CUDA GPU (docs/gpu.md): tests, demo, bench blocks, FSDP2, under a
# GPU_BUDGET (seconds, counted from make's start, so creating the venv counts). It makes $(GPU_VENV) with the public
# index's default Linux torch wheel, a CUDA build (its pip ignores this machine's pip config and torch cap, and the
# local CPU wheels of PIP_FIND_LINKS, which would win for torch==2.13.0), or with GPU_PYTHON=/path/to/python uses that
# interpreter (a CUDA torch 2.13-2.15 with the test extra) and makes no venv.
GPU_VENV   ?= .venv-cuda
GPU_STAMP  := $(GPU_VENV)/.subclass_ca-installed
GPU_PIP    := env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(GPU_VENV)/bin/python -m pip
GPU_PY     := $(or $(GPU_PYTHON),$(GPU_VENV)/bin/python)
GPU_OUT    ?= gpu-check-out
GPU_BUDGET ?= 480
ifneq ($(filter gpu-check,$(MAKECMDGOALS)),)
GPU_START  := $(shell date +%s)
endif

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PIP) install -q --upgrade pip
	$(GPU_PIP) install -q torch==$(TORCH)
	$(GPU_PIP) install -q -e '.[test,demo,torchao]'
	$(GPU_VENV)/bin/python -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$(TORCH)' and torch.version.cuda else f'$(GPU_VENV): wanted a CUDA build of torch $(TORCH), got {torch.__version__}')"
	touch $(GPU_STAMP)

gpu-check: $(if $(GPU_PYTHON),,$(GPU_STAMP))
	$(GPU_PY) -m subclass_ca gpu-check --out $(GPU_OUT) --budget-s $(GPU_BUDGET) --started-at $(GPU_START) $(GPU_ARGS)

# the same plan checked without CUDA (what CI's tests/tools/test_gpu_check.py runs too)
gpu-check-dry: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m subclass_ca gpu-check --dry-run --out $(GPU_OUT) --budget-s $(GPU_BUDGET) $(GPU_ARGS)

clean:
	rm -rf .venv .venv-* demo-out gpu-check-out .pytest_cache build
