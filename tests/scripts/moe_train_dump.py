"""Train an MoE model, then check replicas and dump the full (all-expert) weights.

usage: moe_train_dump.py OUT.npz [--run-dir DIR] [--resume auto|FILE] [--set key=value ...]
Dense parameters must be identical on every rank (allreduce MIN = MAX of checksums);
each expert lives on one rank, so rank 0 gathers them under their global names and
writes every tensor (pickle-free npz), which is comparable across world sizes.
`... --next OUT2.npz [--run-dir DIR] [--set key=value ...]`: one more run after it in the
same processes (one launch for several runs; each run's Trainer reseeds the process, as
in train_dump.py).
"""

import sys

import numpy as np
import step_reads
from run_list import split_runs

from hpctrain import Config, Trainer
from hpctrain.moe.parallel import gather_expert_weights, is_expert_param
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
    weights = trainer.strategy.backend.get_weights()
    w = trainer.world
    dense = [v for k, v in weights.items() if not is_expert_param(k)]
    sums = np.array([np.float64(v.astype(np.float64).sum()) for v in dense])
    lo = w.allreduce_array(sums, "min", "replica checksum min")
    hi = w.allreduce_array(sums, "max", "replica checksum max")
    if not np.array_equal(lo, hi):
        raise SystemExit(f"{out}: dense replicas differ after training")
    full = gather_expert_weights(weights, trainer.strategy.groups.experts)
    if w.rank == 0:
        np.savez(out, **full)
        n_exp = sum(is_expert_param(k) for k in full)
        sys.stdout.write(  # one write: a log line could land between text and newline
            f"DENSE REPLICAS IDENTICAL over {w.size} rank(s); "
            f"{n_exp} expert tensors gathered: {out}\n"
        )
        sys.stdout.flush()


def main():
    step_reads.watch()
    for argv in split_runs(sys.argv[1:]):
        run_one(argv)


sys.exit(run_fail_together(main))
