"""fastsoftmax: softmax, log_softmax and cross-entropy GPU kernels for PyTorch, right on every input.

Nothing runs at import: kernels are imported, compiled and cached on first use.
"""

from .info import info
from .ops.cross_entropy import cross_entropy
from .ops.lm_head import LinearCrossEntropy, linear_cross_entropy
from .ops.softmax import LogSoftmax, Softmax, log_softmax, log_softmax_backward, softmax, softmax_backward
from .version import __version__

__all__ = [
    "__version__",
    "LinearCrossEntropy",
    "LogSoftmax",
    "Softmax",
    "cross_entropy",
    "info",
    "linear_cross_entropy",
    "log_softmax",
    "log_softmax_backward",
    "softmax",
    "softmax_backward",
]
