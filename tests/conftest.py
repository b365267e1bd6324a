"""Shared fixtures, and the tiers of the suite. tests/mpi/ only runs inside mpirun (see
tests/mpi_pytest.py).

Every test gets its tier markers here, by module, so no test file repeats them:

    quick      starts no mpirun job, no emulated cluster and no SLURM (`make test-quick`)
    mpi        runs inside every rank of an mpirun job (tests/mpi)
    multinode  jobs across two emulated nodes (test_multinode.py, test_cluster_tool.py)
    slurm      a SLURM cluster (test_slurm.py, and every test that starts one)
    slow       every test that is not quick
    beside     `make test` runs these in a second pytest process beside the others:
               the tests that mostly wait, and every SLURM and emulated-node test
    gpu        set by a test itself; skipped, with the reason, where torch sees no CUDA
    extended   set by a test itself: a variant `make test` covers with another test, left
               out of it (its 20-minute budget) and run by `make test-extended`

e.g. `pytest -m quick tests`, `pytest -m "slow and not multinode" tests`.
"""

import inspect
import os
from pathlib import Path

import pytest
import shared_runs

collect_ignore = [] if "OMPI_COMM_WORLD_SIZE" in os.environ else ["mpi", "scripts"]

TESTS = Path(__file__).resolve().parent

# The quick tier, kept only here: modules none of whose tests starts an mpirun job, an
# emulated cluster or SLURM (the Makefile's `test-quick` selects them with `-m quick`).
QUICK_MODULES = frozenset(
    {
        "test_activation_checkpointing",
        "test_async_fence",
        "test_backend_step",
        "test_pipeline_stream_order",
        "test_bench_projection",
        "test_checkpoint_atomic",
        "test_checkpoint_memory",
        "test_checkpoint_cli",
        "test_checkpoint_format",
        "test_checkpoint_policy",
        "test_checkpoint_sharded",
        "test_clock",
        "test_code_shape",
        "test_config",
        "test_data",
        "test_device_exchange",
        "test_devices",
        "test_doctor",
        "test_docs",
        "test_environment",
        "test_gpu_bench",
        "test_gradient_engine",
        "test_grid",
        "test_grid_shape",
        "test_host_reads",
        "test_launcher",
        "test_loss_scaling",
        "test_memory_limit",
        "test_memory_plan",
        "test_moe_routing",
        "test_model_match",
        "test_no_module_state",
        "test_preemption",
        "test_protocols",
        "test_rank_errors",
        "test_rundir",
        "test_run_marker",
        "test_tiers",
        "test_zero_layout",
        "test_zoo_parity",
    }
)
MULTINODE_MODULES = frozenset({"test_multinode", "test_cluster_tool"})
# `make test` runs the tests marked `beside` in a second pytest process beside the rest:
# these modules' tests mostly wait (deadlines, heartbeats, signals, supervisors, a memory
# cgroup's kernel), and SLURM's and the emulated nodes' tests (which must not run beside
# each other: they share daemons, ports and namespaces).
BESIDE_MODULES = frozenset(
    {"test_stall", "test_elastic", "test_interrupt_exit", "test_ps", "test_memory_limit_jobs"}
)
SLURM_MODULES = frozenset({"test_slurm"})
# a test elsewhere that starts a SLURM cluster names one of these (tests/slurm_cluster.py)
SLURM_NAMES = ("slurm_cluster", "start_slurm_on")
GPU_SKIP_REASON = "no CUDA GPU visible (torch.cuda.is_available() is False)"


def tiers(path: Path, source: str = "") -> set[str]:
    """The tier markers of a test in the file `path`; `source`: the test function's code."""
    path = Path(path).resolve()
    name = path.stem
    if path.parent == TESTS / "mpi":
        return {"mpi", "slow"}
    if path.parent == TESTS and name in QUICK_MODULES:
        return {"quick"}
    marks = {"slow"}
    if name in MULTINODE_MODULES:
        marks.add("multinode")
    if name in SLURM_MODULES or any(s in source for s in SLURM_NAMES):
        marks.add("slurm")
    if name in BESIDE_MODULES or marks & {"multinode", "slurm"}:
        marks.add("beside")
    return marks


def _source(item) -> str:
    try:
        return inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return ""


def _cuda_visible() -> bool:
    try:
        import torch  # only when a selected test asks for a GPU
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by `-m`
def pytest_collection_modifyitems(config, items):
    for item in items:
        marks = tiers(item.path)
        if "slow" in marks:  # a test elsewhere may start SLURM: its code says so
            marks = tiers(item.path, _source(item))
        for mark in sorted(marks):
            item.add_marker(mark)


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselected: torch only for gpu tests kept
def pytest_collection_finish(session):
    # the shared runs only extended tests need are trained only when one is selected
    shared_runs.EXTENDED_SELECTED = any(i.get_closest_marker("extended") for i in session.items)
    launches = any(i.get_closest_marker("slow") for i in session.items)
    if launches and "OMPI_COMM_WORLD_SIZE" not in os.environ:  # not inside the mpi tier's ranks
        from mpirun import start_spares

        start_spares()  # niced warm jobs importing while the in-process tests run first
    gpu = [item for item in session.items if item.get_closest_marker("gpu")]
    if gpu and not _cuda_visible():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))
