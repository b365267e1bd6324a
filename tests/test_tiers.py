"""The tiers of the suite (tests/conftest.py): `-m quick` selects exactly the quick
modules, none that starts mpirun, a cluster or SLURM; every other test is `slow` and
carries its kind; a `gpu` test is skipped with the reason where torch sees no CUDA."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPU_SKIP_REASON, QUICK_MODULES, TESTS, tiers

ROOT = TESTS.parent
NOT_QUICK = ("test_multinode", "test_cluster_tool", "test_slurm", "mpi/")


def _quick_plan() -> str:
    """`-m quick` as `make test-quick` selects it: the tests it would run (their setup
    plan, nothing executed) and the skips, in one collection (about 8 s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--setup-plan", "-q", "-rs", "-m", "quick", "tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_the_quick_tier_is_the_quick_modules_and_nothing_else():
    out = _quick_plan()
    files = set(re.findall(r"^\s*(tests/\S+?\.py)::", out, re.M))
    assert not [f for f in files if any(s in f for s in NOT_QUICK)], files
    assert {Path(f).stem for f in files} == QUICK_MODULES, files
    assert re.search(r"\d+ deselected", out), out[-500:]
    # and the gpu test among them is skipped with the reason where torch sees no CUDA
    skipped = re.search(r"^SKIPPED \[1\] tests/test_tiers.py:\d+: (.*)$", out, re.M)
    if _cuda_visible():
        assert skipped is None, out[-500:]
    else:
        assert skipped and skipped.group(1) == GPU_SKIP_REASON, out[-500:]


@pytest.mark.parametrize(
    "path,source,marks",
    [
        ("test_config.py", "", {"quick"}),
        ("mpi/test_world.py", "", {"mpi", "slow"}),
        ("test_multinode.py", "def test_x(two_nodes): ...", {"multinode", "slow", "beside"}),
        (
            "test_multinode.py",
            "slurm = emulated.start_slurm_on(",
            {"multinode", "slurm", "slow", "beside"},
        ),
        ("test_cluster_tool.py", "", {"multinode", "slow", "beside"}),
        ("test_slurm.py", "", {"slurm", "slow", "beside"}),
        ("test_resume_jobs.py", "x = slurm_cluster()", {"slurm", "slow", "beside"}),
        ("test_stall.py", "", {"slow", "beside"}),
        ("test_trainer_jobs.py", "", {"slow"}),
    ],
)
def test_each_module_gets_its_tiers(path, source, marks):
    assert tiers(TESTS / path, source) == marks


def test_the_tests_that_start_slurm_on_the_emulated_nodes_are_marked_slurm():
    path = TESTS / "test_multinode.py"
    text = path.read_text()
    funcs = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)]
    marked = {
        f.name
        for f in funcs
        if f.name.startswith("test_") and "slurm" in tiers(path, ast.get_source_segment(text, f))
    }
    assert marked == {
        "test_slurm_two_nodes_runs_the_template_and_requeues_bit_for_bit",
        "test_elastic_srun_step_finishes_on_the_node_left_when_a_node_is_lost",
    }


@pytest.mark.gpu
def test_a_gpu_test_runs_where_cuda_is_visible():
    import torch

    assert torch.cuda.is_available()
    x = torch.ones(4, device="cuda")
    assert float((x * 2).sum().cpu()) == 8.0
