"""Models: a multi-layer perceptron with ReLU and softmax cross-entropy, written for any xp."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ..device.arrays import to_host
from ..errors import ConfigError
from ..layers import DenseStack, softmax, softmax_cross_entropy
from .contract import (
    BUILT_IN,
    Model,
    Ready,
    build_from_factory,
    check_model,
    factory_name,
    import_factory,
)
from .metrics import accuracy, auc
from .variables import VariableSpec

if TYPE_CHECKING:
    from ..data.batches import DatasetInfo
    from ..job import ModelConfig


class MLP(Model):
    """Dense layers ``sizes[0] -> ... -> sizes[-1]``; variables in creation order
    ``dense_0/kernel, dense_0/bias, dense_1/kernel, ...`` (the order placement uses)."""

    def __init__(self, sizes: list[int], xp: ModuleType = np):
        self.sizes = list(sizes)
        self.xp = xp
        self.layers = DenseStack(self.sizes, "dense_", xp)

    def variables(self) -> list[VariableSpec]:
        return self.layers.variables()

    def initial_values(self, seed: int) -> dict[str, np.ndarray]:
        """He-uniform kernels, zero biases (numpy, on the host: the chief writes them to the PS)."""
        return self.layers.initial_values(np.random.default_rng(seed))

    def logits(self, params: dict[str, Any], x: Any) -> Any:
        return self.layers.forward(params, x)[0]

    def predict(self, params: dict[str, Any], x: Any) -> Any:
        """Class probabilities (softmax of the logits), one row per example."""
        return softmax(self.xp, self.logits(params, x))

    def evaluate(self, params: dict[str, Any], x: Any, y: Any) -> dict[str, float]:
        """Mean cross-entropy ("loss") and "accuracy" of the model on ``x, y``; with two
        classes also "auc" (of the second class's logit margin)."""
        z = self.logits(params, x)
        loss, _ = softmax_cross_entropy(self.xp, z, y)
        host_z, host_y = to_host(z), to_host(y)
        out = {"loss": loss, "accuracy": accuracy(host_z, host_y)}
        if host_z.shape[1] == 2:
            out["auc"] = auc(host_y, host_z[:, 1] - host_z[:, 0])
        return out

    def tables(self) -> list[VariableSpec]:
        """No row-partitioned tables: every variable is pulled whole."""
        return []

    def loss_and_grads(
        self,
        params: dict[str, Any],
        x: Any,
        y: Any,
        grads: dict[str, Any],
        ready: Ready | None = None,
    ) -> float:
        """Mean cross-entropy of the batch; writes d loss / d variable into ``grads`` in place.

        ``ready`` is told as soon as each gradient, or a block of a kernel's rows, is written
        (last layer first), so a caller can start reducing it while backward goes on.
        """
        z, acts = self.layers.forward(params, x)
        loss, d = softmax_cross_entropy(self.xp, z, y)
        self.layers.backward(params, acts, d, grads, ready)
        return loss


def build_model(
    config: ModelConfig,
    info: DatasetInfo,
    xp: ModuleType = np,
    job_file: str | None = None,
    factory: Any = None,
) -> Model:
    """The job's model for its dataset: a built-in one (an MLP on dense data, a CTR model on
    sparse data), the user's ``model.kind = "module:factory"`` (called with the dataset's
    facts and ``[model.args]``), or ``factory`` from the Python API (a callable, or a model)."""
    if factory is not None:
        if isinstance(factory, Model):
            factory.xp = xp
            return check_model(factory, "the model passed to mpips.train")
        return build_from_factory(
            factory,
            info,
            xp,
            config.args,
            f"the model factory {factory_name(factory)}",
            config.init_seed,
        )
    if config.kind not in BUILT_IN:
        return build_from_factory(
            import_factory(config.kind, job_file),
            info,
            xp,
            config.args,
            f"model.kind = {config.kind!r}",
            config.init_seed,
        )
    if config.args:
        raise ConfigError(
            f"model.args: only for a model of your own (model.kind = "
            f'"module:factory"); {config.kind!r} takes model.hidden etc.'
        )
    if (config.kind == "mlp") == info.sparse:
        want = "dense (x, y)" if config.kind == "mlp" else "sparse (CSR ids and values)"
        raise ConfigError(
            f"model.kind = {config.kind!r} needs {want} data; {info.path} is "
            f"{'sparse' if info.sparse else 'dense'}"
        )
    if config.kind == "mlp":
        return MLP([info.num_inputs, *config.hidden, info.num_classes], xp)
    from .ctr import WideDeep

    hidden = config.hidden if config.kind == "wide_deep" else None
    return WideDeep(info.num_inputs, hidden, config.embedding_dim, xp)
