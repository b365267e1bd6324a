"""The worked configurations in configs/, one per strategy, do what their comments say.

Each file's header names its launch line: a real `mpirun -np N hpctrain ...` command
for this very file, whose options the CLI accepts. Every CPU config trains under real
mpirun at that rank count, all four in one launch (tests/scripts/train_configs.py: the
same Config.load and TrainingLoop as `hpctrain train`), briefly, on small data: it
shows the metrics its comments promise, its startup line follows the run directory's
(as the README says), and it asks for nothing that does nothing. Each also renders with
its SLURM template at 2 nodes x 2 tasks. The GPU config cannot run here: it must
validate as it is and, apart from the device and its engine, on CPU ranks.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from mpirun import HPCTRAIN, PYTHON, ROOT, mpirun

from hpctrain.config import Config

CONFIGS = ROOT / "configs"
SCRIPT = str(ROOT / "tests" / "scripts" / "train_configs.py")
DEMOS = ("demo.yaml", "demo-tf.yaml")  # trained to their accuracy by test_trainer_jobs.py
NP = 4  # every CPU worked config is written for 4 ranks (its header says so)
STEPS = 3
COMMON = [f"train.max_steps={STEPS}", "metrics.tensorboard=false", "train.log_every=1"]

# file: (strategy, {metrics.jsonl event: a key its comments promise}, small-data overrides)
# and the SLURM template that runs it (slurm/README.md names them)
CPU = {
    "pipeline.yaml": (
        "pipeline",
        {"step": "stage_busy_sec", "summary": "bubble_fraction"},
        ["data.train_samples=512", "data.val_samples=64"],
    ),
    "ps.yaml": (
        "parameter_server",
        {"ps_server": "pushes_per_sec", "ps_worker": "samples_per_sec"},
        ["data.train_samples=1024", "data.val_samples=128"],
    ),
    "moe.yaml": (
        "data_parallel",
        {"step": "moe_load"},
        ["data.train_samples=256", "data.val_samples=32"],
    ),
    "transformer-tp-zero.yaml": (
        "data_parallel",
        {"step": "zero_model_optimizer_bytes"},
        # the config's model, shorter sequences: bf16 is slow on CPUs without bf16 units
        ["data.train_samples=256", "data.val_samples=32", "data.seq_len=16", "train.batch_size=8"],
    ),
}
TEMPLATES = {
    "pipeline.yaml": "pipeline",
    "ps.yaml": "ps",
    "moe.yaml": "moe",
    "transformer-tp-zero.yaml": "train",
}
# how the startup line (the one after the run directory's, README "A first run") begins
STARTS = {
    "pipeline": "pipeline:",
    "parameter_server": "parameter server",
    "data_parallel": "data parallel:",
}
GPU = "gpu.yaml"
GPU_ON_CPU = ["runtime.device=cpu", "train.allreduce=gloo"]


def _launch_line(name: str) -> list[str]:
    """The header's launch command: the first comment line that runs `mpirun -np`."""
    for line in (CONFIGS / name).read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("mpirun -np "):
            return shlex.split(text)
    raise AssertionError(f"configs/{name}: no `mpirun -np N hpctrain ...` line in its header")


def test_every_config_file_is_a_demo_or_a_worked_config_tested_here():
    files = {p.name for p in CONFIGS.glob("*.yaml")}
    assert files == {*DEMOS, *CPU, GPU}, files


def test_the_bench_trains_every_cpu_config_to_its_end_with_its_own_launch_line(monkeypatch):
    """benchmarks/sections/configs.py reads each header's launch line (the figures the
    headers quote come from its report)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.sections import configs

    assert {f"{n}.yaml" for n in configs.CONFIGS} == {*DEMOS, *CPU}
    for name in configs.CONFIGS:
        line, ranks, sub = configs.launch_line(name)
        assert line.endswith(f"--config configs/{name}.yaml") and sub in ("train", "ps")
        assert ranks == (2 if f"{name}.yaml" in DEMOS else NP), line


@pytest.mark.parametrize("name", [*CPU, GPU])
def test_the_header_launch_line_is_a_real_command_for_this_file(name):
    from hpctrain.cli import build_parser

    words = _launch_line(name)
    np_ = int(words[words.index("-np") + 1])
    tail = next(i for i, w in enumerate(words) if Path(w).name == "hpctrain")
    try:
        args = build_parser().parse_args(words[tail + 1 :])
    except SystemExit:
        pytest.fail(f"configs/{name}: hpctrain refuses its launch line {shlex.join(words)}")
    assert args.command in ("train", "ps"), words
    assert args.config == f"configs/{name}", words
    if name in CPU:
        assert np_ == NP, f"configs/{name} is launched on {np_} ranks; the test trains it on {NP}"
    cfg = Config.load(ROOT / args.config, args.overrides)
    assert cfg["strategy"] == CPU.get(name, ("data_parallel",))[0]


@pytest.mark.parametrize("name", [*DEMOS, *CPU, GPU])
def test_every_config_file_says_what_it_is_and_validates_as_it_is(name):
    text = (CONFIGS / name).read_text()
    assert text.startswith("# "), f"configs/{name}: no header comment"
    Config.load(CONFIGS / name)


def test_the_gpu_config_validates_on_cpu_ranks_apart_from_its_device():
    raw = yaml.safe_load((CONFIGS / GPU).read_text())
    assert raw["runtime"]["device"] == "cuda" and raw["train"]["allreduce"] == "nccl"
    assert raw["model"]["name"] == "transformer" and raw["train"]["precision"] == "bf16"
    args = [HPCTRAIN, "config", "--config", f"configs/{GPU}"]
    for override in GPU_ON_CPU:
        args += ["--set", override]
    job = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    resolved = yaml.safe_load(job.stdout)
    assert resolved["runtime"]["device"] == "cpu" and resolved["train"]["precision"] == "bf16"


@pytest.mark.parametrize("name", list(CPU))
def test_each_cpu_config_renders_with_its_slurm_template_for_its_ranks(name, tmp_path):
    """2 nodes x 2 tasks: the template's own checks (strategy, experts over the expert
    groups, world size a multiple of the stages or the tensor groups) pass."""
    out = tmp_path / "job.sbatch"
    args = [HPCTRAIN, "slurm", "render", TEMPLATES[name], "--config", f"configs/{name}"]
    args += ["--nodes", "2", "--ntasks-per-node", str(NP // 2), "--time", "30", "-o", str(out)]
    job = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    command = "ps" if CPU[name][0] == "parameter_server" else "train"
    assert f'"$HPCTRAIN" {command} --config' in out.read_text()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{config file: (summary, metrics records, run dir)} of one launch training all four."""
    where = tmp_path_factory.mktemp("worked")
    args = [SCRIPT]
    for name, (_, _, small) in CPU.items():
        args += ["--next"] if len(args) > 1 else []
        args += [f"configs/{name}", str(where / name.removesuffix(".yaml"))]
        for override in [*COMMON, *small]:
            args += ["--set", override]
    job = mpirun(NP, PYTHON, *args, timeout=240)
    assert job.returncode == 0, job.output
    info = re.findall(r"\[rank 0/\d+\] INFO (.*)$", job.output, re.M)
    noop = re.findall(r"^.*\bdo(?:es)? nothing\b.*$", job.output, re.M)
    assert not noop, f"a worked config asks for what does nothing: {noop}"
    results = {}
    for name in CPU:
        said = re.search(rf"^CONFIG TRAINED configs/{re.escape(name)} (.*)$", job.output, re.M)
        assert said, f"{name} did not finish:\n{job.output}"
        run = where / name.removesuffix(".yaml")
        records = [json.loads(x) for x in (run / "metrics.jsonl").open()]
        first = info.index(f"run directory {run}")
        results[name] = json.loads(said.group(1)), records, run, info[first + 1]
    return results


@pytest.mark.parametrize("name", list(CPU))
def test_each_cpu_config_trains_at_its_rank_count(trained, name):
    strategy, metrics, _ = CPU[name]
    summary, records, run, startup = trained[name]
    assert startup.startswith(STARTS[strategy]), startup  # after the run directory's line
    assert summary["steps"] == STEPS and summary["world_size"] == NP, summary
    assert summary["strategy"] == strategy, summary
    losses = [r["loss"] for r in records if r["event"] == "step"]
    assert losses and all(math.isfinite(x) for x in losses), losses
    for event, key in metrics.items():
        assert any(key in r for r in records if r["event"] == event), (event, key, records)
    assert list((run / "checkpoints").glob("ckpt-*.h5")), f"{name}: no checkpoint written"
