"""functorch_optim: torch.optim as pure JAX functions over pytrees, with torch's numbers.

``__all__`` is the public API; everything in underscored modules is private.
"""

from functorch_optim._accumulate import GradAccumulateState, grad_accumulate
from functorch_optim._adadelta import adadelta
from functorch_optim._adagrad import adagrad
from functorch_optim._asgd import asgd
from functorch_optim._base import TorchState, apply_updates, step
from functorch_optim._hyperparams import HParams, get_hparams, set_hparams
from functorch_optim._rmsprop import rmsprop
from functorch_optim._rprop import rprop
from functorch_optim._sgd import sgd

__version__ = "0.1.0"

__all__ = [
    "GradAccumulateState",
    "HParams",
    "TorchState",
    "adadelta",
    "adagrad",
    "apply_updates",
    "asgd",
    "get_hparams",
    "grad_accumulate",
    "rmsprop",
    "rprop",
    "set_hparams",
    "sgd",
    "step",
]
