"""Models a new user brings (`model.name: first_hour_models:<fn>`), for tests/test_first_hour.py
and tests/test_export_roundtrip.py. Plain torch / Keras, nothing from hpctrain."""


def torch_sized(input_shape, classes, width=16):
    """Sized from the data: hpctrain passes input_shape and classes."""
    import math

    from torch import nn

    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(), nn.Linear(width, classes)
    )


def torch_fixed(width=8):
    """Fixed at 32 inputs and 10 classes, whatever the data holds."""
    from torch import nn

    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 10))


def keras_sized(input_shape, num_classes, width=16):
    """The issue's model: a `dense1` of 64 units over 20 features, 3 classes."""
    import keras

    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(width, activation="relu", name="dense1"),
            keras.layers.Dense(num_classes, name="out"),
        ]
    )


def keras_fixed(width=8):
    import keras

    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(width, name="d1"),
            keras.layers.Dense(10, name="d2"),
        ]
    )


def keras_conv(input_shape, classes):
    """Channels last, as Keras convolves: hpctrain passes (H, W, C)."""
    import keras

    L = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape),
            L.Conv2D(8, 3, padding="same", activation="relu", name="conv"),
            L.GlobalAveragePooling2D(name="pool"),
            L.Dense(classes, name="head"),
        ]
    )


def torch_conv(input_shape, classes):
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(input_shape[0], 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, classes),
    )


def broken(width=8):
    raise ValueError(f"width {width} is not supported")
