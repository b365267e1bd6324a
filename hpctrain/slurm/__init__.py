"""SLURM support: sbatch templates that launch every rank with srun, and their renderer.

`hpctrain slurm render|submit` (cli.py) fills the templates in templates/ after
validating every value (templates.py; the GPU options and whether this install can use
GPUs at all: gpus.py). Preemption handling lives in the runtime layer
(hpctrain.runtime.preemption), because the trainer, not this package, reacts to it.
"""
