"""A real training job in which rank STOP_RANK stops itself (SIGSTOP) once training
reaches step 5; the others wait for it in the gradient allreduce. With SUSPEND (seconds)
instead, a process outside the job stops every rank at step 5 and resumes them that much
later, as `scontrol suspend` and `scontrol resume` do: the job must finish.

usage: stall_train.py RUN_DIR [--set key=value ...]  (env: STOP_RANK, SUSPEND, TIMEOUT)

The run starts under the configured deadline (runtime.collective_timeout); TIMEOUT, when
set, replaces it once the trainer is built, so that only the training steps, where the
rank stops, run under a tight deadline and a slow start on a loaded machine cannot trip it.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from hpctrain import Config, Trainer
from hpctrain.runtime import run_fail_together, world
from hpctrain.runtime.faults import Faults


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    w = world()
    w.set_report_dir(args.run_dir)  # what the training loop does (one line in loop.py)
    # suspended: rank 0 sleeps 20 ms a step, so the run is still training when its
    # suspending thread, which looks every 5 ms, sees step 5
    faults = Faults(step_sleep=(0, 0.02)) if os.environ.get("SUSPEND") else Faults.none()
    trainer = Trainer(Config.load(None, args.overrides), run_dir=args.run_dir, faults=faults)
    if os.environ.get("TIMEOUT"):
        world(collective_timeout=float(os.environ["TIMEOUT"]))  # the gradient allreduce's
    if os.environ.get("SUSPEND"):
        pids = w.allgather_object(os.getpid(), "pids")
        if w.rank == 0:
            threading.Thread(target=suspend_at_step_5, args=(trainer, pids), daemon=True).start()
    elif w.rank == int(os.environ.get("STOP_RANK", "1")):

        def stop_at_step_5():
            while trainer.state.step < 5:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGSTOP)

        threading.Thread(target=stop_at_step_5, daemon=True).start()
    trainer.fit()


def suspend_at_step_5(trainer, pids):
    while trainer.state.step < 5:
        time.sleep(0.005)
    ids = " ".join(map(str, pids))
    # the SUSPEND seconds count from when every rank is stopped: on a loaded machine the
    # stops below arrived a second or more after a plain `sleep` began (a 6 s suspension
    # was then under the 5 s beyond a poll that clock.py calls a pause)
    stopped = f'for p in {ids}; do until grep -qs "^State:.*stopped" /proc/$p/status '
    stopped += "|| [ ! -e /proc/$p ]; do sleep 0.01; done; done"
    script = f"{stopped}; sleep {os.environ['SUSPEND']}; kill -CONT {ids}"
    subprocess.Popen(["sh", "-c", script], start_new_session=True)  # resumes them
    for pid in sorted(pids, key=lambda p: p == os.getpid()):  # this rank last
        os.kill(pid, signal.SIGSTOP)


sys.exit(run_fail_together(main))
