"""Every training step of a torch run on a process-group engine (Gloo here: the code
NCCL runs on GPU ranks) is watched for host reads (tests/host_reads.py); a run with one
fails, naming the lines. So each such run of the job tests, at np 2 and 4 and across
emulated nodes, also proves that its layout would not make a GPU rank's host wait
inside a step. A mixture-of-experts layer reads once, by design: its router plans the
all-to-all's row counts on the host (`moe_ffn`); any other read fails the run. The
pipeline's step on a process group's links is watched the same way
(`Pipeline.step_sums`: the step before the loop reads its sums), its stages' experts
with the same one read per layer. Where ranks share a GPU on Gloo, a pipeline's message
crosses host memory by design (`start_send`: Gloo's point-to-point calls take host
pointers; docs/gpu.md), so that copy is not counted either; on the CPU it never runs.
`watch()` once per process, `check(label)` after each run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: host_reads

from host_reads import HostReads  # noqa: E402

from hpctrain.backends import step  # noqa: E402
from hpctrain.strategies.pipeline import Pipeline  # noqa: E402

_reads: list[str] = []
ROUTER = "moe_ffn"  # backends/torch_moe.py: the router's plan, the MoE step's one read
GLOO_STAGED = "start_send"  # backends/torch_transport.py: a CUDA message to Gloo's host send
DESIGNED = (f" in {ROUTER}", f" in {GLOO_STAGED}")


def watch() -> None:
    """Wrap the step written once for every backend (backends/step.py)."""
    inner = step.train_step
    if getattr(inner, "watched", False):
        return

    def train_step(b, micro_batches, lr, tally=True):
        if getattr(b, "engine", None) not in ("gloo", "nccl"):
            return inner(b, micro_batches, lr, tally)
        with HostReads() as reads:
            stats = inner(b, micro_batches, lr, tally)
        _reads.extend(w for w in reads.where if not w.endswith(DESIGNED))
        return stats

    train_step.watched = True
    step.train_step = train_step
    pipeline_step = Pipeline.step_sums

    def step_sums(self, batch, lr, tally=True):
        if not self.links:  # host links: numpy over MPI or Horovod
            return pipeline_step(self, batch, lr, tally)
        with HostReads() as reads:
            stats = pipeline_step(self, batch, lr, tally)
        _reads.extend(w for w in reads.where if not w.endswith(DESIGNED))
        return stats

    Pipeline.step_sums = step_sums


def check(label: str) -> None:
    """Fail this rank's run (the job ends, naming the rank) if a step read on the host."""
    where, _reads[:] = sorted(set(_reads)), []
    if where:
        # not SystemExit: a read on one rank only (a pipeline's last stage) must abort
        # the whole job at once (run_fail_together), not leave its peers waiting
        raise AssertionError(f"{label}: a training step read on the host: {where}")
