"""Train with tensor parallelism, then dump the canonical (whole) weights for a test.

usage: tp_train_dump.py OUT.npz [--run-dir DIR] [--resume auto|FILE] [--set key=value ...]
Rank 0 writes the weights joined from every tensor rank's pieces (the checkpoint path:
strategy.export_state, a collective) and prints each rank's own parameter count.
"""

import sys

import numpy as np

from hpctrain import Config, Trainer
from hpctrain.runtime import run_fail_together


def main():
    out, args = sys.argv[1], sys.argv[2:]
    opts = {"--run-dir": out + ".run", "--resume": None}
    for flag in opts:
        if flag in args:
            i = args.index(flag)
            opts[flag] = args[i + 1]
            del args[i : i + 2]
    overrides = [a for a in args if a != "--set"]
    trainer = Trainer(
        Config.load(None, overrides), run_dir=opts["--run-dir"], resume=opts["--resume"]
    )
    trainer.fit()
    w = trainer.world
    holder = getattr(trainer.strategy, "backend", None) or trainer.strategy.stage  # pipeline
    local = sum(int(np.prod(v.shape)) for v in holder.get_weights().values())
    counts = w.gather_object(local, what="gather parameter counts")
    state = trainer.strategy.export_state()
    if w.rank == 0:
        weights = {k[len("model/") :]: v for k, v in state.items() if k.startswith("model/")}
        np.savez(out, **weights)
        print(f"TP DUMP over {w.size} rank(s): local parameters {counts}")


sys.exit(run_fail_together(main))
