"""hpctrain: an MPI-launched training suite for HPC clusters.

    from hpctrain import Config, Trainer
    Trainer(Config.load("configs/demo.yaml")).fit()

Importing hpctrain starts neither MPI nor any framework; `Trainer` does, when created.
"""

from .config import Config
from .version import __version__


def __getattr__(name):
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(name)


__all__ = ["Config", "Trainer", "__version__"]
