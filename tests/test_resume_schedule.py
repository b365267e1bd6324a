"""Resuming with another length says what it does to the lr schedule (issue 29, item 5).

A cosine's lr depends on its length: the README's `--set train.epochs=14 --resume auto`
after 12 epochs takes the lr from ~0 back up. optimizer.resume_schedule: stretch (the
default, as before) spreads the cosine over the new length and rank 0 warns with both
lrs; continue keeps the checkpoint's schedule and, past its end, its last lr.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest
from mpirun import HPCTRAIN, ROOT

from hpctrain.config import Config
from hpctrain.lr_schedule import Schedule, lr_at, resumed_schedule

# The README's demo: 65,536 samples, 128 per rank on 2 ranks, Adam at sqrt scaling,
# one warm-up epoch, 12 epochs then resumed with 14.
DEMO = {
    "lr": 0.001,
    "lr_scaling": "sqrt",
    "warmup_epochs": 1,
    "schedule": "cosine",
    "resume_schedule": "stretch",
}
SPE, REPLICAS = 65536 // 256, 2
OLD, NEW = 12 * SPE, 14 * SPE


def test_the_readme_resume_stretches_the_cosine_and_says_so():
    plan = resumed_schedule(DEMO, REPLICAS, SPE, NEW, OLD, OLD)
    before = lr_at(OLD - 1, DEMO, REPLICAS, SPE, OLD)  # the last step the 12 epochs ran
    after = lr_at(OLD, DEMO, REPLICAS, SPE, NEW)
    assert before < 1e-8 and after > 5e-5  # the jump the issue measured
    # behaviour unchanged: the lr of every step is the 14-epoch cosine's
    for step in (OLD, OLD + 50, NEW - 1):
        assert plan.schedule.lr(step, REPLICAS) == lr_at(step, DEMO, REPLICAS, SPE, NEW)
    assert plan.warn and plan.message is not None
    text = plan.message
    assert f"{before:.3g}" in text and f"{after:.3g}" in text, text
    assert f"spans {NEW} steps" in text and f"spanned {OLD}" in text, text
    assert "optimizer.resume_schedule=continue" in text, text


def test_continue_keeps_the_finished_schedule_and_its_final_lr():
    ocfg = {**DEMO, "resume_schedule": "continue"}
    plan = resumed_schedule(ocfg, REPLICAS, SPE, NEW, OLD, OLD)
    final = lr_at(OLD - 1, ocfg, REPLICAS, SPE, OLD)
    assert [plan.schedule.lr(s, REPLICAS) for s in (OLD, OLD + 50, NEW - 1)] == [final] * 3
    assert plan.schedule.length == OLD  # what the next checkpoint records
    assert not plan.warn and "continue" in plan.message and f"{final:.3g}" in plan.message
    # resumed mid-run, continue follows the saved cosine exactly until it ends
    mid = resumed_schedule(ocfg, REPLICAS, SPE, NEW, OLD // 2, OLD)
    for step in (OLD // 2, OLD - 1):
        assert mid.schedule.lr(step, REPLICAS) == lr_at(step, ocfg, REPLICAS, SPE, OLD)


@pytest.mark.parametrize(
    "ocfg,saved",
    [
        (DEMO, NEW),  # the same length
        (DEMO, None),  # a checkpoint that does not say (and a config that cannot tell)
        ({**DEMO, "schedule": "constant"}, OLD),  # no cosine: the length changes nothing
    ],
)
def test_nothing_is_said_when_the_lr_does_not_change(ocfg, saved):
    plan = resumed_schedule(ocfg, REPLICAS, SPE, NEW, OLD, saved)
    assert plan.message is None
    assert plan.schedule == Schedule(ocfg, SPE, NEW)


def test_the_key_is_in_the_schema_with_stretch_as_default():
    assert Config.load(None, []).optimizer["resume_schedule"] == "stretch"
    cfg = Config.load(None, ["optimizer.resume_schedule=continue"])
    assert cfg.optimizer["resume_schedule"] == "continue"


# --- real runs: a 2-epoch run resumed with 3 epochs -------------------------------------
SETS = [
    "data.train_samples=512",
    "data.val_samples=64",
    "train.batch_size=32",  # 16 steps per epoch on one process
    "model.hidden=[16]",
    "optimizer.name=adam",
    "optimizer.lr=0.01",
    "optimizer.schedule=cosine",
    "train.log_every=1",
    "metrics.tensorboard=false",
]
STEPS = 16


def _train(run, *sets, resume=None):
    cmd = [HPCTRAIN, "train", "--run-dir", str(run)]
    if resume:
        cmd += ["--resume", resume]
    for s in [*SETS, *sets]:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lrs = {}
    for line in (run / "metrics.jsonl").open():
        x = json.loads(line)
        if x["event"] == "step":
            lrs[x["step"]] = x["lr"]  # the lr of the step that ended at `step`
    return out, lrs


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    """The 2-epoch run both modes resume (trained once: a process start each costs)."""
    run = tmp_path_factory.mktemp("two-epochs") / "run"
    return run, _train(run, "train.epochs=2")[1]


@pytest.mark.parametrize("mode", ["stretch", "continue"])
def test_a_resume_with_more_epochs_follows_and_says_the_chosen_schedule(tmp_path, mode, two_epochs):
    run = tmp_path / "run"
    shutil.copytree(two_epochs[0], run)
    first = two_epochs[1]
    ocfg = Config.load(None, [*SETS, f"optimizer.resume_schedule={mode}"]).optimizer
    assert first[2 * STEPS] == pytest.approx(lr_at(2 * STEPS - 1, ocfg, 1, STEPS, 2 * STEPS))
    out, lrs = _train(run, "train.epochs=3", f"optimizer.resume_schedule={mode}", resume="auto")
    assert "lr schedule on resume" in out, out
    resumed = lrs[2 * STEPS + 1]  # the first step after the resume
    final = lr_at(2 * STEPS - 1, ocfg, 1, STEPS, 2 * STEPS)
    stretched = lr_at(2 * STEPS, ocfg, 1, STEPS, 3 * STEPS)
    assert stretched > 50 * final  # the jump this is about
    if mode == "stretch":
        assert resumed == pytest.approx(stretched)
        assert "warning" in out.lower() and f"{stretched:.3g}" in out, out
    else:
        assert resumed == pytest.approx(final)
        assert lrs[3 * STEPS] == pytest.approx(final)
        assert math.isclose(max(lrs[s] for s in lrs if s > 2 * STEPS), final, rel_tol=1e-9)


def test_a_checkpoint_written_before_the_length_was_recorded_takes_it_from_its_config():
    from types import SimpleNamespace

    from hpctrain.checkpoint.session import _saved_schedule_length

    def loop(*sets):
        cfg = Config.load(None, [*SETS, *sets])
        return SimpleNamespace(
            cfg=cfg, strategy=SimpleNamespace(steps_per_epoch=16, checkpoint_world=2)
        )

    old = Config.load(None, [*SETS, "train.epochs=12"]).to_yaml()
    ckpt = SimpleNamespace(trainer={"world_size": 2}, attrs={"config_yaml": old})
    assert _saved_schedule_length(ckpt, loop("train.epochs=14")) == 12 * 16
    capped = Config.load(None, [*SETS, "train.epochs=12", "train.max_steps=100"]).to_yaml()
    ckpt_capped = SimpleNamespace(trainer={"world_size": 2}, attrs={"config_yaml": capped})
    assert _saved_schedule_length(ckpt_capped, loop("train.epochs=14")) == 100
    # another batch size or world size: its steps per epoch are not these, so unknown
    assert _saved_schedule_length(ckpt, loop("train.batch_size=64")) is None
    ckpt_other_world = SimpleNamespace(trainer={"world_size": 4}, attrs={"config_yaml": old})
    assert _saved_schedule_length(ckpt_other_world, loop()) is None
    # recorded: taken as is
    ckpt_new = SimpleNamespace(trainer={"schedule_steps": 77}, attrs={})
    assert _saved_schedule_length(ckpt_new, loop()) == 77


def test_a_resume_on_other_replicas_says_when_the_scaled_peak_lr_moves(caplog):
    """The same global batch on 1 replica x grad_accum 2 instead of 2 replicas: with
    linear scaling the peak halves; rank 0 names the optimizer.lr that keeps it."""
    from types import SimpleNamespace

    from hpctrain.checkpoint.session import RunCheckpoints

    def loop(replicas):
        cfg = SimpleNamespace(optimizer={"lr": 0.05, "lr_scaling": "linear"})
        world = SimpleNamespace(is_root=True)
        return SimpleNamespace(cfg=cfg, world=world, strategy=SimpleNamespace(lr_replicas=replicas))

    for replicas, warned in ((1, True), (2, False)):
        caplog.clear()
        me = SimpleNamespace(trainer=loop(replicas), _saved_peak=0.1)
        with caplog.at_level("WARNING", logger="hpctrain"):
            RunCheckpoints._say_if_the_peak_moved(me)
        said = "peak lr of 0.1; this run's is 0.05" in caplog.text
        assert said == warned and (not warned or "--set optimizer.lr=0.1" in caplog.text)


def test_the_peak_lr_the_warning_names_silences_it(caplog):
    """The warning printed 6 digits (%g) and compared within 1e-9: the value it told the
    user to set (0.00141421) warned again, showing the same number twice."""
    import math
    import re
    from types import SimpleNamespace

    from hpctrain.checkpoint.session import RunCheckpoints

    def said_for(lr) -> str:
        cfg = SimpleNamespace(optimizer={"lr": lr, "lr_scaling": "sqrt"})
        loop = SimpleNamespace(
            cfg=cfg, world=SimpleNamespace(is_root=True), strategy=SimpleNamespace(lr_replicas=1)
        )
        caplog.clear()
        with caplog.at_level("WARNING", logger="hpctrain"):
            me = SimpleNamespace(trainer=loop, _saved_peak=0.001 * math.sqrt(2))  # 2 replicas
            RunCheckpoints._say_if_the_peak_moved(me)
        return caplog.text

    text = said_for(0.001)
    assert "peak lr of 0.001414214; this run's is 0.001" in text, text
    named = float(re.search(r"--set optimizer.lr=(\S+)", text).group(1))
    assert said_for(named) == ""
    assert said_for(0.00141421) == ""  # within 1e-5: the same peak
