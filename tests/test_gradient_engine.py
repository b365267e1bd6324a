"""`train.allreduce: auto` picks MPI only when no core is left for Horovod's engine."""

import importlib.util

import pytest

from hpctrain.backends.gradient_engine import choose
from hpctrain.config import Config
from hpctrain.errors import ConfigError

# auto and an explicit horovod look for Horovod (a missing one means mpi, or a refusal:
# test_missing_framework.py); make test installs it, a torch-only venv may not
needs_horovod = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None, reason="Horovod is not installed here"
)


def _cfg(**train):
    cfg = Config.load(None)
    cfg.train.update(train)
    return cfg


def test_auto_uses_mpi_when_ranks_times_threads_fill_the_cores():
    assert choose(_cfg(), local_ranks=2, threads=1, cores=2)[0] == "mpi"
    assert choose(_cfg(), local_ranks=4, threads=1, cores=2)[0] == "mpi"  # oversubscribed
    assert choose(_cfg(), local_ranks=1, threads=8, cores=8)[0] == "mpi"


@needs_horovod
def test_auto_uses_horovod_with_a_spare_core_whatever_fp16():
    engine, why = choose(_cfg(), local_ranks=2, threads=1, cores=4)
    assert engine == "horovod" and "2 spare core(s)" in why
    # fp16 runs on either engine: Horovod's Compression.fp16 or the MPI engine's 16-bit ring.
    assert choose(_cfg(compression="fp16"), local_ranks=2, threads=1, cores=4)[0] == "horovod"
    assert choose(_cfg(compression="fp16"), local_ranks=2, threads=1, cores=2)[0] == "mpi"


def test_auto_keeps_fp16_precision_off_horovod_which_refuses_it():
    """fp16 loss scaling steps the optimizer itself: Horovod's wrapper exchanged the
    gradients a second time (and warned), so an explicit horovod is refused and auto,
    with a spare core, picks the MPI engine."""
    engine, why = choose(_cfg(precision="fp16"), local_ranks=1, threads=1, cores=4)
    assert engine == "mpi" and "fp16 loss scaling" in why, why


@needs_horovod
def test_explicit_choice_wins():
    assert choose(_cfg(allreduce="horovod"), local_ranks=2, threads=1, cores=2)[0] == "horovod"
    assert choose(_cfg(allreduce="mpi"), local_ranks=1, threads=1, cores=64)[0] == "mpi"
    assert choose(_cfg(allreduce="mpi", compression="bf16"), local_ranks=2, threads=1)[0] == "mpi"


def test_overlap_is_chosen_explicitly_and_refuses_compression():
    assert choose(_cfg(allreduce="overlap"), local_ranks=2, threads=1, cores=2)[0] == "overlap"
    with pytest.raises(ConfigError, match="train.allreduce=overlap sends dense float32"):
        Config.load(None, ["train.allreduce=overlap", "train.compression=topk"])


def test_compression_beyond_fp16_needs_an_mpi_engine():
    with pytest.raises(ConfigError, match="Horovod compresses only to fp16"):
        Config.load(None, ["train.allreduce=horovod", "train.compression=topk"])
    engine, why = choose(_cfg(compression="powersgd"), local_ranks=1, threads=1, cores=8)
    assert engine == "mpi" and "powersgd" in why


def test_without_horovod_auto_uses_mpi_and_an_explicit_horovod_is_refused(monkeypatch):
    """A torch-only install (or OMP_NUM_THREADS=1 leaving a spare core): auto picked
    Horovod and the run died on a ModuleNotFoundError traceback."""
    import builtins

    real_import = builtins.__import__

    def no_horovod(name, *args, **kwargs):
        if name == "horovod" or name.startswith("horovod."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_horovod)
    monkeypatch.setattr("importlib.import_module", lambda name, *a: no_horovod(name))
    engine, why = choose(_cfg(), local_ranks=2, threads=1, cores=4)
    assert engine == "mpi" and why.startswith("auto: Horovod for torch is not installed here")
    assert choose(_cfg(), local_ranks=2, threads=1, cores=2)[0] == "mpi"  # full: not asked
    with pytest.raises(ConfigError, match="train.allreduce=horovod: Horovod for torch is not"):
        choose(_cfg(allreduce="horovod"), local_ranks=2, threads=1, cores=2)


@pytest.mark.parametrize("engine", ["overlap", "horovod"])
def test_the_advice_names_only_engines_the_backend_runs(engine):
    """TensorFlow was sent to gloo or nccl, which it refuses (torch's process groups)."""
    overrides = [f"train.allreduce={engine}", "train.compression=topk"]
    with pytest.raises(ConfigError) as tf:
        Config.load(None, ["backend=tensorflow", *overrides])
    assert "train.allreduce=mpi" in str(tf.value)
    assert "gloo" not in str(tf.value) and "nccl" not in str(tf.value)
    with pytest.raises(ConfigError, match="gloo"):
        Config.load(None, overrides)
