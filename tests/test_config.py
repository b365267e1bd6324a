"""Config validation names every offending key; overrides parse like YAML."""

import re
import sys
from types import SimpleNamespace

import pytest

from hpctrain.config import Config, parse_override
from hpctrain.errors import ConfigError
from hpctrain.lr_schedule import lr_at


def test_defaults_validate_and_overrides_apply(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend: tensorflow\ntrain:\n  batch_size: 32\n")
    cfg = Config.load(path, ["train.batch_size=16", "optimizer.lr=1e-4", "model.hidden=[8, 4]"])
    assert cfg.backend == "tensorflow"
    assert cfg.train["batch_size"] == 16 and cfg.optimizer["lr"] == 1e-4
    assert cfg.model["hidden"] == [8, 4]


def test_all_problems_are_reported_together_naming_each_key():
    with pytest.raises(ConfigError) as err:
        Config.load(
            None,
            [
                "train.epochs=0",
                "train.bogus=1",
                "optimizer.lr_scaling=cubic",
                "train.clip_norm=-1",
                "model.hidden=[]",
                "train.batch_size=true",
            ],
        )
    text = str(err.value)
    for fragment in (
        "train.epochs: must be >= 1",
        "train.bogus: unknown key",
        "optimizer.lr_scaling: 'cubic' is not one of none, linear, sqrt",
        "train.clip_norm: must be > 0",
        "model.hidden: expected a non-empty list",
        "train.batch_size: expected int, got bool",
    ):
        assert fragment in text


def test_model_and_task_must_fit():
    with pytest.raises(ConfigError, match="data.task: model cnn needs data.task images"):
        Config.load(None, ["model.name=cnn"])
    with pytest.raises(ConfigError, match="model.n_heads: d_model=10 is not divisible"):
        Config.load(
            None,
            ["model.name=transformer", "data.task=tokens", "model.d_model=10", "model.n_heads=4"],
        )


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        Config.load(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Config.load(bad)
    # an HDF5 file given by tab completion, a Latin-1 comment: one line, not a traceback
    binary = tmp_path / "data.h5"
    binary.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    with pytest.raises(ConfigError, match="data.h5: not a UTF-8 text file"):
        Config.load(binary)
    # a second section of the same name dropped the first's settings silently
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  epochs: 2\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="duplicate key 'train'"):
        Config.load(twice)
    # a list as a key was a TypeError traceback on every rank
    listed = tmp_path / "listed.yaml"
    listed.write_text("? [1, 2]\n: 3\n")
    with pytest.raises(ConfigError, match=r"a key must be a plain value, got \[1, 2\]"):
        Config.load(listed)
    with pytest.raises(ConfigError, match="a key must be a plain value"):
        Config.load(None, ["train.batch_size={[1]: 2}"])


def test_yaml_merge_keys_work_and_a_key_of_the_mapping_overrides_a_merged_one(tmp_path):
    """`<<:` was refused as 'could not determine a constructor' (the duplicate check built
    the merge key before PyYAML merged it)."""
    merged = tmp_path / "merged.yaml"
    merged.write_text("train: {<<: {epochs: 2, batch_size: 16}, epochs: 3}\n")
    cfg = Config.load(merged)
    assert (cfg.train["epochs"], cfg.train["batch_size"]) == (3, 16)
    merged.write_text("train: {epochs: 2, epochs: 3}\n")  # still a duplicate
    with pytest.raises(ConfigError, match="duplicate key 'epochs'"):
        Config.load(merged)


def test_override_parsing():
    assert parse_override("a.b=1e-3") == (["a", "b"], 1e-3)
    assert parse_override("x=null") == (["x"], None)
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_override("novalue")


def test_lr_warmup_scaling_and_cosine():
    o = {"lr": 0.1, "lr_scaling": "linear", "warmup_epochs": 1, "schedule": "cosine"}
    assert lr_at(0, o, 4, 10, 100) == pytest.approx(0.1)
    assert lr_at(5, o, 4, 10, 100) == pytest.approx(0.25)
    assert lr_at(10, o, 4, 10, 100) == pytest.approx(0.4)
    assert lr_at(100, o, 4, 10, 100) == pytest.approx(0.0, abs=1e-12)
    o.update(lr_scaling="sqrt", warmup_epochs=0, schedule="constant")
    assert lr_at(7, o, 4, 10, 100) == pytest.approx(0.2)


def test_tensor_parallelism_composes_with_the_pipeline_and_names_what_it_does_not():
    tp = ["model.name=transformer", "data.task=tokens", "parallel.tensor=2"]
    cfg = Config.load(None, [*tp, "strategy=pipeline"])  # data x pipe x tensor
    assert cfg.parallel["tensor"] == 2 and cfg.strategy == "pipeline"
    with pytest.raises(ConfigError) as err:
        Config.load(None, [*tp, "strategy=parameter_server", "train.allreduce=horovod"])
    text = str(err.value)
    assert "under strategy data_parallel or pipeline on the mpi, gloo or nccl engine" in text
    assert "strategy parameter_server" in text and "train.allreduce=horovod" in text
    with pytest.raises(ConfigError, match="model.n_heads=3 and model.d_ff=63 must be divisible"):
        Config.load(
            None, [*tp, "strategy=pipeline", "model.d_model=33", "model.n_heads=3", "model.d_ff=63"]
        )


def test_zero3_is_refused_under_the_pipeline_and_for_what_tensorflow_cannot_shard():
    """ZeRO-3 shards parameters under data parallelism only, the pipeline strategy is
    refused saying what it does shard; the tensorflow backend shards the zoo's models
    (experts included) and refuses a Keras model, saying what to use."""
    cfg = Config.load(None, ["train.zero=3", "train.zero_unit_mb=0.5"])
    assert cfg.train["zero"] == 3 and cfg.train["zero_prefetch"] is True
    assert Config.load(None, ["train.zero=3", "backend=tensorflow"]).train["zero"] == 3
    with pytest.raises(ConfigError, match="a Keras model's layers own their variables"):
        Config.load(None, ["train.zero=3", "backend=tensorflow", "model.name=my.module:build"])
    moe = ["model.name=transformer", "data.task=tokens", "model.moe.experts=2"]
    assert Config.load(None, ["train.zero=3", "backend=tensorflow", *moe]).train["zero"] == 3
    with pytest.raises(ConfigError, match="train.zero=3: the pipeline shards with ZeRO-1") as err:
        Config.load(None, ["train.zero=3", "strategy=pipeline"])
    assert "DeepSpeed" in str(err.value)
    with pytest.raises(ConfigError, match="zero_unit_mb"):
        Config.load(None, ["train.zero=3", "train.zero_unit_mb=0"])
    with pytest.raises(ConfigError, match="train.zero"):
        Config.load(None, ["train.zero=4"])


def test_offload_is_refused_on_cpu_ranks_and_outside_gpu_zero_with_the_reason(monkeypatch):
    from hpctrain.config import Config
    from hpctrain.errors import ConfigError

    assert Config.load(None, ["train.zero=3"]).train["offload"] == "none"
    cpu = ["runtime.device=cpu", "train.zero=3"]
    with pytest.raises(ConfigError, match=r"train.offload=optimizer: .*host memory al"):
        Config.load(None, [*cpu, "train.offload=optimizer"])
    with pytest.raises(ConfigError, match=r"optimizer\+params: .*train.zero=2 keeps whole"):
        Config.load(None, ["runtime.device=cuda", "train.zero=2", "train.offload=optimizer+params"])
    with pytest.raises(ConfigError, match=r"optimizer\+params: .*host memory al"):
        Config.load(None, [*cpu, "train.offload=optimizer+params"])
    gpu = ["runtime.device=cuda", "train.offload=optimizer"]
    with pytest.raises(ConfigError, match="not with train.zero=0"):
        Config.load(None, gpu)
    with pytest.raises(ConfigError, match="not with train.allreduce=mpi"):
        Config.load(None, [*gpu, "train.zero=2", "train.allreduce=mpi"])
    monkeypatch.setenv("HPCTRAIN_GPU_UNTESTED", "1")  # ZeRO on GPU ranks: see test_devices
    for stage in (1, 2, 3):
        assert Config.load(None, [*gpu, f"train.zero={stage}"]).train["offload"] == "optimizer"
    both = ["runtime.device=cuda", "train.zero=3", "train.offload=optimizer+params"]
    assert Config.load(None, both).train["offload"] == "optimizer+params"


@pytest.mark.parametrize(
    "partition,expected",
    [
        ("foo", "pipeline.partition: 'foo' is not one of parameters, time or a list"),
        ("[1,-2]", "every stage needs at least one layer, got [1, -2]"),
        ("[1,2,3]", "3 entries for pipeline.stages=2"),
    ],
)
def test_a_pipeline_partition_wrong_whatever_the_model_is_found_at_config_load(partition, expected):
    """`hpctrain config` passed these; only the launched job refused them."""
    with pytest.raises(ConfigError, match=re.escape(expected)):
        Config.load(
            None, ["strategy=pipeline", "pipeline.stages=2", f"pipeline.partition={partition}"]
        )
    Config.load(None, ["pipeline.partition=foo"])  # not a pipeline: not its business


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["pipeline.partition=[1,1]"], "[1, 1] sums to 2 layers but the model has 3"),
        (["pipeline.stages=4", "model.hidden=[8]"], "pipeline.stages=4 is more than the model's 2"),
        (["pipeline.stages=6", "model.name=cnn", "data.task=images"], "the model's 5 layers"),
    ],
)
def test_a_pipeline_cut_the_models_layers_cannot_take_is_found_at_config_load(overrides, expected):
    """Only a launched job refused these: the zoo model's layers on generated data are
    known from the config alone."""
    with pytest.raises(ConfigError, match=re.escape(expected)):
        Config.load(None, ["strategy=pipeline", *overrides])
    hdf5 = ["data.source=hdf5", "data.path=/nonexistent.h5"]  # its layers: once read
    Config.load(None, ["strategy=pipeline", *overrides, *hdf5])


def test_the_pipeline_refuses_grad_accum_at_config_load():
    """It accumulates over its micro-batches; train.grad_accum would do nothing."""
    with pytest.raises(ConfigError, match="accumulates over pipeline.microbatches"):
        Config.load(None, ["strategy=pipeline", "train.grad_accum=2"])


@pytest.mark.parametrize("engine", ["auto", "horovod", "gloo", "mpi"])
def test_the_pipeline_refuses_exchange_settings_its_stages_would_ignore(engine):
    """Its stages average dense float32 gradients with a flat allreduce on every engine:
    fp16 compression and hierarchical allreduce would be accepted and do nothing."""
    pipe = ["strategy=pipeline", f"train.allreduce={engine}"]
    with pytest.raises(ConfigError, match="train.compression=fp16: the pipeline's stages"):
        Config.load(None, [*pipe, "train.compression=fp16"])
    with pytest.raises(ConfigError, match="train.hierarchical: the pipeline's stages"):
        Config.load(None, [*pipe, "train.hierarchical=true"])
    Config.load(None, pipe)


@pytest.mark.parametrize("engine", ["overlap", "horovod"])
def test_local_sgd_on_another_engine_is_refused_at_config_load(engine):
    """`hpctrain config` and `slurm render` refuse what the job would refuse at start."""
    with pytest.raises(ConfigError, match=f"local SGD runs on the MPI engine .*not {engine}"):
        Config.load(None, ["train.sync_every=4", f"train.allreduce={engine}"])
    Config.load(None, ["train.sync_every=4", "train.allreduce=mpi"])


def test_a_problem_from_a_set_override_names_the_override_not_the_file(tmp_path):
    """A --set typo is not looked for in the YAML file: each problem says where it came
    from, all of them still listed together."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  bogus: 1\n  epochs: 2\n")
    with pytest.raises(ConfigError) as err:
        Config.load(path, ["train.epoch=3", "optimizer.lr=-1"])
    text = str(err.value)
    assert text.startswith(f"invalid configuration ({path}):\n")
    assert (
        "train.epoch: unknown key (from --set train.epoch=3; did you mean train.epochs? known here: "
        in text
    )
    assert "optimizer.lr: must be > 0, got -1 (from --set optimizer.lr=-1)" in text
    bogus = next(line for line in text.splitlines() if "train.bogus" in line)
    assert bogus == "  train.bogus: unknown key (known here: " + bogus.split("here: ")[1]
    with pytest.raises(ConfigError, match=r"train.epochz: unknown key \(from --set train="):
        Config.load(None, ["train={epochz: 1}"])  # a whole section set
    with pytest.raises(ConfigError, match=r"must be >= 1, got 0 \(from --set train.epochs=0\)"):
        Config.load(None).replace(["train.epochs=0"])
    with pytest.raises(ConfigError) as err:  # a clash of two overrides names both
        Config.load(None, ["train.zero=2", "train.compression=topk"])
    assert "(from --set train.zero=2, --set train.compression=topk)" in str(err.value)


def test_the_parameter_server_refuses_what_it_cannot_do_at_config_load():
    """Refused by `hpctrain config` and before any rank starts, not after MPI started."""
    from hpctrain.strategies.ps.runner import config_problems

    assert Config.load("configs/ps.yaml").strategy == "parameter_server"
    assert Config.load(None, ["train.clip_norm=1.0"]).train["clip_norm"] == 1.0
    for override, says in (
        ("train.clip_norm=1.0", "train.clip_norm=1.0: the parameter server does not clip"),
        ("train.compression=fp16", "train.compression=fp16: gradients travel as float32"),
        ("data.source=benchmark", "data.source=benchmark: not with the parameter server"),
        ("model.name=my.module:build", "the parameter server trains zoo models only"),
        ("ps.backends=[torch, jax]", "ps.backends: 'jax' is not one of torch, tensorflow"),
    ):
        with pytest.raises(ConfigError) as err:
            Config.load("configs/ps.yaml", [override])
        assert says in str(err.value) and f"(from --set {override})" in str(err.value)
    cfg = Config.load("configs/ps.yaml", ["ps.servers=1"])
    assert config_problems(cfg, 3) is None  # the world size's rule stays at start
    assert config_problems(cfg, 1).startswith("ps.servers=1 leaves no worker in a job of 1")


def test_a_bare_yaml_argument_is_pointed_to_config(capsys):
    from hpctrain.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["config", "configs/demo.yaml"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: configs/demo.yaml (give a configuration file as " in err


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ["-c", "configs/pipeline.yaml", "--np", "3"],
            "needs a multiple of 2 ranks (2, 4, 6, ...); --np 3 gives 3",
        ),
        (["-c", "configs/ps.yaml", "--np", "1"], "ps.servers=1 leaves no worker: --np 1 gives 1"),
        (["--set", "data.train_samples=100", "--np", "4"], "do not fill one global batch of 256"),
        (["--np", "0"], "--np 0: expected a number of ranks, 1 or more"),
    ],
)
def test_config_with_np_checks_that_many_ranks_can_run_it(args, says, capsys):
    """What a job refuses at start for its world size, found before it queues."""
    from hpctrain.cli import main

    assert main(["config", *args]) == 2
    captured = capsys.readouterr()
    assert says in captured.err and captured.out == "", captured.err
    assert main(["config", "-c", "configs/pipeline.yaml", "--np", "4"]) == 0
    assert "strategy: pipeline" in capsys.readouterr().out


def test_config_says_what_this_host_cannot_check_and_checks_a_user_models_options(
    tmp_path, monkeypatch, capsys
):
    """`hpctrain config` passed a missing data file, a model module that does not import
    and an option the model's function does not take, all of which the run refuses."""
    from hpctrain.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # the module imported goes
    monkeypatch.setattr(sys, "path", list(sys.path))  # with the directory put there
    (tmp_path / "cfg_check_models.py").write_text("def build(hidden=3, classes=2):\n    pass\n")
    hdf5 = ["--set", "data.source=hdf5", "--set", "data.path=missing.h5"]
    assert main(["config", *hdf5, "--np", "2"]) == 0
    err = capsys.readouterr().err
    assert "note: not checked on this host: data.path missing.h5: no such file here" in err
    assert "--np 2: whether the training split fills a global batch" in err
    assert main(["config", "--set", "model.name=nomod:build"]) == 0
    assert "cannot import 'nomod'" in capsys.readouterr().err
    assert (
        main(["config", "--set", "model.name=cfg_check_models:build", "--set", "model.widht=3"])
        == 2
    )
    assert "build has no parameter for model.widht" in capsys.readouterr().err
    assert (
        main(["config", "--set", "model.name=cfg_check_models:build", "--set", "model.hidden=4"])
        == 0
    )
    assert capsys.readouterr().err == ""


def test_a_rank_given_another_configuration_than_rank_zeros_says_what_differs():
    """loop.agree_on_config: rank 0's values broadcast, each rank names what differs
    (ranks launched with different --set went on to an MPI_ERR_TRUNCATE traceback)."""
    from hpctrain.loop import agree_on_config

    class RankOne:
        is_root = False

        def __init__(self, root):
            self.root, self.said = root, "not called"

        def bcast_object(self, obj, what=""):
            return self.root

        def agree(self, error, error_type=None):
            self.said = error

    zero = Config.load(None, ["model.hidden=[64]"])
    same = RankOne(zero.to_dict())
    agree_on_config(same, Config.load(None, ["model.hidden=[64]"]))
    assert same.said is None
    other = RankOne(zero.to_dict())
    agree_on_config(other, Config.load(None, ["model.hidden=[32]", "train.epochs=7"]))
    assert other.said.startswith("another configuration than rank 0's (model.hidden: [64]")
    assert "train.epochs: " in other.said and "7 here" in other.said


def test_seeds_beyond_what_torch_takes_are_refused_when_the_config_loads():
    """train.seed above 2^63 failed in torch.manual_seed after the run had started."""
    with pytest.raises(ConfigError, match="train.seed: expected 0 to"):
        Config.load(None, ["train.seed=99999999999999999999"])
    assert Config.load(None, ["train.seed=4611686018427387904"]).train["seed"] == 2**62


@pytest.mark.parametrize(
    "override, said",
    [
        # each failed after the run started: an IndexError at the first compressed step,
        # a ctypes overflow setting the threads; momentum 1.5 diverged without a word
        ("compression.ratio=1.5", "compression.ratio: must be <= 1, got 1.5"),
        ("runtime.threads=10000000000000000000000", "runtime.threads: must be <= 4096"),
        ("optimizer.momentum=1", "optimizer.momentum: must be < 1, got 1"),
    ],
)
def test_values_past_a_keys_upper_bound_are_refused(override, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        Config.load(None, [override])


@pytest.mark.parametrize(
    "override, said",
    [
        ("runtime.collective_timeout=0.001", "runtime.collective_timeout: must be >= 1"),
        ("runtime.stall_warning=0.5", "runtime.stall_warning: expected 0 (never) or at least 1"),
    ],
)
def test_watchdog_deadlines_below_its_poll_are_refused(override, said):
    """The monitor looks once a second: a 1 ms deadline ended healthy jobs blaming MPI."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        Config.load(None, [override])
    assert Config.load(None, ["runtime.collective_timeout=1", "runtime.stall_warning=0"])


def test_horovod_settings_that_would_do_nothing_are_refused_or_named(tmp_path):
    """A timeline Horovod cannot open was its C++ error line and a run without it; on
    another engine the horovod.* keys did nothing without a word (the run warns now)."""
    from hpctrain.backends.horovod_env import keys_set

    for path, says in (
        (tmp_path / "no" / "tl.json", "its directory does not exist"),
        (tmp_path, "is a directory"),
    ):
        with pytest.raises(ConfigError, match=f"horovod.timeline: {path} {says}"):
            Config.load(None, [f"horovod.timeline={path}"])
    # Horovod truncates the file it is given: a typo cost a user's file
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match="notes.txt exists and is not a Horovod timeline"):
        Config.load(None, [f"horovod.timeline={tmp_path / 'notes.txt'}"])
    (tmp_path / "earlier.json").write_text('[\n{"name": "process_name", "ph": "M"},\n')
    Config.load(None, [f"horovod.timeline={tmp_path / 'earlier.json'}"])  # its own: rewritten
    cfg = Config.load(None, [f"horovod.timeline={tmp_path / 'tl.json'}", "horovod.cycle_time_ms=5"])
    assert keys_set(cfg.horovod) == [
        "horovod.cycle_time_ms=5",
        f"horovod.timeline={tmp_path / 'tl.json'}",
    ]
    assert keys_set(Config.load(None).horovod) == []


def test_experts_past_the_bound_and_in_no_block_are_refused():
    """100,000 experts hung the start for minutes in silence; `every` past n_layers
    trained a dense model without a word."""
    lm = ["model.name=transformer", "data.task=tokens"]
    with pytest.raises(ConfigError, match="model.moe.experts: at most 65536, got 100000"):
        Config.load(None, [*lm, "model.moe={experts: 100000}"])
    with pytest.raises(ConfigError, match=r"model.moe.every=3 puts experts in no block of the 2"):
        Config.load(None, [*lm, "model.n_layers=2", "model.moe={every: 3}"])
    assert Config.load(None, [*lm, "model.n_layers=2", "model.moe={every: 2}"])


def test_yaml_1_2_has_no_dates():
    """`checkpoint.resume=2024-01-01` (a file of that name) was read as a date and refused
    as 'expected str, got date'; PyYAML's own SafeLoader is left as it is."""
    import datetime

    import yaml

    from hpctrain.config import _yaml_load

    assert _yaml_load("a: 2024-01-01") == {"a": "2024-01-01"}
    assert isinstance(yaml.safe_load("a: 2024-01-01")["a"], datetime.date)


@pytest.mark.parametrize(
    "text,value",
    [
        ("017", 17),
        ("0o17", 15),
        ("-0o7", -7),
        ("0x1f", 31),
        ("1_000", 1000),
        ("09", 9),
        ("1:30", "1:30"),
        ("1e-4", 1e-4),
        ("yes", True),
    ],
)
def test_yaml_numbers_are_yaml_1_2s(text, value):
    """PyYAML (YAML 1.1) read `seed: 017` as 15 and `1:30` as 90, silently, and
    refused `0o17` as a string."""
    from hpctrain.config import _yaml_load

    got = _yaml_load(f"a: {text}")["a"]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["!!int abc", "!!float abc"])
def test_a_yaml_tag_on_a_value_it_cannot_be_is_one_line(tmp_path, text):
    """A ValueError traceback from PyYAML's constructors."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"train:\n  seed: {text}\n")
    with pytest.raises(ConfigError, match="'abc' is not an? "):
        Config.load(bad)


@pytest.mark.parametrize("moe", ["{experts: 4}", "{}"])
def test_an_empty_moe_mapping_is_moe_with_its_defaults_everywhere(moe):
    """`model.moe={}` built MoE blocks (every option at its default) while the checks
    and the strategies read it as off: a run failed at start asking for an expert group
    it had, and the refusals below let it through."""
    base = ["model.name=transformer", "data.task=tokens", f"model.moe={moe}"]
    with pytest.raises(ConfigError, match="model.checkpoint_activations: not with model.moe"):
        Config.load(None, [*base, "model.checkpoint_activations=true"])
    with pytest.raises(ConfigError, match="train.sync_every"):
        Config.load(None, [*base, "train.sync_every=2"])
    recorded = Config.load(None, base).recorded()["model"]
    assert recorded["moe"]["experts"] == 4 and recorded["moe"]["top_k"] == 2
    dense = Config.load(None, base[:2]).recorded()["model"]
    assert "moe" not in dense and dense["d_model"] == 64  # off: left out, not null


def test_hpctrain_ps_refuses_a_configuration_that_asks_for_another_layout(tmp_path):
    """`hpctrain ps --config configs/pipeline.yaml` trained a parameter server without a
    word; a plain (data-parallel) configuration is still made the server's."""
    from hpctrain.cli import _refuse_another_strategy_for_ps

    said = "configs/pipeline.yaml sets strategy: pipeline: run it with hpctrain train"
    with pytest.raises(ConfigError, match=said):  # before the run: agreed, said once
        _refuse_another_strategy_for_ps(
            SimpleNamespace(config="configs/pipeline.yaml", overrides=[])
        )
    binary = tmp_path / "not-utf8.yaml"  # no crash: Config.load says what it is, agreed
    binary.write_bytes(b"\xff\xfe strategy: pipeline")
    _refuse_another_strategy_for_ps(SimpleNamespace(config=str(binary), overrides=[]))
    with pytest.raises(ConfigError, match="--set strategy: pipeline"):
        _refuse_another_strategy_for_ps(
            SimpleNamespace(config=None, overrides=["strategy=pipeline"])
        )
    for config, sets in (
        ("configs/pipeline.yaml", ["strategy=parameter_server"]),
        ("configs/moe.yaml", []),
    ):
        _refuse_another_strategy_for_ps(SimpleNamespace(config=config, overrides=sets))


def test_mpi_start_settings_are_read_from_a_configuration_that_fails():
    """A rank whose configuration is refused still starts MPI with the TCP settings its
    peers read from the same file and --set (hpctrain/cli.py's agreed refusal)."""
    import tempfile

    from hpctrain.config import mpi_start_settings

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write("runtime:\n  tcp_links: 4\n  mpi_yield_when_idle: false\ntrain:\n  zero: x\n")
        f.flush()
        assert mpi_start_settings(f.name, ["train.zero=banana"]) == (False, 4)
        assert mpi_start_settings(f.name, ["runtime.tcp_links=3", "bad"]) == (False, 3)
        # the invalid value is what failed here: the peers have the file's
        assert mpi_start_settings(f.name, ["runtime.tcp_links=0"]) == (False, 4)
        assert mpi_start_settings(f.name, ["runtime=[1]", "runtime.tcp_links=4.0"]) == (False, 4)
        assert mpi_start_settings(f.name, ["runtime={tcp_links: 3}"]) == (True, 3)
    assert mpi_start_settings("/nonexistent.yaml", ["runtime.tcp_links=0"]) == (True, 2)
    assert mpi_start_settings(None, ["runtime=[1]", "runtime.tcp_links=x"]) == (True, 2)
