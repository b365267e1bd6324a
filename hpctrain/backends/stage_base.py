"""What both pipeline stages (torch_stage.py, tensorflow_stage.py) do at start: seed
this rank's process, keep the model's groups, build the stage's layers, and wait for a
way to average over the stage's replicas (attach_mpi / attach_zero / attach_replicas)."""

from __future__ import annotations

from ..runtime.comm import under_deadline
from ..runtime.memory import peak_rss_bytes
from .groups import ModelGroups


class StageBase:
    """Subclasses give `prepare_process(threads, deterministic, seed)` and
    `build(layers, weights)` (the net and its optimizer; `self._ocfg` is the optimizer's
    config; `weights`: (name, initial value) pairs, drawn as they are taken) of their
    framework."""

    def __init__(
        self, cfg, layers, weights, first, last, threads: int, rank: int, groups=None,
        device=None,
    ):  # fmt: skip
        """device: where a torch stage computes when its links are a process group's
        (its messages then stay tensors there); None: host arrays over MPI or Horovod."""
        self.prepare_process(threads, cfg.train["deterministic"], cfg.train["seed"] + rank)
        self.first, self.last = first, last
        self.device = device
        self.tally = True  # count correct predictions (the loop's logged steps)
        self.microbatches = cfg.pipeline["microbatches"]
        self.precision = cfg.train["precision"]  # bf16: a torch stage autocasts
        self.zero = None  # ZeRO-1: attach_zero
        self.groups = groups or ModelGroups()  # tensor axis and experts, from the grid
        self._ocfg = cfg.optimizer
        self.build(layers, weights)
        self.stash: dict[int, tuple] = {}
        self.peak_stash = 0
        self.loss_sum, self.correct = 0.0, 0
        self.hvd = self.process_set = self.mpi = self.zero = None
        self._hvd_comm = None  # the process set's ranks' communicator (attach_replicas)
        self._flat = None  # the mpi engine's flat buffer (attach_mpi)

    def prepare_process(self, threads: int, deterministic: bool, seed: int) -> None:
        raise NotImplementedError

    def build(self, layers, weights) -> None:
        raise NotImplementedError

    def tally_step(self, tally: bool) -> None:
        """Whether the coming optimizer step counts its correct predictions (the
        loop's logged steps; a torch stage skips the argmax on the others)."""
        self.tally = tally

    def read_later(self, stats):
        """The step's StepStats with its sums readable on the host (torch: without
        waiting for a GPU inside the step)."""
        return stats

    def peak_memory(self) -> tuple[float, str]:
        """(peak bytes, what they measure) of this rank: its peak RSS on CPU ranks."""
        return float(peak_rss_bytes()), "peak RSS"

    def attach_replicas(self, hvd, process_set, replicas=None) -> None:
        """The horovod engine: average over this stage's Horovod process set; `replicas`
        (the same ranks' guarded communicator) puts each wait under its watchdog."""
        self.hvd, self.process_set, self._hvd_comm = hvd, process_set, replicas

    def horovod_wait(self, what: str):
        """A watchdog section around a wait on Horovod: its stall shutdown runs in its
        background thread, which a stopped peer leaves blocked in MPI (torch.py's)."""
        return under_deadline(self._hvd_comm, what)
