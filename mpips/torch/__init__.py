"""PyTorch frontend: train a ``torch.nn.Module`` as it is on the parameter server.

The job's factory returns ``mpips.torch.Model(module, loss)``; mpips places the module's
trainable parameters on the PS tasks under their ``named_parameters()`` names, and every mode,
command and checkpoint treats it like a native model (docs/guide/torch.md). Needs the
``torch`` extra: ``pip install ".[torch]"``. (mpips seeds torch before calling a factory
whatever imports it first: mpips.models.contract.build_from_factory.)
"""

from .binding import Traffic
from .model import Model, accuracy, binary_accuracy, binary_auc
from .tables import SparseInput

__all__ = ["Model", "SparseInput", "Traffic", "accuracy", "binary_accuracy", "binary_auc"]
