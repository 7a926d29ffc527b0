import numpy as np

from mpips.nn import MLP
from mpips.optim import apply_sgd


def test_gradients_match_finite_differences():
    model = MLP([5, 7, 3])
    params = {k: v.astype(np.float64) for k, v in model.initial_values(0).items()}
    params = {
        k: v + 0.1 * np.random.default_rng(1).standard_normal(v.shape) for k, v in params.items()
    }
    x = np.random.default_rng(2).standard_normal((6, 5))
    y = np.array([0, 1, 2, 1, 0, 2])
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    model.loss_and_grads(params, x, y, grads)
    eps = 1e-6
    for name, p in params.items():
        for idx in [(0,) * p.ndim, tuple(s - 1 for s in p.shape)]:
            old = p[idx]
            p[idx] = old + eps
            up = model.evaluate(params, x, y)["loss"]
            p[idx] = old - eps
            down = model.evaluate(params, x, y)["loss"]
            p[idx] = old
            assert abs((up - down) / (2 * eps) - grads[name][idx]) < 1e-6, name


def test_sgd_steps_reduce_loss():
    model = MLP([4, 8, 2])
    params = model.initial_values(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    first = model.loss_and_grads(params, x, y, grads)
    for _ in range(50):
        model.loss_and_grads(params, x, y, grads)
        for k in params:
            apply_sgd(params[k], grads[k], 0.5)
    assert model.evaluate(params, x, y)["loss"] < first / 3


def test_the_mlp_reports_auc_on_two_classes():
    """A binary dense task gets the AUC of the second class's logit margin (like the CTR
    models), and none with more classes."""
    from mpips.metrics import auc
    from mpips.nn import MLP

    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = MLP([5, 8, 2])
    params = model.initial_values(0)
    got = model.evaluate(params, x, y)
    z = model.logits(params, x)
    assert got["auc"] == auc(y, z[:, 1] - z[:, 0]) and 0 <= got["auc"] <= 1
    assert "auc" not in MLP([5, 8, 3]).evaluate(MLP([5, 8, 3]).initial_values(0), x, y)
