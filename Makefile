# make test: set up .venv (if missing) with the project, the tool's dependencies (app), an
# MPI from PyPI (mpi) and the test tools (dev), then run every test.
# make lint: ruff's defect rules ([tool.ruff] in pyproject.toml) over the whole tree (seconds).
# make bench-check: speed ratios of the hot paths against recorded floors (not a test).
# make demo: same set-up, then the main job: layer-parallel training on digits over 2 MPI
# ranks next to serial training (accuracies and figures in out/demo), then one epoch of a
# deep narrow network (1024 layers), where layer-parallel training is the faster one, to
# show what it is for (out/demo/deep.md). Under 3 minutes on 2 cores.
# Elsewhere (e.g. a CUDA machine) override the torch requirement: make test TORCH_SPEC="torch>=2.3"
# make test runs the tests in TEST_WORKERS processes (pytest-xdist; 0: in pytest's own).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# a cluster with its own MPI: make test EXTRAS=app,dev (mpi4py then builds against it)
EXTRAS ?= app,mpi,dev
# two: much of the suite is one process at a time (a test and its single-rank runs), which
# leaves a second core idle; more than the cores would only oversubscribe the MPI tests' ranks
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mgrit-installed

.PHONY: test test-fast test-timing lint demo bench bench-check install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -e ".[$(EXTRAS)]"
	touch $(STAMP)

# MGRIT_TEST_REQUIRE_ALL: a missing mpiexec or optional package fails the tests that need
# it instead of skipping them (tests/needs.py)
# timing tests assert on wall-clock time: they belong to a quiet machine, not to make test
test: $(STAMP)
	MGRIT_TEST_REQUIRE_ALL=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not timing"

lint: $(STAMP)
	$(PY) -m ruff check .

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not mpi and not slow and not timing"

test-timing: $(STAMP)
	$(PY) -m pytest -q -m timing

demo: $(STAMP)
	$(VENV)/bin/mgrit compare --ranks 2 --epochs 15 --no-progress --overwrite --out out/demo \
		--deep-steps 1024

bench: $(STAMP)
	$(VENV)/bin/mgrit bench w0

# the speed ratios that guard the hot paths against the floors in benchmarks/floors.json
# (under a minute, one process); run before every commit that touches a hot path
bench-check: $(STAMP)
	$(PY) -m benchmarks.check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
