"""The transport: the collectives the exchange layer needs, over the backend's own arrays.

Why: ZeRO's partition (and, later, compressors and the overlap engine) is arithmetic on
flat buffers plus a few collectives. Written against this Protocol instead of against
MPI and numpy, the same code runs with its buffers in host memory (the MPI transport:
`runtime.comm.GuardedComm`, numpy, every wait under the watchdog) or on the rank's
device (`backends.torch_transport.ProcessGroupTransport`, torch tensors over a
torch.distributed group: Gloo on CPU ranks, NCCL on GPU ranks), with no copy to the
host per step. A buffer is whatever the transport's own array type is; the exchange
code never names numpy or torch for per-step work: where it must allocate or compute
locally it asks the transport (the array seam below). Checkpoint layout (flattening,
unsharding, gathers onto rank 0) stays host numpy: it runs once per save, not per step.

Every call is collective over the transport's ranks (send/recv: over the two peers),
takes `what` (named in the error when a deadline passes, with the rank), and has a
deadline: the MPI transport's watchdog or point-to-point poll, the process group's
`work.wait(timeout)`. A `start_` form returns a `Pending`; its buffers must stay
untouched until `wait()`, and every rank starts the same operations in the same order.

Cost per rank, N ranks, a buffer of B bytes (alpha: one message's latency). The
bandwidth terms do not grow with N; the latency terms do, which is why 1,024 and 4,096
ranks are stated (Open MPI and NCCL pick ring, tree or recursive algorithms by size):

- allreduce: 2(N-1)/N x B sent (< 2B at any N); latency 2 log2 N alpha with a tree or
  recursive doubling (20 / 24 at 1,024 / 4,096 ranks), 2(N-1) with a ring (2,046 /
  8,190: only for buffers large enough that bandwidth dominates);
- reduce-scatter and allgather: (N-1)/N x B each (reduce-scatter + allgather = one
  allreduce's bytes, ZeRO's step); latency log2 N (10 / 12) to N-1 (1,023 / 4,095);
- all-to-all (equal splits, or `_v` with counts per rank): (N-1)/N x B, but as N-1
  messages of B/N (1,023 / 4,095 messages, each 1/1,024 / 1/4,096 of the buffer):
  latency-bound at scale, so it belongs on small groups (the expert axis), not on the
  whole job;
- send / recv: B to one peer, one message, independent of N;
- the array seam: local, no communication.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

Array = Any  # the transport's own array type: numpy.ndarray (MPI) or torch.Tensor


@runtime_checkable
class Pending(Protocol):
    """A started operation. `test()` progresses it without blocking (True once done);
    `wait()` blocks under the deadline and returns the result buffer."""

    def test(self) -> bool: ...

    def wait(self) -> Array: ...


@runtime_checkable
class Transport(Protocol):
    """Collectives over one group of ranks, on buffers of one array type."""

    rank: int
    size: int

    # --- collectives over 1-D contiguous buffers ------------------------------------------
    def allreduce_inplace(self, buf: Array, op: str = "sum", what: str = "allreduce") -> Array:
        """`buf` summed (or min, max) over the ranks, in place."""

    def start_allreduce_inplace(
        self, buf: Array, op: str = "sum", what: str = "allreduce"
    ) -> Pending: ...

    def reduce_scatter_sum(self, buf: Array, counts: list[int], what: str) -> Array:
        """The sum over the ranks of `buf`'s slice for this rank (counts[rank] elements,
        slices in rank order), as a new buffer."""

    def allgather_into(self, mine: Array, buf: Array, counts: list[int], what: str) -> Array:
        """Every rank's `mine` (counts[r] elements) into `buf`, in rank order."""

    def start_allgather_into(
        self, mine: Array, buf: Array, counts: list[int], what: str
    ) -> Pending: ...

    def all_to_all(self, send: Array, recv: Array, what: str = "all-to-all") -> Array:
        """Equal splits: slice r of `send` (len/N elements) goes to rank r; slice r of
        `recv` comes from rank r."""

    def start_all_to_all(self, send: Array, recv: Array, what: str = "all-to-all") -> Pending: ...

    def all_to_all_v(
        self, send: Array, recv: Array, send_counts: list, recv_counts: list, what: str
    ) -> Array:
        """Uneven splits: send_counts[r] elements of `send` (in rank order) go to rank r,
        recv_counts[r] elements of `recv` come from rank r (mixture-of-experts rows)."""

    def send(
        self, buf: Array, peer: int, tag: int = 0, what: str = "send", peer_name: str = ""
    ) -> None: ...

    def recv(
        self, buf: Array, peer: int, tag: int = 0, what: str = "recv", peer_name: str = ""
    ) -> Array: ...

    def start_send(
        self, buf: Array, peer: int, tag: int = 0, what: str = "send", peer_name: str = ""
    ) -> Pending:
        """`peer_name`: how a missed deadline names the peer (default: its rank here)."""

    def start_recv(
        self, buf: Array, peer: int, tag: int = 0, what: str = "recv", peer_name: str = ""
    ) -> Pending: ...

    # --- the array seam: what the exchange code computes locally --------------------------
    def zeros(self, n: int, dtype: str = "float32") -> Array:
        """A new 1-D buffer of zeros where this transport's buffers live."""

    def square_sum(self, buf: Array) -> Array:
        """The sum of squares of `buf`, accumulated in float64, as a 0-d value of the
        array type (no host synchronisation on a device)."""

    def square_sum_where(self, buf: Array, mask: Array) -> Array:
        """square_sum of the elements where the boolean `mask` is true (a device keeps
        the shape: `buf[mask]`'s size would be read on the host first)."""

    def scale_(self, buf: Array, factor: float) -> None:
        """`buf *= factor` in place, `factor` (a float or a 0-d value of the array type)
        rounded to float32 first."""

    def clip_coefficient(self, square_sum: Array, max_norm: float) -> Array:
        """torch's clip_grad_norm_ coefficient from a gradient's float64 sum of squares:
        min(max_norm / (sqrt(square_sum) + 1e-6), 1), a 0-d float64 value of the array
        type. Scaling by it always (1 is exact) spares a device the host's `if`."""

    # what the gradient compressors compute locally (exchange/compression/lossy.py);
    # 0-d reductions stay arrays (`buf.min()`), so a device never waits for the host
    def copy(self, buf: Array) -> Array: ...

    def concat(self, bufs: list) -> Array:
        """The buffers flattened and joined, in order."""

    def astype(self, buf: Array, dtype: str) -> Array: ...

    def bitcast(self, buf: Array, dtype: str) -> Array:
        """The same bytes seen as `dtype` (indices travel bit for bit beside values)."""

    def top_k_indices(self, buf: Array, k: int) -> Array:
        """int32 positions of the k largest magnitudes of `buf`, in any order."""

    def take(self, buf: Array, idx: Array) -> Array: ...

    def put_(self, buf: Array, idx: Array, values: Array) -> None: ...

    def index_add_(self, buf: Array, idx: Array, values: Array) -> None:
        """buf[idx] += values, repeated positions adding up."""

    def round_clip(self, buf: Array, lo: float, hi: float) -> Array:
        """Rounded half to even, clipped to [lo, hi] (a new buffer)."""

    def qr(self, mat: Array) -> Array:
        """The orthonormal factor of a reduced QR decomposition, float32."""

    def from_host(self, values) -> Array:
        """A host numpy array where this transport's buffers live (no host wait)."""

    def to_host(self, buf: Array):
        """A numpy copy (checkpoints: once per save, not per step)."""


def protocol_methods(protocol: type = Transport) -> list[str]:
    """The methods a Protocol declares (its own, not object's): for conformance checks."""
    import inspect

    return sorted(
        name
        for name, member in vars(protocol).items()
        if not name.startswith("_") and inspect.isfunction(member)
    )
