"""functorch_optim: torch.optim as pure JAX functions over pytrees, with torch's numbers.

``__all__`` is the public API; everything in underscored modules is private.
"""

from functorch_optim._accumulate import GradAccumulateState, grad_accumulate
from functorch_optim._adafactor import adafactor
from functorch_optim._base import TorchState, apply_updates, step
from functorch_optim._hyperparams import HParams, get_hparams, set_hparams
from functorch_optim._lbfgs import LBFGSState, lbfgs, lbfgs_step
from functorch_optim._muon import muon
from functorch_optim._sgd import sgd
from functorch_optim._sparse_adam import sparse_adam

__version__ = "0.1.0"

__all__ = [
    "GradAccumulateState",
    "HParams",
    "LBFGSState",
    "TorchState",
    "adafactor",
    "apply_updates",
    "get_hparams",
    "grad_accumulate",
    "lbfgs",
    "lbfgs_step",
    "muon",
    "set_hparams",
    "sgd",
    "sparse_adam",
    "step",
]
