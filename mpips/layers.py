"""Layers: ``DenseStack`` (the dense ReLU layers of the built-in MLP and of wide-and-deep),
and a layer library for models of your own (Dense, Conv2D, MaxPool2D, ReLU, Tanh, Sigmoid,
Flatten, Reshape, Dropout, Embedding; softmax cross-entropy and logistic losses) put
together with ``Sequential``, itself an ``mpips.Model``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import numpy as np

from .device import kernels as device_kernels
from .device.arrays import scatter_add, to_host
from .models.contract import Model, Ready
from .models.metrics import accuracy, auc
from .models.variables import VariableSpec


def he_uniform(
    rng: np.random.Generator, fan_in: int, fan_out: int
) -> tuple[np.ndarray, np.ndarray]:
    """A He-uniform ``(fan_in, fan_out)`` kernel and a zero bias (float32, on the host)."""
    limit = np.sqrt(6.0 / fan_in)
    return (
        rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32),
        np.zeros(fan_out, np.float32),
    )


def dense_forward(x: Any, kernel: Any, bias: Any) -> Any:
    """``x @ kernel + bias``: a dense layer, or a convolution on its im2col columns."""
    return x @ kernel + bias


BLOCK_BYTES = 256 << 10  # a kernel gradient reported to ``ready`` is written in blocks this big
# (512 KiB hid less of the reference MLP's exchange: docs/performance.md); on the host only:
# on a GPU each block is a launch (~65 us of host time in cupy) and a wait for its copy out,
# while the whole backward of the wide MLP takes ~1.5 ms there (H100, docs/performance.md)


def dense_backward(
    xp: ModuleType,
    x: Any,
    kernel: Any,
    dy: Any,
    grad_kernel: Any,
    grad_bias: Any,
    written: Callable[[int], None] | None = None,
    input_grad: bool = True,
) -> Any:
    """The gradients of ``dense_forward`` from ``dy``, the output's: bias and kernel into
    ``grad_bias`` and ``grad_kernel`` (in place), and the input's, returned (None unless
    ``input_grad``). ``written(rows)``, if given, is called once the bias and the first
    ``rows`` rows of the kernel are final (0 for the bias alone): then, on the host, the
    kernel's gradient is written in blocks of rows, so sync replicas can reduce the first
    while the rest are computed (on a device, whole). The input's gradient comes first:
    after ``written`` the kernel is not read (sync replicas may update it then)."""
    dx = dy @ kernel.T if input_grad else None
    dy.sum(axis=0, out=grad_bias)
    rows = grad_kernel.shape[0]
    step = rows
    if written is not None:
        written(0)
    if written is not None and xp is np:
        blocks = max(1, -(-grad_kernel.nbytes // BLOCK_BYTES))
        step = max(1, -(-rows // blocks))
    for first in range(0, rows, step):
        stop = min(rows, first + step)
        xp.matmul(x.T[first:stop], dy, out=grad_kernel[first:stop])
        if written is not None:
            written(stop)
    return dx


def _report(ready: Ready, bias: str, kernel: str, rows: int) -> None:
    """``dense_backward``'s progress as ``ready`` calls: the bias, then the kernel's rows."""
    if rows:
        ready(kernel, rows)
    else:
        ready(bias)


class DenseStack:
    """``sizes[0] -> ... -> sizes[-1]``, ReLU between layers (none after the last);
    variables ``{prefix}{i}/kernel`` and ``{prefix}{i}/bias`` in creation order."""

    def __init__(self, sizes: list[int], prefix: str = "dense_", xp: ModuleType = np):
        self.sizes, self.prefix, self.xp = list(sizes), prefix, xp
        self.num_layers = len(self.sizes) - 1
        self.names = [(f"{prefix}{i}/kernel", f"{prefix}{i}/bias") for i in range(self.num_layers)]

    def variables(self) -> list[VariableSpec]:
        return [
            VariableSpec(n, shape)
            for (k, b), (a, c) in zip(self.names, self._shapes(), strict=True)
            for n, shape in ((k, (a, c)), (b, (c,)))
        ]

    def _shapes(self) -> list[tuple[int, int]]:
        return list(zip(self.sizes[:-1], self.sizes[1:], strict=True))

    def initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """He-uniform kernels, zero biases (numpy, on the host), drawn in layer order."""
        out = {}
        for (k, b), (fan_in, fan_out) in zip(self.names, self._shapes(), strict=True):
            out[k], out[b] = he_uniform(rng, fan_in, fan_out)
        return out

    def forward(self, params: dict[str, Any], x: Any) -> tuple[Any, list[Any]]:
        """(output, activations): the input and every layer's output, for ``backward``."""
        acts, h = [x], x
        for i, (k, b) in enumerate(self.names):
            h = dense_forward(h, params[k], params[b])
            if i < self.num_layers - 1:
                h = self.xp.maximum(h, 0)
            acts.append(h)
        return h, acts

    def backward(
        self,
        params: dict[str, Any],
        acts: list[Any],
        d: Any,
        grads: dict[str, Any],
        ready: Ready | None = None,
        input_grad: bool = False,
    ) -> Any:
        """Gradients of every kernel and bias into ``grads`` (in place) from ``d``, the
        gradient of the output; ``ready(name)`` as each is written (last layer first).
        Returns the gradient of the input if ``input_grad``, else None."""
        for i in reversed(range(self.num_layers)):
            k, b = self.names[i]
            written = None if ready is None else partial(_report, ready, b, k)
            d = dense_backward(
                self.xp, acts[i], params[k], d, grads[k], grads[b], written, bool(i or input_grad)
            )
            if i:
                d *= acts[i] > 0
        return d


# -- the layer library: build a model as a Sequential of layers ------------------------------
#
# A layer maps a batch to a batch. It knows its output shape from its input shape (one
# example's shape, without the batch axis), declares its variables (relative names), makes
# their initial values, and has a forward pass (returning what backward needs) and a backward
# pass (writing its variables' gradients in place, returning the input's gradient). All of
# them compute with ``xp`` (numpy or cupy) and keep the dtype they are given, so a float64
# gradient check runs the very code that trains.

Shape = tuple[int, ...]


class Layer:
    """Base of the layer library; stateless layers override only forward/backward."""

    name = "layer"

    def build(self, in_shape: Shape) -> Shape:
        """Set up for inputs of ``in_shape`` (one example); returns the output shape."""
        return in_shape

    def variables(self) -> list[tuple[str, Shape]]:
        return []

    def initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {}

    def forward(
        self,
        xp: ModuleType,
        params: dict[str, Any],
        x: Any,
        train: bool,
        rng: np.random.Generator | None = None,
    ) -> tuple[Any, Any]:
        raise NotImplementedError

    def backward(
        self, xp: ModuleType, params: dict[str, Any], cache: Any, dy: Any, grads: dict[str, Any]
    ) -> Any:
        raise NotImplementedError


class Dense(Layer):
    """``x @ kernel + bias`` on the last axis; He-uniform kernel, zero bias."""

    name = "dense"

    def __init__(self, units: int):
        self.units = units

    def build(self, in_shape: Shape) -> Shape:
        if len(in_shape) != 1:
            raise ValueError(f"Dense takes flat inputs, got shape {in_shape}: add Flatten()")
        self.fan_in = in_shape[0]
        return (self.units,)

    def variables(self) -> list[tuple[str, Shape]]:
        return [("kernel", (self.fan_in, self.units)), ("bias", (self.units,))]

    def initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return dict(zip(("kernel", "bias"), he_uniform(rng, self.fan_in, self.units), strict=True))

    def forward(self, xp, params, x, train, rng=None):
        return dense_forward(x, params["kernel"], params["bias"]), x

    def backward(self, xp, params, x, dy, grads):
        return dense_backward(xp, x, params["kernel"], dy, grads["kernel"], grads["bias"])


class Conv2D(Layer):
    """2-D convolution of ``(channels, height, width)`` inputs: ``filters`` kernels of
    ``size`` x ``size``, ``stride``, zero ``padding``; im2col, so one matmul a batch."""

    name = "conv"

    def __init__(self, filters: int, size: int = 3, stride: int = 1, padding: int = 0):
        self.filters, self.size, self.stride, self.padding = filters, size, stride, padding

    def build(self, in_shape: Shape) -> Shape:
        if len(in_shape) != 3:
            raise ValueError(
                f"Conv2D takes (channels, height, width), got {in_shape}: "
                f"add Reshape((1, H, W)) for images"
            )
        c, h, w = in_shape
        k, s, p = self.size, self.stride, self.padding
        self.in_shape = in_shape
        self.out_hw = ((h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1)
        if min(self.out_hw) < 1:
            raise ValueError(f"Conv2D: a {k}x{k} kernel does not fit {h}x{w} (padding {p})")
        return (self.filters, *self.out_hw)

    def variables(self) -> list[tuple[str, Shape]]:
        c = self.in_shape[0]
        return [("kernel", (c * self.size * self.size, self.filters)), ("bias", (self.filters,))]

    def initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        fan_in = self.in_shape[0] * self.size * self.size
        return dict(zip(("kernel", "bias"), he_uniform(rng, fan_in, self.filters), strict=True))

    def _cols(self, xp: ModuleType, x: Any) -> Any:
        k, s, p = self.size, self.stride, self.padding
        if p:
            x = xp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
        oh, ow = self.out_hw
        win = xp.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))
        win = win[:, :, : s * (oh - 1) + 1 : s, : s * (ow - 1) + 1 : s]  # (n, c, oh, ow, k, k)
        return win.transpose(0, 2, 3, 1, 4, 5).reshape(len(x) * oh * ow, -1)

    def forward(self, xp, params, x, train, rng=None):
        cols = self._cols(xp, x)
        oh, ow = self.out_hw
        out = dense_forward(cols, params["kernel"], params["bias"])
        return out.reshape(len(x), oh, ow, self.filters).transpose(0, 3, 1, 2), (cols, len(x))

    def backward(self, xp, params, cache, dy, grads):
        cols, n = cache
        k, s, p = self.size, self.stride, self.padding
        c, h, w = self.in_shape
        oh, ow = self.out_hw
        d2 = dy.transpose(0, 2, 3, 1).reshape(-1, self.filters)
        dcols = dense_backward(xp, cols, params["kernel"], d2, grads["kernel"], grads["bias"])
        dcols = dcols.reshape(n, oh, ow, c, k, k)
        dx = xp.zeros((n, c, h + 2 * p, w + 2 * p), dy.dtype)
        for i in range(k):  # col2im: k*k strided adds, each over the whole batch
            for j in range(k):
                dx[:, :, i : i + s * (oh - 1) + 1 : s, j : j + s * (ow - 1) + 1 : s] += dcols[
                    :, :, :, :, i, j
                ].transpose(0, 3, 1, 2)
        return dx[:, :, p : p + h, p : p + w] if p else dx


class MaxPool2D(Layer):
    """Max over non-overlapping ``size`` x ``size`` windows of ``(channels, h, w)`` inputs
    (rows and columns that do not fill a window are dropped)."""

    name = "pool"

    def __init__(self, size: int = 2):
        self.size = size

    def build(self, in_shape: Shape) -> Shape:
        if len(in_shape) != 3:
            raise ValueError(f"MaxPool2D takes (channels, height, width), got {in_shape}")
        c, h, w = in_shape
        self.out = (c, h // self.size, w // self.size)
        if min(self.out[1:]) < 1:
            raise ValueError(f"MaxPool2D: a {self.size}x{self.size} window does not fit {h}x{w}")
        return self.out

    def forward(self, xp, params, x, train, rng=None):
        c, oh, ow = self.out
        k = self.size
        blocks = x[:, :, : oh * k, : ow * k].reshape(len(x), c, oh, k, ow, k)
        blocks = blocks.transpose(0, 1, 2, 4, 3, 5).reshape(len(x), c, oh, ow, k * k)
        arg = blocks.argmax(axis=-1)
        return xp.take_along_axis(blocks, arg[..., None], -1)[..., 0], (x.shape, arg)

    def backward(self, xp, params, cache, dy, grads):
        shape, arg = cache
        c, oh, ow = self.out
        k = self.size
        blocks = xp.zeros((shape[0], c, oh, ow, k * k), dy.dtype)
        xp.put_along_axis(blocks, arg[..., None], dy[..., None], -1)
        dx = xp.zeros(shape, dy.dtype)
        dx[:, :, : oh * k, : ow * k] = (
            blocks.reshape(shape[0], c, oh, ow, k, k)
            .transpose(0, 1, 2, 4, 3, 5)
            .reshape(shape[0], c, oh * k, ow * k)
        )
        return dx


class ReLU(Layer):
    name = "relu"

    def forward(self, xp, params, x, train, rng=None):
        return xp.maximum(x, 0), x > 0

    def backward(self, xp, params, mask, dy, grads):
        return dy * mask


class Tanh(Layer):
    name = "tanh"

    def forward(self, xp, params, x, train, rng=None):
        y = xp.tanh(x)
        return y, y

    def backward(self, xp, params, y, dy, grads):
        return dy * (1 - y * y)


class Sigmoid(Layer):
    name = "sigmoid"

    def forward(self, xp, params, x, train, rng=None):
        y = sigmoid(xp, x)
        return y, y

    def backward(self, xp, params, y, dy, grads):
        return dy * y * (1 - y)


class Flatten(Layer):
    name = "flatten"

    def build(self, in_shape: Shape) -> Shape:
        return (int(np.prod(in_shape)),)

    def forward(self, xp, params, x, train, rng=None):
        return x.reshape(len(x), -1), x.shape

    def backward(self, xp, params, shape, dy, grads):
        return dy.reshape(shape)


class Reshape(Layer):
    """Each example to ``shape`` (e.g. flat 784 pixels to (1, 28, 28) for Conv2D)."""

    name = "reshape"

    def __init__(self, shape: Shape):
        self.shape = tuple(shape)

    def build(self, in_shape: Shape) -> Shape:
        if int(np.prod(in_shape)) != int(np.prod(self.shape)):
            raise ValueError(f"Reshape: {in_shape} does not hold {self.shape}")
        return self.shape

    def forward(self, xp, params, x, train, rng=None):
        return x.reshape(len(x), *self.shape), x.shape

    def backward(self, xp, params, shape, dy, grads):
        return dy.reshape(shape)


class Dropout(Layer):
    """Zero a ``rate`` share of the inputs in training (scaling the rest by 1/(1-rate));
    the identity in evaluation. The mask comes from the model's generator, seeded by worker
    and step, so a run is reproducible."""

    name = "dropout"

    def __init__(self, rate: float):
        if not 0 <= rate < 1:
            raise ValueError(f"Dropout: rate must be in [0, 1), got {rate}")
        self.rate = rate

    def forward(self, xp, params, x, train, rng=None):
        if not train or not self.rate:
            return x, None
        assert rng is not None
        keep = rng.random(x.shape) >= self.rate
        mask = xp.asarray(keep.astype(np.dtype(x.dtype)) / (1 - self.rate))
        return x * mask, mask

    def backward(self, xp, params, mask, dy, grads):
        return dy if mask is None else dy * mask


class Embedding(Layer):
    """Integer ids ``(n, length)`` (stored as numbers in the data) to the sum or mean of
    their rows of a ``(vocabulary, width)`` table: ``(n, width)``."""

    name = "embedding"

    def __init__(self, vocabulary: int, width: int, combine: str = "sum"):
        if combine not in ("sum", "mean"):
            raise ValueError(f"Embedding: combine is 'sum' or 'mean', got {combine!r}")
        self.vocabulary, self.width, self.combine = vocabulary, width, combine

    def build(self, in_shape: Shape) -> Shape:
        if len(in_shape) != 1:
            raise ValueError(f"Embedding takes (length,) ids per example, got {in_shape}")
        self.length = in_shape[0]
        return (self.width,)

    def variables(self) -> list[tuple[str, Shape]]:
        return [("table", (self.vocabulary, self.width))]

    def initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"table": rng.normal(0, 0.05, (self.vocabulary, self.width)).astype(np.float32)}

    def forward(self, xp, params, x, train, rng=None):
        ids = x.astype(np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocabulary):
            raise ValueError(f"Embedding: ids must be in 0..{self.vocabulary - 1}")
        out = params["table"][ids].sum(axis=1)
        return (out / self.length if self.combine == "mean" else out), ids

    def backward(self, xp, params, ids, dy, grads):
        g = dy / self.length if self.combine == "mean" else dy
        grads["table"][...] = 0
        rows = xp.broadcast_to(g[:, None, :], ids.shape + (self.width,))
        scatter_add(xp, grads["table"], ids.reshape(-1), rows.reshape(-1, self.width))
        return None  # ids have no gradient


# -- losses: (mean loss, gradient of the mean loss w.r.t. the outputs) ------------------------


def softmax_cross_entropy(xp: ModuleType, z: Any, y: Any) -> tuple[float, Any]:
    """Mean softmax cross-entropy of logits ``z`` (n, classes) for integer labels ``y``, and
    its gradient with respect to ``z`` (on a GPU by one fused kernel: device_kernels)."""
    fused = device_kernels.softmax_xent(z, y)
    if fused is not None:
        losses, d = fused
        return float(losses.mean()), d
    z = z - z.max(axis=1, keepdims=True)
    e = xp.exp(z)
    s = e.sum(axis=1, keepdims=True)
    n = len(y)
    y = y.astype(np.int64, copy=False)  # (on a GPU each array operation is a launch)
    rows = xp.arange(n)
    loss = float((xp.log(s[:, 0]) - z[rows, y]).mean())
    d = e / s
    d[rows, y] -= 1
    d /= n
    return loss, d


def softmax(xp: ModuleType, z: Any) -> Any:
    """Class probabilities of logits ``z`` (n, classes), one row per example."""
    e = xp.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def sigmoid(xp: ModuleType, z: Any) -> Any:
    """``1 / (1 + exp(-z))``, without overflow for any finite ``z`` (clipped to +-60)."""
    return 1 / (1 + xp.exp(-xp.clip(z, -60, 60)))


def log_loss(xp: ModuleType, z: Any, y: Any) -> tuple[float, Any]:
    """Mean binary cross-entropy of logits ``z`` for 0/1 labels ``y`` (both flat), and the
    probabilities: stable, and without overflow warnings, for any finite z (exp is only
    taken of -|z| and of z clipped)."""
    loss = float((xp.maximum(z, 0) - z * y + xp.log1p(xp.exp(-xp.abs(z)))).mean())
    return loss, sigmoid(xp, z)


def logistic(xp: ModuleType, z: Any, y: Any) -> tuple[float, Any]:
    """Mean log loss of one logit per example (``z`` (n, 1) or (n,)) for 0/1 labels."""
    flat = z.reshape(-1)
    y = y.reshape(-1).astype(flat.dtype)
    loss, p = log_loss(xp, flat, y)
    return loss, ((p - y) / len(y)).reshape(z.shape)


LOSSES = {"softmax_cross_entropy": softmax_cross_entropy, "logistic": logistic}


class Sequential(Model):
    """A model made of layers applied in order, with a loss on the last one's output:
    ``"softmax_cross_entropy"`` (integer class labels) or ``"logistic"`` (0/1 labels, one
    output). ``input_shape`` is one example's shape as the data holds it (e.g. ``(784,)``).
    Variables are named ``<layer>_<index>/<variable>``, e.g. ``conv_0/kernel``."""

    def __init__(
        self,
        layers: list[Layer],
        input_shape: Shape,
        loss: str = "softmax_cross_entropy",
        seed: int = 0,
    ):
        if loss not in LOSSES:
            raise ValueError(f"Sequential: loss is one of {sorted(LOSSES)}, got {loss!r}")
        self.layers, self.loss_name, self.seed = list(layers), loss, seed
        shape: Shape = tuple(input_shape)
        self.prefixes = []
        for i, layer in enumerate(self.layers):
            shape = layer.build(shape)
            self.prefixes.append(f"{layer.name}_{i}/")
        self.output_shape = shape
        self.steps = 0  # training batches seen by this worker (seeds dropout)

    def variables(self) -> list[VariableSpec]:
        return [
            VariableSpec(p + name, shape)
            for p, layer in zip(self.prefixes, self.layers, strict=True)
            for name, shape in layer.variables()
        ]

    def initial_values(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {
            p + k: v
            for p, layer in zip(self.prefixes, self.layers, strict=True)
            for k, v in layer.initial_values(rng).items()
        }

    def _own(self, prefix: str, arrays: dict[str, Any]) -> dict[str, Any]:
        return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}

    def forward(
        self,
        params: dict[str, Any],
        x: Any,
        train: bool = False,
        rng: np.random.Generator | None = None,
    ) -> tuple[Any, list[Any]]:
        caches = []
        for prefix, layer in zip(self.prefixes, self.layers, strict=True):
            x, cache = layer.forward(self.xp, self._own(prefix, params), x, train, rng)
            caches.append(cache)
        return x, caches

    def loss_and_grads(
        self,
        params: dict[str, Any],
        x: Any,
        y: Any,
        grads: dict[str, Any],
        ready: Ready | None = None,
    ) -> float:
        self.steps += 1
        rng = np.random.default_rng([self.seed, self.worker, self.steps])
        out, caches = self.forward(params, x, True, rng)
        loss, d = LOSSES[self.loss_name](self.xp, out, y)
        for prefix, layer, cache in reversed(
            list(zip(self.prefixes, self.layers, caches, strict=True))
        ):
            own = self._own(prefix, grads)
            d = layer.backward(self.xp, self._own(prefix, params), cache, d, own)
            if ready is not None:
                for name in own:
                    ready(prefix + name)
        return loss

    def predict(self, params: dict[str, Any], x: Any) -> Any:
        """Class probabilities (softmax), or the probability of 1 (logistic)."""
        out = self._outputs(params, x)
        if self.loss_name == "logistic":
            return sigmoid(self.xp, out.reshape(-1))
        return softmax(self.xp, out)

    def _outputs(self, params: dict[str, Any], x: Any, chunk: int = 1024) -> Any:
        """The last layer's outputs in evaluation mode, ``chunk`` rows at a time (bounded
        memory for im2col on a whole test split)."""
        parts = [self.forward(params, x[i : i + chunk])[0] for i in range(0, len(x), chunk)]
        return self.xp.concatenate(parts) if len(parts) > 1 else parts[0]

    def evaluate(self, params: dict[str, Any], x: Any, y: Any) -> dict[str, float]:
        out = self._outputs(params, x)
        loss, _ = LOSSES[self.loss_name](self.xp, out, y)
        if self.loss_name == "logistic":
            p = to_host(out.reshape(-1))
            labels = to_host(y).reshape(-1)
            return {
                "loss": loss,
                "accuracy": float(((p > 0) == (labels > 0.5)).mean()),
                "auc": auc(labels, p),
            }
        return {"loss": loss, "accuracy": accuracy(to_host(out), to_host(y))}
