"""The one training loop. Every strategy (data parallel, pipeline, parameter server)
runs under it; what differs between them lives in the strategy, nothing else.

    from hpctrain import Config, TrainingLoop
    TrainingLoop(Config.load("configs/demo.yaml")).fit()

Per step: the strategy's data gives a batch, `strategy.step(batch, lr)` trains on it,
and the step's small report (loss, counts, a non-finite flag, preemption and checkpoint
wishes) goes out with a non-blocking allreduce over the ranks that train, read one
step later (`step_reports`), so it never adds a wait. The hooks act on settled reports:
progress and metrics, the NaN stop, the checkpoint policy, preemption, evaluation at
epoch ends, the lr schedule and `train.max_steps`. The loop owns the run directory,
the process grid, threads, timing and the summary.

Ranks that serve instead of training (parameter servers) run `strategy.serve(loop)`
and meet the training ranks again in the end-of-run collectives.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import yaml

from . import run_marker, rundir, runtime
from .backends import framework_problem
from .checkpoint.session import RunCheckpoints
from .config import Config
from .errors import ConfigError, HpctrainError, StoppedBeforeStart, TrainingDiverged
from .lr_schedule import scaled_lr
from .metrics import MetricsWriter, Progress, tensorboard_problem
from .runtime import allocator
from .runtime.clock import Stopwatch
from .runtime.failfast import EXIT_INTERRUPTED
from .runtime.faults import Faults
from .runtime.memory import reset_peak_rss
from .runtime.openmpi import OpenMpiDefaults
from .runtime.preemption import Preemption, interrupt_exit_code, interrupt_reason
from .step_reports import StepReducer
from .strategies import strategy_class
from .strategies.base import RunContext

log = logging.getLogger("hpctrain.loop")


@dataclass
class TrainState:
    """Where training stands; everything needed to continue from here."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current epoch (0-based)
    position: int = 0  # samples of this epoch's permutation already consumed
    epoch_loss_sum: float = 0.0  # this epoch's settled loss sum so far (its record's loss)
    epoch_count: int = 0  # ... over this many samples (tokens for language models)


def default_run_dir(cfg: Config) -> Path:
    """runs/<config name>-<UTC>, made now and this run's alone (rank 0): two runs started
    in the same second (a sweep's) get -2, -3, ... instead of sharing one directory."""
    stem = Path(cfg.source).stem if cfg.source != "<defaults>" else "run"
    return rundir.make_new_run_dir(
        Path("runs") / f"{stem}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    )


def prepare_process(cfg: Config):
    """Settings that must exist before MPI starts (the allocator; Open MPI's, in
    runtime/openmpi.py), then the World with the watchdog's configured deadlines."""
    rt = cfg.runtime
    if rt["malloc_keep_freed"]:
        allocator.keep_freed_memory()
    # this run's memory figures are its own: what an earlier run in this process freed
    # goes back to the kernel and the peak starts from what is resident now (a full
    # gc.collect() here as well, for an earlier run's cycles, cost 0.2-0.4 s of CPU a
    # run with torch and TensorFlow loaded: 30% of the suite's tensor-parallel batches,
    # which run several runs a process; the collector reaches them by itself)
    allocator.give_back_freed()
    reset_peak_rss()
    return runtime.world(
        rt["collective_timeout"],
        rt["stall_warning"],
        OpenMpiDefaults(yield_when_idle=rt["mpi_yield_when_idle"], tcp_links=rt["tcp_links"]),
        rt["startup_timeout"],
    )


def agree_on_config(world, cfg: Config) -> None:
    """Every rank runs the configuration rank 0 runs. Ranks given different ones (an
    mpirun with another --set per app context, a config file that differs between the
    nodes' copies) went on until their first collective of another size failed with
    MPI_ERR_TRUNCATE. Rank 0's values are broadcast (a few kB: a tree, O(log N)
    latency at 1,024 or 4,096 ranks, once) and each rank names what differs."""
    mine = cfg.to_dict()
    root = world.bcast_object(mine if world.is_root else None, what="agree on the config")
    differ = _differences(root, mine)
    shown = "; ".join(f"{k}: {a!r} on rank 0, {b!r} here" for k, a, b in differ[:3])
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    world.agree(
        f"another configuration than rank 0's ({shown}{more}): give every rank the same"
        if differ
        else None,
        error_type=ConfigError,
    )


def _differences(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, a's value, b's value) where two configurations differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b)]


class TrainingLoop:
    """Builds the run (world, grid, strategy, checkpoints, metrics); `fit()` trains, once.

    Creating it claims the run directory (run_marker.py) and takes SIGUSR1/SIGTERM over;
    `fit()` gives both back at its end. A loop that is not fitted gives them back on
    `close()`, at the end of a `with` block, when it is collected, or at exit: until then
    the directory is this process's (a notebook that built a loop and dropped it had
    another loop for the same directory refused, and SIGTERM no longer ended it)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str | Path | None = None,
        verbose: bool = False,
        resume: str | None = None,
        overwrite: bool = False,
        new: bool = False,
        faults: Faults | None = None,
    ):
        """faults: a test's injected faults (runtime/faults.py); none by default."""
        # From the start: a SIGUSR1/SIGTERM while the run starts (MPI, the data, a resume)
        # is recorded, not fatal, and acted on at the first step (checkpoint, requeue).
        self.pre = Preemption(max_requeues=cfg.runtime["max_requeues"]).install()
        self.marker = None  # <run-dir>/.hpctrain-running, rank 0's (run_marker.py)
        self._fitted = False
        try:
            self._build(cfg, run_dir, verbose, resume, overwrite, new, faults)
        except BaseException:
            self.close()
            raise
        # a loop dropped unfitted gives the directory and the signals back (not self's
        # methods: the finalizer must not keep the loop alive)
        self._finalizer = weakref.finalize(self, _give_back, self.pre, self.marker)

    def close(self) -> None:
        """Give the run directory and the signal handlers back without training (fit()
        does it itself). Idempotent; a closed loop cannot fit."""
        self._fitted = True
        _give_back(self.pre, self.marker)
        self.marker = None

    def __enter__(self) -> TrainingLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _release_marker(self) -> None:
        if self.marker is not None:
            self.marker.release()
            self.marker = None

    def _build(self, cfg, run_dir, verbose, resume, overwrite, new, faults) -> None:
        self.cfg = cfg
        self.faults = Faults.none() if faults is None else faults
        self.world = w = prepare_process(cfg)
        runtime.setup_logging(w.rank, w.size, verbose)
        agree_on_config(w, cfg)
        # before the run directory, the data or any import of it: one line on every rank
        # (one agreement for both; rank 0 alone writes TensorBoard's events)
        wanted = w.is_root and cfg.metrics["tensorboard"]
        missing = framework_problem(cfg.backend) or tensorboard_problem(wanted)
        w.agree(missing, error_type=ConfigError)
        log.debug("allocator: %s", allocator.status())
        chosen, error = run_dir, None
        if run_dir is None and w.is_root:
            try:
                chosen = default_run_dir(cfg)
            except OSError as exc:
                error = f"cannot create a run directory under runs/: {exc}"
        w.agree(error, error_type=ConfigError)
        chosen = w.bcast_object(str(chosen), what="agree on the run directory")
        self.run_dir = Path(chosen)
        w.set_report_dir(self.run_dir)  # stall reports land beside the run's metrics
        resume = self._claim_run_dir(resume, overwrite, new)
        threads = cfg.runtime["threads"]
        if threads is None:
            threads, self.threads_source = runtime.threads_per_rank(w.local_size)
        else:
            self.threads_source = "runtime.threads"
        self.threads = threads
        runtime.limit_blas_threads(threads)
        self.strategy = strategy_class(cfg["strategy"])(cfg, w, self.run_dir, threads)
        self.faults.at_start(w.rank)  # a test's Ctrl-C while the data and model load
        self.grid = self.strategy.grid
        self.data = self.strategy.data  # None on ranks that serve
        self.state = TrainState()
        self.checkpoints = RunCheckpoints(self)
        self.resumed_from = self.checkpoints.resume(resume)
        # A test's lost rank (die_at_step: elastic restart) and slow first run (step_sleep:
        # time to unplug a node) act on the first run only; its restart runs at full speed.
        self._step_faults = Faults.none() if self.resumed_from else self.faults
        # only now, every check passed: a refused run leaves the earlier run as it was
        self._stop_before_the_plan()
        self._apply_run_dir_plan()
        self._write_config()
        tcfg = cfg.train
        self.steps_per_epoch = self.strategy.steps_per_epoch
        epochs = self.steps_per_epoch * tcfg["epochs"]
        self.total_steps = self.checkpoints.steps_to_go(epochs, tcfg["max_steps"])
        self.schedule = self.checkpoints.schedule(self.total_steps)  # lr per step (resume: said)
        self.metrics = MetricsWriter(
            self.run_dir, w.is_root, cfg.metrics["jsonl"], cfg.metrics["tensorboard"]
        )
        log.info(
            "%s, %d rank(s) x %d thread(s) (%s), grid %s, %d steps/epoch, %s, run dir %s",
            self.strategy.describe(),
            w.size,
            threads,
            self.threads_source,
            self.strategy.grid_text(),
            self.steps_per_epoch,
            self._lr_text(),
            self.run_dir,
        )
        if w.is_root:  # every rank builds the same list; one says it
            for warning in self.strategy.layout_warnings():
                log.warning("%s", warning)
        dataset = getattr(self.strategy, "dataset", None)
        if dataset is not None and hasattr(dataset, "summary"):
            note = getattr(getattr(self.strategy, "data", None), "memory_note", None)
            log.info("%s%s", dataset.summary(), f"; {note}" if note else "")

    # --- set-up ---------------------------------------------------------------------
    def _claim_run_dir(self, resume, overwrite: bool, new: bool):
        """One run per directory (rundir.py): rank 0 decides, every rank agrees; returns
        the --resume to use (a requeued job's FILE gives way to the run's newer ones)."""
        w, cfg = self.world, self.cfg
        error, message, chosen = None, None, None
        self._run_dir_plan = None
        if w.is_root:
            try:
                rundir.make_run_dir(self.run_dir)  # a refused run takes it back (cli.py)
                # first: two runs started at once must not both find it free
                self.marker = run_marker.claim(self.run_dir)
                plan = rundir.plan_run_dir(
                    self.run_dir,
                    cfg.to_dict(),
                    resume if resume is not None else cfg.checkpoint["resume"],
                    overwrite=overwrite,
                    new=new,
                    checkpoint_dir=cfg.checkpoint["dir"],
                    requeued=int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0,
                    resume_option="--resume" if resume is not None else "checkpoint.resume",
                )
                chosen = plan.resume
                self._run_dir_plan = plan  # applied once the run passed every check
                if cfg.checkpoint["enabled"]:
                    rundir.claim_checkpoint_dir(self.run_dir, cfg.checkpoint["dir"])
                message = plan.message if not plan.remove else None
            except HpctrainError as exc:
                error = str(exc)
            except OSError as exc:
                error = f"run directory {self.run_dir}: {exc}"
        w.agree(error, error_type=ConfigError)
        if message:
            log.info("%s", message)
        # with it, whether rank 0 has earlier files to remove or move once the run passed
        # its checks: the ranks join that agreement only then (_apply_run_dir_plan)
        plan = self._run_dir_plan
        chosen, self._plan_acts = w.bcast_object(
            (chosen, plan is not None and bool(plan.remove)), what="agree on what to resume from"
        )
        return chosen or resume

    def _stop_before_the_plan(self) -> None:
        """A stop the user asked for while the run started (Ctrl-C, SIGUSR2, a SIGTERM
        outside SLURM) ends it before what --overwrite deletes, --new moves or --resume
        FILE sets aside is touched (it went on to delete, train and save): nothing has
        trained, so nothing is saved. Agreed, as a signal may reach some ranks only. A
        scheduler's stop is acted on at the first step, as before (checkpoint, requeue)."""
        if not self._plan_acts:  # nothing to leave untouched (the same on every rank)
            return
        name = self.pre.signal_name
        reason = interrupt_reason(name) if name else None
        if self.world.any_flag(reason is not None, "agree on a stop during start-up"):
            exc = StoppedBeforeStart(
                f"{name or 'a stop signal on another rank'} during start-up"
                f"{f' ({reason})' if reason else ''}: nothing trained, and nothing of the "
                f"earlier run in {self.run_dir} was deleted or moved",
                interrupt_exit_code(name) if reason else EXIT_INTERRUPTED,
            )
            exc.agreed = True  # every rank raises it; rank 0 says it
            raise exc

    def _apply_run_dir_plan(self) -> None:
        """What --overwrite deletes, --new moves and --resume FILE sets aside, done after
        the data, the model and the checkpoint to resume passed their checks (a typo in
        the new config used to cost the earlier run); rank 0, agreed."""
        if not self._plan_acts:  # the same on every rank (broadcast with the resume)
            return
        plan, error = self._run_dir_plan, None
        if plan is not None:  # rank 0
            try:
                rundir.apply_plan(plan)
            except OSError as exc:
                error = f"run directory {self.run_dir}: {exc}"
        self.world.agree(error, error_type=ConfigError)
        if plan is not None:
            log.info("%s", plan.message)

    def _write_config(self) -> None:
        """config.yaml as run: the configuration plus what hpctrain found in the data."""
        if not self.world.is_root:
            return
        values = self.cfg.recorded()
        dataset = getattr(self.strategy, "dataset", None)
        if dataset is not None and hasattr(dataset, "describe"):
            values["data"]["inferred"] = dataset.describe()
        text = rundir.CONFIG_HEADER + yaml.safe_dump(values, sort_keys=True)
        rundir.write_config_text(self.run_dir, text)

    def _lr_text(self) -> str:
        o, n = self.cfg.optimizer, self.strategy.lr_replicas
        peak = scaled_lr(float(o["lr"]), o["lr_scaling"], n)
        if o["lr_scaling"] == "none" or n == 1:
            return f"lr {peak:g}"
        return f"lr {o['lr']:g} x {n} replicas ({o['lr_scaling']} scaling) = {peak:g}"

    # --- the loop ---------------------------------------------------------------
    def fit(self) -> dict:
        if self._fitted:  # its marker and signal handlers are given back: a new loop resumes
            raise ConfigError(
                "this TrainingLoop has already fitted or been closed: create a new one "
                "(with resume 'auto' it continues from the last checkpoint)"
            )
        self._fitted = True
        w, cfg, st, s = self.world, self.cfg, self.state, self.strategy
        self.t_start = time.perf_counter()
        self.stopwatch = Stopwatch(w.watchdog.clock)  # leaves out a suspension
        self._run = {"samples": 0, "comm": 0.0, "compute": 0.0, "count": 0}
        self.last_eval: dict = {}
        self.preempted = None
        self.signalled_in_evaluation = False  # a signal agreed during an evaluation
        pre = self.pre  # installed since the run started (__init__)
        self.progress = Progress(
            w.is_root,
            max(0, self.total_steps - st.step),
            log,
            cfg.train["log_every"],
            cfg.metrics["progress_bar"],
        )
        self._ctx = ctx = self._context()
        try:
            self.metrics.start(st.step, st.epoch, self.resumed_from)  # a full disk: below
            s.begin(ctx)
            if s.serves:
                w.end_startup()  # its waits from here are the workers' steps'
                s.serve(ctx)  # parameter servers: until every worker is done
            else:
                self._train()
            self._apply(s.finish(ctx))  # end-of-run collectives every rank joins
            if not self.preempted:
                self.checkpoints.maybe_save(st.step, final=True, metrics=self.last_eval)
            self.checkpoints.close()
            s.release()
        except BaseException:
            self._release_marker()
            raise
        finally:
            pre.uninstall()
            self.progress.close()
        try:
            summary = self._summary()
        finally:
            self._release_marker()  # the run's last write is the summary's
        self.checkpoints.requeue_after_run(pre)  # last: SLURM ends the job now
        return summary

    def _context(self) -> RunContext:
        """What the strategy may use of this run (strategies/base.py `RunContext`)."""
        return RunContext(
            state=self.state,
            total_steps=self.total_steps,
            elapsed=self.stopwatch.elapsed,
            schedule=self.schedule,
            pre=self.pre,
            faults=self.faults,
            checkpoints=self.checkpoints,
            metrics=self.metrics,
            progress=self.progress,
            evaluate=self.evaluate,
            preempted=lambda: self.preempted is not None,
        )

    def _apply(self, end) -> None:
        """A strategy's agreed end of run (strategies/base.py `RunEnd`; None: nothing to
        apply): its position and evaluation, a preemption checkpoint by the shared code."""
        if end is None:
            return
        st = self.state
        st.step, st.epoch, st.position = end.step, end.epoch, end.position
        self.last_eval = {**self.last_eval, **end.metrics}  # the last epoch's loss stays
        if end.preempted:
            self.preempted = self.checkpoints.preempt(
                self.pre, self.progress, self.last_eval, end.label
            )

    def _train(self) -> None:
        cfg, st, s = self.cfg, self.state, self.strategy
        max_steps = cfg.train["max_steps"]
        reducer = StepReducer(
            s.report_comm, cfg.train["overlap_step_metrics"], deferred=s.step_sums_on_device
        )
        starting = True  # until the first step, waits may take runtime.startup_timeout
        while st.epoch < cfg.train["epochs"] and st.step < self.total_steps:
            self._run.update(count=0)
            t_epoch, t_last = self.stopwatch.elapsed(), time.perf_counter()
            flags: dict = {}
            deferred_save = False
            for batch in s.batches(st.epoch, st.position):
                lr = self.schedule.lr(st.step, s.lr_replicas)
                stats = s.step(batch, lr, tally=self._logged(st.step + 1))
                if starting:  # this run's first step has run on this rank
                    self.world.end_startup()
                    starting = False
                st.step += 1
                self._step_faults.after_step(self.world.rank, st.step)
                st.position += self.data.global_batch
                now = time.perf_counter()
                seconds, t_last = now - t_last, now
                last = st.step >= self.total_steps or self._epoch_finished()
                wish = self.checkpoints.due_locally(st.step)
                flags = self._settle(
                    reducer.push(st.step, stats, lr, seconds, self.pre.requested, wish)
                )
                if s.agreed_flags is not None:  # the strategy agrees on its own (PS)
                    flags = s.agreed_flags(stats)
                    save = flags["save"]
                else:
                    save = flags["save"] or self.checkpoints.due_by_step(st.step)
                if flags["preempt"] or save or last:  # these must see this step's result
                    more = self._settle(reducer.drain())
                    if s.agreed_flags is None:
                        flags = {k: flags[k] or more[k] for k in flags}
                        save = save or flags["save"]
                if flags["preempt"]:  # a rank was signalled: every rank stops here
                    self.preempted = s.on_preempt(self._ctx)
                    break
                if flags.get("stop"):  # the strategy ends this rank's training early
                    break
                # a save on an epoch's last step waits for the epoch's end (below), so the
                # checkpoint starts the next epoch: a resume does not end this one again
                deferred_save = save and s.agreed_flags is None and self._epoch_finished()
                if save and not deferred_save:
                    s.save_now(self._ctx)
                if max_steps and st.step >= max_steps:
                    break
            if self.preempted:
                break
            epoch_done = self._epoch_finished()
            if (epoch_done or st.step >= self.total_steps) and not flags.get("stop"):
                self.last_eval = self._end_of_epoch(t_epoch)
            if epoch_done:
                st.epoch += 1
                st.position, st.epoch_loss_sum, st.epoch_count = 0, 0.0, 0
                # a signal cut the evaluation short: its checkpoint starts the next epoch
                # (after the last epoch the run is over: its final save, no requeue)
                if self.signalled_in_evaluation and st.step < self.total_steps:
                    self.preempted = s.on_preempt(self._ctx)
                    break
                if s.agreed_flags is None:
                    self.checkpoints.maybe_save(
                        st.step,
                        agreed_due=True if deferred_save else None,
                        epoch_end=True,
                        metrics=self.last_eval,
                    )

    def _epoch_finished(self) -> bool:
        return self.data.steps_left(self.state.position) == 0

    def _settle(self, reports) -> dict:
        """Log settled step reports; stop on NaN/inf; return the agreed flags."""
        flags = {"preempt": False, "save": False}
        cfg, s = self.cfg, self.strategy
        comm = s.report_comm
        size = comm.size if comm is not None else 1
        for r in reports:
            if r.nonfinite and cfg.train["nan_check"]:
                flags_by_rank = (
                    comm.allgather_object(r.local_nonfinite, "which ranks saw NaN/inf")
                    if size > 1
                    else [r.local_nonfinite]
                )
                ranks = [s.rank_name(i) for i, f in enumerate(flags_by_rank) if f]
                exc = TrainingDiverged(
                    f"loss became NaN/inf at step {r.step} (epoch {self.state.epoch}) "
                    f"on {', '.join(ranks)}: lower optimizer.lr, set train.clip_norm, or "
                    "check the data for NaN/inf values"
                )
                exc.agreed = size == self.world.size  # every rank raises the same
                raise exc
            n = self.data.global_batch
            run = self._run
            run["samples"] += n
            run["comm"] += r.comm_seconds
            run["compute"] += r.seconds
            self.state.epoch_loss_sum += r.loss_sum
            self.state.epoch_count += r.count
            run["count"] += r.count
            sps = n / r.seconds if r.seconds > 0 else None
            if self._logged(r.step):
                self.metrics.write(
                    "step",
                    epoch=self.state.epoch,
                    step=r.step,
                    loss=r.loss,
                    lr=r.lr,
                    accuracy=r.accuracy,
                    samples_per_sec=sps,
                    samples_per_sec_per_rank=sps / self.world.size if sps else None,
                    comm_share=r.comm_seconds / r.seconds if r.seconds > 0 else None,
                    **r.extra,
                )
            self.progress.update(
                r.step, f"epoch {self.state.epoch} loss {r.loss:.4f} lr {r.lr:.4g}"
            )
            flags["preempt"] = flags["preempt"] or r.preempt
            flags["save"] = flags["save"] or r.save_due
        return flags

    def _logged(self, step: int) -> bool:
        """Step `step` writes a step line (with its accuracy: only these steps count
        correct predictions, an argmax that is ~1% of a GPU step)."""
        return step % self.cfg.train["log_every"] == 0 or step == self.total_steps

    def _end_of_epoch(self, t_epoch: float) -> dict:
        st, run = self.state, self._run
        result = {"loss": st.epoch_loss_sum / max(1, st.epoch_count)}
        due = (st.epoch + 1) % self.cfg.train["eval_every_epochs"] == 0
        if self.strategy.evaluates_in_loop and (due or st.step >= self.total_steps):
            result.update(self.evaluate())
        elapsed = max(0.0, self.stopwatch.elapsed() - t_epoch)
        self.metrics.write(
            "epoch",
            epoch=st.epoch,
            step=st.step,
            samples_per_sec=run["count"] / elapsed if elapsed > 0 else None,
            **result,
        )
        self.progress.message(
            f"epoch {st.epoch}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in result.items())
        )
        return result

    def evaluate(self) -> dict:
        """Validation loss and accuracy, summed over every rank (collective); {} when a
        signal ended it (`signalled_in_evaluation`)."""
        s = self.strategy
        s.average_buffers()
        sums = s.evaluate(stop=self._signal_agreed)
        if sums is None:
            return {}
        total = self.world.allreduce_array(
            np.asarray(sums, np.float64), "sum", "validation metrics"
        )
        if not total[2]:
            return {}
        samples = int(total[3]) if len(total) > 3 else int(total[2])
        result = {
            "val_loss": total[0] / total[2],
            "val_accuracy": total[1] / total[2],
            "val_samples": samples,  # sequences or images
        }
        if int(total[2]) != samples:  # language models: loss and accuracy are per token
            result["val_tokens"] = int(total[2])
        return result

    def _signal_agreed(self) -> bool:
        """Whether any rank was signalled (preemption), agreed by every rank: asked once
        per validation batch, so a signal during a long evaluation (a large validation
        set, SLURM's 30 s between SIGTERM and SIGKILL) is acted on within a batch, not
        after the evaluation. One 1-flag allreduce per batch of >= 256 samples: O(log N),
        tens of microseconds at 1,024 or 4,096 ranks."""
        self._step_faults.sleep("eval_sleep", self.world.rank)
        if not self.signalled_in_evaluation:
            self.signalled_in_evaluation = self.world.any_flag(
                self.pre.requested, "agree on a signal during evaluation"
            )
        return self.signalled_in_evaluation

    def _summary(self) -> dict:
        w, st, cfg, run = self.world, self.state, self.cfg, self._run
        elapsed, suspended = self.stopwatch.elapsed(), self.stopwatch.suspended()
        summary = {
            "steps": st.step,
            "epochs": st.epoch,
            "world_size": w.size,
            "backend": cfg.backend,
            "model": cfg.model["name"],
            "strategy": cfg["strategy"],
            "samples_per_sec": run["samples"] / elapsed if elapsed > 0 else None,
            "samples_per_sec_per_rank": run["samples"] / elapsed / w.size if elapsed > 0 else None,
            "comm_share": run["comm"] / run["compute"] if run["compute"] else None,
            "elapsed_sec": elapsed,
            **({"suspended_sec": suspended} if suspended else {}),
            "resumed_from": self.resumed_from,
            "preempted": self.preempted,
            **self.last_eval,
        }
        summary = self.strategy.summary(self._ctx, summary)  # collective; the root's dict counts
        self.metrics.write("summary", epoch=st.epoch, step=st.step, **summary)
        self.metrics.close()
        if w.is_root:
            log.info("done: %s", ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
        return w.bcast_object(summary, what="agree on the run summary")


def _give_back(pre: Preemption, marker) -> None:
    """A loop's signal handlers (main thread only: signal.signal's rule; a collection in
    another thread leaves them to the process's exit) and its run marker."""
    if threading.current_thread() is threading.main_thread():
        pre.uninstall()
    if marker is not None:
        marker.release()


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
