"""``mpips.torch.Model``: a ``torch.nn.Module`` and its loss behind the mpips model contract.

mpips moves the bytes (placement, pulls, pushes, the sync replicas' reductions, checkpoints)
and PyTorch computes: the module's trainable parameters are mpips variables under their
``named_parameters()`` names, bound to mpips's buffers (binding.py) so that a step copies
neither parameters nor gradients. Nothing here calls MPI.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Iterable, Mapping
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


MEANS = ("mean", "batchmean")  # a torch loss's reductions that are the batch's mean
COMPILED = "_orig_mod"  # the module torch.compile wraps: its names start "_orig_mod."


def plain_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (its ``_orig_mod``), else ``module``: it names
    the variables and the state, so a compiled and a plain module have the same names (and
    checkpoints of one load into the other)."""
    while isinstance(getattr(module, COMPILED, None), torch.nn.Module):
        module = getattr(module, COMPILED)
    return module


def plain_name(name: str) -> str:
    """A state_dict name without torch.compile's ``_orig_mod.`` prefixes."""
    while name.startswith(f"{COMPILED}."):
        name = name[len(COMPILED) + 1 :]
    return name


def _check_reduction(loss: Any) -> None:
    """A torch loss (or a partial of a functional one) whose ``reduction`` is not the
    batch's mean is refused: a sum scales every update by the batch size, and mpips
    averages the workers' gradients as means."""
    reduction = getattr(loss, "reduction", None)
    if reduction is None:
        reduction = (getattr(loss, "keywords", None) or {}).get("reduction")
    if isinstance(reduction, str) and reduction not in MEANS:
        raise ConfigError(
            f"mpips.torch.Model: the loss has reduction={reduction!r}; mpips trains on the "
            f"batch's mean loss (a sum scales every update by the batch size): use "
            f'reduction="mean"'
        )


def _norms(module: torch.nn.Module) -> list[tuple[str, torch.nn.modules.batchnorm._BatchNorm]]:
    """The module's BatchNorm layers that keep running statistics, by name."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        and m.track_running_stats
        and m.running_mean is not None
    ]


def _doubles(loss: Callable[..., Any], outputs: Any, y: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``loss`` is a sum over the batch: on the batch given twice over (outputs and
    labels repeated) a mean is the same and a sum doubles. Checked once, at the first step,
    without gradients; a loss that cannot take the doubled batch is not judged."""
    once = float(value.detach())
    if not isinstance(outputs, torch.Tensor) or outputs.dim() == 0 or len(outputs) != len(y):
        return False
    if once == 0 or not math.isfinite(once):
        return False
    o = outputs.detach()
    try:
        with torch.no_grad():
            twice = float(loss(torch.cat([o, o]), torch.cat([y, y])))
    except Exception:  # noqa: BLE001 (the user's loss: its own rules on what it takes)
        return False
    return abs(twice / once - 2) < 0.01


class Model(_Model):
    """A PyTorch module trained by mpips. ``loss(outputs, y)`` gives the batch's mean loss
    as a scalar tensor; ``metrics`` are more numbers an evaluation reports, each
    ``metric(outputs, y) -> float`` on a whole split (accuracy is added for class labels,
    accuracy and AUC for 0/1 labels with one output per row). ``input_shape`` reshapes each
    row of the data (e.g. ``(1, 28, 28)`` for a convolution over 784 pixels, a view);
    ``output`` maps outputs to what ``predict`` returns (softmax after a cross-entropy loss,
    sigmoid after a binary one, else the outputs). ``table_offsets``: tables that each serve
    a part of the data's one id space (as DLRM's per-feature tables), by parameter name
    (``"embeddings.3.weight"``), the data id their row 0 serves; only the batch's ids in a
    table's ``[offset, offset + rows)`` are pulled and pushed for it. The module still
    indexes every table with the batch's ids renumbered to the rows mpips pulled (one
    numbering for every table: a table's rows for the ids it does not serve read zero, or,
    where the module indexes each table only with its own ids, are not read: spans.py).

    Trainable parameters are the variables, named as ``named_parameters()`` names them;
    ``nn.Embedding`` and ``nn.EmbeddingBag`` modules made with ``sparse=True`` are tables
    split by rows over the PS tasks, whose touched rows alone move (their module is then
    called as ``module(SparseInput)``). Frozen parameters and buffers (BatchNorm's running
    statistics) are the model's state: each worker updates its own, the chief's serve
    evaluation and are checkpointed (docs/guide/torch.md). A ``torch.compile``d module is
    named as the module it wraps; a dense float batch is cast to the dtype of the first
    trainable parameter; a loss that is a sum, not the batch's mean, is refused."""

    def __init__(
        self,
        module: torch.nn.Module,
        loss: Callable[[Any, torch.Tensor], torch.Tensor],
        metrics: Mapping[str, Metric] | None = None,
        *,
        input_shape: tuple[int, ...] | None = None,
        output: Callable[[torch.Tensor], torch.Tensor] | None = None,
        table_offsets: Mapping[str, int] | None = None,
    ):
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(
                f"mpips.torch.Model: module is {type(module).__name__}, not a torch.nn.Module"
            )
        if not callable(loss):
            raise ConfigError("mpips.torch.Model: loss must be callable as loss(outputs, y)")
        _check_reduction(loss)
        self.module, self.loss, self.metrics = module, loss, dict(metrics or {})
        self.plain = plain_module(module)  # (names: a compiled module's are the plain one's)
        self.input_shape = tuple(input_shape) if input_shape else None
        self.output = output or _default_output(loss)
        self.table_set = Tables(self.plain, table_offsets or {})
        dense = {
            n: p
            for n, p in self.plain.named_parameters()
            if p.requires_grad and n not in self.table_set.names
        }
        if not dense and not self.table_set.names:
            raise ConfigError("mpips.torch.Model: the module has no trainable parameters")
        self.specs = [VariableSpec(n, tuple(p.shape), numpy_dtype(p, n)) for n, p in dense.items()]
        self.traffic = Traffic()
        self.binding = Binding(dense, self.traffic)
        # a dense batch is cast to the parameters' dtype (a view where it is theirs already)
        self.dtype = next((p.dtype for p in dense.values()), None)
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

    def table_offsets(self) -> dict[str, int]:
        return dict(self.table_set.offsets)

    def initial_rows(self, table: str, rows: tuple[int, int, int], seed: int) -> np.ndarray:
        return self.table_set.initial_rows(table, rows)

    def initial_rows_of(self, table: str, ids: np.ndarray, seed: int) -> np.ndarray:
        return self.table_set.initial_rows_of(table, ids, seed)

    def use_dynamic_tables(self) -> None:
        """tables.kind = "dynamic": the data's ids are any values below 2^63."""
        self.table_set.dynamic = True

    def _kept(self) -> dict[str, torch.Tensor]:
        """What the module keeps untrained, by state_dict name: its persistent buffers and
        frozen parameters."""
        trained = set(self.binding.params) | self.table_set.names
        kept = self.plain.state_dict(keep_vars=True).items()
        return {n: t for n, t in kept if n not in trained}

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
            for n, t in self.plain.state_dict(keep_vars=True).items()
        }

    def batch_statistics(self) -> list[str]:
        """The running means and variances of the module's BatchNorm layers."""
        return [
            f"{name}.{kind}" if name else kind
            for name, _ in _norms(self.plain)
            for kind in ("running_mean", "running_var")
        ]

    def recompute_batch_statistics(self, batches: Iterable[tuple[dict[str, Any], Any]]) -> int:
        """BatchNorm's running statistics made anew with fixed parameters, as
        ``torch.optim.swa_utils.update_bn`` makes them: reset, then the cumulative average
        over the batches (momentum None) of a forward in train mode without gradients."""
        given = iter(batches)
        first = next(given, None)
        if first is None:
            return 0
        norms = [m for _, m in _norms(self.plain)]
        momenta = [m.momentum for m in norms]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
        used = 0
        try:
            self.module.train()
            with torch.no_grad():
                for params, x in itertools.chain([first], given):
                    self._bind_values(params)
                    self.module(*self._inputs(x))
                    used += 1
        finally:
            for m, momentum in zip(norms, momenta, strict=True):
                m.momentum = momentum
        return used

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
        if not self.steps or not self.module.training:  # (once, and after an eval())
            self.module.train()
        try:
            loss = self._loss(x, y)
            loss.backward()
        finally:
            b.ready = None
        b.collect()
        self.table_set.collect(self.traffic)
        self._say_unused()
        self._say_spans()
        self.steps += 1
        return float(loss.detach())

    def _loss(self, x: Any, y: Any) -> torch.Tensor:
        """The batch's loss, checked to be a scalar (and, at the first step, a mean)."""
        outputs, labels = self.module(*self._inputs(x)), self._labels(y)
        loss = self.loss(outputs, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(
                f"mpips.torch.Model: loss(outputs, y) returned {type(loss).__name__}"
                f"{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}, not a "
                f"scalar tensor (reduce it: the batch's mean)"
            )
        if not self.steps and _doubles(self.loss, outputs, labels, loss):
            raise ConfigError(
                "mpips.torch.Model: loss(outputs, y) doubles when the batch is given twice "
                "over, so it is the batch's sum, not its mean (a sum scales every update by "
                'the batch size): return the mean, e.g. reduction="mean" or .mean()'
            )
        return loss

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
        ``input_shape`` rows, in the parameters' dtype), or a SparseInput's tensors for a
        module with tables."""
        if isinstance(x, SparseInput):
            return (x.to(self.device),)
        return (self._cast(self._rows(x)),)

    def _rows(self, x: Any) -> torch.Tensor:
        """A dense batch as a tensor of its memory, each row viewed as ``input_shape``."""
        t = as_tensor(x)
        return t.view(len(t), *self.input_shape) if self.input_shape else t

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        """Float inputs in the parameters' dtype (float64, float16 modules): the tensor
        itself where they are already (no copy), a copy in that dtype where not."""
        if self.dtype is None or not t.is_floating_point() or t.dtype == self.dtype:
            return t
        return t.to(self.dtype)

    def _labels(self, y: Any) -> torch.Tensor:
        """Labels as torch wants them: class indices as int64 (a copy of the batch's labels
        when the data holds another integer type), other labels as they are."""
        t = as_tensor(y).to(self.device)
        if not t.is_floating_point() and t.dtype != torch.int64:
            t = t.long()
        return t

    def _bind_values(self, params: dict[str, Any]) -> None:
        """The module's parameters views of ``params`` for a forward without gradients."""
        self.binding.unbind_gradients()
        self.binding.values(params)
        self._place()
        self.table_set.bind(params, None)

    def _outputs(self, params: dict[str, Any], x: Any) -> torch.Tensor:
        """The module's outputs on a whole split, EVAL_ROWS rows at a time, in eval mode."""
        self._bind_values(params)
        self.module.eval()
        with torch.no_grad():
            if isinstance(x, SparseInput):
                return self.module(x.to(self.device))
            t = self._rows(x)
            return torch.cat(
                [self.module(self._cast(t[i : i + EVAL_ROWS])) for i in range(0, len(t), EVAL_ROWS)]
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

    def _say_spans(self) -> None:
        """What the check of the module's indexing of its tables with offsets found, once."""
        news, self.table_set.spans.news = self.table_set.spans.news, ""
        if news:
            log(f"/job:worker/task:{self.worker}", f"warning: mpips.torch.Model: the module {news}")

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
