"""User-supplied models for tests: `model.name: usermodels:torch_net` etc."""


def torch_net(width=8):
    from torch import nn

    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 10))


def keras_net(width=8):
    import keras

    return keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10)]
    )


def keras_net_with_unused_head(width=8):
    """A subclassed Keras model with a layer that never reaches the loss (an auxiliary
    head used elsewhere): its variables get no gradient from the tape."""
    import keras

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.body = keras.layers.Dense(width, activation="relu")
            self.head = keras.layers.Dense(10)
            self.unused = keras.layers.Dense(10)

        def build(self, shape):
            self.body.build(shape)
            self.head.build((None, width))
            self.unused.build((None, width))

        def call(self, x, training=False):
            return self.head(self.body(x))

    return Net()
