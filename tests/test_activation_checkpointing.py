"""Activation checkpointing (`model.checkpoint_activations`, transformer blocks): exact
gradients in both backends, and fewer activation bytes kept for backward (measured with
torch's saved-tensor hooks, which see every tensor autograd keeps)."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.config import Config
from hpctrain.errors import ConfigError
from hpctrain.models import zoo

INP = zoo.InputSpec(shape=(32,), classes=50, tokens=True)
MODEL = {"name": "transformer", "d_model": 32, "n_layers": 3, "n_heads": 4, "d_ff": 64}


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, INP.classes, size=(8, 32)).astype(np.int64)
    y = rng.integers(0, INP.classes, size=(8, 32)).astype(np.int64)
    return x, y


def _torch_grads(recompute: bool):
    import torch

    from hpctrain.backends.torch import backward_mean_loss, build_model

    torch.manual_seed(0)
    model = build_model({**MODEL, "checkpoint_activations": recompute}, INP, seed=3)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backward_mean_loss(model, [_batch()])
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return grads, sum(saved)


def test_torch_gradients_are_exact_and_fewer_activations_are_kept():
    plain, plain_bytes = _torch_grads(False)
    ckpt, ckpt_bytes = _torch_grads(True)
    assert plain.keys() == ckpt.keys()
    for name in plain:
        np.testing.assert_allclose(ckpt[name], plain[name], rtol=0, atol=1e-6, err_msg=name)
    # Kept for backward: the blocks' inputs only (their insides are recomputed). With 3
    # blocks of attention + MLP the saving is most of the activations.
    assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)


def _tf_grads(recompute: bool):
    import tensorflow as tf

    from hpctrain.backends.tensorflow import build_model

    net = build_model({**MODEL, "checkpoint_activations": recompute}, INP, seed=3)
    x, y = _batch()
    with tf.GradientTape() as tape:
        logits = net(tf.constant(x), training=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    grads = tape.gradient(loss, list(net.vars.values()))
    return {n: tf.convert_to_tensor(g).numpy() for n, g in zip(net.vars, grads, strict=True)}


def test_tensorflow_gradients_are_exact_and_equal_torch():
    plain, ckpt = _tf_grads(False), _tf_grads(True)
    for name in plain:
        np.testing.assert_allclose(ckpt[name], plain[name], rtol=0, atol=1e-6, err_msg=name)
    torch_grads, _ = _torch_grads(True)
    for name in plain:
        np.testing.assert_allclose(ckpt[name], torch_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "model, message",
    [
        ({**MODEL, "checkpoint_activations": "yes"}, "expected true or false"),
        (
            {**MODEL, "checkpoint_activations": True, "moe": {"experts": 2}},
            "not with model.moe",
        ),
        ({"name": "mlp", "checkpoint_activations": True}, "not an option of mlp"),
    ],
)
def test_bad_checkpoint_activations_settings_are_refused(model, message):
    with pytest.raises(ConfigError, match=message):
        Config({"model": model, "data": {"task": "tokens"}})
