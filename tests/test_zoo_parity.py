"""Every zoo model is the same network in both backends: identical weights give the same
outputs, and one training step moves the weights the same way."""

import numpy as np
import pytest

from hpctrain import Config
from hpctrain.models import zoo

CASES = {
    "mlp": (["model.name=mlp"], zoo.InputSpec((12,), 5)),
    "cnn": (["model.name=cnn", "data.task=images"], zoo.InputSpec((3, 8, 8), 4)),
    "resnet": (
        ["model.name=resnet", "data.task=images", "model.width=4"],
        zoo.InputSpec((3, 8, 8), 4),
    ),
    "transformer": (
        [
            "model.name=transformer",
            "data.task=tokens",
            "model.d_model=16",
            "model.n_heads=2",
            "model.d_ff=32",
        ],
        zoo.InputSpec((6,), 11, tokens=True),
    ),
}


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import world

    return world()


def _backends(world, overrides, inp):
    from hpctrain.backends.tensorflow import TensorFlowBackend
    from hpctrain.backends.torch import TorchBackend

    cfg = Config.load(None, [*overrides, "optimizer.name=sgd", "optimizer.lr=0.1"])
    return TorchBackend(cfg, world, inp, 1), TensorFlowBackend(cfg, world, inp, 1)


def _batch(inp, n, seed):
    rng = np.random.default_rng(seed)
    if inp.tokens:
        x = rng.integers(0, inp.classes, (n, *inp.shape))
        return x, rng.integers(0, inp.classes, (n, *inp.shape))
    return rng.standard_normal((n, *inp.shape)).astype(np.float32), rng.integers(0, inp.classes, n)


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_weights_same_outputs_and_same_step(world, name):
    overrides, inp = CASES[name]
    bt, bf = _backends(world, overrides, inp)
    wt, wf = bt.get_weights(), bf.get_weights()
    assert sorted(wt) == sorted(wf)  # the same canonical names
    for k in wt:
        np.testing.assert_array_equal(wt[k], wf[k], err_msg=k)  # same initial values
    x, y = _batch(inp, 8, 1)
    out_t, out_f = bt.predict(x), bf.predict(x)
    expected = (8, *inp.shape, inp.classes) if inp.tokens else (8, inp.classes)
    assert out_t.shape == out_f.shape == expected
    np.testing.assert_allclose(out_t, out_f, atol=1e-5)
    for step in range(2):
        st = bt.train_step([_batch(inp, 8, 10 + step)], 0.1)
        sf = bf.train_step([_batch(inp, 8, 10 + step)], 0.1)
        assert abs(st.loss_sum - sf.loss_sum) / st.count < 1e-5
    wt, wf = bt.get_weights(), bf.get_weights()
    moved = max(
        np.abs(wt[k] - v).max()
        for k, v in zoo.init_weights(
            zoo.build_layers(bt.cfg.model, inp), bt.cfg.train["seed"]
        ).items()
    )
    assert moved > 1e-3
    for k in wt:
        np.testing.assert_allclose(wt[k], wf[k], atol=2e-5, err_msg=k)
    np.testing.assert_allclose(bt.predict(x), bf.predict(x), atol=1e-4)


@pytest.mark.parametrize("zero", [0, 2])
def test_a_step_that_counts_no_predictions_trains_the_same(world, zero):
    """The loop asks for correct predictions on its logged steps only (tally): skipping
    the argmax changes no weight and no loss; torch then reports NaN, TF counts anyway."""
    overrides, inp = CASES["transformer"]
    overrides = [*overrides, f"train.zero={zero}"]
    (counted, _), (skipped, tf_backend) = (
        _backends(world, overrides, inp),
        _backends(world, overrides, inp),
    )
    for step in range(2):
        batch = [_batch(inp, 8, 20 + step)]
        a, b = counted.train_step(batch, 0.1), skipped.train_step(batch, 0.1, tally=False)
        assert a.loss_sum == b.loss_sum and 0 <= a.correct <= a.count and np.isnan(b.correct)
        assert 0 <= tf_backend.train_step(batch, 0.1, tally=False).correct <= a.count
    wa, wb = counted.get_weights(), skipped.get_weights()
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


def test_weights_from_one_backend_load_into_the_other(world):
    overrides, inp = CASES["cnn"]
    bt, bf = _backends(world, overrides, inp)
    x, y = _batch(inp, 8, 3)
    bt.train_step([(x, y)], 0.1)
    bf.set_weights(bt.get_weights())
    np.testing.assert_allclose(bt.predict(x), bf.predict(x), atol=1e-5)


def test_wrong_architecture_is_refused_with_names_and_shapes(world):
    overrides, inp = CASES["mlp"]
    bt, _ = _backends(world, overrides, inp)
    weights = bt.get_weights()
    weights["fc1.weight"] = weights["fc1.weight"][:, :3]
    del weights["head.bias"]
    weights["extra.weight"] = np.zeros(2, np.float32)
    with pytest.raises(ValueError) as err:
        bt.set_weights(weights)
    text = str(err.value)
    assert "missing ['head.bias']" in text and "unexpected ['extra.weight']" in text
    assert "fc1.weight: file (128, 3) vs model (128, 12)" in text


@pytest.mark.parametrize("kind", ["backend", "stage", "worker"])
def test_torch_and_tensorflow_implement_the_same_declared_interface(kind):
    """Each framework class offers every method of its Protocol (backends/base.py)."""
    import inspect

    from hpctrain.backends import backend_class, stage_class, worker_class
    from hpctrain.backends.base import PROTOCOLS

    get = {"backend": backend_class, "stage": stage_class, "worker": worker_class}[kind]
    wanted = {n for n, v in vars(PROTOCOLS[kind]).items() if inspect.isfunction(v) and n[0] != "_"}
    for name in ("torch", "tensorflow"):
        cls = get(name)
        missing = sorted(n for n in wanted if not callable(getattr(cls, n, None)))
        assert not missing, f"{cls.__name__} lacks {missing}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_initial_values_do_not_depend_on_how_they_are_drawn(name, monkeypatch):
    """Drawn a few elements at a time (no float64 temporary of a whole tensor), the
    initial values are those of one draw per tensor; tensor_shapes names every tensor
    in their order, with their shapes (a pipeline stage keeps its own), and
    iter_layer_weights gives them a layer at a time (the time partition's)."""
    overrides, inp = CASES[name]
    layers = zoo.build_layers(Config.load(None, overrides).model, inp)
    whole = zoo.init_weights(layers, 3)  # these models' tensors: one draw each
    monkeypatch.setattr(zoo, "DRAW_CHUNK", 5)
    cut = zoo.init_weights(layers, 3)
    assert all(np.array_equal(whole[k], cut[k]) and cut[k].dtype == np.float32 for k in whole)
    shapes = zoo.tensor_shapes(layers)
    assert list(shapes) == list(whole)
    assert all(shapes[k] == whole[k].shape for k in whole)
    per_layer = list(zoo.iter_layer_weights(layers, 3))  # one layer at a time
    assert len(per_layer) == len(layers)
    assert [k for d in per_layer for k in d] == list(whole)
    assert all(np.array_equal(d[k], whole[k]) for d in per_layer for k in d)
