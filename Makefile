# ulysses-lowp developer targets.
#
# Every target runs with $(PYTHON). Left unset, PYTHON is .venv/bin/python and the first target
# that needs it builds that environment: `python3 -m venv .venv`, then $(TORCH_SPEC) if the
# environment has no torch yet (a torch already there is never replaced), then
# `pip install -e ".[test,dev]"`. The stamp .venv/.ulysses-ready records that this was done;
# editing pyproject.toml redoes the package install.
#
#   make test                                   # the fast tier; uses (and builds) .venv
#   make clean-venv; make test TORCH_SPEC=torch==2.11.0 \
#       TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130    # .venv with a CUDA build
#   make test PYTHON=python3                    # an interpreter you manage; make installs into
#                                               # it only what it lacks
#   make setup                                  # reinstall the package and its extras

VENV ?= .venv
# The interpreter that creates .venv (Python >= 3.10).
BASE_PYTHON ?= python3
# Extra `python3 -m venv` flags, e.g. --system-site-packages to reuse an installed torch.
VENV_ARGS ?=
# The torch installed into an environment that has none, from pip's configured index. Pick
# another build with TORCH_SPEC and TORCH_INDEX_URL (PyTorch's wheel indexes: .../whl/cpu for
# the CPU-only build, .../whl/cu130, ...). Empty TORCH_SPEC installs none explicitly: pip then
# resolves the package's torch>=2.11 itself.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
EXTRAS ?= test,dev
PIP_FLAGS ?= --quiet

WORLD_SIZES ?= 2 4 6 8
# pytest-xdist workers; the CPU suite is interpreter-bound, one worker per core.
XDIST ?= auto
# Workers for the tests that start processes: each starts 2 to 8 ranks of its own.
DIST_XDIST ?= 2
# Where `make gpu-check` writes its logs; empty: a new temporary folder (printed at the end).
OUT ?=

ifeq ($(origin PYTHON),undefined)
PYTHON_DEFAULTED := 1
PYTHON := $(VENV)/bin/python
READY := $(VENV)/.ulysses-ready
else
# A caller-chosen interpreter: no venv, no stamp; check it on every run (cheap, no imports).
READY := check-python
endif

TORCH_INDEX_ARGS := $(if $(strip $(TORCH_INDEX_URL)),--index-url $(TORCH_INDEX_URL),)
# Modules the targets need; find_spec looks them up without importing torch.
NEEDED := torch triton numpy ulysses pytest xdist pytest_timeout hypothesis ruff

.PHONY: setup check-python install test test-dist test-slow test-all validate validate-large gpu-check lint format bench \
	wheel-check clean-venv compile-check

$(VENV)/.ulysses-ready: pyproject.toml
	@if [ ! -x "$(VENV)/bin/python" ]; then \
		echo "make: creating $(VENV) with $(BASE_PYTHON)"; \
		$(BASE_PYTHON) -m venv $(VENV_ARGS) "$(VENV)" || { \
			echo "make: '$(BASE_PYTHON) -m venv' failed. Install Python >= 3.10 with its venv" \
			     "module (Debian: apt-get install python3-venv), or pass PYTHON=/path/to/python" \
			     "of an environment you manage." >&2; exit 1; }; \
	fi
	@if [ -n "$(strip $(TORCH_SPEC))" ] && ! "$(PYTHON)" -c "import importlib.util as u, sys; \
			sys.exit(u.find_spec('torch') is None)"; then \
		echo "make: installing $(TORCH_SPEC) $(TORCH_INDEX_ARGS) into $(VENV)"; \
		"$(PYTHON)" -m pip install $(PIP_FLAGS) $(TORCH_INDEX_ARGS) "$(TORCH_SPEC)" || { \
			echo "make: could not install $(TORCH_SPEC). Choose another build with" \
			     "TORCH_SPEC=... and/or TORCH_INDEX_URL=..., e.g. make clean-venv; make test" \
			     "TORCH_SPEC=torch TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2; \
			exit 1; }; \
	fi
	@echo "make: installing ulysses-lowp (editable) with extras [$(EXTRAS)] into $(VENV)"
	"$(PYTHON)" -m pip install $(PIP_FLAGS) -e ".[$(EXTRAS)]"
	@"$(PYTHON)" -c "import torch, triton, ulysses; print('make: ready: torch', torch.__version__, \
		'| triton', triton.__version__, '| ulysses', ulysses.__version__, '| CUDA GPUs', \
		torch.cuda.device_count())"
	@touch "$@"

# With PYTHON given: install into it only what it lacks.
check-python:
	@"$(PYTHON)" -c "import sys" 2>/dev/null || { \
		echo "make: PYTHON=$(PYTHON) does not run. Leave PYTHON unset to use $(VENV)." >&2; \
		exit 1; }
	@missing=$$("$(PYTHON)" -c "import importlib.util as u; \
		print(' '.join(m for m in '$(NEEDED)'.split() if u.find_spec(m) is None))"); \
	if echo " $$missing " | grep -q " torch "; then \
		if [ -z "$(strip $(TORCH_SPEC))" ]; then \
			echo "make: $(PYTHON) has no torch and TORCH_SPEC is empty." >&2; exit 1; fi; \
		echo "make: $(PYTHON) has no torch; installing $(TORCH_SPEC) $(TORCH_INDEX_ARGS)"; \
		"$(PYTHON)" -m pip install $(PIP_FLAGS) $(TORCH_INDEX_ARGS) "$(TORCH_SPEC)" || exit 1; \
	fi; \
	if [ -n "$$missing" ]; then \
		echo "make: $(PYTHON) lacks: $$missing; installing -e .[$(EXTRAS)]"; \
		"$(PYTHON)" -m pip install $(PIP_FLAGS) -e ".[$(EXTRAS)]" || exit 1; \
	fi

# Reinstall the package with $(EXTRAS); torch only if missing. To change the torch build of
# .venv: make clean-venv, then any target with TORCH_SPEC=... TORCH_INDEX_URL=...
setup:
ifeq ($(READY),check-python)
	@$(MAKE) --no-print-directory check-python
	"$(PYTHON)" -m pip install $(PIP_FLAGS) -e ".[$(EXTRAS)]"
else
	@rm -f "$(VENV)/.ulysses-ready"
	@$(MAKE) --no-print-directory $(READY)
endif

# Kept for older instructions: same as setup.
install: setup

# Remove the environment make built.
clean-venv:
	rm -rf "$(VENV)"

# The test tiers, one folder each (README "Tests"). The pytest markers of pyproject.toml select
# them; every target collects all of tests/, so tests/conftest.py sees every test and fails one
# whose folder and markers disagree.
#   test       tests/unit/: in-process unit tests at small shapes (Triton's interpreter on CPU)
#   test-dist  tests/dist/ (marker dist): tests that start processes: torchrun runs (the planted
#              faults in one run, the watchdog, P = 3), the examples, scripts, a fresh interpreter
#   test-slow  tests/slow/ (marker slow): interpreter sweeps of launch tiles, P = 16, the harness
#              under pytest at 2/4/6/8 (what `make validate` runs), every kernel compiled for sm90
#   test-all   all three
test: $(READY)
	"$(PYTHON)" -m pytest -n $(XDIST) -m "not dist and not slow" tests

test-dist: $(READY)
	"$(PYTHON)" -m pytest -n $(DIST_XDIST) -m "dist and not slow" tests

test-slow: $(READY)
	"$(PYTHON)" -m pytest -n $(DIST_XDIST) -m "slow" tests

test-all: $(READY)
	"$(PYTHON)" -m pytest -n $(XDIST) tests

# The main job: every world size in WORLD_SIZES on the best backend this machine has.
validate: $(READY)
	WORLD_SIZES="$(WORLD_SIZES)" PYTHON="$(PYTHON)" bash scripts/validate.sh

# The harness with the GPU-sized --large cases added.
validate-large: $(READY)
	WORLD_SIZES="$(WORLD_SIZES)" PYTHON="$(PYTHON)" bash scripts/validate.sh --large

# Every GPU check in one run, logs under $(OUT) or a temporary folder. No venv is built here (a GPU machine usually
# has its CUDA torch installed already): PYTHON if given, else .venv's if it exists, else python3.
GPU_PYTHON := $(if $(PYTHON_DEFAULTED),$(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3),$(PYTHON))
gpu-check:
	PYTHON="$(GPU_PYTHON)" bash scripts/gpu_check.sh $(if $(strip $(OUT)),"$(OUT)",)

# Compile every kernel for sm90 with the installed Triton, no GPU needed: the specializations
# that the kernel tests and the public calls at the benchmark shapes make the package launch
# with its compiled settings (tools/compile_sm90.py; tests/unit/test_compile_sm90.py runs it in
# `make test`). Prints registers and local memory a kernel; fails on a compile error or a
# spill. --fusion-diff compiles each one again with FP fusion on: what pinning it off costs.
COMPILE_CHECK_ARGS ?= --shapes --fusion-diff
compile-check: $(READY)
	"$(PYTHON)" tools/compile_sm90.py $(COMPILE_CHECK_ARGS)

# Build a wheel, install it with $(TORCH_SPEC) into a new venv outside the clone, run a first
# CPU call there (tests/dist/test_wheel.py, the test that `make test-dist` skips).
wheel-check: $(READY)
	ULYSSES_TEST_WHEEL=1 ULYSSES_WHEEL_TORCH_SPEC="$(TORCH_SPEC)" \
		ULYSSES_WHEEL_TORCH_INDEX_URL="$(TORCH_INDEX_URL)" \
		"$(PYTHON)" -m pytest -p no:cacheprovider tests/dist/test_wheel.py

# ruff lint and format check.
lint: $(READY)
	"$(PYTHON)" -m ruff check .
	"$(PYTHON)" -m ruff format --check .

# Apply ruff's formatter.
format: $(READY)
	"$(PYTHON)" -m ruff format .

# k_grouped_amax on one GPU: cold kernel time, eager per call, host overhead (one table).
bench: $(READY)
	"$(PYTHON)" scripts/bench_amax.py
