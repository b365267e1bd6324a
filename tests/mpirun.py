"""Start real mpirun jobs from single-process tests, always under a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
HPCTRAIN = str(VENV_BIN / "hpctrain")
PYTHON = sys.executable


@dataclass
class Job:
    returncode: int
    output: str
    seconds: float


def mpirun(
    np: int, *cmd: str, timeout: float = 300, env: dict | None = None, cwd: str | Path | None = None
) -> Job:
    """Run `cmd` on `np` ranks; stdout+stderr together; killed (and failed) on timeout."""
    full_env = dict(os.environ)
    full_env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1"
    )
    full_env.update(env or {})
    args = ["mpirun", "-np", str(np)]
    if np > 2:
        args.append("--oversubscribe")
    args += list(cmd)
    start = time.monotonic()
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=cwd or ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(
            f"mpirun -np {np} {' '.join(cmd)} hung for {timeout} s:\n{out}"
        ) from None
    return Job(proc.returncode, out, time.monotonic() - start)
