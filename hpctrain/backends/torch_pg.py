"""The process-group engine: gradients averaged by torch.distributed (NCCL or Gloo).

Bootstrapped over MPI, so nothing like MASTER_ADDR has to be set and it works under
mpirun, srun and horovodrun alike: rank 0 of the communicator opens a `TCPStore` on a
free port and broadcasts its IPv4 addresses and the port with MPI; every other rank
connects to the first address it can reach (the emulated nodes and real clusters have
several interfaces; loopback is tried last). NCCL on GPU ranks, Gloo on CPU ranks: the
same code, so the CPU suite exercises what GPU nodes run.

Deadlines: the group's `timeout` is `runtime.collective_timeout`. A Gloo collective that
passes it raises on that rank (fail-together then ends the job naming it); NCCL's
watchdog aborts a timed-out or failed communicator and ends the process (torch's
default TORCH_NCCL_ASYNC_ERROR_HANDLING), and mpirun/srun end the rest of the job.

Cost at scale: bootstrap is one MPI broadcast and N-1 TCP connections to rank 0's
store (torch's libuv store serves thousands of clients: seconds at 4,096 ranks, once).
The dense average is one ring/tree allreduce of the gradient bytes per step: 2(N-1)/N
of the buffer per rank at 1,024 and 4,096 ranks alike. ZeRO-1/2 on these engines use the
same group through the exchange layer's transport (`torch_transport.py`).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError

_SIOCGIFADDR = 0x8915


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


def init_process_group(comm, backend: str, timeout_s: float, device: torch.device):
    """torch.distributed's default group over `comm`'s ranks (a guarded MPI
    communicator), bootstrapped over it. A group left by an earlier run in this process
    (tests train several runs per launch) is replaced: each run has its own store."""
    timeout = timedelta(seconds=float(timeout_s))
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
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, store=store, rank=comm.rank, world_size=comm.size, timeout=timeout, **kwargs
    )
    return dist.group.WORLD


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


class ProcessGroupMean:
    """The dense gradient average on the device: the step's gradients gathered into one
    preallocated flat buffer of the device, one in-place `all_reduce`, the mean copied
    back. Same arithmetic as the MPI engine's DenseMean (sum, then times float32 1/N),
    so the two agree to rounding of the reduction order."""

    def __init__(self, comm, params: list, device: torch.device, engine: str, timeout_s: float):
        check_backend(engine, device)
        self.size = comm.size if comm is not None else 1
        self.sizes = [p.numel() for p in params]
        self.buffer = torch.zeros(sum(self.sizes), dtype=torch.float32, device=device)
        self.group = None
        if self.size > 1:
            self.group = init_process_group(comm, engine, timeout_s, device)
        self._sent = 0

    @torch.no_grad()
    def average(self, params: list) -> None:
        if self.group is None:
            self._sent = 0
            return
        flat = self.buffer
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        dist.all_reduce(flat, group=self.group)
        flat.mul_(1.0 / self.size)
        for p, view in zip(params, flat.split(self.sizes), strict=True):
            if p.grad is not None:  # a parameter without gradient stays without
                p.grad.copy_(view.view_as(p))
        self._sent = 2 * (self.size - 1) * flat.numel() * 4 // self.size

    @torch.no_grad()
    def broadcast(self, tensors) -> None:
        """Rank 0's values of `tensors` on every rank (device-resident)."""
        if self.group is None:
            return
        for t in tensors:
            dist.broadcast(t, src=0, group=self.group)

    def stats(self) -> dict[str, float]:
        return {"comm_bytes": float(self._sent), "compression_ratio": 1.0}

    def state(self) -> dict:
        return {}

    def load_state(self, state) -> None:
        return None
