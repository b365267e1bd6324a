"""The elastic supervisor: launch the job with mpirun (or as an srun step inside a SLURM
allocation), watch it, and on a failure restart it from the newest checkpoint that
verifies, on the hosts that still answer.

One process on the launch node (where a batch script's mpirun would run). Each attempt
is `mpirun --hostfile <alive hosts> -np N ... hpctrain train ... --resume auto`; the
training's own `--resume auto` picks the newest verified checkpoint and continues at its
sample position, which is a position in the global epoch order, so a restart at another
world size neither skips nor repeats a sample of the epoch. Events go to
`<run-dir>/elastic/events.jsonl` and to stderr.

Not restarted: success (0), a user error every rank agreed on (2: it would fail again;
one rank's own error, 3, is restarted), Ctrl-C (130), or a stop the supervisor itself
was asked for (SIGTERM/SIGINT/SIGUSR1). Such a stop reaches the job as SIGUSR1,
hpctrain's "checkpoint and stop" signal: the launcher runs in a session of its own (a
terminal's Ctrl-C reaches the supervisor only),
because mpirun ends its ranks about 1 s after a SIGINT/SIGTERM of its own
(`odls_base_sigkill_timeout`), before a checkpoint could be written. A second
SIGINT/SIGTERM is passed on as it is: the job ends now.

While an attempt runs, its hosts are probed every `watch_interval` seconds (TCP only,
in parallel; see hosts.py for the cost at 1,024 and 4,096 hosts): a host that misses
two probes in a row ends the attempt at once. mpirun notices a lost node by itself
within seconds, but an srun step with a silent node ends only when slurmctld marks it
DOWN, after the cluster's SlurmdTimeout (300 s by default), and the ranks left wait
for their peer until the collective deadline (600 s by default).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import run_marker
from ..errors import ConfigError
from ..rundir import find_previous_run
from ..stop_signals import interrupt_reason
from .batch import plan_batch, ranks_per_replica, replicas_of
from .hosts import Host, probe, write_hostfile

NOT_RESTARTED = {0: "finished", 2: "stopped on a user error", 130: "interrupted (Ctrl-C)"}


@dataclass
class Options:
    train_args: list[str]  # `train ...` without --resume/--new/--overwrite
    first_flags: list[str]  # the user's --resume/--new/--overwrite, for the first launch
    run_dir: Path
    hosts: list[Host]
    np_min: int = 1
    np_max: int | None = None
    max_restarts: int = 3
    mpirun_args: list[str] = field(default_factory=list)  # the launcher's own arguments
    launcher: str = "mpirun"  # or "srun": a job step inside the allocation
    agent: list[str] | None = None
    probe_port: int = 22
    probe_timeout: float = 5.0
    watch_interval: float = 30.0  # seconds between probes of a running attempt; 0: none
    hpctrain: list[str] = field(default_factory=lambda: [sys.executable, "-m", "hpctrain"])


def say(message: str) -> None:
    print(f"hpctrain elastic: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, opts: Options, cfg):
        self.opts, self.cfg = opts, cfg
        self.events = opts.run_dir / "elastic" / "events.jsonl"
        self.proc: subprocess.Popen | None = None
        self.stop_signal: int | None = None
        self.hosts: list[Host] = list(opts.hosts)  # the running attempt's

    # --- bookkeeping ------------------------------------------------------------------
    def event(self, kind: str, **fields) -> None:
        self.events.parent.mkdir(parents=True, exist_ok=True)
        with self.events.open("a") as f:
            f.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")

    def world_size(self, hosts: list[Host]) -> int:
        """Ranks for `hosts`: their slots, at most --np max, a whole number of replicas."""
        n = sum(h.slots for h in hosts)
        if self.opts.np_max is not None:
            n = min(n, self.opts.np_max)
        per = ranks_per_replica(self.cfg)
        return n - n % per

    def minimum(self) -> int:
        """The fewest ranks to run: --np MIN, and at least one replica (parameter server:
        one worker beside the servers)."""
        one = ranks_per_replica(self.cfg)
        if self.cfg["strategy"] == "parameter_server":
            one = self.cfg.ps["servers"] + 1
        return max(self.opts.np_min, one)

    def enough(self, n: int) -> bool:
        return n >= self.minimum() and replicas_of(self.cfg, n) >= 1

    # --- one attempt --------------------------------------------------------------------
    def argv(self, attempt: int, hosts: list[Host], n: int, plan) -> list[str]:
        o = self.opts
        hostfile = write_hostfile(o.run_dir / "elastic" / f"hosts-{attempt}", hosts)
        flags = o.first_flags if attempt == 0 else ["--resume", "auto"]
        sets = ["--set", f"train.grad_accum={plan.grad_accum}"]
        if plan.microbatches is not None:
            sets += ["--set", f"pipeline.microbatches={plan.microbatches}"]
        if plan.lr != float(self.cfg.optimizer["lr"]):
            sets += ["--set", f"optimizer.lr={plan.lr!r}"]
        if o.launcher == "srun":  # a new step of this allocation, on the nodes left
            launch = ["srun", f"--nodes={len(hosts)}", f"--ntasks={n}"]
            launch += [f"--nodelist={','.join(h.name for h in hosts)}", "--kill-on-bad-exit=1"]
            launch.append(f"--job-name={STEP_NAME}")  # the step the watch may end
            if attempt > 0:
                # the failed step still holds its CPUs while a lost node cannot confirm
                # its end ("Requested nodes are busy"): let the new step share them
                launch.append("--overlap")
        else:
            launch = ["mpirun", "--hostfile", str(hostfile), "-np", str(n)]
        return [*launch, *o.mpirun_args, *o.hpctrain, *o.train_args, *flags, *sets]

    def launch(self, argv: list[str]) -> int | None:
        """Run one attempt to its end; None: a stop was asked for before it started."""
        if self.stop_signal is not None:
            return None
        self.proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent)
        try:
            if self.stop_signal is not None:  # arrived while it started: pass it on now
                self.proc.send_signal(self._stop_for_ranks())
            return self._wait()
        finally:
            self.proc = None

    def _wait(self) -> int:
        """The attempt's exit code. Its hosts that answer a probe as it starts are probed
        every watch interval; one that misses two probes in a row (the second at once)
        ends the attempt, which then fails and is restarted like any other failure."""
        interval = self.opts.watch_interval
        if not interval:
            return self.proc.wait()
        watched = self._answering(self.hosts)
        while True:
            try:
                return self.proc.wait(timeout=interval)
            except subprocess.TimeoutExpired:
                pass
            if self.stop_signal is not None:  # a stop is under way: let it checkpoint
                continue
            lost = self._silent(watched)
            if lost:
                for name, why in lost.items():
                    say(f"host {name} stopped answering while the job ran ({why}): ending it")
                self.event("lost_while_running", lost=lost)
                self._end_attempt()
                return self.proc.wait()

    def _answering(self, hosts: list[Host]) -> list[Host]:
        """The hosts that answer a probe now, as the attempt starts: only they can be
        seen to stop. A host whose probe port never answers (a firewall that drops it)
        is left out of the watch, named once, instead of ending every attempt."""
        o = self.opts
        first = probe(hosts, o.probe_port, o.probe_timeout, None)
        silent = {name: why for name, why in first.items() if why is not None}
        if silent:
            say(f"the watch leaves out {', '.join(silent)}: no answer as the job starts")
            self.event("unwatched", hosts=silent)
        return [h for h in hosts if h.name not in silent]

    def _silent(self, hosts: list[Host]) -> dict:
        """{host: why} of the hosts that missed a TCP probe and then a second one."""
        o = self.opts
        if not hosts:
            return {}
        first = probe(hosts, o.probe_port, o.probe_timeout, None)
        missed = [h for h in hosts if first[h.name] is not None]
        if not missed:
            return {}
        again = probe(missed, o.probe_port, o.probe_timeout, None)
        return {name: why for name, why in again.items() if why is not None}

    def _end_attempt(self) -> None:
        """End a running attempt whose host is lost. srun: `scancel --signal=KILL` of the
        step reaches its tasks on the nodes that answer at once (srun itself would wait
        for the lost node until slurmctld marks it DOWN); scancel waits for the lost
        node's slurmd for SLURM's MessageTimeout (10 s by default), so it runs on in
        the background while srun goes and the next attempt starts (with --overlap).
        mpirun: SIGTERM (it ends its ranks and daemons), SIGKILL 10 s later."""
        if self.opts.launcher == "srun":
            for step in _steps_named():
                with contextlib.suppress(OSError):  # no scancel: srun goes all the same
                    _in_background(["scancel", "--signal=KILL", step])
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _forward(self, signum, frame) -> None:
        again = self.stop_signal is not None and signum not in (signal.SIGUSR1, signal.SIGUSR2)
        self.stop_signal = self.stop_signal or signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum if again else self._stop_for_ranks())

    def _stop_for_ranks(self) -> int:
        """The signal that asks the ranks to checkpoint and stop; the launcher passes
        SIGUSR1 and SIGUSR2 on and waits. SIGUSR1 (a requeue under SLURM) for a
        scheduler's SIGTERM or SIGUSR1; SIGUSR2 (never requeued) for Ctrl-C, a SIGTERM
        outside SLURM (a stop request: nothing to requeue) and SIGUSR2 itself."""
        scheduler = interrupt_reason(signal.Signals(self.stop_signal).name) is None
        return signal.SIGUSR1 if scheduler else signal.SIGUSR2

    def _kept(self) -> str:
        """What a run that gave up leaves: its newest checkpoint, or none written yet."""
        prev = find_previous_run(self.opts.run_dir, self.cfg.checkpoint["dir"])
        if prev.newest_step is None:
            return f"it wrote no checkpoint in {prev.checkpoint_dir} yet"
        return (
            f"its newest checkpoint (step {prev.newest_step}) stays in {prev.checkpoint_dir} "
            "(resume with --resume auto)"
        )

    # --- the loop -----------------------------------------------------------------------
    def run(self) -> int:
        """Launch, watch and restart the job; the signal handlers it installs are put back
        at its end (a supervisor run from Python must not leave them behind)."""
        stops = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
        previous = {sig: signal.signal(sig, self._forward) for sig in stops}
        try:
            return self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _supervise(self) -> int:
        o = self.opts
        hosts = list(o.hosts)
        n = self.world_size(hosts)
        if not self.enough(n):  # the user's input, before any launch: one line, exit 2
            raise ConfigError(f"the hostfile gives {n} ranks, below the minimum {self.minimum()}")
        first = replicas_of(self.cfg, n)
        self.event(
            "start",
            launcher=o.launcher,
            hosts=[h.name for h in hosts],
            np=n,
            max_restarts=o.max_restarts,
        )
        attempt = 0
        while True:
            plan = plan_batch(self.cfg, first, replicas_of(self.cfg, n))
            self.hosts = hosts
            argv = self.argv(attempt, hosts, n, plan)
            what = "launch" if attempt == 0 else f"restart {attempt} of {o.max_restarts}"
            say(f"{what}: {n} ranks on {', '.join(h.name for h in hosts)}; {plan.note}")
            self.event(
                "launch",
                attempt=attempt,
                np=n,
                hosts=[h.name for h in hosts],
                grad_accum=plan.grad_accum,
                microbatches=plan.microbatches,
                lr=plan.lr,
                global_batch=plan.global_batch,
                note=plan.note,
            )
            code = self.launch(argv)
            if self.stop_signal is not None:
                name = signal.Signals(self.stop_signal).name
                ended = "not started" if code is None else f"the job exited {code}"
                say(f"stopped by {name} ({ended}); not restarted")
                self.event("stopped", signal=name, exit_code=code)
                return code if code else 128 + self.stop_signal
            if code in NOT_RESTARTED:
                say(f"the job {NOT_RESTARTED[code]} (exit code {code})")
                self.event("end", exit_code=code, restarts=attempt)
                return code
            self.event("failure", attempt=attempt, exit_code=code)
            if attempt >= o.max_restarts:
                say(
                    f"the job failed (exit code {code}) and the restart budget of "
                    f"{o.max_restarts} is used up; {self._kept()}"
                )
                self.event("gave_up", reason="restart budget used up", exit_code=code)
                return code
            say(f"the job failed ({_exit_text(code)}): probing its hosts before a restart")
            t0 = time.monotonic()
            problems = probe(hosts, o.probe_port, o.probe_timeout, o.agent)
            lost = {name: why for name, why in problems.items() if why is not None}
            for name, why in lost.items():
                say(f"host {name} is lost: {why}")
            hosts = [h for h in hosts if h.name not in lost]
            n = self.world_size(hosts)
            self.event(
                "probe", seconds=time.monotonic() - t0, lost=lost, hosts=[h.name for h in hosts]
            )
            if not self.enough(n):
                say(
                    f"the job failed (exit code {code}); the hosts that still answer "
                    f"({', '.join(h.name for h in hosts) or 'none'}) give {n} ranks, below "
                    f"the minimum {self.minimum()}; {self._kept()}"
                )
                self.event("gave_up", reason="too few ranks", np=n, exit_code=code)
                return code
            # the failed attempt has ended: its marker (a lost node's rank 0 left it
            # fresh) must not refuse the restart
            run_marker.clear(o.run_dir)
            attempt += 1


def _exit_text(code: int | None) -> str:
    """'exit code 137, SIGKILL': a launcher reports a rank killed by a signal as 128 + it."""
    if code is None:
        return "not started"
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"exit code {code}, {signal.Signals(code - 128).name}"
    return f"exit code {code}"


STEP_NAME = "hpctrain-elastic"  # srun --job-name of each attempt's step


def _steps_named(name: str = STEP_NAME) -> list[str]:
    """This allocation's job steps named `name` (JOBID.STEPID), from squeue."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return []
    try:
        done = subprocess.run(
            ["squeue", "--steps", f"--jobs={job}", "--noheader", "--format=%i %j"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = (line.split() for line in done.stdout.splitlines())
    return [row[0] for row in rows if len(row) == 2 and row[1] == name]


def _in_background(argv: list[str]) -> subprocess.Popen:
    """`argv` running on its own, its output dropped; a thread reaps it when it ends."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    threading.Thread(target=proc.wait, daemon=True, name="reap").start()
    return proc


def _die_with_parent() -> None:
    """In the launcher, before it starts (Linux): SIGTERM when the supervisor dies, so a
    killed supervisor leaves no job running outside its process group."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
