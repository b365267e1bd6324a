"""Train with tensor parallelism (or any layout), then dump the canonical (whole) weights.

usage: tp_train_dump.py OUT.npz [--run-dir DIR] [--resume auto|FILE] [--set key=value ...]
         [--next OUT2.npz [--run-dir DIR] [--set key=value ...] ...]
Rank 0 writes the weights joined from every rank's pieces (the checkpoint path:
strategy.export_state, a collective) and prints each rank's own parameter count as
`TP DUMP OUT.npz over N rank(s): local parameters [...], tensor sums by X` (X: the
process group's backend the tensor-parallel activations were summed over, or mpi). `--next` trains one more run
after it in the same processes (one launch for several runs; each run's loop reseeds
the process and sets its own layer groups).
"""

import sys

import numpy as np
import step_reads
from run_list import split_runs

from hpctrain import Config, Trainer
from hpctrain.runtime import run_fail_together


def run_one(argv: list[str]) -> None:
    out, args = argv[0], argv[1:]
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
    step_reads.check(out)
    w = trainer.world
    holder = getattr(trainer.strategy, "backend", None) or trainer.strategy.stage  # pipeline
    local = sum(int(np.prod(v.shape)) for v in holder.get_weights().values())
    counts = w.gather_object(local, what="gather parameter counts")
    state = trainer.strategy.export_state()
    transport = getattr(getattr(holder, "groups", None), "tensor", None)
    transport = getattr(transport, "transport", None)  # the activations' device transport
    sums = transport.name if transport is not None else "mpi"
    if w.rank == 0:
        weights = {k[len("model/") :]: v for k, v in state.items() if k.startswith("model/")}
        np.savez(out, **weights)
        sys.stdout.write(
            f"TP DUMP {out} over {w.size} rank(s): local parameters {counts}, "
            f"tensor sums by {sums}\n"
        )
        sys.stdout.flush()


def main():
    step_reads.watch()
    for argv in split_runs(sys.argv[1:]):
        run_one(argv)


sys.exit(run_fail_together(main))
