"""Bad input to `hpctrain data synth`, `hpctrain elastic` and `hpctrain slurm render` is
one line naming the option, exit status 2 and no traceback (and `data synth` writes no
file): seeds, class counts and sizes numpy or h5py tripped over, a request too large for
memory, an unbalanced quote in --mpirun-args/--rsh-agent, and empty paths for slurm's
--run-root/--log-dir/--results-dir/--output. `data synth --val 0` writes an empty
validation split that training reads."""

from __future__ import annotations

import h5py
import pytest

from hpctrain.cli import main as cli_main
from hpctrain.data.dataset import inspect_dataset

SMALL = ["--train", "64", "--val", "16"]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    """Exit status and everything printed; a crash (run_fail_together's FATAL) too."""
    try:
        code = cli_main(list(argv))
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _refused(capsys, argv: list[str], option: str) -> str:
    code, text = _cli(capsys, *argv)
    assert code == 2, text
    assert "Traceback" not in text and "FATAL" not in text, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "error: " in lines[0] and option in lines[0], text
    return lines[0]


@pytest.mark.parametrize(
    "extra, option, expected",
    [
        (["--seed", "-1"], "--seed -1", "from 0 to 18446744073709551615"),
        (["--seed", "99999999999999999999"], "--seed 99999999999999999999", "from 0 to"),
        (["--classes", "1"], "--classes 1", "2 or more"),
        (["--task", "images", "--classes", "1"], "--classes 1", "2 or more"),
        (["--train", str(10**12)], f"--train {10**12}", "of memory to generate"),
        (["--task", "tokens", "--vocab", "1"], "--vocab 1", "2 or more"),  # trained to 1.0
    ],
)
def test_data_synth_refuses_bad_numbers_before_writing(tmp_path, capsys, extra, option, expected):
    out = tmp_path / "d.h5"
    line = _refused(capsys, ["data", "synth", str(out), *SMALL, *extra], option)
    assert expected in line, line
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file


def test_data_synth_makes_no_directories(tmp_path, capsys):
    """A typo in the path made the whole tree (/nonexist/dir/) at the file system's root."""
    out = tmp_path / "nonexist" / "dir" / "d.h5"
    line = _refused(capsys, ["data", "synth", str(out), *SMALL], str(out))
    assert f"no directory {out.parent}: create it first" in line, line
    assert list(tmp_path.iterdir()) == []


def test_data_synth_val_0_writes_an_empty_validation_split(tmp_path, capsys):
    """--val 0 is a data set without validation (training skips evaluation); the largest
    seed the file's attribute holds is taken."""
    out = tmp_path / "d.h5"
    argv = ["data", "synth", str(out), "--train", "64", "--val", "0", "--seed", str(2**64 - 1)]
    code, text = _cli(capsys, *argv)
    assert code == 0, text
    assert "64 train + 0 val samples" in text
    with h5py.File(out) as f:
        assert f["val/x"].shape == (0, 32) and f["val/y"].shape == (0,)
        assert int(f.attrs["seed"]) == 2**64 - 1
    info = inspect_dataset(out)
    assert (info.train_size, info.val_size) == (64, 0)


def test_a_training_run_refuses_a_synthetic_task_too_big_to_generate(tmp_path, capsys):
    """The config's data.train_samples gets `data synth`'s memory check: 1e10 samples
    ran rank 0 out of memory while generating."""
    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run), "--set", f"data.train_samples={10**10}"]
    code, text = _cli(capsys, *argv)
    assert code == 2 and "Traceback" not in text, text
    assert f"data.train_samples {10**10} + data.val_samples" in text
    assert "of memory to generate" in text
    assert not run.exists()  # the refused run's directory is taken back


@pytest.mark.parametrize(
    "options, option",
    [
        (["--mpirun-args=--mca btl 'x"], "--mpirun-args"),
        (["--launcher", "srun", "--launcher-args=--mpi='pmix"], "--launcher-args"),
        (["--rsh-agent", "ssh -o 'x"], "--rsh-agent"),
        (['--mpirun-args=--mca plm_rsh_agent "ssh \'x"'], "--mpirun-args plm_rsh_agent"),
        (["--mpirun-args=--mca btl x\\"], "--mpirun-args"),
    ],
)
def test_elastic_refuses_launcher_arguments_it_cannot_split(tmp_path, capsys, options, option):
    argv = ["elastic", *options, "--", "train", "--run-dir", str(tmp_path / "run")]
    line = _refused(capsys, argv, option)
    assert "shell-quoted" in line, line


def test_slurm_render_refuses_empty_paths(tmp_path, capsys, monkeypatch):
    """--run-root '' rendered run_dir=''/<job name>-<job id>: the filesystem root."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  name: mlp\n")
    base = ["slurm", "render", "train", "--nodes", "1", "--ntasks-per-node", "2"]
    base += ["--time", "10", "--config", str(config)]
    for option in ("--run-root", "--log-dir", "--results-dir", "--output"):
        for value in ("", "  "):
            line = _refused(capsys, [*base, option, value], f"{option} {value!r}")
            assert "empty" in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.yaml"]
