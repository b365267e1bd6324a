"""The data-parallel training loop. It knows no framework: a backend does the math.

    from hpctrain import Config, Trainer
    Trainer(Config.load("configs/demo.yaml")).fit()

Every rank runs this loop on its own shard; the backend averages gradients with
Horovod. Per step the ranks also exchange one small vector (loss, correct, count, a
non-finite flag, preemption and checkpoint flags) so that progress shows global numbers
and a NaN on any rank stops every rank at the same step with the same message. That
vector is read one step later (`step_reports`), so it never adds a second wait per step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from . import runtime
from .backends import load_backend
from .checkpoint.session import TrainerCheckpoints
from .config import Config
from .data import (
    BenchmarkData,
    ShardedTrainData,
    benchmark_input_spec,
    iterate_val,
    prepare_dataset,
)
from .errors import TrainingDiverged
from .metrics import MetricsWriter, Progress
from .runtime import allocator
from .runtime.preemption import Preemption
from .schedule import lr_at
from .step_reports import StepReducer

log = logging.getLogger("hpctrain.trainer")


@dataclass
class TrainState:
    """Where training stands; everything needed to continue from here."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current epoch (0-based)
    position: int = 0  # samples of this epoch's permutation already consumed


def default_run_dir(cfg: Config) -> Path:
    stem = Path(cfg.source).stem if cfg.source != "<defaults>" else "run"
    return Path("runs") / f"{stem}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"


def prepare_process(cfg: Config):
    """Settings that must exist before MPI starts, then the World."""
    if cfg.runtime["mpi_yield_when_idle"]:
        # Ranks waiting in MPI give their core to ranks still computing: essential when
        # ranks share cores, harmless otherwise (Open MPI reads this at MPI_Init).
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    if cfg.runtime["malloc_keep_freed"]:
        allocator.keep_freed_memory()
    return runtime.world(cfg.runtime["collective_timeout"])


class Trainer:
    """Builds data, backend and metrics for one run; `fit()` trains and returns a summary."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str | Path | None = None,
        verbose: bool = False,
        resume: str | None = None,
    ):
        self.cfg = cfg
        self.world = prepare_process(cfg)
        w = self.world
        runtime.setup_logging(w.rank, w.size, verbose)
        log.debug("allocator: %s", allocator.status())
        chosen = str(run_dir) if run_dir is not None else str(default_run_dir(cfg))
        self.run_dir = Path(w.bcast_object(chosen, what="agree on the run directory"))
        if w.is_root:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        threads = cfg.runtime["threads"]
        if threads is None:
            threads, source = runtime.threads_per_rank(w.local_size)
        else:
            source = "runtime.threads"
        self.threads = threads
        tcfg = cfg.train
        if cfg.data["source"] == "benchmark":
            self.dataset = None
            inp = benchmark_input_spec(cfg.data)
            steps = max(
                1, cfg.data["train_samples"] // (tcfg["batch_size"] * tcfg["grad_accum"] * w.size)
            )
            self.data = BenchmarkData(
                inp, tcfg["batch_size"], tcfg["grad_accum"], w.size, tcfg["seed"] + w.rank, steps
            )
        else:
            self.dataset = prepare_dataset(cfg, w, self.run_dir)
            inp = self.dataset.input_spec
            self.data = ShardedTrainData(
                self.dataset,
                w.rank,
                w.size,
                tcfg["batch_size"],
                tcfg["grad_accum"],
                tcfg["seed"],
                cfg.data["prefetch"],
            )
        self.input_spec = inp
        from .backends.horovod_env import apply_horovod_env

        apply_horovod_env(cfg.horovod, cfg.runtime["collective_timeout"])
        backend_cls = load_backend(cfg.backend)
        cls = backend_cls.TorchBackend if cfg.backend == "torch" else backend_cls.TensorFlowBackend
        self.backend = cls(cfg, w, inp, threads)
        self.state = TrainState()
        self.checkpoints = TrainerCheckpoints(self)
        self.resumed_from = self.checkpoints.resume(resume)
        self.steps_per_epoch = self.data.steps_per_epoch
        total = self.steps_per_epoch * tcfg["epochs"]
        self.total_steps = min(total, tcfg["max_steps"]) if tcfg["max_steps"] else total
        self.metrics = MetricsWriter(
            self.run_dir, w.is_root, cfg.metrics["jsonl"], cfg.metrics["tensorboard"]
        )
        log.info(
            "%s backend, model %s, %d rank(s) x %d thread(s) (%s), gradients by %s (%s), "
            "%d steps/epoch, global batch %d, run dir %s",
            cfg.backend,
            cfg.model["name"],
            w.size,
            threads,
            source,
            self.backend.engine,
            self.backend.engine_reason,
            self.steps_per_epoch,
            self.data.global_batch,
            self.run_dir,
        )

    # --- the loop ---------------------------------------------------------------
    def fit(self) -> dict:
        w, cfg, st = self.world, self.cfg, self.state
        max_steps = cfg.train["max_steps"]
        progress = Progress(
            w.is_root,
            max(0, self.total_steps - st.step),
            log,
            cfg.train["log_every"],
            cfg.metrics["progress_bar"],
        )
        t_start = time.perf_counter()
        self._run = {"samples": 0, "comm": 0.0, "compute": 0.0, "epoch_loss": 0.0, "count": 0}
        last_eval: dict = {}
        preempted = None
        pre = Preemption().install()
        reducer = StepReducer(w, cfg.train["overlap_step_metrics"])
        try:
            while st.epoch < cfg.train["epochs"] and not (max_steps and st.step >= max_steps):
                self._run.update(epoch_loss=0.0, count=0)
                t_epoch = time.perf_counter()
                t_last = time.perf_counter()
                for micro in self.data.iterate(st.epoch, st.position):
                    lr = lr_at(
                        st.step, cfg.optimizer, w.size, self.steps_per_epoch, self.total_steps
                    )
                    stats = self.backend.train_step(micro, lr)
                    st.step += 1
                    st.position += self.data.global_batch
                    now = time.perf_counter()
                    seconds, t_last = now - t_last, now
                    flags = self._settle(
                        reducer.push(
                            st.step,
                            stats,
                            lr,
                            seconds,
                            pre.requested,
                            self.checkpoints.due_locally(st.step),
                        ),
                        progress,
                    )
                    last = (max_steps and st.step >= max_steps) or self.data.steps_left(
                        st.position
                    ) == 0
                    save = flags["save"] or self.checkpoints.due_by_step(st.step)
                    if flags["preempt"] or save or last:  # these must see this step's result
                        more = self._settle(reducer.drain(), progress)
                        flags = {k: flags[k] or more[k] for k in flags}
                        save = save or flags["save"]
                    if flags["preempt"]:  # a rank was signalled: every rank stops here
                        preempted = self.checkpoints.preempt(pre, progress)
                        break
                    if save:
                        self.checkpoints.maybe_save(st.step, agreed_due=True)
                    if max_steps and st.step >= max_steps:
                        break
                if preempted:
                    break
                epoch_done = self.data.steps_left(st.position) == 0
                if epoch_done or (max_steps and st.step >= max_steps):
                    last_eval = self._end_of_epoch(
                        self._run["epoch_loss"], self._run["count"], t_epoch, progress
                    )
                if epoch_done:
                    st.epoch += 1
                    st.position = 0
                    self.checkpoints.maybe_save(st.step, epoch_end=True, metrics=last_eval)
            if not preempted:
                self.checkpoints.maybe_save(st.step, final=True, metrics=last_eval)
            self.checkpoints.close()
        finally:
            pre.uninstall()
            progress.close()
        samples_done = self._run["samples"]
        comm_total, compute_total = self._run["comm"], self._run["compute"]
        elapsed = time.perf_counter() - t_start
        summary = {
            "steps": st.step,
            "epochs": st.epoch,
            "world_size": w.size,
            "backend": cfg.backend,
            "model": cfg.model["name"],
            "samples_per_sec": samples_done / elapsed if elapsed > 0 else None,
            "samples_per_sec_per_rank": samples_done / elapsed / w.size if elapsed > 0 else None,
            "comm_share": comm_total / compute_total if compute_total else None,
            "elapsed_sec": elapsed,
            "resumed_from": self.resumed_from,
            "preempted": preempted,
            **last_eval,
        }
        self.metrics.write("summary", epoch=st.epoch, step=st.step, **summary)
        self.metrics.close()
        if w.is_root:
            log.info("done: %s", ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
        return summary

    def _settle(self, reports, progress) -> dict:
        """Log settled step reports; stop on NaN/inf; return the agreed flags."""
        flags = {"preempt": False, "save": False}
        cfg, w = self.cfg, self.world
        for r in reports:
            if r.nonfinite and cfg.train["nan_check"]:
                flags_by_rank = w.comm.allgather(r.local_nonfinite) if w.size > 1 else [True]
                ranks = [rank for rank, f in enumerate(flags_by_rank) if f]
                exc = TrainingDiverged(
                    f"loss became NaN/inf at step {r.step} (epoch {self.state.epoch}) "
                    f"on rank(s) {ranks}: lower optimizer.lr, set train.clip_norm, or check "
                    f"the data for NaN/inf values"
                )
                exc.agreed = True
                raise exc
            n = self.data.global_batch
            run = self._run
            run["samples"] += n
            run["comm"] += r.comm_seconds
            run["compute"] += r.seconds
            run["epoch_loss"] += r.loss_sum
            run["count"] += r.count
            sps = n / r.seconds if r.seconds > 0 else None
            max_steps = cfg.train["max_steps"]
            if r.step % cfg.train["log_every"] == 0 or r.step == max_steps:
                self.metrics.write(
                    "step",
                    epoch=self.state.epoch,
                    step=r.step,
                    loss=r.loss,
                    lr=r.lr,
                    accuracy=r.accuracy,
                    samples_per_sec=sps,
                    samples_per_sec_per_rank=sps / w.size if sps else None,
                    comm_share=r.comm_seconds / r.seconds if r.seconds > 0 else None,
                    **r.extra,
                )
            progress.update(r.step, f"epoch {self.state.epoch} loss {r.loss:.4f} lr {r.lr:.4g}")
            flags["preempt"] = flags["preempt"] or r.preempt
            flags["save"] = flags["save"] or r.save_due
        return flags

    def _end_of_epoch(self, epoch_loss, epoch_count, t_epoch, progress) -> dict:
        st = self.state
        self.backend.average_buffers()
        result = {"loss": epoch_loss / max(1, epoch_count)}
        if (st.epoch + 1) % self.cfg.train["eval_every_epochs"] == 0 or st.step >= self.total_steps:
            result.update(self.evaluate())
        elapsed = time.perf_counter() - t_epoch
        self.metrics.write(
            "epoch",
            epoch=st.epoch,
            step=st.step,
            samples_per_sec=epoch_count / elapsed if elapsed else None,
            **result,
        )
        progress.message(
            f"epoch {st.epoch}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in result.items())
        )
        return result

    def evaluate(self) -> dict:
        """Validation loss and accuracy, weighted by sample counts across ranks."""
        if self.dataset is None or self.dataset.val_size == 0:
            return {}
        sums = np.zeros(3)
        for x, y in iterate_val(
            self.dataset, self.world.rank, self.world.size, max(256, self.cfg.train["batch_size"])
        ):
            ev = self.backend.evaluate(x, y)
            sums += (ev.loss_sum, ev.correct, ev.count)
        total = self.world.allreduce_array(sums, "sum", "validation metrics")
        return {
            "val_loss": total[0] / total[2],
            "val_accuracy": total[1] / total[2],
            "val_samples": int(total[2]),
        }

    def state_dict(self) -> dict:
        return asdict(self.state)


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
