"""Sharding rules: every sample read once per step across ranks, validation covered once."""

import h5py
import numpy as np
import pytest

from hpctrain.data.dataset import DataOptions, held_out_rows, inspect_dataset
from hpctrain.data.keys import validate_keys_option
from hpctrain.data.layout import decide_layout
from hpctrain.data.sharded import (
    DatasetInfo,
    ShardedTrainData,
    epoch_permutation,
    split_bytes,
    val_block,
)
from hpctrain.data.synthetic import generate, write_dataset
from hpctrain.errors import DataError
from hpctrain.models.zoo import InputSpec


def _info(n):
    return DatasetInfo("unused.h5", n, 0, InputSpec((4,), 3), "float32", {})


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("val_size", [0, 1, 7, 1000, 1001])
def test_validation_blocks_cover_every_sample_exactly_once(size, val_size):
    covered = []
    for r in range(size):
        lo, hi = val_block(val_size, r, size)
        covered += range(lo, hi)
    assert covered == list(range(val_size))


def test_ranks_together_read_what_one_rank_reads_with_the_global_batch():
    n, b, a = 1000, 8, 2
    one = ShardedTrainData(_info(n), 0, 1, b * 2 * a, 1, seed=3, prefetch=0)
    two = [ShardedTrainData(_info(n), r, 2, b, a, seed=3, prefetch=0) for r in range(2)]
    assert one.global_batch == two[0].global_batch == 32
    for pos in (0, 32, 64):
        whole = one.micro_batch_rows(epoch=1, position=pos)[0]
        parts = [rows for r in range(2) for rows in two[r].micro_batch_rows(1, pos)]
        assert sorted(np.concatenate(parts)) == sorted(whole)
        assert len(np.unique(np.concatenate(parts))) == 32


def test_shuffle_depends_on_seed_and_epoch_only():
    assert np.array_equal(epoch_permutation(50, 1, 2), epoch_permutation(50, 1, 2))
    assert not np.array_equal(epoch_permutation(50, 1, 2), epoch_permutation(50, 1, 3))


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="do not fill one global batch"):
        ShardedTrainData(_info(10), 0, 4, 8, 1, seed=0)
    # the pipeline's micro-batches are named as the setting they come from
    with pytest.raises(DataError, match=r"x pipeline.microbatches 4 x 1 data-parallel replica"):
        ShardedTrainData(_info(30), 0, 1, 32, 4, seed=0, accum_key="pipeline.microbatches")


def test_prefetched_batches_equal_direct_reads(tmp_path):
    splits, attrs = generate("vectors", 300, 20, seed=5, features=4, classes=3)
    path = write_dataset(tmp_path / "d.h5", splits, attrs)
    info = DatasetInfo(str(path), 300, 20, InputSpec((4,), 3), "float32", {})
    a = list(ShardedTrainData(info, 1, 2, 16, 1, seed=0, prefetch=2).iterate(0, 32))
    b = list(ShardedTrainData(info, 1, 2, 16, 1, seed=0, prefetch=0).iterate(0, 32))
    assert len(a) == len(b) == (300 - 32) // 32
    x_all = splits["train"][0]
    rows = ShardedTrainData(info, 1, 2, 16, 1, seed=0).micro_batch_rows(0, 32)[0]
    np.testing.assert_array_equal(a[0][0][0], x_all[rows])
    for sa, sb in zip(a, b, strict=True):
        np.testing.assert_array_equal(sa[0][0], sb[0][0])
        np.testing.assert_array_equal(sa[0][1], sb[0][1])


@pytest.mark.parametrize("held_out", [False, True])
def test_a_split_in_memory_gives_the_batches_read_from_the_file(tmp_path, held_out):
    """data.in_memory_mb: the split read whole once, or row by row: the same batches bit
    for bit (with validation held out of the file's one split too), and the limit
    decides which path a run takes."""
    splits, attrs = generate("vectors", 300, 20, seed=5, features=4, classes=3)
    if held_out:
        x, y = splits["train"]
        path = _file(tmp_path / "d.h5", x=x, y=y)
        info = inspect_dataset(path, DataOptions(val_fraction=0.2, seed=1))
    else:
        path = write_dataset(tmp_path / "d.h5", splits, attrs)
        info = DatasetInfo(str(path), 300, 20, InputSpec((4,), 3), "float32", {})
    need = split_bytes(info)
    assert need == info.train_size * (4 * 4 + 8)  # float32 x 4 features + int64 label
    for prefetch in (0, 2):
        memory = ShardedTrainData(info, 1, 2, 16, 2, seed=0, prefetch=prefetch,
                                  in_memory_bytes=need)  # fmt: skip
        file = ShardedTrainData(info, 1, 2, 16, 2, seed=0, prefetch=prefetch,
                                in_memory_bytes=need - 1)  # fmt: skip
        assert memory.in_memory is not None and file.in_memory is None
        for epoch, position in ((0, 0), (1, 64)):
            got = list(memory.iterate(epoch, position))
            want = list(file.iterate(epoch, position))
            assert len(got) == len(want) > 0
            for step_got, step_want in zip(got, want, strict=True):
                for (gx, gy), (wx, wy) in zip(step_got, step_want, strict=True):
                    assert gx.dtype == wx.dtype and gy.dtype == wy.dtype
                    np.testing.assert_array_equal(gx, wx)
                    np.testing.assert_array_equal(gy, wy)


def test_synthetic_tasks_are_deterministic_and_learnable_in_shape():
    for task in ("vectors", "images", "tokens"):
        s1, a1 = generate(task, 64, 16, seed=9)
        s2, _ = generate(task, 64, 16, seed=9)
        np.testing.assert_array_equal(s1["train"][0], s2["train"][0])
        assert len(s1["val"][0]) == 16 and a1["classes"] >= 2
    _, attrs = generate("tokens", 64, 16, seed=9)
    assert 0.1 < attrs["bayes_accuracy"] <= 1.0


@pytest.mark.parametrize("val_size,size,batch", [(1001, 4, 256), (257, 2, 256), (5, 4, 2)])
def test_every_rank_runs_the_same_number_of_validation_batches(tmp_path, val_size, size, batch):
    from hpctrain.data.sharded import iterate_val

    splits, attrs = generate("vectors", 64, val_size, seed=1, features=4, classes=3)
    path = write_dataset(tmp_path / "v.h5", splits, attrs)
    info = DatasetInfo(str(path), 64, val_size, InputSpec((4,), 3), "float32", {})
    per_rank = [list(iterate_val(info, r, size, batch)) for r in range(size)]
    assert len({len(batches) for batches in per_rank}) == 1
    rows = np.concatenate([x for batches in per_rank for x, _ in batches])
    np.testing.assert_array_equal(rows, splits["val"][0])  # every sample exactly once


# --- data as users have it: names, splits, dtypes, layouts (issue 18) ------------------------
def _file(path, **datasets):
    attrs = datasets.pop("attrs", {})
    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            f[key.replace("__", "/")] = value
        f.attrs.update(attrs)
    return path


@pytest.mark.parametrize(
    "shape, model_kind, layout",
    [
        ((3, 16, 16), "images", "nchw"),
        ((16, 16, 3), "images", "nhwc"),
        ((1, 28, 28), "images", "nchw"),
        ((28, 28, 1), "user", "nhwc"),
        ((3, 32, 48), "images", "nchw"),
        ((32, 48, 4), "images", "nhwc"),
        ((28, 28), "images", "hw"),
        ((16, 16, 16), "any", None),  # an mlp flattens: no decision needed
        ((20,), "images", None),
    ],
)
def test_layout_is_detected_only_when_unambiguous(shape, model_kind, layout):
    assert decide_layout("f.h5", shape, "auto", model_kind) == layout


@pytest.mark.parametrize("shape", [(3, 3, 3), (16, 16, 16), (3, 8, 3), (10, 20, 30)])
def test_ambiguous_layouts_are_refused_in_one_line(shape):
    with pytest.raises(DataError, match="set data.layout to nchw or nhwc") as err:
        decide_layout("f.h5", shape, "auto", "images")
    assert "\n" not in str(err.value)
    assert decide_layout("f.h5", shape, "nhwc", "images") == "nhwc"


def test_a_layout_the_file_declares_decides_what_the_shape_cannot(tmp_path):
    """Synthetic images of side 4 with 3 channels, (3, 4, 4), were generated and then
    refused as ambiguous: the generator knew they were channels first. A file's root
    attribute `layout` now says it; data.layout set by the user still wins."""
    splits, attrs = generate("images", 32, 8, seed=1, image_size=4, channels=3)
    assert attrs["layout"] == "nchw"
    path = tmp_path / "images.h5"
    write_dataset(path, splits, attrs)
    info = inspect_dataset(path, DataOptions(model="cnn"))
    assert info.input_spec.shape == (3, 4, 4)
    with h5py.File(path, "a") as f:
        del f.attrs["layout"]
    with pytest.raises(DataError, match="could be channels first or channels last"):
        inspect_dataset(path, DataOptions(model="cnn"))
    assert inspect_dataset(path, DataOptions(model="cnn", layout="nhwc")).input_spec.shape == (
        4,
        3,
        4,
    )


@pytest.mark.parametrize(
    "x_dtype, model, tokens, scale, fed",
    [
        (np.float64, "mlp", False, 1.0, np.float32),
        (np.float16, "mlp", False, 1.0, np.float32),
        (np.int32, "mlp", False, 1.0, np.float32),
        (np.uint8, "mlp", False, 1 / 255, np.float32),
        (np.int32, "transformer", True, 1.0, np.int64),
        (np.uint8, "transformer", True, 1.0, np.int64),
    ],
)
def test_x_dtypes_are_cast_to_what_the_model_takes(tmp_path, x_dtype, model, tokens, scale, fed):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 9, (40, 6)).astype(x_dtype)
    y = (x if tokens else rng.integers(0, 3, 40)).astype(np.int16)
    info = inspect_dataset(_file(tmp_path / "d.h5", x=x, y=y), DataOptions(model=model))
    assert info.input_spec.tokens is tokens
    assert info.casts.x_scale == pytest.approx(scale)
    bx, by = info.convert(x[:4], y[:4])
    assert bx.dtype == fed and by.dtype == np.int64
    np.testing.assert_allclose(bx, x[:4].astype(np.float64) * scale, rtol=1e-6)


def test_float_x_for_a_language_model_and_integer_x_for_a_user_model_are_refused(tmp_path):
    path = _file(tmp_path / "f.h5", x=np.zeros((20, 5)), y=np.zeros((20, 5), np.int64))
    with pytest.raises(DataError, match="needs integer token ids in /x, the file holds float64"):
        inspect_dataset(path, DataOptions(model="transformer"))
    ints = _file(tmp_path / "i.h5", x=np.zeros((20, 5), np.int32), y=np.arange(20) % 2)
    with pytest.raises(DataError, match="set data.tokens true"):
        inspect_dataset(ints, DataOptions(model="pkg.mod:fn"))
    info = inspect_dataset(ints, DataOptions(model="pkg.mod:fn", tokens=False))
    assert not info.input_spec.tokens


@pytest.mark.parametrize(
    "y, message",
    [
        (np.r_[np.zeros(30), 0.5, np.zeros(9)], "/y row 30 holds 0.5, not a whole number"),
        (np.r_[np.zeros(12, int), -1, np.ones(27, int)], "/y row 12 holds -1, negative"),
        (np.r_[np.zeros(39, int), 7], "/y row 39 holds 7, outside 0..2 (3 classes, the file's"),
        (np.eye(3)[np.arange(40) % 3], "looks one-hot"),
        (np.zeros(40, int), "training needs at least two classes"),
        (np.r_[np.arange(39) % 3, 10**9], "the largest label is 1,000,000,000, which makes"),
    ],
)
def test_bad_labels_are_named_by_file_dataset_row_and_value(tmp_path, y, message):
    attrs = {"classes": 3} if "outside" in message else {}
    path = _file(tmp_path / "d.h5", x=np.zeros((40, 4)), y=y, attrs=attrs)
    with pytest.raises(DataError) as err:
        inspect_dataset(path)
    assert message in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(
    "x, y, message",
    [
        (np.zeros(40), np.arange(40) % 2, "/x holds one value per sample (shape (40,))"),
        (np.float64(3.0), np.arange(40) % 2, "/x holds a single value"),
        (np.zeros((40, 4)), np.int64(1), "/y is a single value"),
    ],
)
def test_samples_that_are_not_arrays_are_refused_before_a_step(tmp_path, x, y, message):
    """A 1-D or scalar /x passed the checks and failed in the first step (a matmul's
    shape error; an IndexError for a scalar): refused when the file is opened."""
    path = _file(tmp_path / "d.h5", x=x, y=y)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        inspect_dataset(path)


def test_labels_as_whole_floats_and_column_vectors_are_accepted(tmp_path):
    y = (np.arange(40) % 3).astype(np.float64)[:, None]
    info = inspect_dataset(_file(tmp_path / "d.h5", x=np.zeros((40, 4)), y=y))
    assert info.input_spec.classes == 3 and info.casts.squeeze_y and info.casts.y_float
    assert info.convert(np.zeros((2, 4)), y[:2])[1].tolist() == [0, 1]


def test_known_names_keys_and_refusals_that_list_the_file(tmp_path):
    x, y = np.zeros((50, 4)), np.arange(50) % 2
    assert inspect_dataset(_file(tmp_path / "a.h5", images=x, labels=y)).keys.train_x == "/images"
    two = _file(tmp_path / "b.h5", x=x, y=y, images=x, labels=y)
    with pytest.raises(DataError, match=r"several x/y pairs \(/x\+/y, /images\+/labels\)"):
        inspect_dataset(two)
    opts = DataOptions(keys={"train_x": "/images", "train_y": "/labels"})
    assert inspect_dataset(two, opts).keys.train_x == "/images"
    with pytest.raises(DataError, match=r"data.keys.train_y is /lbl.*it holds /images \(50, 4\)"):
        inspect_dataset(two, DataOptions(keys={"train_x": "/images", "train_y": "/lbl"}))
    assert validate_keys_option({"train_x": "/a"}) == [
        "data.keys.train_y: required when data.keys is set"
    ]
    assert "give val_x and val_y together" in " ".join(
        validate_keys_option({"train_x": "/a", "train_y": "/b", "val_x": "/c"})
    )


def test_held_out_validation_is_random_disjoint_and_reproducible():
    train, val = held_out_rows(1000, 0.1, seed=4)
    assert len(val) == 100 and len(train) == 900
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(1000))
    assert np.array_equal(val, held_out_rows(1000, 0.1, seed=4)[1])
    assert not np.array_equal(val, np.arange(900, 1000))  # not the (often sorted) tail
    assert np.all(np.diff(val) > 0) and np.all(np.diff(train) > 0)


def test_held_out_rows_are_read_once_across_ranks_and_never_trained_on(tmp_path):
    from hpctrain.data.sharded import iterate_val

    x = np.arange(300, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    path = _file(tmp_path / "d.h5", x=x, y=np.arange(300) % 3)
    info = inspect_dataset(path, DataOptions(val_fraction=0.2, seed=1))
    assert (info.train_size, info.val_size) == (240, 60)
    seen = [v for r in range(3) for bx, _ in iterate_val(info, r, 3, 7) for v in bx[:, 0]]
    assert sorted(seen) == sorted(info.val_rows.tolist())
    data = ShardedTrainData(info, 0, 1, 16, 1, seed=0, prefetch=0)
    trained = {v for step in data.iterate(0) for bx, _ in step for v in bx[:, 0]}
    assert not trained & set(seen)


def test_what_was_found_is_described_for_config_yaml_and_the_first_log_line(tmp_path):
    x = np.zeros((100, 8, 8, 3), np.uint8)
    path = _file(tmp_path / "d.h5", images=x, labels=(np.arange(100) % 4).astype(np.int32))
    info = inspect_dataset(path, DataOptions(model="cnn"))
    d = info.describe()
    assert d["sample_shape"] == [3, 8, 8] and d["stored_shape"] == [8, 8, 3]
    assert d["classes"] == 4 and d["train_samples"] == 90 and d["val_samples"] == 10
    assert d["x"] == "uint8 -> float32 x 1/255 features" and d["y"] == "int32 -> int64 labels"
    assert d["layout"] == "NHWC, fed as NCHW"
    assert "90 train + 10 val samples" in info.summary() and "\n" not in info.summary()


def test_data_synth_refuses_to_replace_a_file_without_force(tmp_path, capsys):
    """`hpctrain data synth OUT` may be pointed at the user's real data: it refuses in one
    line, writing nothing, unless told --force."""
    from hpctrain.cli import main as cli_main

    real = tmp_path / "real.h5"
    real.write_text("my real dataset\n")
    small = ["--train", "64", "--val", "16"]
    assert cli_main(["data", "synth", str(real), *small]) == 2
    err = capsys.readouterr().err
    assert f"{real} exists: pass --force to replace it" in err and err.count("\n") == 1, err
    assert real.read_text() == "my real dataset\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real.h5"]  # no temporary file
    assert cli_main(["data", "synth", str(real), *small, "--force"]) == 0
    assert f"wrote {real}: task vectors" in capsys.readouterr().out
    with h5py.File(real) as f:
        assert f["train/x"].shape == (64, 32) and f["val/y"].shape == (16,)
    assert cli_main(["data", "synth", str(tmp_path), *small, "--force"]) == 2
    assert f"{tmp_path} is a directory: name the HDF5 file" in capsys.readouterr().err


def test_data_synth_under_a_launcher_writes_once_on_each_node(tmp_path, monkeypatch):
    """`mpirun -np N hpctrain data synth OUT`: each node's first rank writes (OUT may be
    node-local, $TMPDIR/d.h5); the others return at once instead of racing it (and
    finding its file there, refused without --force)."""
    from hpctrain.cli import main as cli_main

    out, small = tmp_path / "d.h5", ["--train", "64", "--val", "16"]
    for var, value in (("RANK", "3"), ("SIZE", "4"), ("LOCAL_RANK", "1"), ("LOCAL_SIZE", "2")):
        monkeypatch.setenv(f"OMPI_COMM_WORLD_{var}", value)
    assert cli_main(["data", "synth", str(out), *small]) == 0
    assert not out.exists()
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")  # rank 2: the second node's first
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    assert cli_main(["data", "synth", str(out), *small]) == 0
    assert out.exists()
