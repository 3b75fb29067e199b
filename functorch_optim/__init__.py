"""functorch_optim: torch.optim as pure JAX functions over pytrees, with torch's numbers.

``__all__`` is the public API; everything in underscored modules is private.
"""

from functorch_optim._accumulate import GradAccumulateState, grad_accumulate
from functorch_optim._base import TorchState, apply_updates, step
from functorch_optim._flat import ravel_by_dtype
from functorch_optim._hyperparams import HParams, get_hparams, set_hparams
from functorch_optim._jit import jit_step
from functorch_optim._sgd import sgd

__version__ = "0.1.0"

__all__ = [
    "GradAccumulateState",
    "HParams",
    "TorchState",
    "apply_updates",
    "get_hparams",
    "grad_accumulate",
    "jit_step",
    "ravel_by_dtype",
    "set_hparams",
    "sgd",
    "step",
]
