"""One user of the emulated cluster at a time: a lock, and a session that cleans up.

Tests and benchmarks on a shared machine may start at the same moment; they share one
state directory (and the default names), so whoever holds the lock (an flock, released
by the kernel even when its holder is killed) owns it. A session takes the lock, removes
what a killed earlier session left (what its state file lists, nothing else), brings the
cluster up, and takes it down again however it ends: `finally`, an atexit hook, and
SIGTERM turned into SystemExit while it runs.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from . import netns
from .agent import on_node
from .errors import ClusterError
from .plan import DEFAULT_BRIDGE, DEFAULT_PREFIX, DEFAULT_SUBNET, Plan, mpirun_args


class Lock:
    """An exclusive flock on STATE_DIR/.hpctrain-cluster.lock; the holder's pid is written
    inside (a name of its own: the directory may be a shared one)."""

    def __init__(self, state_dir: Path = netns.STATE_DIR):
        self.path = Path(state_dir) / ".hpctrain-cluster.lock"
        self._fd: int | None = None

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def acquire(self, wait: float = 0.0, what: str = "") -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self.holder()
                    os.close(fd)
                    raise ClusterError(
                        f"the emulated cluster is in use by {holder}"
                        + (f" (waited {wait:g} s)" if wait else "")
                        + ": wait for it to finish"
                    ) from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}{' (' + what + ')' if what else ''}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing releases the flock
            self._fd = None


@dataclass
class Cluster:
    """A running emulated cluster, as a session hands it out."""

    plan: Plan
    state: dict
    state_dir: Path

    @property
    def nodes(self) -> list[str]:
        return list(self.state["nodes"])

    @property
    def agent(self) -> str:
        return self.state["agent"]

    def mpirun(self, per_node: int, *argv: str, hosts: str | None = None) -> list[str]:
        """argv of an mpirun started on the first node, `per_node` ranks on every node
        (or the `--host` list `hosts`, e.g. 'hpcn1:2,hpcn2:1' for uneven nodes)."""
        args = mpirun_args(self.plan, self.agent, per_node)
        if hosts is not None:
            args[args.index("--host") + 1] = hosts
        return on_node(self.nodes[0], ["mpirun", *args, *argv], self.state.get("cores"))

    def on_node(self, node: str, *argv: str) -> list[str]:
        return on_node(node, list(argv), self.state.get("cores"))

    def shape(self, link: str) -> None:
        netns.shape(link, state_dir=self.state_dir)
        self.plan = dataclasses.replace(self.plan, link=link)

    def link_down(self, node: str) -> None:
        netns.set_link(node, False, self.state_dir)

    def link_up(self, node: str) -> None:
        netns.set_link(node, True, self.state_dir)


@contextlib.contextmanager
def session(
    nodes: int = 2,
    link: str = "none",
    wait: float = 600.0,
    what: str = "session",
    state_dir: Path = netns.STATE_DIR,
    subnet: str = DEFAULT_SUBNET,
    bridge: str = DEFAULT_BRIDGE,
    prefix: str = DEFAULT_PREFIX,
):
    """Hold the cluster for the `with` block: up on entry, down however it ends."""
    plan = Plan(nodes, link, subnet, bridge, prefix)
    lock = Lock(state_dir)
    lock.acquire(wait, what)
    previous_term = signal.getsignal(signal.SIGTERM)

    def _on_term(signum, frame):
        raise SystemExit(128 + signum)

    def _teardown():
        with contextlib.suppress(Exception):
            netns.down(state_dir)
        lock.release()

    atexit.register(_teardown)
    if previous_term in (signal.SIG_DFL, None):
        with contextlib.suppress(ValueError):  # only the main thread may set handlers
            signal.signal(signal.SIGTERM, _on_term)
    try:
        state = netns.read_state(state_dir)
        if state and state.get("owner") == "cli":
            raise ClusterError(
                "an emulated cluster brought up by `hpctrain cluster up` is running: "
                "`hpctrain cluster down` first"
            )
        netns.down(state_dir)  # what a killed earlier session left behind (its state lists it)
        state = netns.up(plan, owner=what, state_dir=state_dir)
        yield Cluster(plan, state, Path(state_dir))
    finally:
        if signal.getsignal(signal.SIGTERM) is _on_term:
            signal.signal(signal.SIGTERM, previous_term)
        atexit.unregister(_teardown)
        _teardown()
