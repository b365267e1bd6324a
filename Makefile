# hpctrain: every target installs what it needs first (tools/install.sh is idempotent).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Open MPI refuses to run as root without these; harmless for other users.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# Hard limits: a hung distributed test fails instead of stalling CI.
MPI_TEST_TIMEOUT ?= 1200
MPIRUN_KILL := timeout --signal=TERM --kill-after=15

.PHONY: install install-test test test-quick test-unit test-extended test-mpi test-multinode demo demo-tf lint format bench bench-quick docs clean gpu-check

install:
	@bash tools/install.sh

## The same, plus what only the tests need (SLURM's daemons, munge, shellcheck).
install-test:
	@bash tools/install.sh --test

## Single-process tests (they start their own mpirun jobs), then the tests that run
## inside every rank of real `mpirun -np 2` and `mpirun -np 4 --oversubscribe` jobs.
test: install-test
	$(MAKE) --no-print-directory test-unit
	$(MAKE) --no-print-directory test-mpi

## The quick tier for your own loop (under 2 minutes): no mpirun jobs, no cluster, no
## SLURM; the layering contracts included. `make test` remains what CI runs. The tiers
## (markers quick, mpi, multinode, slurm, slow, gpu) are set in tests/conftest.py.
test-quick: install
	$(PY) -m pytest -q -m quick tests
	cd $(CURDIR) && $(VENV)/bin/lint-imports

## Two pytest processes: the tests marked `beside` (those that mostly wait; SLURM's and
## the emulated nodes', kept in one process: they share daemons and namespaces) run in
## the background into a log printed after the rest, whose output streams here; the
## status fails if either fails. --durations: the slowest tests, where the 20 minutes go.
## The second has few warm launches: a small share of memory for its warm ranks, no
## spares. A Ctrl-C stops both (a shell starts a background job ignoring SIGINT: undone).
test-unit:
	@log=$$(mktemp /tmp/hpctrain-tests-beside.XXXXXX.log); trap 'rm -f "$$log"' EXIT; \
	echo "tests marked beside run in a second pytest process; its log: $$log"; \
	(trap - INT; HPCTRAIN_TEST_WARM_SHARE=0.15 HPCTRAIN_TEST_SPARES=0 exec $(PY) -m pytest \
		tests -q -m "beside and not extended" --durations=15) > "$$log" 2>&1 & \
	beside=$$!; \
	$(PY) -m pytest tests -q -m "not beside and not extended" --durations=25; rest=$$?; \
	wait $$beside; second=$$?; \
	echo "--- the tests marked beside (exit status $$second):"; cat "$$log"; \
	test $$rest = 0 -a $$second = 0

## The longer variants left out of `make test` (marked `extended`; root for the emulated nodes).
test-extended: install-test
	$(MPIRUN_KILL) 1800 $(PY) -m pytest tests -q -rs -m extended

test-mpi:
	$(MPIRUN_KILL) $(MPI_TEST_TIMEOUT) mpirun -np 2 $(PY) tests/mpi_pytest.py tests/mpi -q
	$(MPIRUN_KILL) $(MPI_TEST_TIMEOUT) mpirun -np 4 --oversubscribe $(PY) tests/mpi_pytest.py tests/mpi -q

## Only the multi-node tier (also part of test-unit): jobs across two emulated nodes,
## network namespaces on this machine (root; skipped with the reason elsewhere).
test-multinode: install-test
	$(MPIRUN_KILL) 900 $(PY) -m pytest tests/test_cluster_tool.py tests/test_multinode.py -q -rs

demo: install
	mpirun -np 2 $(VENV)/bin/hpctrain train --config configs/demo.yaml --run-dir runs/demo --new

demo-tf: install
	mpirun -np 2 $(VENV)/bin/hpctrain train --config configs/demo-tf.yaml --run-dir runs/demo-tf --new

## Scaling vs raw Horovod and mpi4py, allreduce microbenchmark, ablation, α–β projection
## and the features' own benchmarks: benchmarks/results/<UTC>/ (report.md, results.json,
## PNGs), benchmarks/latest points at it. Every mpirun inside has its own hard timeout.
## Extra options: make bench BENCH_ARGS="--network 25GbE-TCP".
BENCH_TIMEOUT ?= 2700
bench: install
	$(MPIRUN_KILL) $(BENCH_TIMEOUT) $(PY) benchmarks/run.py $(BENCH_ARGS)

bench-quick: install
	$(MPIRUN_KILL) 600 $(PY) benchmarks/run.py --quick $(BENCH_ARGS)

## ruff, plus the layering contracts in .importlinter (a lower layer never imports a
## higher one; only hpctrain/backends imports torch, TensorFlow or Horovod), no module-level
## communicator state, and the code-shape limits (no function over 80 lines, no backend
## module over 450).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd $(CURDIR) && $(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider tests/test_code_shape.py tests/test_no_module_state.py

format:
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## The documentation site (docs/ -> site/): the configuration-key page is regenerated
## from the schema first, and any MkDocs warning (broken link or anchor) fails the build.
docs: install
	$(PY) tools/gen_config_docs.py
	$(VENV)/bin/mkdocs build --strict

## Build outputs only: never runs/, where your training runs and checkpoints are.
clean:
	rm -rf build site *.egg-info .pytest_cache .ruff_cache

## The prepared GPU check (issue 27) for a GPU machine whose Python has torch with CUDA,
## h5py and mpi4py: GPU tests, multi-rank GPU layouts, the demo on one GPU, two ranks
## sharing it through the host-staged engine, the GPU bench, hierarchical allreduce on
## 2 emulated nodes; report in gpu-check/<UTC>/report.md. No install here. One call:
## 15 minutes at most (the script's default budget is one 10-minute call's).
gpu-check:
	GPU_CHECK_BUDGET=$${GPU_CHECK_BUDGET:-900} bash tools/gpu_check.sh
