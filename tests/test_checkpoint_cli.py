"""`hpctrain ckpt inspect | verify | export`, and exports that load in torch and Keras."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from hpctrain.backends.export import keras_weights
from hpctrain.checkpoint import capture_process_rng, save
from hpctrain.cli import main as cli_main
from hpctrain.models import zoo

ROOT = Path(__file__).resolve().parents[1]
HPCTRAIN = Path(sys.executable).parent / "hpctrain"


def zoo_checkpoint(directory, model_cfg: dict, inp: zoo.InputSpec, seed=3, step=40):
    """A checkpoint of a real zoo model built by the torch backend's model builder."""
    from hpctrain.backends.torch import build_model

    model = build_model(model_cfg, inp, seed)
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    state = {f"model/{k}": v for k, v in weights.items()}
    state.update({f"optimizer/momentum_buffer/{k}": np.zeros_like(v) for k, v in weights.items()})
    config = yaml.safe_dump({"backend": "torch", "model": model_cfg})
    attrs = {"backend": "torch", "framework": "torch 2.x", "world_size": 2, "config_yaml": config}
    rng = {0: capture_process_rng(), 1: capture_process_rng()}
    trainer = {"step": step, "epoch": 2, "position": 0, "best_metric": 0.5}
    path = save(directory, step, state, trainer, rng, attrs, {"val_loss": 0.5})
    return path, model, weights


CNN = ({"name": "cnn", "channels": [4, 8]}, zoo.InputSpec((3, 8, 8), 10))
MLP = ({"name": "mlp", "hidden": [16]}, zoo.InputSpec((8,), 5))


def test_inspect_shows_what_is_inside(tmp_path, capsys):
    path, _, weights = zoo_checkpoint(tmp_path, *CNN)
    assert cli_main(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    for text in (
        "verified    yes",
        "step        40",
        "strategy    data_parallel",  # from the config: a data-parallel run's has no attribute
        "backend     torch",
        "world size  2",
        "hpctrain-ckpt-2",
        "metrics     val_loss=0.5",
        "epoch=2",
        "rank(s) 0-1",
        "config:",
        "name: cnn",
    ):
        assert text in out, f"{text!r} not in:\n{out}"
    assert re.search(r"model/conv1\.weight +float32 +\(4, 3, 3, 3\) +0\.4 kB", out), out


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    """`hpctrain ckpt inspect F | head`: the reader leaves, the command ends with
    128 + SIGPIPE like a shell tool, not with a crash report."""
    path, _, _ = zoo_checkpoint(tmp_path, *CNN)
    job = subprocess.Popen(
        [str(HPCTRAIN), "ckpt", "inspect", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    job.stdout.close()  # before it writes: its first write finds no reader
    err = job.stderr.read().decode()
    assert job.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "uncaught" not in err, err
    # a pipe or socket of its own that breaks is a crash like any other, reported
    code = (
        "import sys\nfrom hpctrain.runtime.failfast import run_fail_together\n"
        "def broken():\n    raise BrokenPipeError(32, 'a worker went away')\n"
        "sys.exit(run_fail_together(broken))\n"
    )
    crash = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert crash.returncode == 1 and "a worker went away" in crash.stderr, crash.stderr


def test_verify_one_line_per_file_and_exit_status(tmp_path, capsys):
    good, _, _ = zoo_checkpoint(tmp_path, *MLP, step=10)
    other, _, _ = zoo_checkpoint(tmp_path, *MLP, step=20)
    bad = tmp_path / "ckpt-00000030.h5"
    data = bytearray(other.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert cli_main(["ckpt", "verify", str(good), str(other)]) == 0
    assert cli_main(["ckpt", "verify", str(good), str(bad), str(other)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["OK", "OK", "OK", "FAIL", "OK"]
    assert str(bad) in lines[3]
    # the installed command, as a user runs it
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [str(HPCTRAIN), "ckpt", "verify", str(good), str(bad)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 1 and run.stdout.count("\n") == 2, run.stdout + run.stderr
    run = subprocess.run(
        [str(HPCTRAIN), "ckpt", "export", str(bad), "--to", "torch", str(tmp_path / "x.pt")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 2 and "file digest mismatch" in run.stderr
    assert not (tmp_path / "x.pt").exists()


def test_export_torch_loads_with_weights_only(tmp_path, capsys):
    import torch

    from hpctrain.backends.torch import build_model

    path, model, weights = zoo_checkpoint(tmp_path, *CNN)
    out = tmp_path / "export" / "cnn.pt"
    assert cli_main(["ckpt", "export", str(path), "--to", "torch", str(out)]) == 0
    assert "torch state_dict of 6 tensors" in capsys.readouterr().out
    loaded = torch.load(out, weights_only=True)
    assert list(loaded) == list(weights)  # the model's own order
    for key, value in weights.items():
        assert np.array_equal(loaded[key].numpy(), value)
    fresh = build_model(CNN[0], CNN[1], seed=99)
    fresh.load_state_dict(loaded)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((5, 3, 8, 8)).astype(np.float32))
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    before = path.read_bytes()  # OUT is never a checkpoint, its own input least of all
    capsys.readouterr()
    assert cli_main(["ckpt", "export", str(path), "--to", "keras", str(path)]) == 2
    assert "is an hpctrain checkpoint and an export would replace it" in capsys.readouterr().err
    assert path.read_bytes() == before
    # any other existing file only with --force (a dataset given by a slip was replaced)
    mine = tmp_path / "mydata.h5"
    mine.write_bytes(b"a user's file")
    assert cli_main(["ckpt", "export", str(path), "--to", "torch", str(mine)]) == 2
    assert "mydata.h5 exists: --force replaces it" in capsys.readouterr().err
    assert mine.read_bytes() == b"a user's file"
    assert cli_main(["ckpt", "export", str(path), "--to", "torch", str(mine), "--force"]) == 0
    for where in (str(tmp_path), ""):  # a directory, an empty name: one line each
        assert cli_main(["ckpt", "export", str(path), "--to", "torch", where]) == 2
        assert "Traceback" not in capsys.readouterr().err


def _keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return pytest.importorskip("keras")


def _set_from_file(kmodel, path):
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "hpctrain-keras-weights-1"
        layers = json.loads(f.attrs["keras_layers"])
        for layer, names in layers.items():
            kmodel.get_layer(layer).set_weights([f[n][()] for n in names])
        return layers


def test_export_keras_cnn_and_mlp_match_torch_predictions(tmp_path):
    import torch

    keras = _keras()
    L = keras.layers
    rng = np.random.default_rng(1)

    path, model, _ = zoo_checkpoint(tmp_path / "cnn", *CNN)
    out = tmp_path / "cnn-keras.h5"
    assert cli_main(["ckpt", "export", str(path), "--to", "keras", str(out)]) == 0
    # the zoo's torch padding is symmetric: explicit ZeroPadding2D + 'valid' convs
    kcnn = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            L.ZeroPadding2D(1),
            L.Conv2D(4, 3, activation="relu", name="conv1"),
            L.ZeroPadding2D(1),
            L.Conv2D(8, 3, strides=2, activation="relu", name="conv2"),
            L.GlobalAveragePooling2D(),
            L.Dense(10, name="head"),
        ]
    )
    assert _set_from_file(kcnn, out) == {
        "conv1": ["conv1.weight", "conv1.bias"],
        "conv2": ["conv2.weight", "conv2.bias"],
        "head": ["head.weight", "head.bias"],
    }
    x = rng.standard_normal((6, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    got = kcnn.predict(x.transpose(0, 2, 3, 1), verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    path, model, _ = zoo_checkpoint(tmp_path / "mlp", *MLP)
    out = tmp_path / "mlp-keras.h5"
    assert cli_main(["ckpt", "export", str(path), "--to", "keras", str(out)]) == 0
    kmlp = keras.Sequential(
        [keras.Input((8,)), L.Dense(16, activation="relu", name="fc1"), L.Dense(5, name="head")]
    )
    _set_from_file(kmlp, out)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(kmlp.predict(x, verbose=0), want, rtol=1e-5, atol=1e-5)


def test_keras_roles_for_norms_and_embeddings_fit_keras_layers():
    keras = _keras()
    d, vocab = 8, 11
    weights = {
        "stem.conv.weight": np.ones((4, 3, 3, 3), np.float32),
        "stem.bn.weight": np.full(4, 2.0, np.float32),
        "stem.bn.bias": np.full(4, 3.0, np.float32),
        "stem.bn.running_mean": np.full(4, 4.0, np.float32),
        "stem.bn.running_var": np.full(4, 5.0, np.float32),
        "stem.bn.num_batches_tracked": np.array(7),
        "embed.tok.weight": np.arange(vocab * d, dtype=np.float32).reshape(vocab, d),
        "ln_f.weight": np.ones(d, np.float32),
        "ln_f.bias": np.zeros(d, np.float32),
        "blocks.0.attn.qkv.weight": np.arange(3 * d * d, dtype=np.float32).reshape(3 * d, d),
    }
    converted, layers = keras_weights(weights, embeddings={"embed.tok.weight"})
    roles = {k: v[0] for k, v in converted.items()}
    assert roles["stem.bn.bias"] == "beta" and roles["ln_f.bias"] == "beta"
    assert roles["embed.tok.weight"] == "embeddings" and "stem.bn.num_batches_tracked" not in roles
    assert converted["stem.conv.weight"][1].shape == (3, 3, 3, 4)
    assert np.array_equal(
        converted["blocks.0.attn.qkv.weight"][1], weights["blocks.0.attn.qkv.weight"].T
    )
    assert layers["stem.bn"] == [
        f"stem.bn.{k}" for k in ("weight", "bias", "running_mean", "running_var")
    ]
    L = keras.layers
    bn, ln, emb = L.BatchNormalization(), L.LayerNormalization(), L.Embedding(vocab, d)
    bn.build((None, 5, 5, 4))
    ln.build((None, d))
    emb.build((None,))
    for layer, name in ((bn, "stem.bn"), (ln, "ln_f"), (emb, "embed.tok")):
        layer.set_weights([converted[n][1] for n in layers[name]])
    assert np.all(bn.moving_variance.numpy() == 5.0) and np.all(bn.gamma.numpy() == 2.0)
    assert np.array_equal(emb.embeddings.numpy(), weights["embed.tok.weight"])


def test_zoo_embedding_detection_from_the_checkpoint_config(tmp_path):
    from hpctrain.backends.export import embedding_names

    cfg = {"name": "transformer", "d_model": 8, "n_layers": 1, "n_heads": 2, "d_ff": 16}
    layers = zoo.build_layers(cfg, zoo.InputSpec((6,), 11, tokens=True))
    weights = zoo.init_weights(layers, 0)
    found = embedding_names(weights, yaml.safe_dump({"model": cfg}))
    assert found == {"embed.tok.weight", "embed.pos.weight"}
    assert "head.weight" not in found  # a dense [vocab, d] kernel, transposed on export
    custom = {"enc.embedding.weight": np.zeros((3, 2)), "fc.weight": np.zeros((3, 2))}
    assert embedding_names(custom, None) == {"enc.embedding.weight"}
    assert embedding_names(custom, None, ["fc.*"]) == {"enc.embedding.weight", "fc.weight"}


@pytest.mark.parametrize(
    "to,out,extra,says",
    [
        ("keras", "model.keras", [], "--to keras writes hpctrain's per-layer weights"),
        ("keras", "model.weights.h5", [], "name it otherwise (model-keras.h5)"),
        ("torch", "model.pt", ["--keep-layout", "emb*"], "--keep-layout applies to --to keras"),
    ],
)
def test_export_options_that_would_mislead_are_refused_before_reading(
    tmp_path, to, out, extra, says, capsys
):
    """--to keras into a Keras model's or Keras weights' name loaded nowhere; --keep-layout
    with another form did nothing."""
    missing = tmp_path / "not-read.h5"  # refused before the checkpoint is opened
    code = cli_main(["ckpt", "export", str(missing), "--to", to, str(tmp_path / out), *extra])
    assert code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / out).exists()
