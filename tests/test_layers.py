"""The layer library: every layer's backward against central differences in float64 (run
through Sequential, so the code that trains is the code checked), shapes, and a Sequential
model that learns."""

import numpy as np
import pytest

from mpips.layers import (
    Conv2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    MaxPool2D,
    ReLU,
    Reshape,
    Sequential,
    Sigmoid,
    Tanh,
)


def as64(values):
    return {k: v.astype(np.float64) for k, v in values.items()}


def numeric_check(model, x, y, params, eps=1e-6, samples=25, tol=1e-5):
    """Compare every variable's analytic gradient with central differences at ``samples``
    random entries (and the input-free loss, so dropout must be off or seeded alike)."""
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    model.steps = 0
    model.loss_and_grads(params, x, y, grads)
    rng = np.random.default_rng(1)
    for name, value in params.items():
        flat = value.reshape(-1)
        for i in rng.choice(flat.size, min(samples, flat.size), replace=False):
            old = flat[i]
            flat[i] = old + eps
            model.steps = 0
            up = model.loss_and_grads(
                params, x, y, {k: np.zeros_like(v) for k, v in params.items()}
            )
            flat[i] = old - eps
            model.steps = 0
            down = model.loss_and_grads(
                params, x, y, {k: np.zeros_like(v) for k, v in params.items()}
            )
            flat[i] = old
            numeric = (up - down) / (2 * eps)
            analytic = grads[name].reshape(-1)[i]
            assert abs(numeric - analytic) <= tol * max(1.0, abs(numeric)), (
                name,
                int(i),
                numeric,
                analytic,
            )


CASES = {
    "dense+tanh": ([Dense(7), Tanh(), Dense(3)], (5,), "softmax_cross_entropy"),
    "dense+sigmoid, logistic": ([Dense(4), Sigmoid(), Dense(1)], (5,), "logistic"),
    "conv stride 1 pad 1 + relu + pool": (
        [Reshape((2, 6, 6)), Conv2D(3, 3, padding=1), ReLU(), MaxPool2D(2), Flatten(), Dense(4)],
        (72,),
        "softmax_cross_entropy",
    ),
    "conv stride 2 no pad, odd size, pool drops a row": (
        [Reshape((1, 7, 7)), Conv2D(2, 3, stride=2), MaxPool2D(2), Flatten(), Dense(3)],
        (49,),
        "softmax_cross_entropy",
    ),
    "embedding sum": ([Embedding(11, 4), Dense(3)], (6,), "softmax_cross_entropy"),
    "embedding mean": ([Embedding(11, 4, "mean"), ReLU(), Dense(1)], (6,), "logistic"),
    "dropout (same mask each evaluation)": (
        [Dense(6), Dropout(0.5), Dense(3)],
        (5,),
        "softmax_cross_entropy",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_layer_backward_matches_central_differences(case):
    layers, in_shape, loss = CASES[case]
    model = Sequential(layers, in_shape, loss, seed=3)
    rng = np.random.default_rng(0)
    n = 4
    if isinstance(layers[0], Embedding):
        x = rng.integers(0, 11, (n, *in_shape)).astype(np.float64)
    else:
        x = rng.normal(size=(n, *in_shape))
    y = rng.integers(0, 2 if loss == "logistic" else 3, n)
    params = as64(model.initial_values(0))
    for k in params:  # biases off zero, so a wrong bias gradient shows
        params[k] += rng.normal(0, 0.1, params[k].shape)
    numeric_check(model, x, y, params)


def test_a_broken_backward_fails_the_check():
    class Wrong(ReLU):
        def backward(self, xp, params, mask, dy, grads):
            return dy  # forgets the mask

    model = Sequential([Dense(6), Wrong(), Dense(3)], (5,))
    rng = np.random.default_rng(0)
    params = as64(model.initial_values(0))
    with pytest.raises(AssertionError):
        numeric_check(model, rng.normal(size=(4, 5)), rng.integers(0, 3, 4), params)


def test_shapes_names_and_bad_stacks():
    model = Sequential(
        [
            Reshape((1, 28, 28)),
            Conv2D(8, 3, padding=1),
            ReLU(),
            MaxPool2D(2),
            Conv2D(16, 3, padding=1),
            ReLU(),
            MaxPool2D(2),
            Flatten(),
            Dense(10),
        ],
        (784,),
    )
    assert model.output_shape == (10,)
    assert [v.name for v in model.variables()] == [
        "conv_1/kernel",
        "conv_1/bias",
        "conv_4/kernel",
        "conv_4/bias",
        "dense_8/kernel",
        "dense_8/bias",
    ]
    assert dict((v.name, v.shape) for v in model.variables())["dense_8/kernel"] == (784, 10)
    with pytest.raises(ValueError, match="Dense takes flat inputs"):
        Sequential([Reshape((1, 4, 4)), Dense(3)], (16,))
    with pytest.raises(ValueError, match="does not hold"):
        Sequential([Reshape((1, 5, 5))], (16,))
    with pytest.raises(ValueError, match="loss is one of"):
        Sequential([Dense(2)], (3,), loss="hinge")


def test_dropout_is_seeded_by_worker_and_step_and_off_in_evaluation():
    def masks(worker):
        model = Sequential([Dense(8), Dropout(0.5), Dense(2)], (4,), seed=7)
        model.worker = worker
        params = model.initial_values(0)
        x, y = np.ones((16, 4), np.float32), np.zeros(16, int)
        out = []
        for _ in range(2):
            grads = {k: np.zeros_like(v) for k, v in params.items()}
            model.loss_and_grads(params, x, y, grads)
            out.append(grads["dense_0/kernel"].copy())
        return out, model, params, x

    (a1, a2), model, params, x = masks(0)
    (b1, _), _, _, _ = masks(0)
    (c1, _), _, _, _ = masks(1)
    assert np.array_equal(a1, b1)  # same worker, same step: same mask
    assert not np.array_equal(a1, a2)  # the next step draws another
    assert not np.array_equal(a1, c1)  # another worker draws another
    first = model.forward(params, x)[0]
    assert np.array_equal(first, model.forward(params, x)[0])  # evaluation: no dropout


def test_a_small_cnn_learns_the_digits_in_one_process():
    from mpips.data.batches import load_split, open_dataset, resolve_path

    info = open_dataset(resolve_path("", "digits"))
    x, y = load_split(info, "train")
    xt, yt = load_split(info, "test")
    model = Sequential(
        [Reshape((1, 8, 8)), Conv2D(8, 3, padding=1), ReLU(), MaxPool2D(2), Flatten(), Dense(10)],
        (64,),
    )
    params = model.initial_values(0)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    rng = np.random.default_rng(0)
    for _ in range(300):
        i = rng.integers(0, len(x), 32)
        model.loss_and_grads(params, x[i], y[i], grads)
        for k in params:
            params[k] -= 0.1 * grads[k]
    assert model.evaluate(params, xt, yt)["accuracy"] > 0.9
