"""What both parameter-server workers (torch_worker.py, tensorflow_worker.py) do at
start: seed this rank's process, then build the model of their framework."""

from __future__ import annotations


class WorkerBase:
    """Subclasses give `prepare_process(threads, deterministic, seed)` and
    `build(model_cfg, inp, seed, groups)` of their framework."""

    name = "base"

    def __init__(self, cfg, inp, threads: int, rank: int = 0, groups=None):
        seed = cfg.train["seed"]
        self.prepare_process(threads, cfg.train["deterministic"], seed + rank)
        self.build(cfg.model, inp, seed, groups)

    def prepare_process(self, threads: int, deterministic: bool, seed: int) -> None:
        raise NotImplementedError

    def build(self, model_cfg: dict, inp, seed: int, groups) -> None:
        raise NotImplementedError
