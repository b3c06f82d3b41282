"""fastsoftmax: softmax and log_softmax GPU kernels for PyTorch, right on every input.

Nothing runs at import: kernels are imported, compiled and cached on first use.
"""

from . import ops  # noqa: F401  registers the torch.library custom ops (no device work)
from .api import LogSoftmax, Softmax, info, log_softmax, log_softmax_backward, softmax, softmax_backward
from .loss import cross_entropy

__version__ = "0.1.0"
__all__ = ["LogSoftmax", "Softmax", "cross_entropy", "info", "log_softmax", "log_softmax_backward", "softmax",
           "softmax_backward"]  # fmt: skip
