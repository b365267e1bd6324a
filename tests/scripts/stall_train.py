"""A real training job in which rank STOP_RANK stops itself (SIGSTOP) once training
reaches step 5; the others wait for it in the gradient allreduce.

usage: stall_train.py RUN_DIR [--set key=value ...]  (env: STOP_RANK, TIMEOUT)

The run starts under the configured deadline (runtime.collective_timeout); TIMEOUT, when
set, replaces it once the trainer is built, so that only the training steps, where the
rank stops, run under a tight deadline and a slow start on a loaded machine cannot trip it.
"""

import argparse
import os
import signal
import sys
import threading
import time

from hpctrain import Config, Trainer
from hpctrain.runtime import run_fail_together, world


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    w = world()
    w.set_report_dir(args.run_dir)  # what the training loop does (one line in loop.py)
    trainer = Trainer(Config.load(None, args.overrides), run_dir=args.run_dir)
    if os.environ.get("TIMEOUT"):
        world(collective_timeout=float(os.environ["TIMEOUT"]))  # the gradient allreduce's
    if w.rank == int(os.environ.get("STOP_RANK", "1")):

        def stop_at_step_5():
            while trainer.state.step < 5:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGSTOP)

        threading.Thread(target=stop_at_step_5, daemon=True).start()
    trainer.fit()


sys.exit(run_fail_together(main))
