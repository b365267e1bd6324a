"""User-supplied models for tests: `model.name: usermodels:torch_net` etc."""


def torch_net(width=8):
    from torch import nn

    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 10))


def keras_net(width=8):
    import keras

    return keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10)]
    )
