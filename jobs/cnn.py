"""A small convolutional network for 28x28 grey images, built from mpips' layer library as a
user would write it. Named from jobs/cnn_fashion_mnist.toml as ``model.kind = "cnn:build"``."""

from mpips.layers import Conv2D, Dense, Flatten, MaxPool2D, ReLU, Reshape, Sequential


def build(data, filters=(8, 16), hidden=64, seed=0):
    """28x28 -> conv 3x3 (filters[0]) -> pool -> conv 3x3 (filters[1]) -> pool -> dense."""
    side = int(round(data.num_inputs**0.5))
    return Sequential(
        [
            Reshape((1, side, side)),
            Conv2D(filters[0], 3, padding=1),
            ReLU(),
            MaxPool2D(2),
            Conv2D(filters[1], 3, padding=1),
            ReLU(),
            MaxPool2D(2),
            Flatten(),
            Dense(hidden),
            ReLU(),
            Dense(data.num_classes),
        ],
        input_shape=(data.num_inputs,),
        seed=seed,
    )
