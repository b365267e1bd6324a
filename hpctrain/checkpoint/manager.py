"""The trainer's side: save on schedule, synchronously or in the background, then prune.

At most one background write is in flight: a new save first joins the previous one.
An error in a background write is kept and re-raised by the next `maybe_save`, `save`
or `wait`, so a failed checkpoint is never silently lost.

An async save copies the arrays it must not see change (views of live tensors) into
reused buffers (staging.py), on the caller's thread, or with `defer_copy=True` on the
background thread while training goes on: then the caller must call `fence()` before
it changes any of those arrays (the torch backend does, before its next update). Arrays
a GPU is still filling come with `ready`, which that thread calls before it reads them.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from ..errors import CheckpointError
from ..runtime.faults import NO_FAULTS, Faults
from . import format as fmt
from . import reader, sharded, writer
from .policy import CheckpointPolicy, Entry
from .staging import Staging

log = logging.getLogger("hpctrain.checkpoint")


class Checkpointer:
    """Owns a policy; on the writer rank (rank 0) writes files and applies retention."""

    def __init__(
        self, policy: CheckpointPolicy, is_writer: bool = True, faults: Faults = NO_FAULTS
    ):
        self.policy = policy
        self.is_writer = is_writer
        self.faults = faults  # a test's write_delay, copy_delay, kill_during_save
        self.last_path: Path | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._metrics: dict[Path, float | None] = {}
        self._not_ours: set[Path] = set()  # files named like checkpoints, not ones
        self._staging = Staging()  # async saves' reused copy buffers
        self._staged: threading.Event | None = None  # set once a deferred copy is done

    # --- saving ---------------------------------------------------------------------
    def maybe_save(self, step: int, collect, epoch_end=False, final=False, agree=None) -> bool:
        """Save if the policy says so; call on every rank with the same arguments.

        collect() gathers what to save and returns save()'s keyword arguments (state,
        trainer_state, rng_by_rank, attrs, metrics) on the writer, None elsewhere; it
        runs only when a save is due, so it may hold collectives. agree(bool) -> bool
        makes the decision identical on every rank (e.g. World.any_flag).
        """
        self.raise_pending()
        due = self.policy.due(step, epoch_end=epoch_end, final=final)
        if agree is not None:
            due = bool(agree(due))
        if not due:
            return False
        payload = collect()
        self.policy.mark_saved(step)
        if self.is_writer and payload is not None:
            self.save(step, **payload)
        return True

    def save(
        self,
        step,
        state,
        trainer_state=None,
        rng_by_rank=None,
        attrs=None,
        metrics=None,
        shards=None,
        private=False,
        defer_copy=False,
        ready=None,
    ) -> Path | None:
        """Save now (writer only). Sync: returns the path. Async: copies the arrays on
        this thread (into buffers reused from the last save), writes in the background
        and returns None (see `wait`). private=True: the caller will not touch `state`'s
        arrays again, so those owning their memory are written without a copy. `shards`:
        the table of a sharded save's per-rank files, already written (this file commits
        them; it is always written on this thread). defer_copy=True (async only): the
        copy too runs in the background; the caller calls `fence()` before it changes
        `state`'s arrays. ready(): blocks until `state`'s arrays hold their values (a
        GPU rank's copy to the host still running); called on the thread that first
        reads them, the background one when the copy is deferred."""
        self.wait()
        async_save = self.policy.async_save and shards is None
        deferred = async_save and defer_copy
        if ready is not None and not deferred:
            ready()
        snap = writer.snapshot(
            step,
            state,
            trainer_state,
            rng_by_rank,
            attrs,
            metrics,
            async_save and not deferred,
            shards,
            staging=self._staging,
            private=private,
        )
        self.policy.mark_saved(step)
        if not async_save:
            return self._write(snap)
        self._staged = threading.Event()
        if not deferred:
            self._staged.set()
        self._thread = threading.Thread(
            target=self._background,
            args=(snap, deferred and private, deferred, ready),
            name="hpctrain-checkpoint",
            daemon=False,
        )
        self._thread.start()
        return None

    def _background(self, snap: writer.Snapshot, private: bool, copy: bool, ready) -> None:
        try:
            try:
                if copy:
                    self.faults.sleep("copy_delay")  # a test: a copy slower than a step
                    if ready is not None:
                        ready()
                    snap = writer.private_copy(snap, self._staging, private)
            finally:
                self._staged.set()  # the caller may change its arrays now (or it failed)
            self._write(snap, background=True)
        except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the caller
            self._error, self._error_step = exc, snap.step

    def fence(self) -> None:
        """Block until the background save has copied the caller's arrays (a deferred
        copy: `save(defer_copy=True)`); at once when nothing is being copied."""
        staged = self._staged
        if staged is not None:
            staged.wait()

    def _write(self, snap: writer.Snapshot, background: bool = False) -> Path:
        try:
            path = writer.write(self.policy.dir, snap, direct=background, faults=self.faults)
        except CheckpointError:
            if snap.shards is not None:  # the commit failed (a full disk): its shards go
                sharded.remove_uncommitted(self.policy.dir, snap.step)
            raise
        if snap.shards is not None:  # committed: every rank's shard is final, temps are stale
            writer.remove_stale_temps(sharded.shards_dir(path))
        self.last_path = path
        self._metrics[path] = snap.attrs.get(f"metric.{self.policy.best_metric}")
        self.prune(path)
        return path

    # --- waiting and errors ---------------------------------------------------------
    def raise_pending(self) -> None:
        """Re-raise the error of a finished background write, once."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, step = self._error, self._error_step
            self._error = self._error_step = None
            raise CheckpointError(f"background save of step {step} failed: {exc}") from exc

    def wait_written(self) -> None:
        """Block until a background write is finished; its error, if any, is raised by
        the next `save`, `maybe_save` or `wait`."""
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> Path | None:
        """Block until a background write is finished; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
        self.raise_pending()
        return self.last_path

    close = wait

    # --- retention -----------------------------------------------------------------
    def _metric(self, path: Path) -> float | None:
        if path not in self._metrics:
            try:
                attrs = reader.verify(path).attrs
                self._metrics[path] = attrs.get(f"metric.{self.policy.best_metric}")
            except CheckpointError:
                self._metrics[path] = None
        return self._metrics[path]

    def _ours(self, path: Path) -> bool:
        """Named like a checkpoint and begins with hpctrain's header: prunable. Anything
        else is a user's file under a checkpoint's name, left in place (said once)."""
        if fmt.starts_as_checkpoint(path):
            return True
        if path not in self._not_ours:
            self._not_ours.add(path)
            log.warning(
                "%s is named like a checkpoint but does not begin with hpctrain's checkpoint "
                "header: left in place and out of checkpoint.keep_last's count",
                path,
            )
        return False

    def prune(self, written: Path) -> list[Path]:
        """Delete what the policy does not keep; never `written` nor newer files.

        Files with a step above the one just written come from an abandoned timeline
        (a resume from an older checkpoint): they are left alone, not counted.
        """
        step = writer.fmt.step_of(written.name)
        entries = []
        for s, path in reader.list_checkpoints(self.policy.dir):
            if s > step or not self._ours(path):
                continue
            metric = self._metric(path) if self.policy.keep_best else None
            entries.append(Entry(s, path, metric))
        removed = []
        for path in self.policy.to_delete(entries):
            if path == written:
                continue
            try:
                path.unlink()  # the commit first: a half-removed checkpoint never looks whole
                removed.append(path)
                self._metrics.pop(path, None)
            except FileNotFoundError:
                pass
            sharded.remove_shards(path)
        sharded.remove_orphans(self.policy.dir, below=step)
        if removed:
            log.info("removed old checkpoint(s): %s", ", ".join(p.name for p in removed))
        return removed


def resume_checkpoint(policy: CheckpointPolicy) -> reader.Checkpoint | None:
    """What `checkpoint.resume` asks for: the newest valid file (auto), none, or one file.

    An explicitly named file must verify; 'auto' skips damaged files with a warning,
    and refuses when there are checkpoints and none verifies: starting afresh would
    write over them (a sharded one whose shard folder was not copied along verifies
    again once it is back).
    """
    if policy.resume == "never":
        return None
    if policy.resume == "auto":
        found = reader.find_latest_valid(policy.dir)
        if found is None and (there := reader.list_checkpoints(policy.dir)):
            raise CheckpointError(
                f"--resume auto: none of the {len(there)} checkpoint(s) in {policy.dir} "
                "verifies (each one's reason above), and starting afresh would write over "
                "them: restore what is missing (a sharded checkpoint's ckpt-<step>.shards/ "
                "folder), or start afresh with --new (moves them to previous/) or --overwrite"
            )
        if found is not None:
            _set_aside_newer(policy, found.step)
        return found
    return reader.load(policy.resume)


def _set_aside_newer(policy: CheckpointPolicy, step: int) -> None:
    """'auto' went back past newer checkpoints that do not verify: they (and their shard
    folders) move to <run-dir>/previous/<UTC>/, never deleted, so that this run's saves
    of those steps, keep_last's pruning and a later --resume auto leave them alone."""
    newer = []
    for entry in os.scandir(policy.dir):
        at = fmt.step_of_entry(entry.name)
        if at is not None and at > step:
            newer.append(Path(entry.path))
    if not newer:
        return
    target = fmt.set_aside_dir(policy.run_dir)
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(newer):
        shutil.move(path, target / path.name)  # the run directory may be on another FS
    log.warning(
        "--resume auto: resuming from step %d; the %d newer file(s) that do not verify "
        "(%s) moved to %s, never deleted (`hpctrain ckpt verify` says what each lacks)",
        step,
        len(newer),
        ", ".join(p.name for p in sorted(newer)),
        target,
    )
