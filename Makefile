# bbio: `make demo` runs the main job, `make test` runs every test.
# Both set up whatever is missing first (scripts/setup-env.sh), then skip it.

VENV    ?= .venv
PY      := $(VENV)/bin/python
NP      ?= 4
READY   := $(VENV)/.bbio-ready
CC      ?= cc
# Open MPI on one machine: allow root, oversubscribe the cores, yield when idle.
# Harmless elsewhere; MPICH ignores them.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := true
export OMPI_MCA_mpi_yield_when_idle := 1
MPIRUN  ?= mpirun
TIMEOUT := timeout --signal=TERM --kill-after=30

CSRC := $(wildcard csrc/*.c csrc/*.h csrc/*.py)

.PHONY: setup demo test test-serial test-mpi lint cwarn bench slurm-check clean

setup: $(READY)

$(READY): scripts/setup-env.sh setup.py pyproject.toml $(CSRC)
	VENV=$(VENV) ./scripts/setup-env.sh
	touch $@

demo: $(READY)
	$(TIMEOUT) 900 $(PY) -m bbio.demo --launcher "$(MPIRUN) -n $(NP)"

test: $(READY) lint cwarn test-serial test-mpi

lint: $(READY)
	$(VENV)/bin/ruff check bbio tests csrc
	$(VENV)/bin/ruff format --check bbio tests csrc

cwarn:
	$(CC) -std=gnu11 -O2 -Wall -Wextra -Werror -Wshadow -Wconversion -c csrc/bbio_native.c -o /dev/null

test-serial: $(READY)
	$(TIMEOUT) 900 $(PY) -m pytest -q tests

test-mpi: $(READY)
	$(TIMEOUT) 900 $(MPIRUN) -n 2 $(PY) -m pytest -q --with-mpi -m mpi tests
	$(TIMEOUT) 900 $(MPIRUN) -n 4 $(PY) -m pytest -q --with-mpi -m mpi tests

bench: $(READY)
	$(MPIRUN) -n 1 --bind-to none $(PY) -m bbio.bench copy --json docs/bench/copy.json

# a real Slurm on this machine (root): one node, then two nodes in namespaces
slurm-check: $(READY)
	$(TIMEOUT) 600 ./scripts/slurm-hooks-check.sh
	$(TIMEOUT) 600 ./scripts/slurm-cluster-check.sh

clean:
	rm -rf build *.egg-info bbio/_bbio_native*.so work $(READY)
