# ulysses-lowp developer targets. PYTHON can point at a venv's interpreter.
PYTHON ?= python3
WORLD_SIZES ?= 2 4 6 8
# pytest-xdist workers; the CPU suite is interpreter-bound, one worker per core.
XDIST ?= auto

.PHONY: install test validate validate-large lint format bench

# Install the package in editable mode with the test and bench extras.
install:
	$(PYTHON) -m pip install -e ".[test,bench,dev]"

# Single-process tests and the torchrun harness on CPU (gloo + Triton interpreter).
test:
	$(PYTHON) -m pytest -n $(XDIST) tests

# The main job: every world size in WORLD_SIZES on the best backend this machine has.
validate:
	@$(PYTHON) -c "import ulysses" 2>/dev/null || $(PYTHON) -m pip install -q -e .
	WORLD_SIZES="$(WORLD_SIZES)" PYTHON=$(PYTHON) bash scripts/validate.sh

# The harness with the GPU-sized --large cases added.
validate-large:
	@$(PYTHON) -c "import ulysses" 2>/dev/null || $(PYTHON) -m pip install -q -e .
	WORLD_SIZES="$(WORLD_SIZES)" PYTHON=$(PYTHON) bash scripts/validate.sh --large

# ruff lint and format check.
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# Apply ruff's formatter.
format:
	$(PYTHON) -m ruff format .

# GPU benchmark of k_grouped_amax and smooth_k_stats (writes bench_out/).
bench:
	$(PYTHON) scripts/bench_k_grouped_amax.py
