"""torch-shaped learning-rate scheduler classes that drive an optimizer's ``param_groups``.

The imperative shell over ``functorch_optim.schedules``: ``Scheduler(optimizer, ...)``
with ``step()``, ``get_last_lr()``, ``state_dict()`` / ``load_state_dict()``, as in
``torch.optim.lr_scheduler``. The optimizer is anything with ``param_groups``, a list of
dicts whose ``"lr"`` (and ``"momentum"`` or ``"betas"``) entries can be read and assigned
and take effect on the next step (``functorch_optim.optim``'s facade). Each ``step()``
reads the current values from the groups, runs torch's chainable step as one jitted pure
function (compiled once per scheduler configuration: schedulers of equal arguments
share it, whatever the learning rates) and writes the new values back as Python
floats, so the optimizer never recompiles. ``SequentialLR`` and ``ChainedScheduler``
step their schedulers, as torch's do.

``state_dict()`` is torch's (Python numbers and lists under torch's attribute names) and
``load_state_dict`` takes torch's, so a run moves between torch and JAX mid-schedule;
the values a scheduler keeps in the groups travel with the optimizer's state dict.
"""

from __future__ import annotations

import bisect
import copy
import functools
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim import schedules as _s
from functorch_optim._checks import check_saved_constants, check_state_dict_keys, to_python
from functorch_optim._hyperparams import hparam_dtype
from functorch_optim.schedules._composite import _lambda_schedule
from functorch_optim.schedules._composite import _LambdaLR as _LambdaLRSpec
from functorch_optim.schedules._composite import _MultiplicativeLR as _MultiplicativeLRSpec
from functorch_optim.schedules._core import _ByValue

__all__ = [
    "SWALR",
    "ChainedScheduler",
    "ConstantLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "ExponentialLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "ReduceLROnPlateau",
    "SequentialLR",
    "StepLR",
]


# The jitted steps, module level with the schedule a static argument compared by value
# (``schedules._ByValue``): one compiled step per configuration, across instances.
@functools.partial(jax.jit, static_argnums=0)
def _spec_step(spec: _ByValue, group: dict, state: dict) -> tuple[dict, dict]:
    return spec.obj.step(group, state)


@functools.partial(jax.jit, static_argnums=0)
def _plateau_update(plateau: _ByValue, lr: Any, state: Any, metric: Any) -> tuple[Any, Any]:
    return plateau.obj.update(lr, state, metric)


def _groups(optimizer: Any) -> list[dict]:
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
    return groups


def _read(optimizer: Any, key: str, owner: str = "scheduler") -> jax.Array:
    vals = []
    for i, group in enumerate(_groups(optimizer)):
        if key not in group:
            raise KeyError(
                f"param_groups[{i}] has no {key!r}, which {owner} writes at construction; "
                "load the optimizer state dict that was saved with this scheduler"
            )
        v = group[key]
        vals.append(float(v[0] if key == "betas" else v))
    return jnp.asarray(vals, hparam_dtype())


# ----------------------------------------------------------------------------- torch's state-dict layout
# torch's ``state_dict()`` is the scheduler's ``__dict__`` (less the optimizer): Python
# ints, floats and lists. The schedules' state names are torch's attribute names, except:
_TORCH_NAMES = {"step_count": "_step_count"}
# attributes torch's __dict__ gains from its context managers (absent in older dicts)
_OPTIONAL = {"_get_lr_called_within_step": False, "_is_initial": False}


def _loaded(cls: str, key: str, value: Any, like: jax.Array) -> jax.Array:
    """``value`` (a torch dict entry) as an array of ``like``'s shape and dtype."""
    arr = np.asarray(to_python(value))
    if arr.shape != like.shape or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        want = (
            "an integer" if like.shape == () else f"a list of {like.shape[0]} numbers (one per param group)"
        )
        raise ValueError(f"{cls}.load_state_dict: {key!r} must be {want}, got {value!r}")
    if np.issubdtype(like.dtype, np.integer) and not np.all(arr == np.round(arr)):
        raise ValueError(f"{cls}.load_state_dict: {key!r} must be an integer, got {value!r}")
    return jnp.asarray(arr, like.dtype)


def _saved_last_lr(cls: str, state_dict: Mapping[str, Any], n: int) -> list[float]:
    last_lr = to_python(state_dict["_last_lr"])
    if not isinstance(last_lr, list | tuple) or len(last_lr) != n:
        raise ValueError(f"{cls}.load_state_dict: '_last_lr' must be a list of {n} numbers, got {last_lr!r}")
    return [float(v) for v in last_lr]


class LRScheduler:
    """Base class: one ``functorch_optim.schedules`` schedule over all param groups.

    The scheduler's view of each group (``lr``, ``initial_lr``, the momentum it cycles,
    and what OneCycleLR / SWALR keep in the groups: ``max_lr``, ``min_lr``,
    ``max_momentum``, ``base_momentum``, ``swa_lr``) lives in the optimizer's
    ``param_groups``, as in torch: written at construction, read at every ``step()``,
    so it travels with the optimizer's state dict.

    Examples:
      >>> from functorch_optim.optim import lr_scheduler
      >>> class Opt:  # anything with ``param_groups``
      ...     param_groups = [{"lr": 1.0}, {"lr": 0.1}]
      >>> opt = Opt()
      >>> sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
      >>> sched.step()
      >>> [round(g["lr"], 6) for g in opt.param_groups], sched.last_epoch
      ([0.5, 0.05], 1)
      >>> sd = sched.state_dict()  # torch's layout
      >>> sd["last_epoch"], sd["_step_count"], sd["step_size"], sd["base_lrs"]
      (1, 2, 1, [1.0, 0.1])

    Attributes:
      optimizer: the driven optimizer.
      last_epoch: scheduler steps taken (torch's ``last_epoch``).
    """

    def __init__(
        self,
        optimizer: Any,
        schedule: _s.Schedule,
        last_epoch: int = -1,
        constants: Mapping[str, Any] | None = None,
    ) -> None:
        if last_epoch != -1:
            raise ValueError(
                f"last_epoch={last_epoch}: resume a scheduler with load_state_dict() instead; "
                "only last_epoch=-1 is supported"
            )
        self.optimizer = optimizer
        self._spec = schedule._spec
        self._constants = dict(constants or {})
        groups = _groups(optimizer)
        self._momentum_key = None
        if self._spec.cycles_momentum:
            defaults = getattr(optimizer, "defaults", groups[0])
            if "momentum" not in defaults and "betas" not in defaults:
                raise ValueError(
                    "optimizer must support momentum or beta1 with `cycle_momentum` option enabled"
                )
            self._momentum_key = "betas" if "betas" in defaults else "momentum"
        start = {"lr": jnp.asarray(schedule._start_lr)}
        if all("initial_lr" in g for g in groups):  # torch: ``group.setdefault("initial_lr", ...)``
            start["initial_lr"] = _read(optimizer, "initial_lr")
        if self._momentum_key is not None:
            start["momentum"] = _read(optimizer, self._momentum_key)
        self._group, self._state = self._spec.construct(start)
        self._step_fn = self._make_step_fn()
        self._write()

    def _make_step_fn(self) -> Callable:
        # eager specs (the lambdas) call the user's Python code with Python ints, outside
        # jit; the others share one compiled step per configuration (``_spec_step``),
        # keyed by the spec's attributes as they are now
        if self._spec.eager:
            return self._spec.step
        return functools.partial(_spec_step, _ByValue(self._spec))

    def _group_key(self, key: str) -> str:
        return self._momentum_key if key == "momentum" else key

    def _read_group(self) -> dict[str, jax.Array]:
        name = type(self).__name__
        return {k: _read(self.optimizer, self._group_key(k), name) for k in self._group}

    def _write(self) -> None:
        for key, value in self._group.items():
            values = np.asarray(value).tolist()
            for group, v in zip(_groups(self.optimizer), values, strict=True):
                if key == "momentum" and self._momentum_key == "betas":
                    group["betas"] = (v, *tuple(group["betas"])[1:])
                else:
                    group[self._group_key(key)] = v
        self._last_lr = np.asarray(self._group["lr"]).tolist()

    @property
    def last_epoch(self) -> int:
        return int(self._state["last_epoch"])

    def step(self) -> None:
        """One scheduler step, from the groups' current values (torch's chainable form)."""
        self._group, self._state = self._step_fn(self._read_group(), self._state)
        self._write()

    def _initial_step(self) -> None:
        """torch's ``_initial_step()``: ``_step_count = 0``, then a step in initial mode."""
        self._group, self._state = self._spec.initial_step(self._read_group(), self._state)
        self._write()

    def _update_lr(self, epoch: int) -> None:
        """torch's ``_update_lr(epoch)``: ``last_epoch = epoch``, the closed form if any."""
        self._group, self._state = self._spec.update_lr(self._read_group(), self._state, epoch)
        self._write()

    def _undo(self) -> None:
        """``SequentialLR.recursive_undo`` on this scheduler: ``last_epoch -= 1``."""
        self._state = self._spec.undo(self._state)

    def get_last_lr(self) -> list[float]:
        """The learning rates the last ``step()`` (or the constructor) set, one per group."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state in torch's layout (Python numbers and lists).

        The keys and value types of ``torch.optim.lr_scheduler.<Same>.state_dict()``: the
        hyperparameters under torch's attribute names, ``last_epoch``, ``_step_count``,
        ``base_lrs``, ``_last_lr`` and the class's own counters. It loads into the torch
        class (``torch_scheduler.load_state_dict(sd)``) and back, and ``torch.save`` /
        ``torch.load`` (``weights_only=True``) keep it. The groups' values (``lr``,
        ``initial_lr``, …) are the optimizer's: save its state dict too.
        """
        sd = dict(self._constants)
        sd.update({_TORCH_NAMES.get(k, k): to_python(v) for k, v in self._state.items()})
        sd.update(_OPTIONAL)
        sd["_last_lr"] = list(self._last_lr)
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state dict in torch's layout: ``state_dict()``'s, or a torch scheduler's.

        Build the scheduler with the arguments the saved one had (they are checked:
        torch would silently adopt the saved ones) and load the optimizer's state dict
        as well, before or after this one: the groups' values come from it.

        Raises:
          TypeError: ``state_dict`` is not a mapping.
          ValueError: keys of another scheduler class (naming the missing and unexpected
            keys), a saved hyperparameter that differs from this scheduler's, or a value
            of the wrong kind or length. Raised before anything changes.
        """
        self._prepare_load(state_dict)()

    def _prepare_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        """Validate ``state_dict`` entirely; return the function that applies it."""
        cls = type(self).__name__
        check_state_dict_keys(cls, state_dict, self.state_dict(), _OPTIONAL)
        check_saved_constants(cls, state_dict, self._constants)
        state = {
            k: _loaded(cls, _TORCH_NAMES.get(k, k), state_dict[_TORCH_NAMES.get(k, k)], v)
            for k, v in self._state.items()
        }
        last_lr = _saved_last_lr(cls, state_dict, len(self._last_lr))
        after = self._after_load(state_dict)

        def apply() -> None:
            self._state = state
            self._last_lr = last_lr
            after()

        return apply

    def _after_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        return lambda: None


def _lrs(optimizer: Any) -> list[float]:
    return [float(g["lr"]) for g in _groups(optimizer)]


class _LambdaScheduler(LRScheduler):
    """LambdaLR / MultiplicativeLR: torch's ``lr_lambdas`` entry in the state dict.

    ``None`` for a function or lambda, a copy of the ``__dict__`` of a callable object,
    whose attributes ``load_state_dict`` updates, as torch does.
    """

    def __init__(
        self, optimizer: Any, lr_lambda: Callable | Sequence[Callable], last_epoch: int = -1
    ) -> None:
        sched = _lambda_schedule(_lrs(optimizer), lr_lambda, self._spec_class, eager=True)
        super().__init__(optimizer, sched, last_epoch)

    _spec_class: type[_LambdaLRSpec]

    @property
    def lr_lambdas(self) -> list[Callable]:
        """One function per group, as torch's ``lr_lambdas``."""
        fns = self._spec.lr_lambdas
        return list(fns) if self._spec.per_group else fns * len(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["lr_lambdas"] = [
            None if isinstance(fn, types.FunctionType) else copy.deepcopy(fn.__dict__)
            for fn in self.lr_lambdas
        ]
        return sd

    def _after_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        saved = state_dict["lr_lambdas"]
        fns = self.lr_lambdas
        if not isinstance(saved, list | tuple) or len(saved) != len(fns):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: 'lr_lambdas' must be a list of "
                f"{len(fns)} entries, got {saved!r}"
            )
        for i, (fn, entry) in enumerate(zip(fns, saved, strict=True)):
            if entry is not None and not hasattr(fn, "__dict__"):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: lr_lambdas[{i}] holds attributes "
                    f"{entry!r}, but this scheduler's lr_lambdas[{i}] has none"
                )

        def apply() -> None:
            for fn, entry in zip(fns, saved, strict=True):
                if entry is not None:
                    fn.__dict__.update(entry)  # read at the next (eager) call

        return apply


class LambdaLR(_LambdaScheduler):
    """``torch.optim.lr_scheduler.LambdaLR``: ``lr = base_lr * lr_lambda(last_epoch)`` per group.

    As torch, each ``step()`` calls ``lr_lambda`` (or each group's) with ``last_epoch`` as
    a Python int, outside jit, so any Python code works: ``if``, ``max()``, ``float()``,
    transformers' ``get_linear_schedule_with_warmup`` lambdas, unchanged. The functional
    ``schedules.lambda_lr`` traces its lambda instead.

    Examples:
      >>> from functorch_optim.optim import lr_scheduler
      >>> class Opt:  # anything with ``param_groups``
      ...     param_groups = [{"lr": 1.0}]
      >>> opt = Opt()
      >>> sched = lr_scheduler.LambdaLR(opt, lambda e: float(e) / 2 if e < 2 else 1.0)
      >>> for _ in range(3):
      ...     sched.step()
      >>> sched.get_last_lr()
      [1.0]
    """

    _spec_class = _LambdaLRSpec


class MultiplicativeLR(_LambdaScheduler):
    """``torch.optim.lr_scheduler.MultiplicativeLR``: ``lr *= lr_lambda(last_epoch)`` each step.

    ``lr_lambda`` is called eagerly with a Python int, as in :class:`LambdaLR`.
    """

    _spec_class = _MultiplicativeLRSpec


class StepLR(LRScheduler):
    """``torch.optim.lr_scheduler.StepLR`` (see ``schedules.step_lr``)."""

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        sched = _s.step_lr(_lrs(optimizer), step_size, gamma)
        super().__init__(optimizer, sched, last_epoch, {"step_size": step_size, "gamma": gamma})


class MultiStepLR(LRScheduler):
    """``torch.optim.lr_scheduler.MultiStepLR`` (see ``schedules.multi_step_lr``)."""

    def __init__(
        self, optimizer: Any, milestones: Sequence[int], gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        sched = _s.multi_step_lr(_lrs(optimizer), milestones, gamma)
        constants = {"milestones": Counter(sched._spec.milestones), "gamma": gamma}
        super().__init__(optimizer, sched, last_epoch, constants)


class ConstantLR(LRScheduler):
    """``torch.optim.lr_scheduler.ConstantLR`` (see ``schedules.constant_lr``)."""

    def __init__(
        self, optimizer: Any, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1
    ) -> None:
        sched = _s.constant_lr(_lrs(optimizer), factor, total_iters)
        super().__init__(optimizer, sched, last_epoch, {"factor": factor, "total_iters": total_iters})


class LinearLR(LRScheduler):
    """``torch.optim.lr_scheduler.LinearLR`` (see ``schedules.linear_lr``)."""

    def __init__(
        self,
        optimizer: Any,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        total_iters: int = 5,
        last_epoch: int = -1,
    ) -> None:
        sched = _s.linear_lr(_lrs(optimizer), start_factor, end_factor, total_iters)
        constants = {"start_factor": start_factor, "end_factor": end_factor, "total_iters": total_iters}
        super().__init__(optimizer, sched, last_epoch, constants)


class ExponentialLR(LRScheduler):
    """``torch.optim.lr_scheduler.ExponentialLR`` (see ``schedules.exponential_lr``)."""

    def __init__(self, optimizer: Any, gamma: float, last_epoch: int = -1) -> None:
        super().__init__(optimizer, _s.exponential_lr(_lrs(optimizer), gamma), last_epoch, {"gamma": gamma})


class PolynomialLR(LRScheduler):
    """``torch.optim.lr_scheduler.PolynomialLR`` (see ``schedules.polynomial_lr``)."""

    def __init__(
        self, optimizer: Any, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1
    ) -> None:
        sched = _s.polynomial_lr(_lrs(optimizer), total_iters, power)
        super().__init__(optimizer, sched, last_epoch, {"total_iters": total_iters, "power": power})


class CosineAnnealingLR(LRScheduler):
    """``torch.optim.lr_scheduler.CosineAnnealingLR`` (see ``schedules.cosine_annealing_lr``)."""

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        sched = _s.cosine_annealing_lr(_lrs(optimizer), T_max, eta_min)
        super().__init__(optimizer, sched, last_epoch, {"T_max": T_max, "eta_min": eta_min})


class CosineAnnealingWarmRestarts(LRScheduler):
    """``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``."""

    def __init__(
        self, optimizer: Any, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1
    ) -> None:
        sched = _s.cosine_annealing_warm_restarts(_lrs(optimizer), T_0, T_mult, eta_min)
        super().__init__(optimizer, sched, last_epoch, {"T_0": T_0, "T_mult": T_mult, "eta_min": eta_min})


class SWALR(LRScheduler):
    """``torch.optim.swa_utils.SWALR`` (see ``schedules.swalr``)."""

    def __init__(
        self,
        optimizer: Any,
        swa_lr: float | Sequence[float],
        anneal_epochs: int = 10,
        anneal_strategy: str = "cos",
        last_epoch: int = -1,
    ) -> None:
        sched = _s.swalr(_lrs(optimizer), swa_lr, anneal_epochs, anneal_strategy)
        constants = {"anneal_epochs": anneal_epochs, "_anneal_strategy": anneal_strategy}
        super().__init__(optimizer, sched, last_epoch, constants)


class CyclicLR(LRScheduler):
    """``torch.optim.lr_scheduler.CyclicLR`` (see ``schedules.cyclic_lr``); cycles momentum/beta1.

    A custom ``scale_fn`` is called eagerly with a Python int, as torch does (any Python
    code works, as for :class:`LambdaLR`).
    """

    def __init__(
        self,
        optimizer: Any,
        base_lr: float | Sequence[float],
        max_lr: float | Sequence[float],
        step_size_up: int = 2000,
        step_size_down: int | None = None,
        mode: str = "triangular",
        gamma: float = 1.0,
        scale_fn: Callable | None = None,
        scale_mode: str = "cycle",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.8,
        max_momentum: float | Sequence[float] = 0.9,
        last_epoch: int = -1,
    ) -> None:
        sched = _s.cyclic_lr(
            base_lr, max_lr, step_size_up, step_size_down, mode, gamma, scale_fn, scale_mode,
            cycle_momentum, base_momentum, max_momentum, lr=_lrs(optimizer),
        )  # fmt: skip
        spec = sched._spec
        spec.eager = scale_fn is not None  # torch calls scale_fn with a Python number
        constants = {
            "total_size": spec.total_size, "step_ratio": spec.step_ratio, "mode": mode, "gamma": gamma,
            "scale_mode": spec.scale_mode, "cycle_momentum": cycle_momentum,
        }  # fmt: skip
        super().__init__(optimizer, sched, last_epoch, constants)
        if cycle_momentum:
            self._constants["use_beta1"] = self._momentum_key == "betas"

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        fn = self._spec.custom
        sd["_scale_fn_custom"] = (
            None if fn is None or isinstance(fn, types.FunctionType) else copy.deepcopy(fn.__dict__)
        )
        return sd

    def _after_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        saved, fn = state_dict["_scale_fn_custom"], self._spec.custom
        if saved is not None and not hasattr(fn, "__dict__"):
            raise ValueError(
                f"CyclicLR.load_state_dict: _scale_fn_custom holds attributes {saved!r}, "
                "but this CyclicLR has no callable-object scale_fn"
            )

        def apply() -> None:
            if saved is not None:
                fn.__dict__.update(saved)
                self._step_fn = self._make_step_fn()  # its attributes are traced in

        return apply


class OneCycleLR(LRScheduler):
    """``torch.optim.lr_scheduler.OneCycleLR`` (see ``schedules.one_cycle_lr``); cycles momentum/beta1.

    Stepping past ``total_steps`` raises torch's ``Tried to step … times`` here (the pure
    schedule turns NaN instead).
    """

    def __init__(
        self,
        optimizer: Any,
        max_lr: float | Sequence[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.85,
        max_momentum: float | Sequence[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
    ) -> None:
        _groups(optimizer)
        sched = _s.one_cycle_lr(
            max_lr, total_steps, epochs, steps_per_epoch, pct_start, anneal_strategy, cycle_momentum,
            base_momentum, max_momentum, div_factor, final_div_factor, three_phase, lr=_lrs(optimizer),
        )  # fmt: skip
        self.total_steps = sched._spec.total_steps
        constants = {
            "total_steps": self.total_steps,
            "_schedule_phases": copy.deepcopy(sched._spec.phases),
            "_anneal_func_type": anneal_strategy,
            "cycle_momentum": cycle_momentum,
        }
        super().__init__(optimizer, sched, last_epoch, constants)
        if cycle_momentum:
            self._constants["use_beta1"] = self._momentum_key == "betas"

    def step(self) -> None:
        if self.last_epoch + 1 > self.total_steps:
            raise ValueError(
                f"Tried to step {self.last_epoch + 1} times. "
                f"The specified number of total steps is {self.total_steps}"
            )
        super().step()


class SequentialLR(LRScheduler):
    """``torch.optim.lr_scheduler.SequentialLR`` over schedulers built on the same optimizer.

    As torch's: it undoes its schedulers' construction steps, re-runs the first one's,
    and from then on steps the scheduler of the current phase (``_update_lr(0)`` at a
    milestone). Step the ``SequentialLR``, not its schedulers. Its state dict nests
    theirs under ``_schedulers``.
    """

    def __init__(
        self, optimizer: Any, schedulers: Sequence[Any], milestones: Sequence[int], last_epoch: int = -1
    ) -> None:
        _check_same_optimizer("SequentialLR", optimizer, schedulers)
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(
                "Sequential Schedulers expects number of schedulers provided to be one more "
                "than the number of milestone points, but got number of schedulers "
                f"{len(schedulers)} and the number of milestones to be equal to {len(milestones)}"
            )
        for i, s in enumerate(schedulers):
            if isinstance(s, SequentialLR | ChainedScheduler):
                raise ValueError(
                    f"SequentialLR at index {i} is a {type(s).__name__}, which torch cannot restart at a "
                    "milestone (it has no get_lr); nest it in a ChainedScheduler instead"
                )
        if last_epoch != -1:
            raise ValueError(
                f"last_epoch={last_epoch}: resume a scheduler with load_state_dict() instead; "
                "only last_epoch=-1 is supported"
            )
        self.optimizer = optimizer
        self._schedulers = list(schedulers)
        self._milestones = list(milestones)
        self._last_epoch = last_epoch + 1
        for group in _groups(optimizer):
            group["lr"] = group["initial_lr"]  # torch resets to the initial lrs
        for s in self._schedulers:
            s._undo()
        idx = bisect.bisect_right(self._milestones, 0)
        self._schedulers[idx]._initial_step()
        self._last_lr = self._schedulers[idx].get_last_lr()

    @property
    def last_epoch(self) -> int:
        return self._last_epoch

    def step(self) -> None:
        """torch's step: the current phase's scheduler steps, or restarts at a milestone."""
        self._last_epoch += 1
        idx = bisect.bisect_right(self._milestones, self._last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self._last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def _undo(self) -> None:
        for s in self._schedulers:
            s._undo()

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``_milestones``, ``last_epoch``, ``_last_lr`` and ``_schedulers``."""
        return {
            "_schedulers": [s.state_dict() for s in self._schedulers],
            "_milestones": list(self._milestones),
            "last_epoch": self._last_epoch,
            "_last_lr": list(self._last_lr),
        }

    def _prepare_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        name = "SequentialLR"
        check_state_dict_keys(name, state_dict, self.state_dict())
        check_saved_constants("SequentialLR", state_dict, {"_milestones": self._milestones})
        subs = _prepare_subs("SequentialLR", self._schedulers, state_dict["_schedulers"])
        last_epoch = int(_loaded("SequentialLR", "last_epoch", state_dict["last_epoch"], jnp.int32(0)))
        last_lr = _saved_last_lr(name, state_dict, len(self._last_lr))

        def apply() -> None:
            for sub in subs:
                sub()
            self._last_epoch, self._last_lr = last_epoch, last_lr

        return apply


class ChainedScheduler(LRScheduler):
    """``torch.optim.lr_scheduler.ChainedScheduler`` over schedulers built on the same optimizer.

    Each ``step()`` steps every scheduler in order, as torch's. Step the chain, not its
    schedulers. Its state dict nests theirs under ``_schedulers``.
    """

    def __init__(self, schedulers: Sequence[Any], optimizer: Any = None) -> None:
        if len(schedulers) < 1:
            raise ValueError(
                "ChainedScheduler expects at least one scheduler to be chained, but got no scheduler."
            )
        optimizer = optimizer or schedulers[0].optimizer
        _check_same_optimizer("ChainedScheduler", optimizer, schedulers)
        self.optimizer = optimizer
        self._schedulers = list(schedulers)
        self._last_lr = _lrs(optimizer)

    @property
    def last_epoch(self) -> int:
        """The last scheduler's ``last_epoch`` (torch's chain keeps none of its own)."""
        return self._schedulers[-1].last_epoch

    def step(self) -> None:
        """Every scheduler's ``step()``, in order, each on the lr the previous one left."""
        for s in self._schedulers:
            s.step()
        self._last_lr = _lrs(self.optimizer)

    def _undo(self) -> None:
        for s in self._schedulers:
            s._undo()

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``_last_lr`` and ``_schedulers``."""
        return {"_schedulers": [s.state_dict() for s in self._schedulers], "_last_lr": list(self._last_lr)}

    def _prepare_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        name = "ChainedScheduler"
        check_state_dict_keys(name, state_dict, self.state_dict())
        subs = _prepare_subs("ChainedScheduler", self._schedulers, state_dict["_schedulers"])
        last_lr = _saved_last_lr(name, state_dict, len(self._last_lr))

        def apply() -> None:
            for sub in subs:
                sub()
            self._last_lr = last_lr

        return apply


def _prepare_subs(name: str, schedulers: Sequence[Any], saved: Any) -> list[Callable[[], None]]:
    if not isinstance(saved, list | tuple) or len(saved) != len(schedulers):
        got = len(saved) if isinstance(saved, list | tuple) else type(saved).__name__
        raise ValueError(
            f"{name}.load_state_dict: '_schedulers' must hold {len(schedulers)} state dicts "
            f"(one per scheduler), got {got}"
        )
    out = []
    for i, (s, sd) in enumerate(zip(schedulers, saved, strict=True)):
        try:
            out.append(s._prepare_load(sd))
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name}._schedulers[{i}]: {err}") from None
    return out


def _check_same_optimizer(name: str, optimizer: Any, schedulers: Sequence[Any]) -> None:
    if len(schedulers) < 1 and name == "SequentialLR":
        raise ValueError(f"{name} expects at least one scheduler, but got no scheduler.")
    for i, s in enumerate(schedulers):
        if not hasattr(s, "optimizer"):
            raise TypeError(f"{name} at index {i} should have `optimizer` as its attribute.")
        if isinstance(s, ReduceLROnPlateau):
            raise ValueError(
                f"{name} does not support `ReduceLROnPlateau` scheduler as it "
                "requires additional kwargs to be specified when calling `step`, "
                f"but got one at index {i} in the given schedulers sequence."
            )
        if s.optimizer is not optimizer:
            raise ValueError(
                f"{name} expects all schedulers to belong to the same optimizer, but "
                f"got scheduler {type(s).__name__} at index {i} has {s.optimizer}, "
                f"which is different from {type(optimizer).__name__}."
            )


class ReduceLROnPlateau:
    """``torch.optim.lr_scheduler.ReduceLROnPlateau``: ``step(metrics)`` on the groups' lrs.

    ``state_dict()`` / ``load_state_dict()`` in torch's layout (``best``,
    ``num_bad_epochs``, ``cooldown_counter``, ``last_epoch``, the hyperparameters).
    """

    def __init__(
        self,
        optimizer: Any,
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_lr: float | Sequence[float] = 0,
        eps: float = 1e-8,
    ) -> None:
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        self.optimizer = optimizer
        self._plateau = _s.reduce_lr_on_plateau(
            _lrs(optimizer), mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps
        )
        self._state = self._plateau.init_state()
        self._static = _ByValue(self._plateau, self._plateau.update_key)
        self._last_lr = _lrs(optimizer)
        per_group = isinstance(min_lr, list | tuple)
        self._constants = {
            "factor": factor,
            "min_lrs": list(min_lr) if per_group else [min_lr] * len(self._last_lr),
            "default_min_lr": None if per_group else min_lr,
            "patience": patience,
            "cooldown": cooldown,
            "eps": eps,
            "mode": mode,
            "threshold": threshold,
            "threshold_mode": threshold_mode,
            "mode_worse": self._plateau.mode_worse,
        }

    @property
    def last_epoch(self) -> int:
        return int(self._state.last_epoch)

    @property
    def num_bad_epochs(self) -> int:
        return int(self._state.num_bad_epochs)

    @property
    def best(self) -> float:
        return float(self._state.best)

    def step(self, metrics: Any) -> None:
        """torch's ``step(metrics)``: update the groups' lrs from the monitored metric."""
        lr = _read(self.optimizer, "lr")
        lrs, self._state = _plateau_update(self._static, lr, self._state, float(metrics))
        new = np.asarray(lrs).tolist()
        for group, old, lr in zip(_groups(self.optimizer), _lrs(self.optimizer), new, strict=True):
            if lr != old:
                group["lr"] = lr
        self._last_lr = _lrs(self.optimizer)

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's layout (Python numbers and lists), loadable into torch's class."""
        sd = dict(self._constants)
        sd.update({k: to_python(v) for k, v in self._state._asdict().items()})
        sd["_last_lr"] = list(self._last_lr)
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state dict in torch's layout (``state_dict()``'s or a torch one's).

        Raises:
          TypeError: ``state_dict`` is not a mapping.
          ValueError: keys of another scheduler, a hyperparameter that differs from this
            scheduler's, a value of the wrong kind or length. Raised before anything changes.
        """
        self._prepare_load(state_dict)()

    def _prepare_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        cls = "ReduceLROnPlateau"
        check_state_dict_keys(cls, state_dict, self.state_dict(), _OPTIONAL)
        check_saved_constants(cls, state_dict, self._constants)
        fields = self._state._asdict()
        state = type(self._state)(**{k: _loaded(cls, k, state_dict[k], v) for k, v in fields.items()})
        last_lr = _saved_last_lr(cls, state_dict, len(self._last_lr))

        def apply() -> None:
            self._state = state
            self._last_lr = last_lr

        return apply
