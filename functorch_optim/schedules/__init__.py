r"""torch's learning-rate schedulers as pure, jit-compatible schedules with torch's numbers.

Each factory here mirrors one class of ``torch.optim.lr_scheduler`` (and
``torch.optim.swa_utils.SWALR``) with the optimizer argument replaced by ``lr``, the
learning rate the optimizer was built with (torch's ``group["lr"]`` when the scheduler is
constructed). The result is a :class:`Schedule`, passed where an optimizer takes a
hyperparameter::

    tx = fo.sgd(lr=fo.schedules.cosine_annealing_lr(0.1, T_max=100), momentum=0.9)

The value then lives in the optimizer state and advances once per optimizer step (never
per ``grad_accumulate`` micro-step); ``fo.get_hparams(state)["lr"]`` is the value the next
step uses, i.e. torch's ``scheduler.get_last_lr()`` after as many ``scheduler.step()``
calls as optimizer steps taken. torch loops that call ``scheduler.step()`` once per epoch
wrap the schedule: ``per_epoch(schedule, steps_per_epoch)`` steps it once every
``steps_per_epoch`` optimizer steps, exactly as torch's per-epoch loop, for every
scheduler.

How torch's numbers are reproduced:

* The schedule carries torch's scheduler state (``last_epoch``, ``_step_count``,
  ``base_lrs``, ``T_cur``, ...) and the scheduler's view of the param group (``lr``,
  ``initial_lr``, ``momentum``, ``max_lr``, ...) in the optimizer state, and each step
  runs torch's *chainable* ``get_lr`` on the current value, as torch does — so
  recursive forms (``CosineAnnealingLR`` past ``T_max``, ``PolynomialLR``), chains and
  sequences round exactly like torch.
* Arithmetic copies torch's Python expressions operation by operation in float64 (under
  x64). XLA rewrites a division by a constant into a multiplication by its reciprocal,
  which is not IEEE-exact; divisions here go through an optimization barrier to keep
  them true divisions.
* ``lr`` may be a sequence of per-group learning rates: the schedule then computes one
  value per group (an array), like torch's ``param_groups``. An optimizer hyperparameter
  takes a scalar schedule (one schedule per param group).

Momentum cycling: ``cyclic_lr`` and ``one_cycle_lr`` (and chains/sequences holding them)
cycle momentum with ``cycle_momentum=True`` (torch's default). Pass the companion
schedule ``sched.momentum`` as ``momentum=`` (SGD, RMSprop) or as beta1,
``betas=(sched.momentum, 0.999)`` (Adam family); an optimizer built with such an ``lr``
schedule but without the companion raises, as torch would otherwise change momentum
behind the optimizer's back.

``reduce_lr_on_plateau`` is driven by a metric: ``state = plateau.step(state, metric)``
is a pure function that updates the lr held in the optimizer state.

One module per family: ``_step`` (the closed-form step schedules: StepLR ... SWALR),
``_cyclic`` (CyclicLR, OneCycleLR), ``_plateau`` (ReduceLROnPlateau), ``_composite``
(LambdaLR, MultiplicativeLR, SequentialLR, ChainedScheduler, and ``per_epoch``), over ``_core`` (torch's
scheduler protocol and :class:`Schedule`). Every public name is re-exported here.
"""

from __future__ import annotations

from functorch_optim.schedules._composite import (
    chained_scheduler,
    lambda_lr,
    multiplicative_lr,
    per_epoch,
    sequential_lr,
)
from functorch_optim.schedules._core import Schedule
from functorch_optim.schedules._cyclic import cyclic_lr, one_cycle_lr
from functorch_optim.schedules._plateau import PlateauState, reduce_lr_on_plateau
from functorch_optim.schedules._step import (
    constant_lr,
    cosine_annealing_lr,
    cosine_annealing_warm_restarts,
    exponential_lr,
    linear_lr,
    multi_step_lr,
    polynomial_lr,
    step_lr,
    swalr,
)

# pickles and reprs name the public path, whichever module holds the class
Schedule.__module__ = PlateauState.__module__ = __name__

__all__ = [
    "PlateauState",
    "Schedule",
    "chained_scheduler",
    "constant_lr",
    "cosine_annealing_lr",
    "cosine_annealing_warm_restarts",
    "cyclic_lr",
    "exponential_lr",
    "lambda_lr",
    "linear_lr",
    "multi_step_lr",
    "multiplicative_lr",
    "one_cycle_lr",
    "per_epoch",
    "polynomial_lr",
    "reduce_lr_on_plateau",
    "sequential_lr",
    "step_lr",
    "swalr",
]
