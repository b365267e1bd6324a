"""The process-group engine: gradients averaged by torch.distributed (NCCL or Gloo).

Bootstrapped over MPI, so nothing like MASTER_ADDR has to be set and it works under
mpirun, srun and horovodrun alike: rank 0 of the communicator opens a `TCPStore` on a
free port and broadcasts its IPv4 addresses and the port with MPI; every other rank
connects to the first address it can reach (the emulated nodes and real clusters have
several interfaces; loopback is tried last). NCCL on GPU ranks, Gloo on CPU ranks: the
same code, so the CPU suite exercises what GPU nodes run.

Deadlines: where a rank's host waits (a Gloo collective; on GPU ranks, reading a
step's results, step_reports.py) the wait is a section of the MPI watchdog's, whose
deadline `runtime.collective_timeout` probes every rank and ends the job naming the one
that stopped or hangs. The groups' own timeout comes after it (group_timeout: twice it
and 15 s), as the fallback: a Gloo collective that passes it raises on that rank
(fail-together then ends the job naming it); NCCL's watchdog, at its timeout, logs the timed-out
collective with the rank that saw it and ends that process (torch's default
TORCH_NCCL_ASYNC_ERROR_HANDLING=3 rethrows in its thread), and mpirun/srun end the rest
of the job.

Cost at scale: bootstrap is one MPI broadcast and N-1 TCP connections to rank 0's
store (torch's libuv store serves thousands of clients: seconds at 4,096 ranks, once).
The dense average is the overlapped engine (exchange/overlap.py) over this group through
the exchange layer's transport (`torch_transport.py`): buckets of `train.bucket_mb`
allreduced from backward hooks, on the device, as DDP does; 2(N-1)/N of the gradients per
rank per step at 1,024 and 4,096 ranks alike. ZeRO-1/2 on these engines use the same
group and transport. With tensor parallelism, experts or the pipeline the default group
spans the job and each grid axis that needs one (the data replicas, the tensor, expert,
data or pipe axis) gets its own subgroup (`grid_groups`).
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError

_SIOCGIFADDR = 0x8915
log = logging.getLogger("hpctrain")
# torch's default since 2.2, pinned: NCCL's watchdog ends a rank whose collective passed
# the group's timeout (a site's 0 would leave that to the MPI watchdog alone)
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
EXIT_DEADLINE_S = 30.0  # destroying the groups at exit: a peer gone must not hang it


def ipv4_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback last."""
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(socket.inet_ntoa(packed[20:24]))
    finally:
        probe.close()
    return sorted(set(found), key=lambda a: (a.startswith("127."), a))


def _reachable(addresses: list[str], port: int, deadline: float) -> str:
    """The first of rank 0's addresses this rank can open a TCP connection to."""
    while True:
        for addr in addresses:
            try:
                with socket.create_connection((addr, port), timeout=2.0):
                    return addr
            except OSError:
                continue
        if time.monotonic() > deadline:
            raise ConfigError(
                f"process-group bootstrap: none of rank 0's addresses {addresses} "
                f"answers on port {port} from {socket.gethostname()}"
            )
        time.sleep(0.2)


# The groups' own deadline comes after the MPI watchdog's, which guards every host wait
# on a CPU rank (torch_transport.py) and a GPU rank's read of each step's results
# (step_reports.py): at runtime.collective_timeout the watchdog probes every rank and
# ends the job naming the one that stopped (its probe and grace take under 10 s,
# runtime/watchdog.py); Gloo's error or NCCL's watchdog, later, is the fallback.
GROUPS_AFTER_WATCHDOG_S = 15.0


def group_timeout(timeout_s: float) -> float:
    """Seconds a process group (gloo or nccl) waits before failing an operation: twice
    runtime.collective_timeout and 15 s. A group counts from when the operation
    started, the watchdog from when the host began to wait: a gradient bucket started
    early in backward is waited for up to a backward later, so with one timeout plus
    15 s a backward over 15 s let Gloo fail first, naming only the rank kept waiting.
    Twice covers any backward shorter than the deadline itself."""
    return 2.0 * float(timeout_s) + GROUPS_AFTER_WATCHDOG_S


def init_process_group(comm, backend: str, timeout_s: float):
    """torch.distributed's default group over `comm`'s ranks (a guarded MPI
    communicator), bootstrapped over it. A group left by an earlier run in this process
    (tests train several runs per launch) is replaced: each run has its own store.

    No `device_id` is bound, on purpose: with one bound, torch makes every later
    subgroup by ncclCommSplit of this group, a collective that every rank of the job
    must enter, while grid_groups' subgroups are made by their members alone
    (`use_local_synchronization`), so the members would wait for the rest until NCCL's
    timeout. Unbound, each NCCL communicator is created among its group's ranks at its
    first collective, on the device of its tensors (the rank's GPU: torch_device sets
    it)."""
    timeout = timedelta(seconds=group_timeout(timeout_s))
    if backend == "nccl":
        _nccl_error_handling(comm.is_root)
    if comm.is_root:
        store = dist.TCPStore(
            "0.0.0.0", 0, comm.size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        where = (ipv4_addresses(), store.port)
    where = comm.bcast_object(where if comm.is_root else None, what="process-group address")
    if dist.is_initialized():
        dist.destroy_process_group()
    if not comm.is_root:
        addr = _reachable(where[0], where[1], time.monotonic() + float(timeout_s))
        store = dist.TCPStore(addr, where[1], comm.size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend, store=store, rank=comm.rank, world_size=comm.size, timeout=timeout
    )
    _register_exit_hook()  # before mpi4py's MPI_Finalize, registered earlier
    return dist.group.WORLD


@functools.cache
def _register_exit_hook() -> None:
    """Once per process."""
    _exit_worker()
    atexit.register(_destroy_at_exit)


@functools.cache
def _exit_worker() -> queue.SimpleQueue:
    """The thread that destroys the groups at exit, started with the first group: Python
    3.12 refuses to start one in an atexit callback ("can't create new thread at
    interpreter shutdown", on every rank of every process-group run); a daemon thread
    started earlier still runs there. Returns the queue that asks it (an Event to set)."""
    requests: queue.SimpleQueue = queue.SimpleQueue()

    def serve() -> None:
        while True:
            done = requests.get()
            try:
                dist.destroy_process_group()
            finally:
                done.set()  # a failed destroy does not wait out the deadline

    threading.Thread(target=serve, daemon=True, name="destroy-process-group").start()
    return requests


def _nccl_error_handling(is_root: bool) -> None:
    """Before NCCL's first group: its async error handling on unless the site chose."""
    name, value = NCCL_ERROR_HANDLING
    os.environ.setdefault(name, value)
    if os.environ[name] == "0" and is_root:
        log.warning(
            "%s=0: a hung NCCL collective is ended by runtime.collective_timeout's watchdog "
            "alone, not by NCCL's own timeout after it",
            name,
        )


def _destroy_at_exit() -> None:
    """The last run's groups, destroyed at a normal exit as NCCL asks (its pending work
    finished; torch warns otherwise, and a peer could wait on a process gone). A job
    that fails ends through MPI_Abort or os._exit, which skip this. With a deadline
    (EXIT_DEADLINE_S, on a thread): past it the process exits without waiting."""
    if not dist.is_initialized():
        return
    done = threading.Event()
    _exit_worker().put(done)  # started with the first group (_register_exit_hook)
    if not done.wait(EXIT_DEADLINE_S):
        sys.stderr.write(
            f"[hpctrain] warning: destroying the process groups took over "
            f"{EXIT_DEADLINE_S:g} s (a peer gone?): exiting without them\n"
        )


def check_backend(engine: str, device: torch.device) -> None:
    if engine == "nccl" and device.type != "cuda":
        raise ConfigError(
            "train.allreduce=nccl: NCCL needs GPU ranks (runtime.device cuda, or auto on a "
            "GPU node); on CPU ranks the process-group engine is train.allreduce=gloo"
        )
    if engine == "nccl" and not dist.is_nccl_available():
        raise ConfigError("train.allreduce=nccl: this torch build has no NCCL")
    if not dist.is_available():
        raise ConfigError(f"train.allreduce={engine}: this torch build has no torch.distributed")


# A second group over an axis's ranks, for traffic that must not queue on the first's
# stream: NCCL runs a group's point-to-point calls in issue order, and the pipeline's
# gradients flow against its activations (pipeline/transport.py).
SECOND_GROUPS = (("pipe-back", "pipe"),)  # (group, the axis it spans)


def axis_of(name: str) -> str:
    """The grid axis whose ranks the group `name` spans."""
    return dict(SECOND_GROUPS).get(name, name)


def grid_groups(grid, backend: str, timeout_s: float, axes) -> dict:
    """{axis: process group} for this rank's `axes` of `grid` (a ProcessGrid), as
    torchtitan's DeviceMesh has one group per mesh dimension: the default group over the
    whole job (bootstrapped over MPI, above), then one subgroup per axis this rank is in,
    made by its own members only (`use_local_synchronization`: a group's barrier is among
    its ranks, and every rank creates its groups in the same order). An axis of the whole
    job is the default group, a second group over an axis (SECOND_GROUPS) its own; an
    axis of one rank has none (None).

    Cost: one TCP store connection per rank, and per axis its members' connections
    (Gloo's mesh; torch's store barrier runs only with TORCH_DIST_INIT_BARRIER=1), once;
    the groups a rank builds do not grow with the job (one per axis asked for, at most
    6: a pipeline stage's two over the pipe axis, replicas, tensor and the experts' two;
    at 1,024 or 4,096 ranks alike). NCCL creates each group's communicator at its first
    collective."""
    world = init_process_group(grid.world, backend, timeout_s)
    timeout, found = timedelta(seconds=group_timeout(timeout_s)), {}
    for axis in axes:
        ranks = grid.members(axis_of(axis))
        if len(ranks) == 1:
            found[axis] = None
        elif len(ranks) == grid.world.size and axis == axis_of(axis):
            found[axis] = world
        else:
            found[axis] = dist.new_group(
                ranks,
                timeout=timeout,
                backend=backend,
                use_local_synchronization=True,
                group_desc=f"hpctrain {axis} axis",
            )
    return found
