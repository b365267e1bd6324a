"""A run's checkpoints: what goes in, when, and how a run resumes, for every strategy.

Written against the training loop (hpctrain/loop.py: world, state, config, data) and
its strategy's state interface (strategies/base.py: export/import in canonical names,
random state, buffers), so data parallelism, the pipeline and the parameter server
share one implementation. Saving: every rank takes part (its random state is gathered
to rank 0 as bytes, BatchNorm statistics are averaged first, and the strategy gathers
its canonical state); rank 0 writes. Resuming: rank 0 picks the file (`--resume auto` takes the
newest that verifies), every rank reads that same file (a shared file system, as for
the run directory), and any rank's problem with it stops every rank with one message.

Bit-for-bit resume at the same world size follows because everything a step depends
on is restored or is a pure function of the step: weights, optimizer slots and step
counter, the data position (samples into the epoch's seeded permutation), the lr
(a function of the step), and each rank's Python/numpy/framework random state.
At another world size the sample position carries over (no sample skipped or
repeated); random streams are re-seeded, which the zoo models do not use in training.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import yaml

from ..errors import CheckpointError
from ..lr_schedule import Schedule, resumed_schedule, scaled_lr
from ..runtime.preemption import interrupt_reason
from . import sharded
from .manager import Checkpointer, resume_checkpoint
from .model_match import model_differences
from .policy import CheckpointPolicy, young_daly
from .reader import load, read_rank_state, require_compatible
from .rng import capture_process_rng, restore_process_rng, rng_from_bytes, rng_to_bytes

log = logging.getLogger("hpctrain.checkpoint")

TRAINER_KEYS = ("step", "epoch", "position")


class RunCheckpoints:
    """Checkpoint policy + writer bound to one training loop (world, strategy, config)."""

    def __init__(self, loop):
        self.trainer = loop
        w = loop.world
        self.policy = CheckpointPolicy.from_config(loop.cfg, loop.run_dir)
        self.checkpointer = Checkpointer(self.policy, is_writer=w.is_root, faults=loop.faults)
        self._since: tuple[int, float] | None = None  # (step, time) the last save ended
        self._start_step = 0  # the step training starts from (a resumed run's)
        self._saved_schedule: int | None = None  # the steps a resumed checkpoint's lr spanned
        self._saved_batch = 0  # the global batch a resumed checkpoint was trained at
        self._saved_peak: float | None = None  # and its peak (scaled) lr
        self._requeue_after_run = False  # a preemption checkpoint waits for the summary

    @property
    def enabled(self) -> bool:
        return self.policy.enabled

    # --- saving ---------------------------------------------------------------------
    def due_locally(self, step: int) -> bool:
        """This rank's view of the step/time rules (agreed through the step reports)."""
        return self.policy.due(step)

    def due_by_step(self, step: int) -> bool:
        """The step rule alone (every_steps): the same on every rank, no agreement needed."""
        return self.policy.due(step, now=float("-inf"))

    def maybe_save(
        self,
        step: int,
        agreed_due: bool | None = None,
        epoch_end=False,
        final=False,
        metrics: dict | None = None,
    ) -> bool:
        """Save when due; every rank calls this with the same arguments."""
        if agreed_due is not None:
            agree = lambda _due: agreed_due  # noqa: E731 - decided by the step allreduce
        else:
            agree = lambda due: self.trainer.world.any_flag(due, "agree on saving")  # noqa: E731
        started = time.perf_counter()
        saved = self.checkpointer.maybe_save(
            step, lambda: self._collect(metrics), epoch_end=epoch_end, final=final, agree=agree
        )
        if saved:
            self._wait_for_the_write("checkpoint write")
        if saved and self.policy.auto and not final:
            self._retune(step, started)
        return saved

    def _retune(self, step: int, started: float) -> None:
        """every_steps: auto: the Young/Daly interval from this save's stall and the step
        time since the last one, agreed over ranks (the slowest rank's figures), so every
        rank's step rule stays the same. One 2-number allreduce per save, not per step."""
        w, now = self.trainer.world, time.perf_counter()
        last_step, last_time = self._since or (self._start_step, self.trainer.t_start)
        self._since = (step, now)
        steps = max(1, step - last_step)
        local = [now - started, (started - last_time) / steps]
        stall, step_s = (float(x) for x in w.allreduce_array(local, "max", "agree on saves"))
        seconds, interval = young_daly(stall, self.policy.mtbf_s, step_s)
        self.policy.every_steps = interval
        log.info(
            "checkpoint interval (Young/Daly): sqrt(2 x %.3g s stall x %.3g s MTBF) = %.3g s "
            "= %d steps of %.3g s",
            stall,
            self.policy.mtbf_s,
            seconds,
            interval,
            step_s,
        )

    def save_now(self, metrics: dict | None = None) -> Path | None:
        """Save unconditionally (preemption); returns the path on rank 0 once written."""
        if not self.enabled:
            return None
        payload = self._collect(metrics)
        if payload is None:
            return None
        self.checkpointer.save(self.trainer.state.step, **payload)
        return self.checkpointer.wait()

    def close(self) -> None:
        """Collective, at the end of a run: the last (asynchronous) write is finished."""
        self.checkpointer.wait()
        self._wait_for_the_write("last checkpoint write")

    def _wait_for_the_write(self, what: str) -> None:
        """Every rank waits while the writer finishes a write on its own thread (a
        synchronous save, the commit of a sharded one, the end of an asynchronous one),
        under `checkpoint.write_timeout` (1 h by default) instead of the collective
        timeout: otherwise the others wait for the writer in their next collective, whose
        deadline (10 min by default) a large checkpoint on a busy parallel filesystem
        can pass, ending the job as a stall and losing the checkpoint. An asynchronous
        save's writer arrives at once. One barrier per save: O(log N) latency, the same
        ~10-20 us at 1,024 or 4,096 ranks as at 2, beside a write of seconds."""
        if self.enabled:
            self.trainer.world.barrier(self._write_section(what), self.policy.write_timeout)

    def _write_section(self, what: str) -> str:
        """A wait for a write, named with the option that sets its deadline."""
        return f"{what} (checkpoint.write_timeout={self.policy.write_timeout:g} s)"

    def preempt(self, pre, progress, metrics: dict | None = None, label: str = "") -> str:
        """Every rank reached the same step after a signal: checkpoint; the job is
        requeued once the run has ended (`requeue_after_run`).

        Returns the signal's name on every rank. `pre` is a runtime Preemption,
        `progress` the rank-0 progress display, `metrics` the checkpoint's evaluation,
        `label` what the message says instead of "<signal> received".
        """
        w, step = self.trainer.world, self.trainer.state.step
        names = w.gather_object(pre.signal_name, what="gather preemption signals")
        signal = next((n for n in names or [] if n), "a signal") if w.is_root else None
        path = self.save_now(metrics)
        if w.is_root:
            where = f"checkpoint {path}" if path else "no checkpoint (checkpoint.enabled false)"
            stopped = f"{label or f'{signal} received'}: stopped at step {step}, {where}"
            why = interrupt_reason(signal, pre.env)
            if why is not None:  # the user asked to stop: said so, never requeued
                then = ": continue with --resume auto" if path is not None else ""
                progress.message(f"{stopped}; interrupted ({why}), not requeued{then}")
            else:
                progress.message(stopped)
                self._requeue_after_run = path is not None
        w.barrier(self._write_section("preemption checkpoint written"), self.policy.write_timeout)
        return w.bcast_object(signal, what="agree on the preemption signal")

    def requeue_after_run(self, pre) -> bool:
        """Requeue the job a preemption checkpointed (rank 0; False elsewhere, or when
        there is nothing to requeue or SLURM refused, which `pre` says on stderr).

        The run's last act: `scontrol requeue` makes SLURM end the running job at once,
        so whatever is written after it (the run's summary, the metrics' last lines, a
        line saying it was requeued) may be lost. The loop calls it after the summary is
        on disk, and says it is requeueing first (a loaded node's batch step was killed
        between scontrol's return and the line that said so).
        """
        wanted, self._requeue_after_run = self._requeue_after_run, False
        if wanted and pre.requeue_blocker() is None:
            log.info("requeueing the job: it resumes from this checkpoint (--resume auto)")
        return wanted and pre.requeue()

    def _collect(self, metrics: dict | None):
        """Everything a checkpoint holds; collective (every rank calls it). Sharded: every
        rank writes its pieces here and rank 0's payload carries the table that commits
        them; otherwise the strategy gathers the whole state onto rank 0."""
        t, w = self.trainer, self.trainer.world
        s = t.strategy
        self.checkpointer.fence()  # the previous save's copy is done before buffers change
        if self.policy.async_save:  # and its write, before a new copy of the state is made
            self.checkpointer.wait_written()  # (save() waits for it too, then holding both)
            self._wait_for_the_write("previous checkpoint write")
        s.average_buffers()
        rng = {**capture_process_rng(), **s.rng_state()}
        gathered = w.gather_bytes(rng_to_bytes(rng), what="gather random states")
        # export_pieces() is None on every rank alike (decided by the strategy's layout)
        sharding = self.policy.sharded and w.size > 1
        pieces = s.export_pieces(self.policy.shard_min_bytes) if sharding else None
        # Per-rank memory (error-feedback residuals): {} on every rank alike (the config
        # decides), else one file per rank, committed with the shards: then the save is
        # written on this thread (manager.py), so a staged export would only be waited for.
        private = s.rank_state()
        table = None
        if pieces is None:  # collective; the canonical state on rank 0, which an async
            # save may take while still filling (a GPU rank's copy beside the next step)
            state = s.export_state(staged=self.policy.async_save and w.is_root and not private)
        else:
            state, table = {}, self._write_shards(pieces)
        ranks = self._write_rank_state(private) if private else None
        if not w.is_root:
            return None
        payload = self.payload(state, gathered, metrics)
        payload["private"] = True  # export_state's own arrays are fresh; views get copied
        payload["ready"] = s.wait_exported  # the save waits where it first reads them
        if self.policy.async_save and table is None:
            # the copy of the views overlaps the next step, up to the strategy's fence
            payload["defer_copy"] = s.hold_exported_state(self.checkpointer.fence)
        if ranks is not None:
            table = table or {"order": [], "files": []}
            table["rank_state"] = ranks
        if table is not None:
            payload["shards"] = table
        return payload

    def _write_rank_state(self, arrays: dict) -> list | None:
        """Every rank writes its private arrays to its own file. The records (one per
        rank, ~100 bytes: 0.4 MB at 4,096 ranks, once per save) on rank 0."""
        return self._every_rank_writes(sharded.write_rank_state, arrays, "rank state")

    def _write_shards(self, pieces) -> dict | None:
        """Every rank writes its shard file. The table on rank 0."""
        records = self._every_rank_writes(sharded.write_shard, pieces, "shard")
        return sharded.shard_table(records) if records is not None else None

    def _every_rank_writes(self, write, what, label: str) -> list | None:
        """`write(folder, step, rank, size, what)` on every rank; a failure on any rank (a
        full disk) stops every rank naming it, and the uncommitted files go. Returns
        every rank's record on rank 0 (None elsewhere)."""
        w, step, folder = self.trainer.world, self.trainer.state.step, self.policy.dir
        record, error = None, None
        try:
            record = write(folder, step, w.rank, w.size, what, faults=self.checkpointer.faults)
        except CheckpointError as exc:
            error = str(exc)
        try:  # the slowest rank's write: under checkpoint.write_timeout
            w.agree(
                error,
                prefix=f"checkpoint {label}: ",
                error_type=CheckpointError,
                timeout=self.policy.write_timeout,
                what=self._write_section(f"agree on the checkpoint {label} writes"),
            )
        except CheckpointError:
            if w.is_root:
                sharded.remove_uncommitted(folder, step)
            raise
        records = w.gather_object(record, what=f"gather checkpoint {label} records")
        return records if w.is_root else None

    def payload(self, state: dict, gathered: list, metrics: dict | None) -> dict:
        """save()'s keyword arguments from the model/optimizer state and gathered rng."""
        t, w, st = self.trainer, self.trainer.world, self.trainer.state
        s = t.strategy
        ranks = s.checkpoint_world  # the data-parallel world this state corresponds to
        return {
            "state": state,
            "trainer_state": {
                "step": st.step,
                "epoch": st.epoch,
                "position": st.position,
                # the epoch's record after a resume averages the loss over the whole epoch
                "epoch_loss_sum": float(st.epoch_loss_sum),
                "epoch_count": int(st.epoch_count),
                "world_size": ranks,
                "global_batch": t.data.global_batch,
                # the length the lr schedule spans (optimizer.resume_schedule reads it)
                "schedule_steps": _schedule_length(t),
                "lr_peak": _peak_lr(t),  # a resume with other replicas says if it moves
                **s.trainer_extras(),
            },
            "rng_by_rank": {r: rng_from_bytes(b) for r, b in enumerate(gathered) if r < ranks},
            "attrs": {
                "backend": t.cfg.backend,
                **s.checkpoint_attrs(),
                "world_size": w.size,
                "config_yaml": t.cfg.to_yaml(),
            },
            "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
        }

    # --- resuming -------------------------------------------------------------------
    def resume(self, resume: str | None) -> str | None:
        """Restore from `resume` ('auto', 'never' or a file); returns the file used."""
        t, w = self.trainer, self.trainer.world

        def apply(ckpt):
            require_compatible(ckpt, t.strategy.weight_shapes())
            differ = model_differences(ckpt.config_yaml, t.cfg.model)
            if differ:
                raise CheckpointError(
                    f"{ckpt.path} was trained as another model ({'; '.join(differ)}): "
                    "resume it with the model it was trained as, or start afresh"
                )
            missing = [k for k in TRAINER_KEYS if k not in ckpt.trainer]
            if missing:
                raise CheckpointError(f"{ckpt.path}: trainer state lacks {missing}")
            t.strategy.import_state(ckpt)

        ckpt = load_agreed(w, self.policy, resume, apply)
        if ckpt is None:
            return None
        chosen = str(ckpt.path)
        st = t.state
        # asynchronous workers resume at their own (StrategyBase.own_position)
        st.step, st.epoch, st.position = t.strategy.own_position(ckpt) or tuple(
            int(ckpt.trainer[k]) for k in TRAINER_KEYS
        )
        st.epoch_loss_sum = float(ckpt.trainer.get("epoch_loss_sum") or 0.0)
        st.epoch_count = int(ckpt.trainer.get("epoch_count") or 0)
        ranks = t.strategy.checkpoint_world
        saved_size = int(ckpt.trainer.get("world_size", ranks))
        if saved_size == ranks and w.rank in ckpt.rng:
            rng = ckpt.rng[w.rank]
            restore_process_rng(rng)
            t.strategy.set_rng_state(rng)
        elif saved_size != ranks and w.is_root:  # the same on every rank: said once
            log.warning(
                "resuming a %d-rank checkpoint on %d ranks: continuing at sample %d of epoch "
                "%d; random streams are re-seeded",
                saved_size,
                ranks,
                st.position,
                st.epoch,
            )
        self._saved_schedule = _saved_schedule_length(ckpt, t)
        self._saved_batch = int(ckpt.trainer.get("global_batch") or 0)
        peak = ckpt.trainer.get("lr_peak")
        self._saved_peak = float(peak) if peak is not None else None
        self._restore_rank_state(ckpt, saved_size == ranks and w.size == ranks)
        self.policy.mark_saved(st.step)
        self._start_step = st.step
        log.info(
            "resumed from %s at step %d (epoch %d, sample %d)",
            chosen,
            st.step,
            st.epoch,
            st.position,
        )
        return chosen

    def steps_to_go(self, total: int, max_steps: int | None = None) -> int:
        """The run's last step in this run's steps, `max_steps` (train.max_steps, a step
        number) applied.

        The step counter goes on from the checkpoint's, counted in its global batch; the
        data position is in samples. Resumed at another global batch (another world size
        at the same per-rank batch), `total` (steps per epoch x epochs, this run's) would
        end the run early (a larger batch: whole epochs never trained) or late; the
        budget is the counter plus the steps that finish the epochs from the position.
        Every rank agrees (the parameter server's serving ranks hold no data): one
        one-element flag and, on a change, one max, at start (about 10 and 12 latency
        steps at 1,024 and 4,096 ranks). The lr
        schedule then spans this budget (its saved length counted the other batch's
        steps), which moves a cosine's lr at the resume step: said."""
        t, st = self.trainer, self.trainer.state
        saved, data = self._saved_batch, t.data
        changed = bool(saved) and data is not None and saved != data.global_batch
        if not t.world.any_flag(changed, what="agree on the resumed step budget"):
            return min(total, max_steps) if max_steps else total
        left = 0
        if data is not None:
            epochs = t.cfg.train["epochs"]
            left = data.steps_left(st.position) + (epochs - st.epoch - 1) * t.steps_per_epoch
        budget = st.step + max(0, left)
        budget = int(t.world.allreduce_array([budget], op="max", what="resumed step budget")[0])
        self._saved_schedule = None  # in the other batch's steps: the budget's instead
        last = min(budget, max_steps) if max_steps else budget
        if t.world.is_root:
            spans = f"these {last}" if last == budget else f"{last} (train.max_steps)"
            log.warning(
                "resuming a checkpoint trained at global batch %d at global batch %d: its "
                "step %d counts the old batch's steps, so the epochs left end at step %d "
                "(train.epochs=%d gives %d steps of this batch); the lr schedule spans %s "
                "steps (keep the global batch with train.grad_accum, as hpctrain elastic "
                "does, to follow the saved schedule exactly)",
                saved,
                data.global_batch if data is not None else 0,
                st.step,
                budget,
                t.cfg.train["epochs"],
                total,
                spans,
            )
        return last

    def schedule(self, total_steps: int) -> Schedule:
        """The lr schedule of this run, `total_steps` long. Resumed with another length
        (train.epochs, train.max_steps), a cosine's lr changes from the resume step on:
        optimizer.resume_schedule decides (stretch, or continue the saved schedule) and
        rank 0 says what happens to the lr."""
        t = self.trainer
        plan = resumed_schedule(
            t.cfg.optimizer,
            t.strategy.lr_replicas,
            t.steps_per_epoch,
            total_steps,
            t.state.step,
            self._saved_schedule,
        )
        if plan.message and t.world.is_root:
            (log.warning if plan.warn else log.info)("%s", plan.message)
        self._say_if_the_peak_moved()
        return plan.schedule

    def _say_if_the_peak_moved(self) -> None:
        """A scaled lr (optimizer.lr_scaling) follows the replicas: resumed on another
        number of them (another world size at the same global batch, another layout)
        the peak lr moves; rank 0 says so and how to keep the checkpoint's."""
        t, saved = self.trainer, self._saved_peak
        now = _peak_lr(t)
        # within 1e-5: the same peak (a value typed from 6 digits of this warning included)
        if saved is None or not t.world.is_root or abs(now - saved) <= 1e-5 * abs(saved):
            return
        o = t.cfg.optimizer
        keep = saved * float(o["lr"]) / now if now else saved
        log.warning(  # the value to set in full (repr): one that round-trips exactly
            "the checkpoint trained at a peak lr of %.7g; this run's is %.7g (optimizer.lr %g "
            "x %d replicas, lr_scaling %s): to keep the checkpoint's, --set optimizer.lr=%r",
            saved,
            now,
            float(o["lr"]),
            t.strategy.lr_replicas,
            o["lr_scaling"],
            keep,
        )

    def _restore_rank_state(self, ckpt, same_world: bool) -> None:
        """Each rank takes back its own private arrays (error-feedback residuals, local
        SGD's optimizer state) when the job has the size that saved them. Otherwise, or
        when any rank's file is missing or damaged (named by that rank), every rank
        starts residuals from zero and takes the checkpoint's one copy of the optimizer
        state, said once: training stays correct, only not bit for bit the
        uninterrupted run."""
        t, w = self.trainer, self.trainer.world
        current = t.strategy.rank_state()
        if not current:  # nothing per rank in this run (the config says)
            return
        arrays, why = None, "saved without them"
        if not same_world:
            why = "saved at another world size"
        elif ckpt.rank_files:
            try:
                arrays = read_rank_state(ckpt, w.rank)
                if arrays is None:
                    raise CheckpointError(f"{ckpt.path}: no rank state file for rank {w.rank}")
            except CheckpointError as exc:
                log.error("%s", exc)
                arrays = None
            why = "a rank's state file is missing or damaged (see the error above)"
        if w.any_flag(arrays is None, what="agree on restoring rank state"):
            if w.is_root:
                log.warning("%s: %s (%s)", ckpt.path.name, _afresh(current), why)
            return
        if w.is_root:  # the same on every rank (one config): said once
            _say_what_starts_afresh(ckpt.path.name, current, arrays)
        t.strategy.load_rank_state(arrays)


def _afresh(current: dict) -> str:
    """What a resume without the ranks' own files does with each kind of them."""
    kinds = {k.startswith("optimizer/") for k in current}  # local SGD's are the optimizer's
    said = ["error-feedback residuals start from zero"] if False in kinds else []
    if True in kinds:
        said.append(
            "every rank takes the checkpoint's one copy of the optimizer state "
            "(local SGD keeps one per rank)"
        )
    return " and ".join(said)


def _say_what_starts_afresh(name: str, current: dict, saved: dict) -> None:
    """The per-rank arrays a resume cannot take back because this run's compressor
    settings give them another size (compression.rank, another method) or has them
    where the checkpoint has none: the reducer starts those from zero (a residual) or
    afresh (PowerSGD's factors), correct but not the uninterrupted run bit for bit."""
    lost = [
        f"{k} ({np.size(saved[k]) if k in saved else 'not saved'} vs {np.size(v)} values)"
        for k, v in sorted(current.items())
        if k not in saved or np.size(saved[k]) != np.size(v)
    ]
    if lost:
        log.warning(
            "%s: saved with other compression settings, so these start afresh: %s",
            name,
            ", ".join(lost),
        )


def _peak_lr(loop) -> float:
    o = loop.cfg.optimizer
    return scaled_lr(float(o["lr"]), o["lr_scaling"], loop.strategy.lr_replicas)


def _schedule_length(loop) -> int:
    schedule = getattr(loop, "schedule", None)
    return int(schedule.length if schedule is not None else loop.total_steps)


# What decides steps per epoch: the same in the checkpoint's configuration and this one,
# its train.epochs/max_steps give the length of its schedule (a checkpoint written
# before /trainer/schedule_steps existed).
_LENGTH_KEYS = (("data",), ("train", "batch_size"), ("train", "grad_accum"), ("strategy",))


def _saved_schedule_length(ckpt, loop) -> int | None:
    """How many steps the checkpoint's lr schedule spanned; None when unknown."""
    saved = ckpt.trainer.get("schedule_steps")
    if saved is not None:
        return int(saved)
    try:
        old = yaml.safe_load(ckpt.attrs.get("config_yaml") or "")
    except yaml.YAMLError:
        return None
    if not isinstance(old, dict):
        return None
    new = loop.cfg.to_dict()

    def get(values, keys):
        for key in keys:
            values = values.get(key) if isinstance(values, dict) else None
        if isinstance(values, dict):  # what hpctrain found in the data is no setting
            values = {k: v for k, v in values.items() if k != "inferred"}
        return values

    same_world = ckpt.trainer.get("world_size") == loop.strategy.checkpoint_world
    if not same_world or any(get(old, k) != get(new, k) for k in _LENGTH_KEYS):
        return None
    train = old.get("train") or {}
    try:
        length = loop.strategy.steps_per_epoch * int(train["epochs"])
        return min(length, int(train["max_steps"])) if train.get("max_steps") else length
    except (KeyError, TypeError, ValueError):
        return None


def load_agreed(world, policy: CheckpointPolicy, resume: str | None, apply):
    """The checkpoint every rank resumes from, applied with `apply(ckpt)` on every rank.

    Rank 0 picks the file (policy.resume, or `resume` when given: auto | never | FILE),
    every rank reads it, and a problem on any rank (damaged file, wrong architecture)
    stops every rank with that message. Returns None when there is nothing to resume.
    """
    if resume is not None:
        policy.resume = resume
    if policy.resume == "never":
        return None
    chosen, error = None, None
    if world.is_root:
        try:
            found = resume_checkpoint(policy)
            chosen = str(found.path) if found is not None else None
        except CheckpointError as exc:
            error = str(exc)
    world.agree(error)
    chosen = world.bcast_object(chosen, what="agree on the checkpoint to resume")
    if chosen is None:
        log.info("no checkpoint to resume from in %s: starting fresh", policy.dir)
        return None
    ckpt, error = None, None
    try:
        ckpt = load(chosen)
        apply(ckpt)
    except CheckpointError as exc:
        error = str(exc)
    except (ValueError, KeyError) as exc:
        error = f"{chosen}: cannot load into this run: {exc}"
    world.agree(error)
    return ckpt
