# make run   : the main job (creates .venv on first use)
# make test  : lint, type-check and the test suite but the slow tier (two workers), with the 25 slowest tests
# make unit  : the tests that start no process (under a minute): the quick loop while changing a module
# make slow  : the long process tests (world-3 suites, resume matrices, faults, launcher edges, plan/bench/verify end
#              to end): about 16 minutes; CI runs them after make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.paratrain-installed

.PHONY: run test lint typecheck unit suite slow bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# a CPU-only machine takes the CPU build of torch; one with a GPU gets pip's default (CUDA) build
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet 'torch>=2.4'; \
	else \
		$(PY) -m pip install --quiet torch==2.13.0; \
	fi
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/paratrain train

test: lint typecheck suite

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples scripts
	$(VENV)/bin/ruff format --check src tests benchmarks examples scripts

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q -m "not processes"

# two workers, a test module each at a time: the process tests mostly wait (timeouts, launches), so two halve
# the wall time on two cores; SUITE_WORKERS=0 runs everything in this one process
SUITE_WORKERS ?= 2
suite: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=25 $(if $(filter 0,$(SUITE_WORKERS)),,-n $(SUITE_WORKERS) --dist loadfile)

slow: $(STAMP)
	$(PY) -m pytest -q -m slow --durations=10 $(if $(filter 0,$(SUITE_WORKERS)),,-n $(SUITE_WORKERS) --dist loadfile)

bench: $(STAMP)
	$(PY) benchmarks/bench_data_parallel.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
