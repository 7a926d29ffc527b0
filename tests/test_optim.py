"""Update rules against independent textbook formulas; schedules; clipping."""

from types import SimpleNamespace

import numpy as np
import pytest

from mpips.optim import Optimizer, clip_by_global_norm, learning_rate

RNG = np.random.default_rng(0)
GRADS = [RNG.standard_normal(5) for _ in range(4)]
VAR0 = RNG.standard_normal(5)
HYPER = {
    "momentum": 0.9,
    "nesterov": False,
    "epsilon": 1e-7,
    "initial_accumulator_value": 0.1,
    "beta1": 0.9,
    "beta2": 0.999,
    "l1": 0.05,
    "l2": 0.01,
}


def reference(kind, lr, hyper):
    """The same rules as papers/TF write them, one scalar formula at a time (float64)."""
    var, state = VAR0.copy(), {}
    for t, g in enumerate(GRADS, start=1):
        if kind == "sgd":
            var = var - lr * g
        elif kind == "momentum":
            m = hyper["momentum"] * state.get("m", 0) + g
            state["m"] = m
            var = var - lr * (g + hyper["momentum"] * m if hyper["nesterov"] else m)
        elif kind == "adagrad":
            acc = state.get("acc", hyper["initial_accumulator_value"]) + g**2
            state["acc"] = acc
            var = var - lr * g / (np.sqrt(acc) + hyper["epsilon"])
        elif kind == "adam":
            b1, b2 = hyper["beta1"], hyper["beta2"]
            m = b1 * state.get("m", 0) + (1 - b1) * g
            v = b2 * state.get("v", 0) + (1 - b2) * g**2
            state.update(m=m, v=v)
            mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
            # TF folds the bias correction into the step: epsilon scales by 1 / sqrt(1 - b2^t)
            var = var - lr * mhat / (np.sqrt(vhat) + hyper["epsilon"] / np.sqrt(1 - b2**t))
        elif kind == "ftrl":
            n_old = state.get("n", hyper["initial_accumulator_value"])
            n = n_old + g**2
            z = state.get("z", 0) + g - (np.sqrt(n) - np.sqrt(n_old)) / lr * var
            state.update(n=n, z=z)
            var = np.where(
                np.abs(z) <= hyper["l1"],
                0.0,
                -(z - np.sign(z) * hyper["l1"]) / (np.sqrt(n) / lr + 2 * hyper["l2"]),
            )
    return var, state


@pytest.mark.parametrize(
    "kind,nesterov",
    [
        ("sgd", False),
        ("momentum", False),
        ("momentum", True),
        ("adagrad", False),
        ("adam", False),
        ("ftrl", False),
    ],
)
def test_rule_matches_textbook(kind, nesterov):
    hyper = dict(HYPER, nesterov=nesterov)
    opt = Optimizer(kind, hyper)
    var = VAR0.copy()
    slots = opt.init_slots(var)
    for t, g in enumerate(GRADS, start=1):
        opt.apply(var, g, slots, 0.1, t)
    want, state = reference(kind, 0.1, hyper)
    np.testing.assert_allclose(var, want, rtol=1e-10, atol=1e-12)
    if kind == "adagrad":
        np.testing.assert_allclose(slots["accumulator"], state["acc"], rtol=1e-12)
    if kind == "ftrl":
        np.testing.assert_allclose(slots["z"], state["z"], rtol=1e-10)
        np.testing.assert_allclose(slots["n"], state["n"], rtol=1e-12)


def test_ftrl_l1_gives_exact_zeros():
    opt = Optimizer("ftrl", dict(HYPER, l1=10.0))
    var = VAR0.astype(np.float32)
    slots = opt.init_slots(var)
    opt.apply(var, GRADS[0].astype(np.float32), slots, 0.1, 1)
    assert var.dtype == np.float32 and not var.any()


def test_slots_per_optimizer():
    assert Optimizer("sgd").slots == () and not Optimizer("sgd").stateful
    assert Optimizer("adam", HYPER).slots == ("m", "v")
    init = Optimizer("adagrad", HYPER).init_slots(np.zeros(3, np.float32))
    assert init["accumulator"].dtype == np.float32 and (init["accumulator"] == 0.1).all()


def cfg(**kw):
    base = dict(
        learning_rate=1.0, schedule="constant", decay_rate=0.5, decay_steps=10, warmup_steps=0
    )
    return SimpleNamespace(**dict(base, **kw))


def test_schedules():
    assert learning_rate(cfg(), 123) == 1.0
    assert learning_rate(cfg(schedule="exponential"), 5) == pytest.approx(0.5**0.5)
    assert learning_rate(cfg(schedule="step"), 19) == 0.5
    assert learning_rate(cfg(schedule="step"), 20) == 0.25
    warm = cfg(warmup_steps=4)
    assert [learning_rate(warm, s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_clip_by_global_norm():
    a, b = np.array([3.0, 0.0]), np.array([4.0])
    assert clip_by_global_norm([a, b], 10.0) == 5.0 and a[0] == 3.0
    assert clip_by_global_norm([a, b], 1.0) == 5.0
    np.testing.assert_allclose(np.concatenate([a, b]), [0.6, 0.0, 0.8])
