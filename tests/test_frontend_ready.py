"""Every frontend says a gradient ready only once it holds its final value, and says every
variable ready exactly once a step: sync replicas reduce a gradient (and may update its
variable) as soon as it is said, so a gradient said before it is written is summed as
whatever the buffer held. The transport here snapshots the buffer at each ``ready`` and
compares the snapshot with what the buffer holds when the step returns: the native models
(the built-in MLP, a ``mpips.layers`` Sequential), ``mpips.torch.Model`` and
``mpips.jax.Model``, two steps each. In process and cheap (tiny models)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import need

from mpips import layers
from mpips.models.contract import Model
from mpips.models.mlp import MLP

ROWS, INPUTS, CLASSES = 6, 36, 3


def mlp(monkeypatch: pytest.MonkeyPatch) -> Model:
    """The built-in MLP, its kernels' gradients written (and said) in blocks of rows."""
    monkeypatch.setattr(layers, "BLOCK_BYTES", 256)
    return MLP([INPUTS, 8, CLASSES])


def sequential(monkeypatch: pytest.MonkeyPatch) -> Model:
    """A small convolutional network of the layer library."""
    net = [
        layers.Reshape((1, 6, 6)),
        layers.Conv2D(2, 3),
        layers.ReLU(),
        layers.MaxPool2D(2),
        layers.Flatten(),
        layers.Dense(5),
        layers.Tanh(),
        layers.Dense(CLASSES),
    ]
    return layers.Sequential(net, (INPUTS,))


def torch_model(monkeypatch: pytest.MonkeyPatch) -> Model:
    """A torch module whose first layer's weight is used twice (two contributions to one
    gradient: final only after the second)."""
    torch = need("torch")
    mt = pytest.importorskip("mpips.torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(INPUTS, INPUTS)
            self.b = torch.nn.Linear(INPUTS, CLASSES)

        def forward(self, x: Any) -> Any:
            return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))

    torch.manual_seed(0)
    return mt.Model(Net(), torch.nn.CrossEntropyLoss())


def jax_model(monkeypatch: pytest.MonkeyPatch) -> Model:
    """A JAX loss over a nested pytree (a list of layers, a dict each)."""
    jax = need("jax")
    mj = pytest.importorskip("mpips.jax")
    jnp = jax.numpy

    def init(key: Any) -> Any:
        k0, k1 = jax.random.split(key)
        return {
            "layers": [
                {"w": jax.random.normal(k0, (INPUTS, 5)) * 0.3, "b": jnp.zeros(5)},
                {"w": jax.random.normal(k1, (5, CLASSES)) * 0.3, "b": jnp.zeros(CLASSES)},
            ]
        }

    def loss(params: Any, x: Any, y: Any) -> Any:
        h = x
        for layer in params["layers"]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        picked = jnp.take_along_axis(jax.nn.log_softmax(h), y.astype(jnp.int32)[:, None], 1)
        return -picked.mean(), {}

    return mj.Model(loss, init)


FRONTENDS: dict[str, Callable[[pytest.MonkeyPatch], Model]] = {
    "mlp": mlp,
    "layers": sequential,
    "torch": torch_model,
    "jax": jax_model,
}


def step_with_snapshots(
    model: Model, params: dict[str, Any], grads: dict[str, np.ndarray], seed: int
) -> dict[str, list[tuple[int | None, np.ndarray]]]:
    """One ``loss_and_grads`` into ``grads`` (filled with NaN first: nothing of an earlier
    step survives), each ``ready(name[, rows])`` answered by a copy of what it says is
    final (the buffer, or its first ``rows`` rows) at that moment."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, INPUTS)).astype(np.float32)
    y = rng.integers(0, CLASSES, ROWS)
    for g in grads.values():
        g.fill(np.nan)
    said: dict[str, list[tuple[int | None, np.ndarray]]] = {}

    def ready(name: str, rows: int | None = None) -> None:
        g = grads.get(name)
        then = None if g is None else (g if rows is None else g[:rows]).copy()
        said.setdefault(name, []).append((rows, then))

    model.loss_and_grads(params, x, y, grads, ready)
    return said


def problems(
    model: Model,
    grads: dict[str, np.ndarray],
    said: dict[str, list[tuple[int | None, np.ndarray]]],
) -> list[str]:
    """What the step's ``ready`` calls got wrong, one line each: a name that is no
    variable, a variable said never or more than once (whole: no rows, or all of them),
    rows said again after the whole, fewer rows than before, or a snapshot that is not the
    final value."""
    out = [f"{n}: said ready, but is no variable" for n in said if n not in grads]
    for spec in model.variables():
        name, final = spec.name, grads[spec.name]
        calls = said.get(name, [])
        if not np.isfinite(final).all():
            out.append(f"{name}: not written (NaN left in the buffer)")
        whole = [i for i, (rows, _) in enumerate(calls) if rows in (None, len(final))]
        if len(whole) != 1:
            out.append(f"{name}: said ready whole {len(whole)} times, not once")
        elif whole[0] != len(calls) - 1:
            out.append(f"{name}: said ready again after it was said whole")
        seen = [len(final) if rows is None else rows for rows, _ in calls]
        if seen != sorted(seen):
            out.append(f"{name}: rows said ready went back ({seen})")
        for rows, then in calls:
            now = final if rows is None else final[:rows]
            if not np.array_equal(then, now):
                what = "whole" if rows is None else f"rows :{rows}"
                out.append(f"{name}: said ready ({what}) before it held its final value")
    return out


@pytest.mark.parametrize("frontend", sorted(FRONTENDS))
def test_a_gradient_is_said_ready_only_once_it_is_final(frontend, monkeypatch):
    """Two steps (the first binds buffers, compiles or checks; the second is a plain one),
    the same push buffers both times, as a worker keeps them."""
    model = FRONTENDS[frontend](monkeypatch)
    params = model.initial_values(0)
    grads = {s.name: np.zeros(s.shape, s.dtype) for s in model.variables()}
    for step in range(2):
        said = step_with_snapshots(model, params, grads, seed=step)
        assert problems(model, grads, said) == [], f"step {step + 1}"
