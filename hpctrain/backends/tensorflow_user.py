"""A user's Keras model (`model.name: module:function`): built, then one checked forward.

Keras convolves channels last, so the function gets `input_shape` as (H, W, C) for
images, and `KerasUserNet` turns hpctrain's channels-first batches (N, C, H, W) into
(N, H, W, C) before calling the model. Variables are keyed by their Keras path without
the outer model's own name (`dense1/kernel`, not `sequential_3/dense1/kernel`), and
Keras' layer-name counter is reset before the model is built, so keys are the same in
every process, however many models it built before, and name the layer that
`model.get_layer` finds (the export recipe relies on it).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..errors import ConfigError
from ..models import user, zoo

_SEED_STATES: OrderedDict = OrderedDict()  # the process's user model's seed states


def _is_seed_state(variable) -> bool:
    """A keras.random.SeedGenerator's state (the variable name Keras gives it)."""
    return variable.name == "seed_generator_state"


def seed_states() -> OrderedDict:
    """Key -> state variable of every SeedGenerator in the user model built last."""
    return _SEED_STATES


def keras_input_shape(inp: zoo.InputSpec) -> tuple[int, ...]:
    """One sample as the Keras model sees it: images channels last."""
    if len(inp.shape) == 3 and not inp.tokens:
        c, h, w = inp.shape
        return (h, w, c)
    return tuple(inp.shape)


def variable_key(model, path: str) -> str:
    """A variable's path relative to the model itself (stable across processes)."""
    prefix = f"{model.name}/"
    return path[len(prefix) :] if path.startswith(prefix) else path


class KerasUserNet:
    """A user's Keras model behind the surface the TF backend uses (vars, buffers, call)."""

    def __init__(self, model, channels_last: bool):
        self.model = model
        self.channels_last = channels_last
        self.index_variables()

    def index_variables(self) -> None:
        """(Re)read the model's variables; a model built lazily has them after a call.

        The states of the layers' SeedGenerators (Dropout, GaussianNoise, ...) are random
        state, not weights: they are never averaged, broadcast or cast to float with the
        buffers; the backend's `rng_state()` checkpoints them per rank instead.
        """
        m = self.model
        self.vars = OrderedDict((variable_key(m, v.path), v) for v in m.trainable_variables)
        rest = [(variable_key(m, v.path), v) for v in m.non_trainable_variables]
        self.buffers = OrderedDict((k, v) for k, v in rest if not _is_seed_state(v))
        self.seed_states = OrderedDict((k, v) for k, v in rest if _is_seed_state(v))
        _SEED_STATES.clear()
        _SEED_STATES.update(self.seed_states)

    @property
    def shapes(self) -> OrderedDict:
        """Every trainable variable's shape (as ZooNet.shapes: the backend's names)."""
        return OrderedDict((k, tuple(v.shape)) for k, v in self.vars.items())

    def __call__(self, x, training=False):
        if self.channels_last:
            import tensorflow as tf

            x = tf.transpose(x, [0, 2, 3, 1])
        return self.model(x, training=training)


def build_user_model(model_cfg: dict, inp: zoo.InputSpec, seed: int) -> KerasUserNet:
    """The user's keras.Model, seeded, with its input and output sizes checked."""
    import keras

    name = model_cfg["name"]
    fn = user.resolve(name)
    shape = keras_input_shape(inp)
    kwargs = user.builder_kwargs(fn, model_cfg, shape, inp.classes)
    # Keras numbers unnamed layers per process (dense, dense_1, ...): a process that built
    # a model before (a second Trainer, a notebook) would name the same layers otherwise
    # and find its own checkpoints "do not fit". Keras' reset of that counter:
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    import tensorflow as tf

    # A seeded global generator (the one `tf.random.get_global_generator()` returns):
    # without one TF seeds it at random, or refuses it under op determinism.
    tf.random.set_global_generator(tf.random.Generator.from_seed(seed))
    model = user.call_builder(fn, name, kwargs)
    if not isinstance(model, keras.Model):
        raise ConfigError(
            f"model.name {name}: returned {type(model).__name__}, not a keras.Model "
            "(backend: tensorflow)"
        )
    net = KerasUserNet(model, channels_last=shape != tuple(inp.shape))
    check_forward(net, name, inp)
    return net


def check_forward(net: KerasUserNet, name: str, inp: zoo.InputSpec) -> None:
    """ConfigError unless a batch of 2 samples gives logits of the data's shape.

    The call also builds a model declared without `keras.Input`, so its variables exist
    before the backend reads them.
    """
    x = np.zeros((2, *inp.shape), dtype=np.int64 if inp.tokens else np.float32)
    try:
        out = net(x, training=False)
    except Exception as exc:  # noqa: BLE001 - any failure here is a size mismatch to report
        shown = zoo.InputSpec(keras_input_shape(inp), inp.classes, inp.tokens)
        raise ConfigError(
            user.mismatch_message(name, shown.shape, inp.classes, inp.tokens, None, exc)
        ) from exc
    if not hasattr(out, "shape"):
        raise ConfigError(
            f"model.name {name}: the model returned {type(out).__name__}; hpctrain needs "
            "one tensor of logits"
        )
    shape = tuple(out.shape)
    problem = user.mismatch_message(name, inp.shape, inp.classes, inp.tokens, shape)
    if problem:
        raise ConfigError(problem)
    net.index_variables()


def decorrelate_ranks(seed: int, rank: int) -> None:
    """After the build, which seeded every rank alike (equal initial weights), rank
    `rank`'s own random streams for its random layers: each layer's SeedGenerator
    (its seed taken at construction) moved by the rank, and Keras's and TF's global
    generators reseeded, so replicas draw different dropout masks and noise for their
    different samples, as one process does across its batch. Rank 0 keeps its streams."""
    if not rank:
        return
    import keras
    import tensorflow as tf

    for state in _SEED_STATES.values():
        value = np.array(state.numpy())
        value.flat[0] = (int(value.flat[0]) + 1_000_003 * rank) % 2**32  # the seed word
        state.assign(value)
    keras.utils.set_random_seed(seed + rank)
    tf.random.set_global_generator(tf.random.Generator.from_seed(seed + rank))
