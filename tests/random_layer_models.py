"""User models with random layers (`model.name: random_layer_models:<fn>`), for
tests/test_random_layers_resume.py: dropout and Gaussian noise draw new numbers every
training step, so a resume is bit for bit only if their random state is checkpointed."""


def torch_dropout(input_shape, classes, width=32):
    from torch import nn

    return nn.Sequential(
        nn.Linear(input_shape[0], width),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(width, classes),
    )


def keras_dropout(input_shape, classes, width=32):
    import keras

    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.GaussianNoise(0.1),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(classes),
        ]
    )


def keras_unseeded_noise(input_shape, classes, width=32):
    """Draws from keras.random and tf.random with no seed generator of its own: the
    global Keras seed generator and TF's global generator."""
    import keras
    import tensorflow as tf

    class Noise(keras.layers.Layer):
        def call(self, x, training=False):
            if not training:
                return x
            x = x + keras.random.normal(tf.shape(x), stddev=0.1)
            return x + 0.1 * tf.random.get_global_generator().normal(tf.shape(x))

    return keras.Sequential(
        [
            keras.Input(input_shape),
            Noise(),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(classes),
        ]
    )
