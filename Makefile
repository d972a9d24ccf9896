# Two set-up-free entry points for a fresh clone: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DIGITS := data/digits_dir0.1_n20.h5
NPROC ?= 2

.PHONY: install run test clean-runs

$(STAMP): setup.py constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[mpi,test]'
	@touch $(STAMP)

install: $(STAMP)

$(DIGITS): $(STAMP)
	$(VENV)/bin/fedcp-partition --source digits --partition dir --beta 0.1 --num-clients 20 --seed 1 --out $@ --force

# FedCP on the embedded digits partition, 2 ranks under torchrun, then the result table.
run: $(STAMP) $(DIGITS)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m fedcp_dist.run \
		--config configs/digits_fedcp.yaml overwrite=true

test: $(STAMP)
	$(PY) -m pytest -q --durations=10 tests

clean-runs:
	rm -rf runs
