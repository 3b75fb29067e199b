"""``torch.optim`` shaped: imperative optimizer classes over the functional core.

Port a PyTorch loop line by line::

    opt = functorch_optim.optim.SGD(params, lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        loss = opt.backward(loss_fn, x, y)  # loss_fn(params, x, y); adds into opt.grad
        opt.step()

Every functional optimizer of the package has its class here under torch's class name,
made by ``make_optimizer_class`` (one line each). ``lr_scheduler`` (torch's schedulers
driving ``param_groups``) is a submodule.
"""

from functorch_optim._sgd import sgd
from functorch_optim.optim._optimizer import (
    TORCH_ONLY_FLAGS,
    GroupedParams,
    Optimizer,
    group_by,
    make_optimizer_class,
    path_name,
    state_dict_to_torch,
)

# One line per functional factory: torch's class name and signature come from it.
SGD = make_optimizer_class(sgd)

__all__ = [
    "SGD",
    "TORCH_ONLY_FLAGS",
    "GroupedParams",
    "Optimizer",
    "group_by",
    "make_optimizer_class",
    "path_name",
    "state_dict_to_torch",
]
