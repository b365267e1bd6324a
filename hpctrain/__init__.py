"""hpctrain: an MPI-launched training suite for HPC clusters.

    from hpctrain import Config, TrainingLoop
    TrainingLoop(Config.load("configs/demo.yaml")).fit()

Importing hpctrain starts neither MPI nor any framework; `TrainingLoop` does, when
created. `Trainer` is the same class under its earlier name. The package itself imports
nothing but its version: the console script (entry.py) guards everything after it.
"""

from .version import __version__


def __getattr__(name):
    if name == "Config":
        from .config import Config

        return Config
    if name in ("TrainingLoop", "Trainer"):
        from .loop import TrainingLoop

        return TrainingLoop
    raise AttributeError(name)


__all__ = ["Config", "Trainer", "TrainingLoop", "__version__"]
