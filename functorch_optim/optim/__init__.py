"""``torch.optim`` shaped: imperative optimizer classes over the functional core.

Port a PyTorch loop line by line::

    opt = functorch_optim.optim.SGD(params, lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        loss = opt.backward(loss_fn, x, y)  # loss_fn(params, x, y); adds into opt.grad
        opt.step()

Every functional optimizer of the package has its class here under torch's class name,
made by ``make_optimizer_class`` (one line each); ``LBFGS``, closure-driven, is its own
small class. Every ``step(closure)`` takes torch's ``closure() -> loss`` (it calls
``opt.zero_grad()`` and ``opt.backward(...)`` itself) or a pure ``closure(params) -> loss``,
told apart by the signature (``closure_takes_params``). ``lr_scheduler`` (torch's
schedulers driving ``param_groups``) is a submodule.
"""

from functorch_optim._adadelta import adadelta
from functorch_optim._adafactor import adafactor
from functorch_optim._adagrad import adagrad
from functorch_optim._adam import adam
from functorch_optim._adamax import adamax
from functorch_optim._adamw import adamw
from functorch_optim._asgd import asgd
from functorch_optim._muon import muon
from functorch_optim._nadam import nadam
from functorch_optim._radam import radam
from functorch_optim._rmsprop import rmsprop
from functorch_optim._rprop import rprop
from functorch_optim._sgd import sgd
from functorch_optim._sparse_adam import sparse_adam
from functorch_optim.optim._lbfgs import LBFGS  # closure-driven, one global state: its own class
from functorch_optim.optim._optimizer import (
    GroupedParams,
    Optimizer,
    closure_takes_params,
    group_by,
    make_optimizer_class,
    path_name,
    state_dict_to_numpy,
    state_dict_to_torch,
)

from functorch_optim.optim import lr_scheduler  # isort: skip

# One line per functional factory: torch's class name and signature come from it.
SGD = make_optimizer_class(sgd)
"""``torch.optim.SGD(params, ...)`` on JAX: the facade over ``functorch_optim.sgd``."""
Adam = make_optimizer_class(adam)
"""``torch.optim.Adam(params, ...)`` on JAX: the facade over ``functorch_optim.adam``."""
# torch 2.13's AdamW is Adam with decoupled weight decay; its groups say so
AdamW = make_optimizer_class(adamw, group_extras={"decoupled_weight_decay": True})
"""``torch.optim.AdamW(params, ...)`` on JAX: the facade over ``functorch_optim.adamw``."""
Adamax = make_optimizer_class(adamax)
"""``torch.optim.Adamax(params, ...)`` on JAX: the facade over ``functorch_optim.adamax``."""
NAdam = make_optimizer_class(nadam)
"""``torch.optim.NAdam(params, ...)`` on JAX: the facade over ``functorch_optim.nadam``."""
RAdam = make_optimizer_class(radam)
"""``torch.optim.RAdam(params, ...)`` on JAX: the facade over ``functorch_optim.radam``."""
Adagrad = make_optimizer_class(adagrad)
"""``torch.optim.Adagrad(params, ...)`` on JAX: the facade over ``functorch_optim.adagrad``."""
Adadelta = make_optimizer_class(adadelta)
"""``torch.optim.Adadelta(params, ...)`` on JAX: the facade over ``functorch_optim.adadelta``."""
RMSprop = make_optimizer_class(rmsprop)
"""``torch.optim.RMSprop(params, ...)`` on JAX: the facade over ``functorch_optim.rmsprop``."""
Rprop = make_optimizer_class(rprop)
"""``torch.optim.Rprop(params, ...)`` on JAX: the facade over ``functorch_optim.rprop``."""
ASGD = make_optimizer_class(asgd)
"""``torch.optim.ASGD(params, ...)`` on JAX: the facade over ``functorch_optim.asgd``."""
Adafactor = make_optimizer_class(adafactor)
"""``torch.optim.Adafactor(params, ...)`` on JAX: the facade over ``functorch_optim.adafactor``."""
Muon = make_optimizer_class(muon)
"""``torch.optim.Muon(params, ...)`` on JAX: the facade over ``functorch_optim.muon``."""
SparseAdam = make_optimizer_class(sparse_adam)
"""``torch.optim.SparseAdam(params, ...)`` on JAX: the facade over ``functorch_optim.sparse_adam``."""

__all__ = [
    "ASGD",
    "LBFGS",
    "SGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "GroupedParams",
    "Muon",
    "NAdam",
    "Optimizer",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SparseAdam",
    "closure_takes_params",
    "group_by",
    "lr_scheduler",
    "make_optimizer_class",
    "path_name",
    "state_dict_to_numpy",
    "state_dict_to_torch",
]
