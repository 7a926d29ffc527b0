"""``mpips.torch.Model``: a ``torch.nn.Module`` and its loss behind the mpips model contract.

mpips moves the bytes (placement, pulls, pushes, the sync replicas' reductions, checkpoints)
and PyTorch computes: the module's trainable parameters are mpips variables under their
``named_parameters()`` names, bound to mpips's buffers (binding.py) so that a step copies
neither parameters nor gradients. Nothing here calls MPI.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..models.contract import Model as _Model
from ..models.contract import Ready
from ..models.metrics import auc
from ..models.variables import VariableSpec
from ..process.log import log
from .binding import Binding, Traffic, as_tensor, numpy_dtype
from .tables import SparseInput, Tables

Metric = Callable[[torch.Tensor, torch.Tensor], float]
EVAL_ROWS = 1024  # rows an evaluation or a prediction runs through the module at a time


def accuracy(outputs: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of rows whose largest output is the label (class labels)."""
    return float((outputs.argmax(dim=1) == y).float().mean())


def binary_accuracy(outputs: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of rows whose logit's sign says the 0/1 label (one output per row)."""
    return float(((outputs.reshape(-1) > 0) == (y.reshape(-1) > 0.5)).float().mean())


def binary_auc(outputs: torch.Tensor, y: torch.Tensor) -> float:
    """Area under the ROC curve of one logit per row against 0/1 labels."""
    return auc(y.reshape(-1).cpu().numpy(), outputs.reshape(-1).double().cpu().numpy())


def _default_output(loss: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``predict`` returns: probabilities for the classification losses, else the
    module's outputs as they are."""
    if isinstance(loss, torch.nn.CrossEntropyLoss) or loss is torch.nn.functional.cross_entropy:
        return lambda z: torch.softmax(z, dim=1)
    if isinstance(loss, torch.nn.NLLLoss) or loss is torch.nn.functional.nll_loss:
        return torch.exp  # (the module's outputs are log-probabilities)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    if isinstance(loss, torch.nn.BCEWithLogitsLoss) or loss is bce:
        return torch.sigmoid
    return lambda z: z


class Model(_Model):
    """A PyTorch module trained by mpips. ``loss(outputs, y)`` gives the batch's mean loss
    as a scalar tensor; ``metrics`` are more numbers an evaluation reports, each
    ``metric(outputs, y) -> float`` on a whole split (accuracy is added for class labels,
    accuracy and AUC for 0/1 labels with one output per row). ``input_shape`` reshapes each
    row of the data (e.g. ``(1, 28, 28)`` for a convolution over 784 pixels, a view);
    ``output`` maps outputs to what ``predict`` returns (softmax after a cross-entropy loss,
    sigmoid after a binary one, else the outputs).

    Trainable parameters are the variables, named as ``named_parameters()`` names them;
    ``nn.Embedding`` and ``nn.EmbeddingBag`` modules made with ``sparse=True`` are tables
    split by rows over the PS tasks, whose touched rows alone move (their module is then
    called as ``module(SparseInput)``). Frozen parameters and buffers (BatchNorm's running
    statistics) are the model's state: each worker updates its own, the chief's serve
    evaluation and are checkpointed (docs/guide/torch.md)."""

    def __init__(
        self,
        module: torch.nn.Module,
        loss: Callable[[Any, torch.Tensor], torch.Tensor],
        metrics: Mapping[str, Metric] | None = None,
        *,
        input_shape: tuple[int, ...] | None = None,
        output: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(
                f"mpips.torch.Model: module is {type(module).__name__}, not a torch.nn.Module"
            )
        if not callable(loss):
            raise ConfigError("mpips.torch.Model: loss must be callable as loss(outputs, y)")
        self.module, self.loss, self.metrics = module, loss, dict(metrics or {})
        self.input_shape = tuple(input_shape) if input_shape else None
        self.output = output or _default_output(loss)
        self.table_set = Tables(module)
        dense = {
            n: p
            for n, p in module.named_parameters()
            if p.requires_grad and n not in self.table_set.names
        }
        if not dense and not self.table_set.names:
            raise ConfigError("mpips.torch.Model: the module has no trainable parameters")
        self.specs = [VariableSpec(n, tuple(p.shape), numpy_dtype(p, n)) for n, p in dense.items()]
        self.traffic = Traffic()
        self.binding = Binding(dense, self.traffic)
        self.steps = 0
        self.device: torch.device | None = None  # where the module computes (mpips's arrays')
        self.unused_said = False

    # -- the contract ---------------------------------------------------------------------

    def variables(self) -> list[VariableSpec]:
        return list(self.specs)

    def tables(self) -> list[VariableSpec]:
        return self.table_set.specs()

    def initial_values(self, seed: int) -> dict[str, np.ndarray]:
        """The module's own values as it was built (mpips seeds torch with model.init_seed
        before calling the factory, so every rank builds the same module)."""
        return {
            s.name: self.binding.params[s.name].detach().cpu().numpy().copy() for s in self.specs
        }

    def initial_rows(self, table: str, rows: tuple[int, int, int], seed: int) -> np.ndarray:
        return self.table_set.initial_rows(table, rows)

    def _kept(self) -> dict[str, torch.Tensor]:
        """What the module keeps untrained, by state_dict name: its persistent buffers and
        frozen parameters."""
        trained = set(self.binding.params) | self.table_set.names
        return {n: t for n, t in self.module.state_dict(keep_vars=True).items() if n not in trained}

    def state(self) -> dict[str, np.ndarray]:
        """Buffers (BatchNorm's running statistics, its batch count) and frozen parameters:
        the chief's go into checkpoints, so an export is the module's whole state_dict."""
        return {n: t.detach().cpu().numpy().copy() for n, t in self._kept().items()}

    def load_state(self, values: dict[str, np.ndarray]) -> None:
        kept = self._kept()
        with torch.no_grad():
            for name, value in values.items():
                if name in kept:
                    kept[name].copy_(torch.from_numpy(np.asarray(value)))

    def fingerprints(self) -> dict[str, int]:
        """A crc32 of every parameter and buffer as the factory built it (tables included)."""
        return {
            n: zlib.crc32(np.ascontiguousarray(t.detach().cpu().numpy()).reshape(-1).data)
            for n, t in self.module.state_dict(keep_vars=True).items()
        }

    def prepare(self, x: Any) -> tuple[Any, Any]:  # type: ignore[override]
        """Sparse (CSR) batches: the batch's unique ids, the rows every table pulls."""
        return self.table_set.prepare(x) if self.table_set.names else (x, None)

    def loss_and_grads(
        self,
        params: dict[str, Any],
        x: Any,
        y: Any,
        grads: dict[str, Any],
        ready: Ready | None = None,
    ) -> float:
        """One forward and backward of the module on the batch, its parameters and their
        .grad views of ``params`` and ``grads`` (backward accumulates into the push buffers;
        ``ready(name)`` as each gradient is final, from autograd's post-accumulate hooks)."""
        if not self.steps:
            self._first_step()
        b = self.binding
        b.values(params)
        self._place()
        self.table_set.bind(params, grads)
        b.gradients(grads)
        b.ready = ready
        self.module.train()
        try:
            loss = self.loss(self.module(*self._inputs(x)), self._labels(y))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError(
                    f"mpips.torch.Model: loss(outputs, y) returned {type(loss).__name__}"
                    f"{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}, not a "
                    f"scalar tensor (reduce it: the batch's mean)"
                )
            loss.backward()
        finally:
            b.ready = None
        b.collect()
        self.table_set.collect(self.traffic)
        self._say_unused()
        self.steps += 1
        return float(loss.detach())

    def evaluate(self, params: dict[str, Any], x: Any, y: Any) -> dict[str, float]:
        """Mean loss over the split, accuracy (class labels, or 0/1 labels with one output)
        and AUC (0/1 labels), and the job's own metrics, the module in eval mode."""
        outputs = self._outputs(params, x)
        labels = self._labels(y)
        with torch.no_grad():
            out = {"loss": float(self.loss(outputs, labels))}
        for name, metric in self._metrics(outputs, labels).items():
            out[name] = float(metric(outputs, labels))
        return out

    def predict(self, params: dict[str, Any], x: Any) -> Any:
        """``output(module(x))`` (probabilities after a classification loss), a numpy array."""
        with torch.no_grad():
            return self.output(self._outputs(params, x)).cpu().numpy()

    # -- the pieces -------------------------------------------------------------------------

    def _first_step(self) -> None:
        """Workers other than the first draw their own dropout masks (worker 0 keeps the
        stream the factory left, so one process trains as a plain PyTorch loop would)."""
        if self.worker:
            torch.manual_seed(int(torch.initial_seed()) + 1_000_003 * self.worker)

    def _place(self) -> None:
        """The module on the device of mpips's arrays (its parameters are views of them
        now): a GPU worker's buffers and frozen parameters move there once."""
        device = next(iter(self.binding.params.values()), None)
        where = device.device if device is not None else torch.device("cpu")
        if where != self.device:
            self.device = where
            self.module.to(where)

    def _inputs(self, x: Any) -> tuple[Any, ...]:
        """The module's positional arguments for a batch: one tensor (viewed as
        ``input_shape`` rows), or a SparseInput's tensors for a module with tables."""
        if isinstance(x, SparseInput):
            return (x.to(self.device),)
        t = as_tensor(x)
        if self.input_shape:
            t = t.view(len(t), *self.input_shape)
        return (t,)

    def _labels(self, y: Any) -> torch.Tensor:
        """Labels as torch wants them: class indices as int64 (a copy of the batch's labels
        when the data holds another integer type), other labels as they are."""
        t = as_tensor(y).to(self.device)
        if not t.is_floating_point() and t.dtype != torch.int64:
            t = t.long()
        return t

    def _outputs(self, params: dict[str, Any], x: Any) -> torch.Tensor:
        """The module's outputs on a whole split, EVAL_ROWS rows at a time, in eval mode."""
        self.binding.unbind_gradients()
        self.binding.values(params)
        self._place()
        self.table_set.bind(params, None)
        self.module.eval()
        with torch.no_grad():
            if isinstance(x, SparseInput):
                return self.module(x.to(self.device))
            t = self._inputs(x)[0]
            return torch.cat(
                [self.module(t[i : i + EVAL_ROWS]) for i in range(0, len(t), EVAL_ROWS)]
            )

    def _metrics(self, outputs: torch.Tensor, y: torch.Tensor) -> dict[str, Metric]:
        """The default metrics for these labels, then the job's own (which win by name)."""
        out: dict[str, Metric] = {}
        if not y.is_floating_point() and outputs.dim() == 2 and outputs.shape[1] > 1:
            out["accuracy"] = accuracy
        elif outputs.numel() == len(y) and bool(((y == 0) | (y == 1)).all()):
            out["accuracy"], out["auc"] = binary_accuracy, binary_auc
        out.update(self.metrics)
        return out

    def _say_unused(self) -> None:
        """A parameter that got no gradient is said (its buffer holds zeros: the loss does
        not use it). At the first step it is an error; later (a module whose graph changes
        from batch to batch) a warning, once."""
        b = self.binding
        unused = [n for n in b.params if n not in b.fired]
        if not unused or self.unused_said:
            return
        self.unused_said = True
        problem = (
            f"mpips.torch.Model: parameter(s) {', '.join(unused[:5])} got no gradient from the loss"
        )
        if not self.steps:
            raise ConfigError(
                f"{problem} at the first step; freeze what the loss does not use "
                f"(p.requires_grad_(False)) so that it is not trained as a variable"
            )
        log(
            f"/job:worker/task:{self.worker}",
            f"warning: {problem} at step {self.steps + 1} of this worker: their gradients "
            f"are pushed as zeros (said once)",
        )
