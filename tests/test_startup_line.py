"""The startup line says what is on, truthfully, and a no-op setting is warned about.

The line states the strategy, the grid, the ZeRO stage and the axis it shards over,
precision, compression and the gradient engine with the reason it was chosen, naming
only the features that are on; a setting this layout makes a no-op (ZeRO over one
replica, compression with nothing to exchange, ...) gets a warning; the parameter
server's grid is its workers and servers; a language model's validation counts
sequences as `val_samples` and tokens as `val_tokens`.
"""

import json
import re
from types import SimpleNamespace

import pytest
from dump_runs import TINY_TRANSFORMER
from mpirun import PYTHON, ROOT, mpirun

from hpctrain.backends.gradient_engine import choose
from hpctrain.config import Config
from hpctrain.runtime.grid import GridShape
from hpctrain.strategies.startup import noop_warnings, settings_text

SCRIPT = str(ROOT / "tests" / "scripts" / "startup_runs.py")
SMALL = [
    "data.train_samples=512",
    "data.val_samples=64",
    "train.batch_size=32",
    "train.max_steps=2",
    "metrics.tensorboard=false",
]
TRANSFORMER = TINY_TRANSFORMER
RUNS = {  # one np=2 launch; the parameter server first (its servers start no framework)
    "ps": ["strategy=parameter_server"],
    "plain": [],
    "zero1": ["train.zero=1"],
    "tp-zero": [*TRANSFORMER, "parallel.tensor=2", "train.zero=1", "train.precision=bf16"],
}


def _cfg(train=None, parallel=None, **sections) -> Config:
    cfg = Config.load(None)
    cfg.train.update(train or {})
    cfg.parallel.update(parallel or {})
    for name, values in sections.items():
        cfg[name].update(values)
    return cfg


# --- the engine's reason names exactly the features that are on -------------------------
@pytest.mark.parametrize(
    "train,parallel,reason",
    [
        ({"zero": 1}, {}, "auto: ZeRO-1 runs on the MPI engine"),
        (
            {"zero": 2},
            {"tensor": 2},
            "auto: ZeRO-2 and tensor parallelism (parallel.tensor=2) run on the MPI engine",
        ),
        ({"hierarchical": True}, {}, "auto: hierarchical allreduce runs on the MPI engine"),
        (
            {"hierarchical": True, "sync_every": 4},
            {},
            "auto: hierarchical allreduce and local SGD (train.sync_every=4) run on the MPI engine",
        ),
        ({}, {"tensor": 2}, "auto: tensor parallelism (parallel.tensor=2) runs on the MPI engine"),
    ],
)
def test_the_engine_reason_names_only_the_features_that_are_on(train, parallel, reason):
    engine, why = choose(_cfg(train, parallel), local_ranks=1, threads=1, cores=64)
    assert (engine, why) == ("mpi", reason)


def test_gpu_ranks_keep_their_own_reasons():
    assert choose(_cfg(), 1, 1, cores=64, device="cuda")[0] == "nccl"
    engine, why = choose(_cfg(), 2, 1, cores=64, device="cuda", gpu_shared=True)
    assert engine == "mpi" and "share a GPU" in why
    # ZeRO runs on a process group's buffers: Gloo stages them through the host
    engine, why = choose(_cfg({"zero": 2}), 2, 1, cores=64, device="cuda", gpu_shared=True)
    assert engine == "gloo" and "share a GPU" in why
    # a GPU pipeline's links are a process group's: NCCL's, or Gloo's on a shared GPU
    pipeline = Config.load("configs/pipeline.yaml")
    engine, why = choose(pipeline, 2, 1, cores=64, device="cuda", gpu_shared=True)
    assert engine == "gloo" and "share a GPU" in why
    assert choose(pipeline, 2, 1, cores=64, device="cuda") == (
        "nccl",
        "auto: GPU stages exchange on the device with NCCL",
    )


# --- the settings and the no-op warnings, without MPI -----------------------------------
class _World:
    def __init__(self, size, nodes=1):
        self.size = size
        self.layout = type("Layout", (), {"nodes": nodes})()


class _Grid:
    def __init__(self, size, **degrees):
        self.shape, problem = GridShape.infer(size, **degrees)
        assert problem is None

    def describe(self):
        return self.shape.describe()


def test_settings_state_zero_with_its_axis_precision_and_compression():
    assert settings_text(_cfg()) == "ZeRO off, precision fp32, compression none"
    text = settings_text(_cfg({"zero": 2, "precision": "bf16"}), "data", 4)
    assert text == (
        "ZeRO-2 shards the optimizer state and gradients over data (4 ranks), "
        "precision bf16 (float32 master weights), compression none"
    )
    text = settings_text(_cfg({"compression": "topk"}, compression={"ratio": 0.01}))
    assert text.endswith("compression topk (ratio 0.01, error feedback)")
    assert settings_text(_cfg({"compression": "powersgd"})).endswith(
        "compression powersgd (rank 4, error feedback)"
    )
    # only the lossy compressors warm up dense: the 16-bit exchange starts at step 0
    text = settings_text(_cfg({"compression": "topk"}, compression={"warmup_steps": 100}))
    assert text.endswith("(ratio 0.1, error feedback, dense for the first 100 steps)")
    fp16 = _cfg({"compression": "fp16"}, compression={"warmup_steps": 100})
    assert settings_text(fp16).endswith("compression fp16")
    (said,) = noop_warnings(fp16, _World(2), _Grid(2), 2, "", "mpi")
    assert said.startswith("compression.warmup_steps=100 does nothing with train.compression=fp16")


def test_settings_that_do_nothing_in_the_layout_are_named():
    # np=1: compression, hierarchical allreduce and local SGD have nothing to exchange
    cfg = _cfg({"compression": "topk", "sync_every": 4})
    (said,) = noop_warnings(cfg, _World(1), _Grid(1), 1, "", "mpi")
    assert said.startswith("train.compression=topk and train.sync_every=4 (local SGD) do nothing")
    assert "1 rank makes one data-parallel replica" in said and "launch 2 ranks" in said
    # hierarchical allreduce on one node, or with one rank per node
    (said,) = noop_warnings(_cfg({"hierarchical": True}), _World(2), _Grid(2), 2, "", "mpi")
    assert said.startswith("train.hierarchical does nothing here: all ranks run on one node")
    (said,) = noop_warnings(
        _cfg({"hierarchical": True}), _World(2, nodes=2), _Grid(2), 2, "", "mpi"
    )
    assert "every node runs one rank" in said
    assert (
        noop_warnings(_cfg({"hierarchical": True}), _World(4, nodes=2), _Grid(4), 4, "", "mpi")
        == []
    )
    # parallel.expert without experts
    (said,) = noop_warnings(
        _cfg(parallel={"expert": 2}), _World(2), _Grid(2, expert=2), 2, "", "mpi"
    )
    assert said.startswith("parallel.expert=2 does nothing: model mlp has no mixture-of-experts")
    # Horovod's knobs where another engine averages (data parallel and pipeline alike)
    cfg = _cfg(horovod={"fusion_threshold_mb": 32})
    (said,) = noop_warnings(cfg, _World(2), _Grid(2), 2, "", "gloo")
    assert said == (
        "horovod.fusion_threshold_mb=32: the gradients are averaged by gloo, not Horovod: "
        "this does nothing"
    )
    assert noop_warnings(cfg, _World(2), _Grid(2), 2, "", "horovod") == []
    # the parameter server: no allreduce at all
    from hpctrain.strategies.ps.runner import ParameterServer

    cfg = _cfg({"hierarchical": True}, horovod={"cycle_time_ms": 5.0}, ps={"backends": None})
    server = SimpleNamespace(cfg=cfg, n_workers=2, n_servers=1)
    (said,) = ParameterServer.layout_warnings(server)
    assert said.startswith(
        "train.hierarchical and horovod.cycle_time_ms=5.0 do nothing with the parameter server"
    )
    # what is on and has work to do is not warned about
    cfg = _cfg({"zero": 1, "compression": "none"}, parallel={"tensor": 2})
    assert noop_warnings(cfg, _World(4), _Grid(4, tensor=2), 2, "parallel.tensor=2", "mpi") == []


# --- the lines of real runs (one launch) ------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    where = tmp_path_factory.mktemp("startup")
    args, dirs = [SCRIPT], {}
    for name, overrides in RUNS.items():
        args += ["--next"] if len(args) > 1 else []
        dirs[name] = where / name
        args.append(str(dirs[name]))
        for o in [*SMALL, *overrides]:
            args += ["--set", o]
    job = mpirun(2, PYTHON, *args, timeout=300)
    assert job.returncode == 0, job.output
    out, start = {}, 0
    for name in RUNS:  # each run's log, up to the line its end prints
        end = job.output.index(f"RUN DONE {dirs[name]}\n", start)
        text = job.output[start:end]
        (line,) = [x for x in text.splitlines() if f"run dir {dirs[name]}" in x]
        warnings = [x.split(" WARNING ", 1)[1] for x in text.splitlines() if " WARNING " in x]
        metrics = [json.loads(x) for x in (dirs[name] / "metrics.jsonl").open()]
        out[name] = line.split(" INFO ", 1)[1], warnings, metrics
        start = end
    return out


def test_plain_data_parallel_says_zero_off_fp32_no_compression(runs):
    line, warnings, _ = runs["plain"]
    # the device and why (runtime.device auto), then the engine
    device = r"on (cpu|cuda:\d+) \(auto: [^)]*\), "
    assert re.match(f"data parallel: torch backend, model mlp, {device}gradients by ", line), line
    engine_reason = re.search(r"gradients by \w+ \((.*?)\), global batch 64, ", line)
    assert engine_reason, line
    for off in ("ZeRO", "tensor", "hierarchical", "local SGD"):
        assert off not in engine_reason.group(1), line  # the reason names nothing that is off
    assert ", ZeRO off, precision fp32, compression none, 2 rank(s) x " in line, line
    assert "grid data 2 x expert 1 x pipe 1 x tensor 1, " in line, line
    assert warnings == []


def test_zero_1_over_data_names_its_stage_axis_and_ranks(runs):
    line, warnings, _ = runs["zero1"]
    assert "gradients by mpi (auto: ZeRO-1 runs on the MPI engine), global batch 64, " in line
    assert "ZeRO-1 shards the optimizer state over data (2 ranks), precision fp32, " in line
    assert warnings == []


def test_zero_with_tensor_2_at_np_2_shards_nothing_and_says_so(runs):
    line, warnings, _ = runs["tp-zero"]
    assert (
        "gradients by mpi (auto: ZeRO-1 and tensor parallelism (parallel.tensor=2) run on the "
        "MPI engine)"
    ) in line, line
    assert "ZeRO-1 shards the optimizer state over data (1 rank), precision bf16" in line, line
    assert "grid data 1 x expert 1 x pipe 1 x tensor 2, " in line, line
    assert warnings == [
        "train.zero=1 shards nothing: 2 ranks with parallel.tensor=2 make one data-parallel "
        "replica (grid data 1 x expert 1 x pipe 1 x tensor 2), so every rank keeps all the "
        "optimizer state; launch 4 ranks or more (a multiple of 2) to shard it, or set "
        "train.zero=0"
    ]


def test_the_parameter_server_grid_is_its_workers_and_servers(runs):
    line, warnings, _ = runs["ps"]
    assert line.startswith("parameter server (sync): 1 server(s), 1 worker(s), "), line
    assert "gradients pushed to the servers as float32, ZeRO off, precision fp32" in line
    assert ", grid 1 worker(s) + 1 server(s), " in line and "grid data" not in line, line
    assert warnings == []


def test_a_language_model_counts_validation_sequences_and_tokens(runs):
    epoch = [x for x in runs["tp-zero"][2] if x["event"] == "epoch"][-1]
    assert epoch["val_samples"] == 64 and epoch["val_tokens"] == 64 * 16, epoch
    plain = [x for x in runs["plain"][2] if x["event"] == "epoch"][-1]
    assert plain["val_samples"] == 64 and "val_tokens" not in plain, plain
