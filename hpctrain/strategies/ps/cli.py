"""`hpctrain ps --config FILE`: train with parameter servers (sets `strategy`).

    mpirun -np 4 hpctrain ps --config configs/demo.yaml --set ps.servers=1 --set ps.mode=async

is the same as `hpctrain train` with `strategy: parameter_server` in the config.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> dict:
    from ...cli import _add_config_args, _config_help

    p = subparsers.add_parser(
        "ps",
        help="train with parameter servers (the last ps.servers ranks serve)",
        description="Parameter-server training over MPI: the last ps.servers ranks hold the "
        "parameters and the optimizer, the other ranks compute gradients. ps.mode: sync "
        "(equal to data-parallel SGD), async, or bounded (stale gradients scaled by "
        "1/(1+decay*s), rejected beyond ps.staleness_bound).",
        epilog=_config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(p)
    p.add_argument("--run-dir", metavar="DIR", help="output directory")
    p.add_argument("--verbose", "-v", action="store_true", help="log from every rank")
    p.add_argument(
        "--resume",
        metavar="auto|never|FILE",
        help="continue from a checkpoint (a parameter-server or data-parallel one): 'auto' "
        "takes the newest valid one in the checkpoint directory, FILE that one "
        "(default: checkpoint.resume)",
    )
    return {"ps": _cmd_ps}


def _cmd_ps(args) -> int:
    from ...cli import _load_config_everywhere
    from .runner import ParameterServerRunner

    args.overrides = [*args.overrides, "strategy=parameter_server"]
    cfg = _load_config_everywhere(args)
    ParameterServerRunner(cfg, run_dir=args.run_dir, verbose=args.verbose, resume=args.resume).fit()
    return 0
