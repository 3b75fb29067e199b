"""functorch_optim: torch.optim as pure JAX functions over pytrees, with torch's numbers.

``__all__`` is the public API; everything in underscored modules is private.
"""

from functorch_optim._accumulate import GradAccumulateState, grad_accumulate
from functorch_optim._adam import adam
from functorch_optim._adamax import adamax
from functorch_optim._adamw import adamw
from functorch_optim._base import TorchState, apply_updates, step
from functorch_optim._hyperparams import HParams, get_hparams, set_hparams
from functorch_optim._nadam import nadam
from functorch_optim._radam import radam
from functorch_optim._sgd import sgd
from functorch_optim._sharding import data_parallel_grad, state_shardings

# the torch.optim-shaped facade, a subpackage (imported last: it builds on the above)
from functorch_optim import optim  # isort: skip

__version__ = "0.1.0"

__all__ = [
    "GradAccumulateState",
    "HParams",
    "TorchState",
    "adam",
    "adamax",
    "adamw",
    "apply_updates",
    "data_parallel_grad",
    "get_hparams",
    "grad_accumulate",
    "nadam",
    "optim",
    "radam",
    "set_hparams",
    "sgd",
    "state_shardings",
    "step",
]
