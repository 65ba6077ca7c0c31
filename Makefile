# Every target creates its venv and installs on first use. One venv per torch lane:
#   make test                  -> torch 2.13.0 in .venv (the default lane; the local CPU wheel)
#   make test TORCH=2.11.0     -> .venv-2.11.0 (public index; likewise 2.12.1, 2.14.1, 2.15.0: one venv per lane)
# Only the default lane takes the local CPU wheel; every other lane's pip ignores the machine's pip config (a torch
# cap, where one is set) and the local wheel folder, so it gets exactly the public wheel it names.
PYTHON ?= python3
comma  := ,
TORCH  ?= 2.13.0
LANES  ?= 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0
ifeq ($(TORCH),2.13.0)
VENV   ?= .venv
else
VENV   ?= .venv-$(TORCH)
endif
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.subclass_ca-installed
# no pip cache: nothing pip fetches is needed twice, and a cached copy only takes disk
PIP    := $(if $(filter 2.13.0,$(TORCH)),,env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null) PIP_NO_CACHE_DIR=1 $(PY) -m pip
TORCH_STAMP := $(VENV)/.torch-installed

.PHONY: setup torch-setup torch-setups demo test test-fast test-lanes test-torchao015 lint bench bench-quick fsdp2 check torchao-matrix versions gpu-check gpu-check-dry gpu-wheels clean

# the venv and its torch alone: the slow part of a set-up, independent of the checkout. The default lane takes the
# local CPU wheel with pip. A public lane is a ~5 GB CUDA build: uv (pinned, installed into the lane's venv) streams
# its wheels into a cache folder inside the venv and hard-links them in, so the install needs the venv's final size
# on disk and no more (pip keeps every downloaded wheel as well, ~3 GB more at its peak), and takes ~20 s instead of
# ~60 s. `--no-config` and uv's own index (PyPI) mean neither this machine's pip config nor its torch cap applies.
# `--compile-bytecode` writes the .pyc files pip would have written (uv skips them by default): this machine runs
# with PYTHONDONTWRITEBYTECODE=1 (.ci/run prints whether CI does), so without them every process of a lane's suite
# compiles torch's source again (importing torch, Dynamo and inductor: 11 s instead of 5 s, in each of the suite's
# many processes); it adds 5-15 s to the set-up.
UV_SPEC ?= uv==0.13.9
$(TORCH_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(TORCH),2.13.0)
	$(PIP) install -q torch==$(TORCH)
else
	$(PIP) install -q $(UV_SPEC)
	rm -rf $(VENV)/.uv-cache
	UV_CACHE_DIR=$(abspath $(VENV))/.uv-cache UV_LINK_MODE=hardlink \
	  $(VENV)/bin/uv pip install -q --no-config --compile-bytecode --python $(abspath $(PY)) torch==$(TORCH)
	rm -rf $(VENV)/.uv-cache
endif
	touch $(TORCH_STAMP)

torch-setup: $(TORCH_STAMP)

torch-setups: $(addprefix torch-setup-,$(LANES))

torch-setup-%:
	@$(MAKE) --no-print-directory torch-setup TORCH=$*

$(STAMP): pyproject.toml subclass_ca/_version.py $(TORCH_STAMP)
	$(PIP) install -q -e '.[test,demo,torchao$(if $(filter 2.13.0,$(TORCH)),$(comma)integrations)]'
	@# installing subclass_ca must never replace the lane's torch (pyproject declares no torch requirement)
	$(PY) -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$(TORCH)' else f'installing subclass_ca changed torch $(TORCH) -> {v}')"
	touch $(STAMP)

setup: $(STAMP)

# The repository's tools (tools/, not in the wheel) run from the checkout: python -m tools COMMAND (docs/design.md).
demo: $(STAMP)
	$(PY) -m tools demo $(DEMO_ARGS)

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

# The torchao extra allows 0.15 to 0.18 (0.15 is torchtune 0.6's; NF4Tensor moved in 0.18): the default lane tests
# 0.18, this target the torchao tests on 0.15, in a venv of their own on the default lane's torch (the local CPU
# wheel), with the trainers that need that torchao (torchtune; torchtitan beside it: the integrations-torchtune
# extra) and their integration tests. CI runs it after the default lane's tests. numpy: the default lane has it (through the demo extra), and
# inductor's CPU path needs it. In-process: the kit's torchao rows share one module-scoped run.
TORCHAO015         ?= 0.15.0
TORCHAO015_TORCH   ?= 2.13.0
TORCHAO015_VENV    ?= .venv-torchao015
TORCHAO015_PY      := $(TORCHAO015_VENV)/bin/python
TORCHAO015_STAMP   := $(TORCHAO015_VENV)/.subclass_ca-installed
TORCHAO015_TESTS   ?= tests/handlers/test_torchao.py tests/testing/test_kit_torchao.py \
                      tests/integrations/test_torchtune.py tests/integrations/test_torchtitan.py
$(TORCHAO015_STAMP): pyproject.toml subclass_ca/_version.py
	test -x $(TORCHAO015_PY) || $(PYTHON) -m venv $(TORCHAO015_VENV)
	PIP_NO_CACHE_DIR=1 $(TORCHAO015_PY) -m pip install -q --upgrade pip
	PIP_NO_CACHE_DIR=1 $(TORCHAO015_PY) -m pip install -q torch==$(TORCHAO015_TORCH) torchao==$(TORCHAO015) numpy
	PIP_NO_CACHE_DIR=1 $(TORCHAO015_PY) -m pip install -q -e '.[test,torchao,integrations-torchtune]'
	$(TORCHAO015_PY) -c "import sys, torch, importlib.metadata as m; t = torch.__version__.split('+')[0]; a = m.version('torchao'); \
	  sys.exit(0 if (t, a) == ('$(TORCHAO015_TORCH)', '$(TORCHAO015)') else f'$(TORCHAO015_VENV): wanted torch $(TORCHAO015_TORCH), torchao $(TORCHAO015); got {t}, {a}')"
	touch $(TORCHAO015_STAMP)

test-torchao015: $(TORCHAO015_STAMP)
	OMP_NUM_THREADS=1 $(TORCHAO015_PY) -m pytest -q -p no:cacheprovider $(TORCHAO015_TESTS) $(PYTEST_ARGS)

# ruff (pyflakes, import order, pyupgrade, bugbear) and mypy (types), both configured in pyproject.toml; CI runs it
# before the test lanes (.ci/run). The tools come from the `lint` extra (exact versions), installed into the venv on
# first use. ruff checks every Python file of the checkout (the package, tools/, tests/, examples/, benchmarks/); mypy
# checks the package, tools/ and benchmarks/ (the `files` of [tool.mypy]).
LINT_STAMP := $(VENV)/.lint-installed
$(LINT_STAMP): pyproject.toml $(STAMP)
	$(PIP) install -q -e '.[lint]'
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(PY) -m ruff check subclass_ca _subclass_ca_pytestplugin.py tools tests examples benchmarks
	$(PY) -m mypy

# the full benchmark (<= 10 min on a 2-core machine): RESULTS.md, results.json, bench.png in benchmarks/
BENCH_ARGS ?= --threads 1 --no-progress --tp --fsdp2 --ddp --depth --append benchmarks/analysis.md
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m tools bench $(BENCH_ARGS)

# the CI smoke run of the same pipeline (<= 2 min)
bench-quick: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m tools bench --quick --threads 1 --no-progress --no-plot --out-dir build/bench-quick

# FSDP2 parity on 2 gloo processes: every mode against eager FSDP2 and a dense run (docs/distributed.md)
FSDP2_ARGS ?= --nproc 2
fsdp2: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m tools fsdp2 $(FSDP2_ARGS)

check: $(STAMP)
	$(PY) -m subclass_ca check $(CHECK_ARGS)

# torchao's training subclasses under subclass_ca and stock, aot_eager and inductor, on every lane (docs/torchao.md).
# check exits 1 when a cell fails: the matrix records it (the page lists every reason), so the loop goes on.
TORCHAO_ROWS ?= nf4,float8_training,float8_weight,int8_mixed_precision,int8_quantized_training,bitnet,optim_state_8bit,optim_state_4bit
torchao-matrix:
	mkdir -p build/torchao
	set -e; for torch in $(LANES); do $(MAKE) --no-print-directory setup TORCH=$$torch; \
	  venv=$$( [ $$torch = 2.13.0 ] && echo .venv || echo .venv-$$torch ); \
	  OMP_NUM_THREADS=1 $$venv/bin/python -m subclass_ca check --subclass $(TORCHAO_ROWS) --backend aot_eager,inductor \
	    --compare-stock --no-progress --json build/torchao/$$torch.json > build/torchao/$$torch.txt || true; done
	$(PY) -m tools torchao-matrix build/torchao/*.json --out docs/torchao.md

# the support table (docs/versions.md) from real runs on every lane
versions:
	set -e; for torch in $(LANES); do $(MAKE) --no-print-directory setup TORCH=$$torch; \
	  venv=$$( [ $$torch = 2.13.0 ] && echo .venv || echo .venv-$$torch ); \
	  $$venv/bin/python -m tools versions run --json build/versions/$$torch.json; done
	$(PY) -m tools versions render build/versions/*.json --out docs/versions.md

# One command that verifies the library on one CUDA GPU (docs/gpu.md): tests, demo, bench blocks, FSDP2, under a
# GPU_BUDGET (seconds, counted from make's start, so creating the venv counts). With GPU_PYTHON=python3 (the lent
# device's only interpreter: torch 2.11.0+cu130, no network) it uses that interpreter and makes no venv: subclass_ca
# and the tools come from this checkout (never pip-installed there), the optional extras from the wheels in
# GPU_WHEELS (make gpu-wheels, here), installed offline. Without GPU_PYTHON it makes $(GPU_VENV) with the public
# index's default Linux torch wheel, a CUDA build (its pip ignores this machine's pip config and torch cap, and the
# local CPU wheels of PIP_FIND_LINKS, which would win for torch==2.13.0). tools/gpu/device_check.sh is the same
# check as one command for the device (results under $OUT).
GPU_VENV   ?= .venv-cuda
GPU_STAMP  := $(GPU_VENV)/.subclass_ca-installed
GPU_PIP    := env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(GPU_VENV)/bin/python -m pip
GPU_PY     := $(or $(GPU_PYTHON),$(GPU_VENV)/bin/python)
GPU_OUT    ?= $(or $(OUT),gpu-check-out)
GPU_BUDGET ?= 360
GPU_WHEELS ?= wheels
GPU_CHECK  := -m tools gpu-check --out $(GPU_OUT) --budget-s $(GPU_BUDGET) --wheels $(GPU_WHEELS) $(GPU_ARGS)
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
	$(GPU_PY) $(GPU_CHECK) --started-at $(GPU_START)

# the same invocation checked without CUDA (CI's tests/tools/test_gpu_check.py runs it too); TORCH=2.11.0 checks it
# on the device's torch release
gpu-check-dry: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) $(GPU_CHECK) --dry-run

# the optional extras the device lacks, as wheels for its Python 3.12 (x86-64): run here, where the network is;
# carried to the device with carry: ["wheels"] (docs/gpu.md)
GPU_WHEEL_SPECS ?= torchao==0.18.0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_SPECS)
	ls -l $(GPU_WHEELS)

clean:
	rm -rf .venv .venv-* demo-out gpu-check-out .pytest_cache .mypy_cache .ruff_cache build
