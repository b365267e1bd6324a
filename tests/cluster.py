"""The emulated two-node cluster for tests: a pytest fixture that always tears it down.

`two_nodes()` (for a module-scoped fixture) brings up hpcn1 and hpcn2 through `hpctrain.cluster.session`,
which holds the cluster's lock (a concurrent test run waits its turn), removes what a
killed earlier run left behind, and takes everything down again however the module
ends: `finally`, an atexit hook, and SIGTERM turned into SystemExit. Where namespaces
cannot be made here (not root, no `ip`), the tests are skipped with that reason;
HPCTRAIN_SKIP_MULTINODE=1 skips them too.

`launch()` runs an mpirun job across the nodes under a hard timeout, killing the whole
process group (mpirun and everything on both nodes) if it hangs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

import pytest
from mpirun import ROOT

from hpctrain.cluster import ClusterUnavailable, session
from hpctrain.cluster.system import missing_capabilities, missing_tools

ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "PYTHONUNBUFFERED": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.environ.get("HPCTRAIN_SKIP_MULTINODE") == "1":
        return "HPCTRAIN_SKIP_MULTINODE=1 is set"
    caps = missing_capabilities()
    if caps:
        return f"the emulated cluster needs root: this process lacks {' and '.join(caps)}"
    tools = missing_tools()
    if tools:
        return f"the emulated cluster needs {', '.join(tools)}"
    return None


def two_nodes():
    """Generator for a module-scoped fixture: `yield from cluster.two_nodes()`."""
    reason = unavailable_reason()
    if reason:
        print(f"\nmulti-node tests skipped: {reason}")
        pytest.skip(reason)
    try:
        with session(nodes=2, link="none", wait=240, what="pytest multi-node tier") as c:
            yield c
    except ClusterUnavailable as exc:
        print(f"\nmulti-node tests skipped: {exc}")
        pytest.skip(str(exc))


@dataclass
class Job:
    returncode: int
    output: str
    seconds: float


def start(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start a job in its own process group, stdout and stderr together."""
    full = dict(os.environ)
    full.update(ENV)
    full.update(env or {})
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full,
        cwd=ROOT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float, started: float | None = None) -> Job:
    """Wait for a started job; on timeout kill its process group and fail the test."""
    started = time.monotonic() if started is None else started
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job hung for {timeout:g} s and was killed:\n{out}") from None
    return Job(proc.returncode, out, time.monotonic() - started)


def launch(argv: list[str], timeout: float = 180, env: dict | None = None) -> Job:
    t0 = time.monotonic()
    return finish(start(argv, env), timeout, t0)
