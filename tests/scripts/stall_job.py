"""Watchdog stall jobs: MODE=startup (rank 1 late by SKIP_DELAY seconds to a barrier
during start-up, under STARTUP_TIMEOUT, then as late to one after it), MODE=skip (rank SKIP_RANK never enters a barrier: it sleeps, or
with SKIP_HOW=stop stops itself, STOP_AFTER seconds in) or MODE=normal
(many quick collectives; a rank stopped inside a collective: stall_train.py); with
OWN_DEADLINE, the skipped wait has a deadline of its own (a checkpoint write's). TIMEOUT,
STALL_WARNING and REPORT_DIR set the watchdog; the deadline and the warning apply only
after the warm-up, to the collectives the tests measure, so that a slow start on a
loaded machine cannot trip them."""

import os
import signal
import sys
import time

import numpy as np

from hpctrain.runtime import run_fail_together, world


def main():
    w = world()  # the defaults (600 s, warning at 60 s) while the ranks start
    if os.environ.get("REPORT_DIR"):
        w.set_report_dir(os.environ["REPORT_DIR"])
    mode = os.environ.get("MODE", "normal")
    buf = np.ones(1024, dtype=np.float64)
    w.allreduce_inplace(buf, what="warm-up allreduce")
    world(collective_timeout=float(os.environ.get("TIMEOUT", "5")))  # from here on
    w.set_stall_warning(float(os.environ.get("STALL_WARNING", "60")))
    if mode == "startup":
        w.begin_startup(float(os.environ["STARTUP_TIMEOUT"]))  # as a run's start does
        late_barrier(w, "start-up barrier")
        w.end_startup()  # as a run's first step does
        late_barrier(w, "test barrier")
    elif mode == "skip":
        if w.rank == int(os.environ.get("SKIP_RANK", "1")):
            if os.environ.get("SKIP_HOW") == "stop":  # stopped (SIGSTOP), not merely busy,
                time.sleep(float(os.environ.get("STOP_AFTER", "0")))  # after a while alive
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(120)
            return
        if os.environ.get("OWN_DEADLINE"):  # a wait with a deadline of its own
            limit = float(os.environ["OWN_DEADLINE"])
            w.agree(None, timeout=limit, what="test write wait (checkpoint.write_timeout)")
        else:
            w.barrier("test barrier")
    else:
        for _ in range(int(os.environ.get("STEPS", "300"))):
            buf[:] = 1
            w.allreduce_inplace(buf, what="gradient allreduce")
            w.barrier("step barrier")
        if w.rank == 0:
            print(f"normal run finished: {buf[0]:g}")


def late_barrier(w, what):
    if w.rank == 1:
        time.sleep(float(os.environ["SKIP_DELAY"]))
    w.barrier(what)
    if w.rank == 0:
        print(f"{what} passed", flush=True)


sys.exit(run_fail_together(main))
