"""functorch_optim: torch.optim as pure JAX functions over pytrees, with torch's numbers.

``__all__`` is the public API; everything in underscored modules is private.
"""

from functorch_optim import schedules
from functorch_optim._accumulate import GradAccumulateState, flush, grad_accumulate
from functorch_optim._adadelta import adadelta
from functorch_optim._adafactor import adafactor
from functorch_optim._adagrad import adagrad
from functorch_optim._adam import adam
from functorch_optim._adamax import adamax
from functorch_optim._adamw import adamw
from functorch_optim._asgd import asgd
from functorch_optim._averaging import (
    AveragedModel,
    AveragedModelState,
    averaged_model,
    get_ema_avg_fn,
    get_ema_multi_avg_fn,
    get_swa_avg_fn,
    get_swa_multi_avg_fn,
)
from functorch_optim._base import TorchState, apply_updates, own_counters, step
from functorch_optim._clip import (
    ClipGradNormState,
    clip_grad_norm,
    clip_grad_norm_transform,
    clip_grad_value,
    clip_grad_value_transform,
    clip_grads_with_norm,
    get_total_norm,
)
from functorch_optim._flat import ravel_by_dtype
from functorch_optim._groups import param_groups
from functorch_optim._hyperparams import HParams, ParamGroupsState, get_hparams, set_hparams
from functorch_optim._jit import jit_step
from functorch_optim._nadam import nadam
from functorch_optim._nonfinite import SkipNonfiniteState, all_finite, skip_nonfinite
from functorch_optim._radam import radam
from functorch_optim._rmsprop import rmsprop
from functorch_optim._rprop import rprop
from functorch_optim._scaler import GradScaler, GradScalerState, LossScaleState, TorchAssertionError
from functorch_optim._sgd import sgd
from functorch_optim._sharding import data_parallel_grad, state_shardings

# the torch.optim-shaped facade, a subpackage (imported last: it builds on the above)
from functorch_optim import optim  # isort: skip
from functorch_optim import nn  # isort: skip
from functorch_optim._lbfgs import LBFGSState, lbfgs, lbfgs_step
from functorch_optim._microbatch import microbatch_grad
from functorch_optim._muon import muon
from functorch_optim._sparse_adam import sparse_adam

__version__ = "0.1.0"

__all__ = [
    "AveragedModel",
    "AveragedModelState",
    "ClipGradNormState",
    "GradAccumulateState",
    "GradScaler",
    "GradScalerState",
    "HParams",
    "LBFGSState",
    "LossScaleState",
    "ParamGroupsState",
    "SkipNonfiniteState",
    "TorchAssertionError",
    "TorchState",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "all_finite",
    "apply_updates",
    "asgd",
    "averaged_model",
    "clip_grad_norm",
    "clip_grad_norm_transform",
    "clip_grad_value",
    "clip_grad_value_transform",
    "clip_grads_with_norm",
    "data_parallel_grad",
    "flush",
    "get_ema_avg_fn",
    "get_ema_multi_avg_fn",
    "get_hparams",
    "get_swa_avg_fn",
    "get_swa_multi_avg_fn",
    "get_total_norm",
    "grad_accumulate",
    "jit_step",
    "lbfgs",
    "lbfgs_step",
    "microbatch_grad",
    "muon",
    "nadam",
    "nn",
    "optim",
    "own_counters",
    "param_groups",
    "radam",
    "ravel_by_dtype",
    "rmsprop",
    "rprop",
    "schedules",
    "set_hparams",
    "sgd",
    "skip_nonfinite",
    "sparse_adam",
    "state_shardings",
    "step",
]
