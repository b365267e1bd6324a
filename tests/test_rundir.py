"""A run directory holds one run: reuse needs --resume (matching config), --overwrite or --new."""

import json
import os

import pytest
import yaml
from test_checkpoint_sharded import _state, _write_sharded

from hpctrain.checkpoint import verify
from hpctrain.checkpoint.format import MAGIC
from hpctrain.config import Config
from hpctrain.errors import ConfigError
from hpctrain.models.zoo import written_model
from hpctrain.rundir import (
    CHECKPOINT_OWNER,
    CONFIG_HEADER,
    apply_plan,
    claim_checkpoint_dir,
    config_differences,
    find_previous_run,
    keep_run_dir,
    plan_run_dir,
    remove_unused_run_dir,
)


@pytest.fixture(autouse=True)
def _forget_claims():
    """What a test's claims and run directories recorded is not the next test's."""
    yield
    keep_run_dir()


def _earlier_run(run_dir, cfg: dict, steps=(10, 20), metrics=3):
    """What a finished run leaves: config.yaml, checkpoints, metrics.jsonl, tb/."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(exist_ok=True)
    for s in steps:
        (ckpts / f"ckpt-{s:08d}.h5").write_bytes(MAGIC + b"x")  # pruned by its header
    with (run_dir / "metrics.jsonl").open("w") as f:
        for i in range(metrics):
            f.write(json.dumps({"event": "step", "step": i}) + "\n")
    (run_dir / "tb").mkdir(exist_ok=True)
    (run_dir / "tb" / "events.out.tfevents.1764400000.node1.123.0").write_bytes(b"e")
    (run_dir / "data").mkdir(exist_ok=True)
    (run_dir / "data" / "synthetic.h5").write_bytes(b"d")


def _cfg(*overrides) -> dict:
    return Config.load(None, list(overrides)).to_dict()


def test_an_empty_or_new_directory_starts_fresh(tmp_path):
    assert plan_run_dir(tmp_path / "new", _cfg()).action == "fresh"
    (tmp_path / "only-data" / "data").mkdir(parents=True)  # the synthetic cache alone
    assert plan_run_dir(tmp_path / "only-data", _cfg()).action == "fresh"
    assert plan_run_dir(tmp_path / "new", _cfg(), resume="auto").action == "fresh"


def test_a_reused_directory_is_refused_without_a_decision(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, _cfg())
    with pytest.raises(ConfigError) as err:
        plan_run_dir(run, _cfg())
    text = str(err.value)
    assert "\n" not in text
    assert "2 checkpoint(s) up to step 20" in text and "metrics.jsonl with 3 line(s)" in text
    assert "--resume auto" in text and "--overwrite" in text
    with pytest.raises(ConfigError):
        plan_run_dir(run, _cfg(), resume="never")


def test_metrics_without_checkpoints_still_count_as_a_run(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, _cfg(), steps=())
    with pytest.raises(ConfigError, match="metrics.jsonl with 3 line"):
        plan_run_dir(run, _cfg())


def test_resume_auto_continues_only_the_same_configuration(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, _cfg("model.hidden=[64]", "train.epochs=2"))
    # epochs, logging and speed knobs may change; what the checkpoint means may not
    same = _cfg("model.hidden=[64]", "train.epochs=5", "data.prefetch=0")
    assert plan_run_dir(run, same, resume="auto").action == "resume"
    with pytest.raises(ConfigError) as err:
        plan_run_dir(run, _cfg("model.hidden=[32]"), resume="auto")
    assert "model.hidden: [64] there, [32] now" in str(err.value)
    with pytest.raises(ConfigError, match="model.name: mlp there, cnn now"):
        plan_run_dir(run, _cfg("model.name=cnn", "data.task=images"), resume="auto")


def test_resume_auto_of_a_run_stopped_before_its_first_checkpoint_restarts(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, _cfg(), steps=())
    plan = plan_run_dir(run, _cfg(), resume="auto")
    assert plan.action == "fresh" and "without a checkpoint yet" in plan.message


def test_resume_auto_without_the_earlier_config_is_refused(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, _cfg())
    (run / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="no config.yaml"):
        plan_run_dir(run, _cfg(), resume="auto")


def test_an_explicit_checkpoint_file_is_the_users_choice(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, _cfg("model.hidden=[64]"))
    chosen = str(run / "checkpoints" / "ckpt-00000010.h5")
    plan = plan_run_dir(run, _cfg("model.hidden=[64]", "optimizer.lr=0.3"), resume=chosen)
    assert plan.action == "resume"


def test_resume_file_into_a_directory_holding_another_run_is_refused(tmp_path):
    """--resume FILE skipped the configuration check: keep_last then pruned the run
    already there (another model) as this run's, and its config.yaml was replaced."""
    run, other = tmp_path / "run", tmp_path / "other"
    _earlier_run(run, _cfg("model.hidden=[256, 256]"), steps=(1, 2, 3, 4))
    _earlier_run(other, _cfg("model.hidden=[64]"), steps=(6,))
    chosen = str(other / "checkpoints" / "ckpt-00000006.h5")
    with pytest.raises(ConfigError, match=r"with another configuration \(model.hidden: \[256"):
        plan_run_dir(run, _cfg("model.hidden=[64]"), resume=chosen)
    assert len(list((run / "checkpoints").iterdir())) == 4
    assert plan_run_dir(tmp_path / "fresh", _cfg("model.hidden=[64]"), resume=chosen).action == (
        "resume"
    )


def test_overwrite_clears_the_earlier_run_but_keeps_the_data_cache(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, _cfg())
    plan = plan_run_dir(run, _cfg("model.hidden=[8]"), overwrite=True)
    assert plan.action == "overwrite"
    apply_plan(plan)
    assert not find_previous_run(run).exists
    assert not list((run / "checkpoints").iterdir())
    assert (run / "data" / "synthetic.h5").exists()
    assert plan_run_dir(run, _cfg()).action == "fresh"


def test_new_moves_the_earlier_run_aside(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run, _cfg())
    plan = plan_run_dir(run, _cfg(), new=True)
    apply_plan(plan)
    kept = plan.archive_to
    assert kept.parent == run / "previous"
    assert sorted(p.name for p in kept.iterdir()) == [
        "ckpt-00000010.h5",
        "ckpt-00000020.h5",
        "config.yaml",
        "metrics.jsonl",
        "tb",
    ]
    assert not find_previous_run(run).exists


def test_contradictory_flags_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="contradict"):
        plan_run_dir(tmp_path, _cfg(), resume="auto", overwrite=True)
    with pytest.raises(ConfigError, match="contradict"):
        plan_run_dir(tmp_path, _cfg(), overwrite=True, new=True)


def test_a_checkpoint_directory_outside_the_run_directory_is_looked_at(tmp_path):
    run, ckpts = tmp_path / "run", tmp_path / "scratch" / "ckpts"
    ckpts.mkdir(parents=True)
    (ckpts / "ckpt-00000005.h5").write_bytes(MAGIC + b"x")
    with pytest.raises(ConfigError, match="1 checkpoint") as refused:
        plan_run_dir(run, _cfg(), checkpoint_dir=ckpts)
    # its advice says what --resume FILE alone does to them (it was "continue from one")
    assert "its own checkpoint.dir (--set checkpoint.dir=...) and --resume FILE" in str(
        refused.value
    )
    assert "keep_last prunes the rest" in str(refused.value)


def test_inferred_data_facts_do_not_count_as_a_difference():
    written = _cfg()
    written["data"]["inferred"] = {"classes": 3, "sample_shape": [20]}
    assert config_differences(written, _cfg()) == []


def test_options_a_checkpoint_resumes_across_do_not_count_as_a_difference():
    """`--resume auto` in the run's own directory refused turning activation
    checkpointing on or changing an MoE layer's routing settings, which the loader
    resumes across (checkpoint/model_match.py) and `--resume FILE` from elsewhere took;
    the experts' count still counts."""
    tf = ["model.name=transformer", "data.task=tokens"]
    assert config_differences(_cfg(*tf), _cfg(*tf, "model.checkpoint_activations=true")) == []
    tf.append("model.moe={experts: 4}")
    assert config_differences(_cfg(*tf), _cfg(*tf, "model.moe.aux_loss=0.05")) == []
    assert config_differences(_cfg(*tf), _cfg(*tf, "model.moe.capacity_factor=2.0")) == []
    assert config_differences(_cfg(*tf), _cfg(*tf, "model.moe.experts=8")) == [
        "model.moe.experts: 4 there, 8 now"
    ]


def test_a_zoo_models_defaults_count_whether_written_or_left_out():
    """A run recorded `model: {name: mlp}`; the same model with its default hidden sizes
    written out was refused a resume ("model.hidden: unset there, [128, 128] now"),
    and a default changed by a later version would have built another model unnoticed.
    config.yaml now records the defaults; either way of writing them compares equal."""
    bare = _cfg()
    written = _cfg("model.hidden=[128,128]")
    assert config_differences(bare, written) == []
    assert config_differences(bare, _cfg("model.hidden=[64]")) == [
        "model.hidden: [128, 128] there, [64] now"
    ]
    moe = ["model.name=transformer", "data.task=tokens"]
    assert (
        config_differences(_cfg(*moe, "model.moe={experts: 4}"), _cfg(*moe, "model.moe={}")) == []
    )
    assert written_model({"name": "pkg.mod:build", "width": 3}) == {
        "name": "pkg.mod:build",
        "width": 3,
    }


def test_new_and_overwrite_take_every_ranks_shards_with_their_checkpoint(tmp_path):
    """A sharded checkpoint is its commit file plus ckpt-<step>.shards/: moved together,
    the archived run still verifies; removed together, no rank's weights are left."""
    for flag in ("new", "overwrite"):
        run = tmp_path / flag
        _earlier_run(run, _cfg(), steps=())
        path = _write_sharded(run / "checkpoints", 10, _state(), 2)
        plan = plan_run_dir(run, _cfg(), **{flag: True})
        apply_plan(plan)
        assert not list((run / "checkpoints").iterdir())
        if flag == "new":
            kept = plan.archive_to / path.name
            assert (plan.archive_to / "ckpt-00000010.shards").is_dir()
            assert verify(kept).nbytes > 0


def test_only_tensorboards_files_leave_tb_and_a_users_notes_stay(tmp_path):
    for flag in ("new", "overwrite"):
        run = tmp_path / flag
        _earlier_run(run, _cfg())
        (run / "tb" / "my_notes.txt").write_text("mine")
        plan = plan_run_dir(run, _cfg(), **{flag: True})
        apply_plan(plan)
        assert sorted(p.name for p in (run / "tb").iterdir()) == ["my_notes.txt"]
        if flag == "new":
            assert [p.name for p in (plan.archive_to / "tb").iterdir()] == [
                "events.out.tfevents.1764400000.node1.123.0"
            ]
    only_notes = tmp_path / "notes"
    (only_notes / "tb").mkdir(parents=True)
    (only_notes / "tb" / "readme.txt").write_text("x")
    assert plan_run_dir(only_notes, _cfg()).action == "fresh"  # not a run


def test_a_config_yaml_hpctrain_did_not_write_is_never_replaced(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("# my precious config\ntrain: {epochs: 3}\n")
    for flags in ({}, {"overwrite": True}, {"new": True}, {"resume": "auto"}):
        with pytest.raises(ConfigError, match="not written by hpctrain") as err:
            plan_run_dir(run, _cfg(), **flags)
        assert "\n" not in str(err.value)
    assert (run / "config.yaml").read_text().startswith("# my precious config")
    # hpctrain's own (its header) with nothing else: a run stopped before its first step
    (run / "config.yaml").write_text(CONFIG_HEADER + yaml.safe_dump(_cfg()))
    assert plan_run_dir(run, _cfg()).action == "fresh"
    # an earlier version's config.yaml (no header: exactly the dump of its values) is
    # hpctrain's; a user's beside a run's outputs is still the user's, even for --overwrite
    legacy = tmp_path / "legacy"
    _earlier_run(legacy, _cfg())
    assert plan_run_dir(legacy, _cfg(), resume="auto").action == "resume"
    (legacy / "config.yaml").write_text("# my notes\n" + yaml.safe_dump(_cfg()))
    for flags in ({"overwrite": True}, {"new": True}):
        with pytest.raises(ConfigError, match="not written by hpctrain"):
            plan_run_dir(legacy, _cfg(), **flags)
    # a user's short file in the dump's own form (sorted keys, no comment) is the user's:
    # it was taken for an earlier version's and replaced by a run without flags
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.yaml").write_text("train:\n  epochs: 3\n")
    assert (short / "config.yaml").read_text() == yaml.safe_dump({"train": {"epochs": 3}})
    for flags in ({}, {"overwrite": True}):
        with pytest.raises(ConfigError, match="not written by hpctrain"):
            plan_run_dir(short, _cfg(), **flags)
    (legacy / "config.yaml").unlink()
    (legacy / "config.yaml").mkdir()
    with pytest.raises(ConfigError, match="config.yaml cannot be read"):
        plan_run_dir(legacy, _cfg(), overwrite=True)


def test_a_checkpoint_dir_another_run_recorded_is_refused_and_left_whole(tmp_path):
    shared = tmp_path / "scratch" / "ckpts"
    run_a, run_b = tmp_path / "A", tmp_path / "B"
    _earlier_run(run_a, _cfg(), steps=())
    claim_checkpoint_dir(run_a, shared)
    assert (shared / CHECKPOINT_OWNER).read_text().strip() == str(run_a.resolve())
    for s in (10, 20):
        (shared / f"ckpt-{s:08d}.h5").write_bytes(MAGIC + b"x")
    before = sorted(p.name for p in shared.iterdir())
    for flags in ({}, {"overwrite": True}, {"new": True}, {"resume": "auto"}):
        with pytest.raises(ConfigError, match=f"belongs to the run in {run_a} \\(2 checkpoint"):
            plan_run_dir(run_b, _cfg(), checkpoint_dir=shared, **flags)
    with pytest.raises(ConfigError, match="its own checkpoint.dir"):
        plan_run_dir(run_b, _cfg(), checkpoint_dir=shared, resume=str(shared / before[0]))
    assert sorted(p.name for p in shared.iterdir()) == before
    # its own run may replace them; a run directory moved away leaves them to its successor
    assert plan_run_dir(run_a, _cfg(), checkpoint_dir=shared, resume="auto").action == "resume"
    run_a.rename(tmp_path / "A-moved")
    # ... but a new directory is not its successor: --overwrite there wiped them
    for flags in ({}, {"overwrite": True}, {"resume": "auto"}):
        with pytest.raises(ConfigError, match=f"recorded in {run_a.resolve()} .* no longer"):
            plan_run_dir(tmp_path / "C", _cfg(), checkpoint_dir=shared, **flags)
    plan = plan_run_dir(tmp_path / "A-moved", _cfg(), checkpoint_dir=shared, overwrite=True)
    apply_plan(plan)
    assert sorted(p.name for p in shared.iterdir()) == [CHECKPOINT_OWNER]


def test_unrecorded_checkpoints_outside_the_run_dir_are_only_resumed_by_name(tmp_path):
    ckpts = tmp_path / "scratch"
    ckpts.mkdir()
    (ckpts / "ckpt-00000005.h5").write_bytes(MAGIC + b"x")
    run = tmp_path / "run"
    for flags in ({}, {"overwrite": True}, {"new": True}, {"resume": "auto"}):
        with pytest.raises(ConfigError, match=f"checkpoint.dir {ckpts} holds 1 checkpoint"):
            plan_run_dir(run, _cfg(), checkpoint_dir=ckpts, **flags)
    assert (ckpts / "ckpt-00000005.h5").exists()
    chosen = str(ckpts / "ckpt-00000005.h5")
    assert plan_run_dir(run, _cfg(), checkpoint_dir=ckpts, resume=chosen).action == "resume"


def test_another_runs_default_checkpoint_dir_is_never_cleared_or_moved(tmp_path):
    """B pointed at A's <run-dir>/checkpoints (no claim there: A's own default): B's
    config.yaml does not make them B's; --overwrite and --new leave them whole."""
    run_a, run_b = tmp_path / "A", tmp_path / "B"
    _earlier_run(run_a, _cfg(), steps=(3,))
    _earlier_run(run_b, _cfg(), steps=(1,))
    theirs = run_a / "checkpoints"
    chosen = {"resume": str(theirs / "ckpt-00000003.h5")}  # its own message's advice was this
    for flags in ({}, {"overwrite": True}, {"new": True}, {"resume": "auto"}, chosen):
        with pytest.raises(ConfigError, match=f"up to step 3 that the run in {run_a} wrote"):
            plan_run_dir(run_b, _cfg(), checkpoint_dir=theirs, **flags)
    assert sorted(p.name for p in theirs.iterdir()) == ["ckpt-00000003.h5"]


def test_resume_from_an_earlier_file_moves_the_abandoned_timeline_aside(tmp_path):
    """--resume ckpt-10 on a run that went on to 20 and 30: those move to previous/ (a
    later --resume auto, a requeue or an elastic restart, must not pick them, nor
    keep_last count them); a requeued job with the same command line continues from the
    run's newest checkpoint instead of going back to the file."""
    run = tmp_path / "run"
    _earlier_run(run, _cfg(), steps=(10, 20, 30))
    (run / "checkpoints" / "ckpt-00000030.shards").mkdir()
    chosen = str(run / "checkpoints" / "ckpt-00000010.h5")
    plan = plan_run_dir(run, _cfg(), resume=chosen)
    assert plan.action == "resume" and "(steps 20-30) move to" in plan.message
    apply_plan(plan)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-00000010.h5"]
    moved = sorted(p.name for p in plan.archive_to.iterdir())
    assert moved == ["ckpt-00000020.h5", "ckpt-00000030.h5", "ckpt-00000030.shards"]
    (run / "checkpoints" / "ckpt-00000015.h5").write_bytes(MAGIC + b"x")  # this timeline's save
    again = plan_run_dir(run, _cfg(), resume=chosen, requeued=True)
    assert again.resume == "auto" and again.remove == ()
    assert again.message.startswith(f"requeued: the run's own checkpoints, not --resume {chosen}")
    assert plan_run_dir(run, _cfg(), resume=chosen).resume is None  # not requeued: the file


def test_a_missing_resume_file_is_refused_before_the_run_writes_anything(tmp_path):
    with pytest.raises(ConfigError, match="--resume .*missing.h5: no such checkpoint file"):
        plan_run_dir(tmp_path / "run", _cfg(), resume=str(tmp_path / "missing.h5"))
    with pytest.raises(
        ConfigError, match="is a directory; it takes a ckpt-<step>.h5, auto or never"
    ):
        plan_run_dir(tmp_path / "run", _cfg(), resume=str(tmp_path))
    # set in the configuration, not on the command line: said so (it blamed --resume)
    with pytest.raises(ConfigError, match="^checkpoint.resume=Auto: no such checkpoint file"):
        plan_run_dir(tmp_path / "run", _cfg(), resume="Auto", resume_option="checkpoint.resume")
    with pytest.raises(ConfigError, match="--new and checkpoint.resume=auto contradict"):
        plan_run_dir(tmp_path / "run", _cfg(), "auto", new=True, resume_option="checkpoint.resume")


def test_a_refused_run_takes_back_its_claim_of_a_checkpoint_dir(tmp_path):
    """Refused after its claim (a missing data file, a model too big): the checkpoint.dir
    it made and its claim go; an earlier owner's claim it adopted is restored."""
    run, fresh = tmp_path / "run", tmp_path / "scratch" / "a" / "ckpts"
    claim_checkpoint_dir(run, fresh)
    assert (fresh / CHECKPOINT_OWNER).exists()
    remove_unused_run_dir()
    assert not (tmp_path / "scratch").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / CHECKPOINT_OWNER).write_text("/gone/run\n")
    claim_checkpoint_dir(run, kept)
    remove_unused_run_dir()
    assert (kept / CHECKPOINT_OWNER).read_text() == "/gone/run\n"
    claim_checkpoint_dir(run, kept)
    keep_run_dir()  # the run started: the claim is its own
    remove_unused_run_dir()
    assert (kept / CHECKPOINT_OWNER).read_text().strip() == str(run.resolve())


def test_two_runs_claiming_one_checkpoint_dir_at_once_cannot_both(tmp_path, monkeypatch):
    """Both looked before either claimed (an array job's tasks start together): the
    claim is an exclusive create, so the second is refused, naming the first."""
    import hpctrain.rundir as rundir

    shared = tmp_path / "ckpts"
    run_a, run_b = tmp_path / "A", tmp_path / "B"
    run_a.mkdir()
    claim_checkpoint_dir(run_a, shared)
    keep_run_dir()
    with pytest.raises(ConfigError, match=f"is claimed by the run in {run_a}"):
        claim_checkpoint_dir(run_b, shared)  # B planned before A's claim, then claims
    assert (shared / CHECKPOINT_OWNER).read_text().strip() == str(run_a.resolve())
    assert sorted(p.name for p in shared.iterdir()) == [CHECKPOINT_OWNER]  # no temp left
    remove_unused_run_dir()  # B's refusal takes back nothing of A's
    assert (shared / CHECKPOINT_OWNER).read_text().strip() == str(run_a.resolve())
    (shared / CHECKPOINT_OWNER).write_text("")  # a claim it cannot read is not taken over
    with pytest.raises(ConfigError, match="is claimed by a run it cannot name"):
        claim_checkpoint_dir(run_b, shared)
    monkeypatch.setattr(rundir.os, "link", lambda a, b: (_ for _ in ()).throw(PermissionError))
    other = tmp_path / "other-ckpts"
    claim_checkpoint_dir(run_b, other)  # no hard links there: an exclusive create
    assert (other / CHECKPOINT_OWNER).read_text().strip() == str(run_b.resolve())


def test_an_empty_run_dir_option_is_refused_not_the_current_directory(capsys):
    """`--run-dir "$UNSET"` trained into the current directory, without a word."""
    from hpctrain.cli import main

    assert main(["train", "--run-dir", " "]) == 2
    assert "--run-dir ' ': expected a directory path" in capsys.readouterr().err
    assert main(["train", "--resume", ""]) == 2  # was read as the file '.'
    assert "--resume '' is blank: auto, never or a file" in capsys.readouterr().err


def test_a_run_dir_that_is_a_file_is_said_so_not_as_an_errno(tmp_path, capsys):
    """It was `run directory X: [Errno 17] File exists: 'X'`."""
    from hpctrain.cli import main

    taken = tmp_path / "afile"
    taken.write_text("mine")
    assert main(["train", "--run-dir", str(taken)]) == 2
    assert f"--run-dir {taken}: it is a file, not a directory" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(taken / "sub")]) == 2
    assert f"--run-dir {taken}/sub: {taken} is a file" in capsys.readouterr().err
    assert taken.read_text() == "mine"


def test_a_checkpoint_dir_that_is_a_file_is_named_as_the_option(tmp_path):
    """It was reported as a problem of the run directory ("File exists")."""
    taken = tmp_path / "afile"
    taken.write_text("mine")
    for where, said in ((taken, "is a file, not a directory"), (taken / "sub", "Not a directory")):
        with pytest.raises(ConfigError, match=f"checkpoint.dir {where}.*{said}"):
            claim_checkpoint_dir(tmp_path / "run", where)
    assert taken.read_text() == "mine"


def _train(capsys, run, *extra: str) -> tuple[int, str]:
    from hpctrain.cli import main as cli_main

    argv = ["train", "--run-dir", str(run), "--set", "data.train_samples=256"]
    argv += ["--set", "data.val_samples=64", "--set", "model.hidden=[8]"]
    for item in extra:
        argv += [item] if item.startswith("--") else ["--set", item]
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("flag", ["--overwrite", "--new"])
def test_ctrl_c_during_start_up_stops_before_the_earlier_run_is_touched(
    flag, tmp_path, capsys, monkeypatch
):
    """A Ctrl-C while a run with --overwrite started was only recorded: the run went on
    to delete the earlier run's checkpoints, trained and saved, then exited 130."""
    import signal

    from hpctrain import loop

    run = tmp_path / "run"
    code, text = _train(capsys, run, "train.max_steps=2")
    assert code == 0, text
    before = _contents(run)
    real = loop.strategy_class

    def interrupted_while_building(name):  # as a Ctrl-C while the data and model load
        os.kill(os.getpid(), signal.SIGINT)
        return real(name)

    monkeypatch.setattr(loop, "strategy_class", interrupted_while_building)
    handler = signal.getsignal(signal.SIGINT)
    code, text = _train(capsys, run, flag, "train.max_steps=4")
    assert code == 130, text
    assert "stopped: SIGINT during start-up (Ctrl-C): nothing trained, and nothing of " in text
    assert "Traceback" not in text and _contents(run) == before
    assert signal.getsignal(signal.SIGINT) == handler  # the run's own given back


def test_a_training_loop_not_fitted_gives_the_directory_and_the_signals_back(tmp_path):
    """A notebook that built a loop to look at it and dropped it (or built a second one
    for the same directory) had the second refused as 'another run', and SIGTERM no
    longer ended the process: the first loop's handlers recorded it for a fit that
    never came."""
    import gc
    import signal

    from hpctrain import TrainingLoop
    from hpctrain.run_marker import MARKER

    cfg = Config.load(None, ["data.train_samples=64", "data.val_samples=32", "model.hidden=[8]"])
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    first = TrainingLoop(cfg, run_dir=run)
    assert (run / MARKER).exists() and signal.getsignal(signal.SIGTERM) == first.pre._handler
    with pytest.raises(ConfigError, match="another TrainingLoop of this process"):
        TrainingLoop(cfg, run_dir=run, resume="auto")
    assert signal.getsignal(signal.SIGTERM) == first.pre._handler  # the refused one's gone
    del first
    gc.collect()
    assert not (run / MARKER).exists() and signal.getsignal(signal.SIGTERM) is before
    with TrainingLoop(cfg, run_dir=run, resume="auto") as loop:
        assert (run / MARKER).exists()
    assert not (run / MARKER).exists() and signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(ConfigError, match="already fitted or been closed: create a new one"):
        loop.fit()
    summary = TrainingLoop(cfg, run_dir=run, resume="auto").fit()
    assert summary["steps"] == 1 and not (run / MARKER).exists()
    assert signal.getsignal(signal.SIGTERM) is before


def _contents(run) -> dict:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and "data" not in p.parts
    }


def test_a_refused_run_leaves_the_earlier_run_whole(tmp_path, capsys):
    """--overwrite and --resume FILE act only once the run passed its checks: a typo in
    the new config's data.path deleted the earlier run, and a damaged FILE moved the
    later checkpoints aside before it was refused."""
    run = tmp_path / "run"
    code, text = _train(capsys, run, "train.max_steps=3", "checkpoint.every_steps=1")
    assert code == 0, text
    before = _contents(run)
    assert "checkpoints/ckpt-00000003.h5" in before
    code, text = _train(
        capsys, run, "--overwrite", "data.source=hdf5", f"data.path={tmp_path / 'typo.h5'}"
    )
    assert code == 2 and "dataset file not found" in text, text
    assert _contents(run) == before
    second = run / "checkpoints" / "ckpt-00000002.h5"
    second.write_bytes(second.read_bytes()[:-64] + b"x" * 64)
    code, text = _train(capsys, run, f"--resume={second}", "train.max_steps=4")
    assert code == 2 and "digest mismatch" in text, text
    assert not (run / "previous").exists()
    assert (run / "checkpoints" / "ckpt-00000003.h5").read_bytes() == before[
        "checkpoints/ckpt-00000003.h5"
    ]
    code, text = _train(capsys, run, "--overwrite", "train.max_steps=1")
    assert code == 0 and "--overwrite: " in text and "deleting what it wrote" in text, text
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-00000001.h5"]


def test_overwrite_removes_a_linked_shard_folder_never_its_target(tmp_path):
    """A symlinked ckpt-<step>.shards made --overwrite stop halfway (rmtree refuses
    links), after the metrics and config were gone."""
    run = tmp_path / "run"
    _earlier_run(run, _cfg())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "shard-00000-of-00002.h5").write_bytes(b"s")
    (run / "checkpoints" / "ckpt-00000020.shards").symlink_to(elsewhere)
    apply_plan(plan_run_dir(run, _cfg(), overwrite=True))
    assert list((run / "checkpoints").iterdir()) == []
    assert (elsewhere / "shard-00000-of-00002.h5").read_bytes() == b"s"


def test_overwrite_leaves_a_users_file_in_a_shard_folder_and_the_folder(tmp_path, caplog):
    """--overwrite removed ckpt-<step>.shards/ whole, with whatever a user had put in it;
    a directory merely named like a checkpoint file was removed too."""
    run = tmp_path / "run"
    _earlier_run(run, _cfg(), steps=())
    _write_sharded(run / "checkpoints", 10, _state(), 2)
    folder = run / "checkpoints" / "ckpt-00000010.shards"
    (folder / "README-mine.txt").write_text("mine")
    (folder / ".shard-00001-of-00002.h5.tmp-77").write_bytes(b"t")  # a crashed writer's
    apply_plan(plan_run_dir(run, _cfg(), overwrite=True))
    assert [p.name for p in folder.iterdir()] == ["README-mine.txt"]
    assert not (run / "checkpoints" / "ckpt-00000010.h5").exists()
    assert "README-mine.txt" in caplog.text and "did not write" in caplog.text
    (run / "checkpoints" / "ckpt-00000030.h5").mkdir()  # a directory named like a file
    (run / "checkpoints" / "ckpt-00000030.h5" / "data").write_text("mine")
    with pytest.raises(ConfigError, match="holds ckpt-00000030.h5, named like checkpoints"):
        plan_run_dir(run, _cfg(), overwrite=True)
    assert (run / "checkpoints" / "ckpt-00000030.h5" / "data").read_text() == "mine"


def test_a_file_only_named_like_a_checkpoint_is_refused_and_kept(tmp_path):
    """--overwrite deleted any file named like a checkpoint (a user's notes saved as
    ckpt-<step>.h5 included), the run's save of that step would replace it, and
    --resume auto found nothing that verifies while --new and --overwrite left it; and
    --overwrite read metrics.jsonl and tb/ as a run's without the config.yaml every run
    writes first. --resume auto beside real checkpoints goes on (a requeue past a
    checkpoint damaged in its first bytes): the newer odd file is set aside."""
    run = tmp_path / "run"
    _earlier_run(run, _cfg())
    notes = run / "checkpoints" / "ckpt-00000050.h5"
    notes.write_text("notes")
    for flags in ({"overwrite": True}, {"new": True}, {}):
        with pytest.raises(ConfigError, match="holds ckpt-00000050.h5, named like checkpoints"):
            plan_run_dir(run, _cfg(), **flags)
    assert plan_run_dir(run, _cfg(), resume="auto").action == "resume"
    only = tmp_path / "only"
    _earlier_run(only, _cfg(), steps=())
    (only / "checkpoints" / notes.name).write_text("notes")
    with pytest.raises(ConfigError, match="holds ckpt-00000050.h5, named like checkpoints"):
        plan_run_dir(only, _cfg(), resume="auto")
    assert notes.read_text() == "notes"
    notes.unlink()
    plan = plan_run_dir(run, _cfg(), overwrite=True)
    assert "holds an earlier run (2 checkpoint(s) up to step 20" in plan.message
    apply_plan(plan)
    assert list((run / "checkpoints").iterdir()) == []

    mine = tmp_path / "mine"
    _earlier_run(mine, _cfg(), steps=())
    (mine / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"metrics.jsonl and tb/ events but no config.yaml"):
        plan_run_dir(mine, _cfg(), overwrite=True)
    assert (mine / "metrics.jsonl").is_file()


def test_default_run_dirs_started_in_the_same_second_are_two(tmp_path):
    """A sweep's runs started together shared runs/<config>-<UTC> (one-second names) and
    wrote over each other's checkpoints; a refused one still takes its own back."""
    from hpctrain.rundir import make_new_run_dir

    base = tmp_path / "runs" / "sweep-20261206-120000"
    first = make_new_run_dir(base)
    keep_run_dir()
    second = make_new_run_dir(base)
    assert (first, second) == (base, base.with_name(base.name + "-2"))
    assert remove_unused_run_dir() == [second]
    assert first.is_dir() and not second.exists()


def test_resume_from_a_copy_named_otherwise_reads_its_step(tmp_path):
    """best.h5, a copy of ckpt-2: its step came from its name (none), so steps 3 and 4
    stayed and the run wrote over them."""
    import numpy as np

    from hpctrain.checkpoint import save

    run = tmp_path / "run"
    _earlier_run(run, _cfg(), steps=())
    for step in (2, 3, 4):
        save(run / "checkpoints", step, {"model/w": np.full(4, step, np.float32)}, {"step": step})
    best = tmp_path / "best.h5"
    best.write_bytes((run / "checkpoints" / "ckpt-00000002.h5").read_bytes())
    plan = plan_run_dir(run, _cfg(), resume=str(best))
    assert "(steps 3-4) move to" in plan.message, plan.message
    best.write_bytes(best.read_bytes()[:-8] + b"damaged!")  # refused by the run: moves nothing
    assert plan_run_dir(run, _cfg(), resume=str(best)).remove == ()


def test_a_run_directory_in_use_by_another_run_is_refused_untouched(tmp_path, capsys):
    """The same sbatch submitted twice: both jobs resumed in one directory and wrote
    over each other's checkpoints. The second is refused, naming the first."""
    run = tmp_path / "run"
    code, text = _train(capsys, run, "train.max_steps=2")
    assert code == 0, text
    before = _contents(run)
    # as a run in progress on another node holds it (one of this host would be given
    # run_marker's 5 s of grace to exit)
    running = json.dumps({"host": "node7", "pid": 123}).encode()
    (run / ".hpctrain-running").write_bytes(running)
    code, text = _train(capsys, run, "--resume=auto", "train.max_steps=4")
    assert code == 2 and f"{run} is in use by another run (host " in text, text
    assert _contents(run) == {**before, ".hpctrain-running": running}
    (run / ".hpctrain-running").unlink()  # that run ended
    code, text = _train(capsys, run, "--resume=auto", "train.max_steps=4")
    assert code == 0 and not (run / ".hpctrain-running").exists(), text


def test_a_config_saved_from_hpctrain_config_is_the_users(tmp_path, capsys):
    """`hpctrain config > run/config.yaml` was exactly an earlier version's dump, so a run
    into that directory took it for a run's and replaced it, without a flag."""
    from hpctrain.cli import main

    assert main(["config", "--set", "train.epochs=3"]) == 0
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(capsys.readouterr().out)
    printed = _cfg("train.epochs=3")
    printed["model"] = written_model(printed["model"])  # the model's defaults too
    assert yaml.safe_load((run / "config.yaml").read_text()) == printed
    for flags in ({}, {"overwrite": True}, {"resume": "auto"}):
        with pytest.raises(ConfigError, match="not written by hpctrain"):
            plan_run_dir(run, _cfg(), **flags)
