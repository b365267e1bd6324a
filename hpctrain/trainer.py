"""The data-parallel training loop. It knows no framework: a backend does the math.

    from hpctrain import Config, Trainer
    Trainer(Config.load("configs/demo.yaml")).fit()

Every rank runs this loop on its own shard; the backend averages gradients with
Horovod. Per step the ranks exchange one small vector (loss, correct, count, a
non-finite flag) so that progress shows global numbers and a NaN on any rank stops
every rank at the same step with the same message.
"""

from __future__ import annotations

import logging
import math
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
from .runtime.preemption import Preemption
from .schedule import lr_at

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
            "%s backend, model %s, %d rank(s) x %d thread(s) (%s), %d steps/epoch, "
            "global batch %d, run dir %s",
            cfg.backend,
            cfg.model["name"],
            w.size,
            threads,
            source,
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
        samples_done, comm_total, compute_total = 0, 0.0, 0.0
        last_eval: dict = {}
        preempted = None
        pre = Preemption().install()
        try:
            while st.epoch < cfg.train["epochs"] and not (max_steps and st.step >= max_steps):
                epoch_loss, epoch_count = 0.0, 0
                t_epoch = time.perf_counter()
                for micro in self.data.iterate(st.epoch, st.position):
                    t0 = time.perf_counter()
                    lr = lr_at(
                        st.step, cfg.optimizer, w.size, self.steps_per_epoch, self.total_steps
                    )
                    stats = self.backend.train_step(micro, lr)
                    save_due = self.checkpoints.due_locally(st.step + 1)
                    totals = self._reduce_step(stats, pre.requested, save_due)
                    dt = time.perf_counter() - t0
                    st.step += 1
                    st.position += self.data.global_batch
                    loss = totals[0] / totals[2]
                    epoch_loss += totals[0]
                    epoch_count += totals[2]
                    n_samples = self.data.global_batch
                    samples_done += n_samples
                    comm_total += stats.comm_seconds
                    compute_total += dt
                    sps = n_samples / dt
                    if st.step % cfg.train["log_every"] == 0 or st.step == max_steps:
                        self.metrics.write(
                            "step",
                            epoch=st.epoch,
                            step=st.step,
                            loss=loss,
                            lr=lr,
                            accuracy=totals[1] / totals[2],
                            samples_per_sec=sps,
                            samples_per_sec_per_rank=sps / w.size,
                            comm_share=stats.comm_seconds / dt,
                            **self._mean_extra(stats.extra),
                        )
                    progress.update(st.step, f"epoch {st.epoch} loss {loss:.4f} lr {lr:.4g}")
                    if totals[4] > 0:  # a rank was signalled: every rank stops here
                        preempted = self.checkpoints.preempt(pre, progress)
                        break
                    self.checkpoints.maybe_save(st.step, agreed_due=bool(totals[5]))
                    if max_steps and st.step >= max_steps:
                        break
                if preempted:
                    break
                epoch_done = self.data.steps_left(st.position) == 0
                if epoch_done or (max_steps and st.step >= max_steps):
                    last_eval = self._end_of_epoch(epoch_loss, epoch_count, t_epoch, progress)
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

    def _reduce_step(self, stats, preempt: bool = False, save_due: bool = False) -> np.ndarray:
        """Global (loss_sum, correct, count, non-finite, preempt, save-due); stop on NaN/inf.

        One small allreduce per step carries the metrics and every per-rank decision
        (NaN, a preemption signal, a time-based checkpoint), so all ranks act alike.
        """
        bad = 0.0 if math.isfinite(stats.loss_sum) else 1.0
        local = np.array(
            [
                stats.loss_sum if not bad else 0.0,
                stats.correct,
                stats.count,
                bad,
                float(preempt),
                float(save_due),
            ],
            dtype=np.float64,
        )
        totals = self.world.allreduce_array(local, "sum", "step metrics")
        if totals[3] > 0 and self.cfg.train["nan_check"]:
            flags = self.world.comm.allgather(bool(bad)) if self.world.size > 1 else [bool(bad)]
            ranks = [r for r, f in enumerate(flags) if f]
            exc = TrainingDiverged(
                f"loss became NaN/inf at step {self.state.step + 1} (epoch {self.state.epoch}) "
                f"on rank(s) {ranks}: lower optimizer.lr, set train.clip_norm, or check the "
                f"data for NaN/inf values"
            )
            exc.agreed = True
            raise exc
        return totals

    def _mean_extra(self, extra: dict) -> dict:
        """A backend's optional step metrics (StepStats.extra) averaged over ranks."""
        if not extra:
            return {}
        keys = sorted(extra)
        parts = [np.atleast_1d(np.asarray(extra[k], dtype=np.float64)) for k in keys]
        flat = self.world.allreduce_array(np.concatenate(parts), "sum", "extra step metrics")
        flat /= self.world.size
        out, i = {}, 0
        for k, part in zip(keys, parts, strict=True):
            value = flat[i : i + part.size]
            out[k] = [float(v) for v in value] if isinstance(extra[k], list) else float(value[0])
            i += part.size
        return out

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
