"""Expert parallelism: which rank owns which expert, and the all-to-alls.

The ranks of the grid's `expert` axis form one expert-parallel group (the whole job
unless `parallel.expert` says less); E experts are split into equal
contiguous blocks (rank r owns experts r*E/R ... (r+1)*E/R - 1), so rows packed by expert
are also packed by destination rank. One MoE layer's forward is one `Alltoall` of
per-expert row counts and two `Alltoallv`s of contiguous float32 rows (dispatch, then
combine in reverse); its backward is the same two `Alltoallv`s with the directions
swapped. They go through the exchange layer's transport methods (exchange/transport.py):
the axis's guarded MPI communicator for numpy rows, under its watchdog, so a rank that
never arrives ends the job instead of hanging it; a process group's transport for
torch tensors (the gloo/nccl engines). Framework code (backends/*_moe.py) calls
`MoELayer`.
"""

from __future__ import annotations

import copy
import math
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from . import routing
from .options import capacity

EXPERT_MARK = ".moe.experts."  # canonical names of expert parameters contain this


def is_expert_param(name: str) -> bool:
    """Expert parameters live on one rank each: never averaged, never broadcast."""
    return EXPERT_MARK in name


def split_experts(state: dict) -> tuple[dict, dict]:
    """(experts, the rest) of a dict keyed by canonical names (weights or slots)."""
    experts = {k: v for k, v in state.items() if is_expert_param(k)}
    return experts, {k: v for k, v in state.items() if k not in experts}


class ExpertGroup:
    """The expert-parallel ranks (the grid's `expert` axis) and their replicas (`data`).

    Tokens are exchanged within `axis`; each expert has one copy per data-parallel
    replica of the group, and those copies average their gradients over `data`.

    With tensor parallelism the group is the expert x tensor ranks of one replica and
    the T ranks of a tensor group share one batch, each routing 1/T of its samples
    (`ranks_per_batch` = T): the group's ranks hold size / T batches between them.
    """

    def __init__(self, axis, data=None, ranks_per_batch: int = 1):
        self.axis, self.data = axis, data
        self.rank = axis.rank
        self.size = axis.size
        self.ranks_per_batch = int(ranks_per_batch)
        # where a backend's own arrays travel (the process-group engines): token rows
        # over `transport`, expert gradients over `data_transport`; None: numpy over MPI
        self.transport = self.data_transport = None

    def with_transports(self, transport, data_transport) -> ExpertGroup:
        """This group with token rows and expert gradients on a backend's transports
        over the same ranks (checked), for arrays of their type."""
        for t, axis in ((transport, self.axis), (data_transport, self.data)):
            if axis is not None and t is not None and (t.rank, t.size) != (axis.rank, axis.size):
                raise ValueError(
                    f"expert group transport is rank {t.rank} of {t.size}, the axis rank "
                    f"{axis.rank} of {axis.size}"
                )
        group = copy.copy(self)
        group.transport, group.data_transport = transport, data_transport
        return group

    @property
    def grad_scale(self) -> float:
        """An expert's gradient sums the tokens of every batch the group holds; scaled
        by this it is their mean, as the dense parameters' data-parallel average is."""
        return self.ranks_per_batch / self.size

    def alltoall_counts(self, send: np.ndarray) -> np.ndarray:
        """send [R, n] int64 (row r goes to rank r) -> [R, n] (row s came from rank s)."""
        send = np.ascontiguousarray(send, dtype=np.int64)
        recv = np.empty_like(send)
        return self.axis.all_to_all(
            send.reshape(-1), recv.reshape(-1), "MoE Alltoall of row counts"
        ).reshape(send.shape)

    def alltoallv(self, x, send_rows: np.ndarray, recv_rows: np.ndarray):
        """Rows of x (packed by destination) to their ranks; returns the received rows:
        numpy over the axis's MPI communicator, or the transport's arrays over it."""
        rows = int(recv_rows.sum())
        width = math.prod(tuple(x.shape[1:]))
        if self.transport is not None and not isinstance(x, np.ndarray):
            on, out = self.transport, self.transport.zeros(rows * width)
        else:  # the axis's guarded communicator, under the watchdog; every row is written
            on, out = self.axis, np.empty(rows * width, np.float32)
            x = np.ascontiguousarray(x, dtype=np.float32)
        on.all_to_all_v(
            x.reshape(-1),
            out,
            [int(r) * width for r in send_rows],
            [int(r) * width for r in recv_rows],
            "MoE Alltoallv of token rows",
        )
        return out.reshape(rows, *x.shape[1:])

    def allreduce_sum(self, value: float) -> float:
        """`value` summed over the group: a float over MPI; a 0-d array of the group's
        transport (a squared norm on the device) over the transport, as a 0-d array:
        no host read."""
        if self.transport is not None and not isinstance(value, (int, float, np.number)):
            buf = self.transport.concat([value])  # 1-D, where the value lives
            return self.transport.allreduce_inplace(buf, "sum", "MoE allreduce")[0]
        buf = np.array([float(value)], dtype=np.float64)  # a device's 0-d value: read once
        return float(self.axis.allreduce_inplace(buf, "sum", "MoE allreduce")[0])

    def average_over_replicas(self, flat):
        """Average expert gradients (one flat float32 buffer: numpy, or the data
        transport's array) over the group's replicas."""
        data = self.data
        if self.data_transport is not None and not isinstance(flat, np.ndarray):
            data = self.data_transport
        if data is not None and data.size > 1:
            data.allreduce_inplace(flat, "sum", "MoE expert gradients over replicas")
            data.scale_(flat, 1.0 / data.size)
        return flat


def require_group(group: ExpertGroup | None) -> ExpertGroup:
    """`group`, or a clear error: mixture-of-experts layers exchange tokens within the
    expert group the process grid placed, never an implicit whole job."""
    if group is None:
        from ..errors import ConfigError

        raise ConfigError(
            "mixture-of-experts layers need an expert group from the process grid "
            "(strategy data_parallel or pipeline)"
        )
    return group


def local_layers(layers: list, seed: int, group: ExpertGroup | None) -> list:
    """The layer specs with only this rank's experts (other layers unchanged).

    Initial values are drawn from the global specs before this (zoo.init_weights), so
    expert e starts the same at any world size and its canonical name
    (`blocks.0.moe.experts.3.fc1.weight`) is portable between world sizes. Raises
    ConfigError on every rank when E is not divisible by the number of ranks. `group`:
    the expert group the process grid placed (backends/groups.py).
    """
    if not any("moe" in spec.attrs for spec in layers):
        return layers
    from ..errors import ConfigError

    group = require_group(group)
    experts = next(spec.attrs["moe"]["experts"] for spec in layers if "moe" in spec.attrs)
    problem = None
    if experts % group.size:
        problem = (
            f"model.moe.experts={experts} cannot be split evenly over {group.size} "
            f"expert-parallel ranks (one per MPI process): use a multiple of {group.size}"
        )
    group.axis.agree(problem, error_type=ConfigError)
    per_rank = experts // group.size
    first = group.rank * per_rank
    mine = range(first, first + per_rank)
    out = []
    for spec in layers:
        if "moe" not in spec.attrs:
            out.append(spec)
            continue
        local = copy.copy(spec)
        local.params = {
            k: s
            for k, s in spec.params.items()
            if not k.startswith("moe.experts.") or int(k.split(".")[2]) in mine
        }  # each key once (it tried every local expert's prefix: E^2 / R steps)
        local.attrs = {
            **spec.attrs,
            "moe": {
                **spec.attrs["moe"],
                "first_expert": first,
                "local_experts": per_rank,
                "seed": int(seed),
            },
        }
        out.append(local)
    return out


@dataclass
class Plan:
    """Index arrays of one layer call: what the framework gathers, sends and scatters."""

    experts: np.ndarray  # [T, k] chosen experts
    send_token: np.ndarray  # [S] token of each dispatched row (rows packed by expert)
    send_slot: np.ndarray  # [S] its choice slot
    send_rows: np.ndarray  # [R] rows to each rank
    recv_rows: np.ndarray  # [R] rows from each rank
    perm: np.ndarray  # received row order -> grouped by local expert: grouped = recv[perm]
    inv_perm: np.ndarray  # grouped -> received order
    expert_rows: np.ndarray  # [E/R] rows per local expert
    fractions: np.ndarray  # [E] f_i of the load-balancing loss (float32)

    def arrays(self) -> list[np.ndarray]:
        return [
            self.experts,
            self.send_token,
            self.send_slot,
            self.send_rows,
            self.recv_rows,
            self.perm,
            self.inv_perm,
            self.expert_rows,
            self.fractions,
        ]


@dataclass
class LayerStats:
    """What one layer did on this rank since the last `take` (training calls only)."""

    calls: int = 0
    tokens: int = 0
    choices: int = 0
    dropped: int = 0
    routed: np.ndarray | None = None
    kept: np.ndarray | None = None
    capacity_sum: int = 0
    aux_loss: float = 0.0
    routing_s: float = 0.0
    alltoall_s: float = 0.0
    expert_s: float = 0.0
    sent_bytes: int = 0
    extra: dict = field(default_factory=dict)


# The jitter noise's generators of this process's MoE layers, by layer name, for the
# checkpoint's per-rank random state (checkpoint/rng.py), and the states a resume read
# before the layers exist (they are made at their first forward).
RNG_KEY = "moe_rng."
_live_rngs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_pending_rngs: dict[str, np.ndarray] = {}


def jitter_rng_states() -> dict[str, np.ndarray]:
    """Each live MoE layer's noise generator (PCG64) as 6 uint64: state and increment
    (128 bits each, high word first), has_uint32, uinteger."""
    out = {}
    for name, layer in list(_live_rngs.items()):
        s = layer.rng.bit_generator.state
        state, inc, low = s["state"]["state"], s["state"]["inc"], 2**64 - 1
        packed = [state >> 64, state & low, inc >> 64, inc & low, s["has_uint32"], s["uinteger"]]
        out[RNG_KEY + name] = np.array(packed, dtype=np.uint64)
    return out


def forget_jitter_rngs() -> None:
    """A run reseeds its process (the backends' prepare_process): an earlier run's layers
    in this process (train_dump.py's --next, a library user's second Trainer) and states
    left for them are not this run's; a resume's states would otherwise go to them."""
    _live_rngs.clear()
    _pending_rngs.clear()


def set_jitter_rng_states(arrays: dict[str, np.ndarray]) -> None:
    """Put back what jitter_rng_states took: now for live layers, at creation for the
    rest (a resume restores the random state before the first forward)."""
    _pending_rngs.clear()
    _pending_rngs.update({k[len(RNG_KEY) :]: v for k, v in arrays.items() if k.startswith(RNG_KEY)})
    for layer in list(_live_rngs.values()):
        layer.take_rng_state()


class MoELayer:
    """The framework-neutral half of one MoE layer on this rank: route, exchange, count."""

    def __init__(self, opts: dict, group: ExpertGroup | None, name: str | None = None):
        self.opts = opts
        self.group = require_group(group)
        self.E, self.k = opts["experts"], opts["top_k"]
        self.per_rank = self.E // self.group.size
        self.first = opts.get("first_expert", self.group.rank * self.per_rank)
        self.rng = np.random.default_rng([opts.get("seed", 0), self.group.rank, 0x6D6F65])
        self.stats = LayerStats()  # counts training calls only (record=True)
        self.name = name
        if name is not None:  # checkpointed with the rank's random state
            _live_rngs[name] = self
            self.take_rng_state()

    def take_rng_state(self) -> None:
        """The generator state a resume left for this layer, if any (once)."""
        packed = _pending_rngs.pop(self.name, None)
        if packed is None:
            return
        w = [int(x) for x in np.asarray(packed, dtype=np.uint64).reshape(-1)]
        self.rng.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]},
            "has_uint32": w[4],
            "uinteger": w[5],
        }

    def jitter_noise(self, shape) -> np.ndarray:
        """Multiplicative router-input noise U(1-eps, 1+eps) (Switch), from this rank's rng."""
        eps = self.opts["jitter"]
        size = tuple(int(s) for s in shape)
        self._last_noise = self.rng.uniform(1.0 - eps, 1.0 + eps, size=size).astype(np.float32)
        return self._last_noise

    def repeat_jitter_noise(self, shape) -> np.ndarray:
        """The latest call's noise again, for the same tokens run again in backward
        (TensorFlow's ZeRO-3 recomputes each unit before the next micro-batch's forward)."""
        noise = getattr(self, "_last_noise", None)
        if noise is None or noise.shape != tuple(int(s) for s in shape):
            raise RuntimeError("a recomputed MoE layer found no noise of its forward's shape")
        return noise

    def plan(self, probs: np.ndarray, record: bool = False) -> Plan:
        """Route this rank's tokens and exchange row counts with every rank (collective)."""
        t0 = time.perf_counter()
        probs = np.asarray(probs, dtype=np.float32)
        tokens = probs.shape[0]
        o = self.opts
        cap = capacity(
            tokens, self.E, self.k, o["capacity_factor"], o["min_capacity"], o["drop_tokens"]
        )
        r = routing.route(probs, self.k, cap)
        R, n = self.group.size, self.per_rank
        t1 = time.perf_counter()
        recv_counts = self.group.alltoall_counts(r.kept_counts.reshape(R, n))  # [R src, n]
        t2 = time.perf_counter()
        recv_rows = recv_counts.sum(axis=1)
        # Received rows: source-major, then local expert; regroup expert-major.
        start = np.concatenate([[0], np.cumsum(recv_counts.reshape(-1))[:-1]]).reshape(R, n)
        perm = np.concatenate(
            [
                np.arange(start[s, j], start[s, j] + recv_counts[s, j])
                for j in range(n)
                for s in range(R)
            ]
            or [np.zeros(0)]
        ).astype(np.int64)
        inv = np.empty_like(perm)
        inv[perm] = np.arange(perm.size)
        plan = Plan(
            experts=r.experts,
            send_token=r.send_token,
            send_slot=r.send_slot,
            send_rows=r.kept_counts.reshape(R, n).sum(axis=1),
            recv_rows=recv_rows.astype(np.int64),
            perm=perm,
            inv_perm=inv,
            expert_rows=recv_counts.sum(axis=0).astype(np.int64),
            fractions=routing.load_fractions(r.routed, tokens, self.k),
        )
        if record:
            s = self.stats
            s.calls += 1
            s.tokens += tokens
            s.choices += tokens * self.k
            s.dropped += r.dropped
            s.routed = r.routed if s.routed is None else s.routed + r.routed
            s.kept = r.kept_counts if s.kept is None else s.kept + r.kept_counts
            s.capacity_sum += cap
            s.aux_loss += routing.aux_loss(probs, r.routed, self.k, o["aux_loss"])
            s.routing_s += (t1 - t0) + (time.perf_counter() - t2)
            s.alltoall_s += t2 - t1
        return plan

    def exchange(self, x, send_rows, recv_rows, record: bool = False) -> np.ndarray:
        """One Alltoallv of rows (dispatch, combine, or either one's gradient)."""
        t0 = time.perf_counter()
        out = self.group.alltoallv(x, np.asarray(send_rows), np.asarray(recv_rows))
        if record:
            self.stats.alltoall_s += time.perf_counter() - t0
            self.stats.sent_bytes += int(x.nbytes)
        return out


def step_metrics(layers: list[MoELayer], step_seconds: float, world_size: int) -> dict:
    """The step's MoE numbers for metrics.jsonl (averaged over ranks by the trainer)."""
    recorded = [m for m in layers if m.stats.calls]
    if not layers:
        return {}
    E = layers[0].E
    routed = sum((m.stats.routed for m in recorded), np.zeros(E, np.int64))
    kept = sum((m.stats.kept for m in recorded), np.zeros(E, np.int64))
    choices = sum(m.stats.choices for m in recorded)
    calls = sum(m.stats.calls for m in recorded)
    per_expert = choices / E if choices else 1.0
    tokens = sum(m.stats.tokens for m in recorded) / max(1, len(layers))
    a2a = sum(m.stats.alltoall_s for m in recorded)
    out = {
        "moe_tokens_per_sec": tokens * world_size / step_seconds if step_seconds > 0 else 0.0,
        "moe_load": [float(v) for v in routed / per_expert],  # 1.0 = perfectly balanced
        "moe_load_max": float((routed / per_expert).max()) if choices else 0.0,
        "moe_kept_load_max": float((kept / per_expert).max()) if choices else 0.0,
        "moe_capacity_load": float(
            sum(m.stats.capacity_sum for m in recorded) * E / max(1, choices)
        ),
        "moe_drop_rate": float(sum(m.stats.dropped for m in recorded) / max(1, choices)),
        "moe_dropped": float(sum(m.stats.dropped for m in recorded)),
        "moe_aux_loss": float(
            sum(m.stats.aux_loss for m in recorded) / max(1, calls) * len(layers)
        ),
        "moe_alltoall_share": a2a / step_seconds if step_seconds > 0 else 0.0,
        "moe_alltoall_seconds": a2a,
        "moe_routing_seconds": sum(m.stats.routing_s for m in recorded),
        "moe_expert_seconds": sum(m.stats.expert_s for m in recorded),
    }
    for m in layers:
        m.stats = LayerStats()
    return out


# step_metrics' keys: summed over a step's layers (the rest are rates, loads and times)
SUMMED_METRICS = ("moe_dropped", "moe_aux_loss")
METRIC_KEYS = (
    "moe_tokens_per_sec", "moe_load", "moe_load_max", "moe_kept_load_max",
    "moe_capacity_load", "moe_drop_rate", *SUMMED_METRICS, "moe_alltoall_share",
    "moe_alltoall_seconds", "moe_routing_seconds", "moe_expert_seconds",
)  # fmt: skip


def pipeline_metrics(found: dict, experts: int, stages: int, moe_stages: int) -> dict:
    """This rank's part of a pipeline's MoE step metrics. The loop averages every
    rank's extras in one allreduce, so every rank gives the same keys and sizes: a rank
    of a stage with MoE layers its stage's figures (`found`, step_metrics') x P / S
    (S of the P stages hold MoE layers, as many ranks each), so that the mean over the
    job is the mean over those ranks; the counts summed over a step's layers (dropped
    tokens, balancing loss) x P, so that it is their sum over the model's layers, as
    data parallelism's ranks report it; a rank of a stage without them zeros."""
    if not found:
        return {k: [0.0] * experts if k == "moe_load" else 0.0 for k in METRIC_KEYS}
    out = {}
    for key in METRIC_KEYS:
        scale = stages if key in SUMMED_METRICS else stages / moe_stages
        value = found[key]
        out[key] = [v * scale for v in value] if isinstance(value, list) else value * scale
    return out


def gather_expert_weights(weights: dict, group: ExpertGroup, root: int = 0) -> dict | None:
    """Every rank's expert tensors merged into one dict on `root` (None elsewhere).

    A rank holds only its own experts; this gives the full, world-size-independent set
    of canonical names (for checkpoints and tests). Non-expert tensors come from root.
    """
    mine, full = split_experts(weights)
    parts = group.axis.gather_arrays(mine, root, "gather MoE experts")
    if group.rank != root:
        return None
    for part in parts:
        full.update(part)
    return full
