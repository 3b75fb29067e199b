"""torch-shaped learning-rate scheduler classes that drive an optimizer's ``param_groups``.

The imperative shell over ``functorch_optim.schedules``: ``Scheduler(optimizer, ...)``
with ``step()``, ``get_last_lr()``, ``state_dict()`` / ``load_state_dict()``, as in
``torch.optim.lr_scheduler``. The optimizer is anything with ``param_groups``, a list of
dicts whose ``"lr"`` (and ``"momentum"`` or ``"betas"``) entries can be read and assigned
and take effect on the next step (``functorch_optim.optim``'s facade). Each ``step()``
reads the current values from the groups, runs torch's chainable step as one jitted pure
function (compiled once per scheduler configuration: schedulers of equal arguments share
it, whatever the learning rates) and writes the new values back as Python floats, so the
optimizer never recompiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim import schedules as _s
from functorch_optim._hyperparams import hparam_dtype

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
def _spec_step(spec: _s._ByValue, group: dict, state: dict) -> tuple[dict, dict]:
    return spec.obj.step(group, state)


@functools.partial(jax.jit, static_argnums=0)
def _plateau_update(plateau: _s._ByValue, lr: Any, state: Any, metric: Any) -> tuple[Any, Any]:
    return plateau.obj.update(lr, state, metric)


def _groups(optimizer: Any) -> list[dict]:
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
    return groups


def _read(optimizer: Any, key: str) -> jax.Array:
    vals = []
    for group in _groups(optimizer):
        v = group[key]
        vals.append(float(v[0] if key == "betas" else v))
    return jnp.asarray(vals, hparam_dtype())


class LRScheduler:
    """Base class: one ``functorch_optim.schedules`` schedule over all param groups.

    Examples:
      >>> from functorch_optim.optim import lr_scheduler
      >>> class Opt:  # anything with ``param_groups``
      ...     param_groups = [{"lr": 1.0}, {"lr": 0.1}]
      >>> opt = Opt()
      >>> sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
      >>> sched.step()
      >>> [round(g["lr"], 6) for g in opt.param_groups], sched.last_epoch
      ([0.5, 0.05], 1)

    Attributes:
      optimizer: the driven optimizer.
      last_epoch: scheduler steps taken (torch's ``last_epoch`` for simple schedulers).
    """

    def __init__(self, optimizer: Any, schedule: _s.Schedule, last_epoch: int = -1) -> None:
        if last_epoch != -1:
            raise ValueError(
                f"last_epoch={last_epoch}: resume a scheduler with load_state_dict() instead; "
                "only last_epoch=-1 is supported"
            )
        self.optimizer = optimizer
        self._spec = schedule._spec
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
        self._static = _s._ByValue(self._spec)
        for group, initial in zip(groups, np.asarray(self._group["initial_lr"]).tolist(), strict=True):
            group["initial_lr"] = initial
        self._write()

    def _write(self) -> None:
        lrs = np.asarray(self._group["lr"]).tolist()
        for group, lr in zip(_groups(self.optimizer), lrs, strict=True):
            group["lr"] = lr
        if self._momentum_key is not None:
            moms = np.asarray(self._group["momentum"]).tolist()
            for group, m in zip(_groups(self.optimizer), moms, strict=True):
                if self._momentum_key == "betas":
                    group["betas"] = (m, *tuple(group["betas"])[1:])
                else:
                    group["momentum"] = m
        self._last_lr = lrs

    @property
    def last_epoch(self) -> int:
        st = self._state
        while "last_epoch" not in st:
            st = st["subs"][-1]
        return int(st["last_epoch"])

    def step(self) -> None:
        """One scheduler step, from the groups' current values (torch's chainable form)."""
        group = dict(self._group)
        group["lr"] = _read(self.optimizer, "lr")
        if self._momentum_key is not None:
            group["momentum"] = _read(self.optimizer, self._momentum_key)
        self._group, self._state = _spec_step(self._static, group, self._state)
        self._write()

    def get_last_lr(self) -> list[float]:
        """The learning rates the last ``step()`` (or the constructor) set, one per group."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state (NumPy arrays and floats; no optimizer)."""
        return {
            "group": jax.tree.map(np.asarray, self._group),
            "state": jax.tree.map(np.asarray, self._state),
            "_last_lr": list(self._last_lr),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the optimizer's lrs come from its own state dict."""
        self._group = jax.tree.map(jnp.asarray, state_dict["group"])
        self._state = jax.tree.map(jnp.asarray, state_dict["state"])
        self._last_lr = list(state_dict["_last_lr"])


def _lrs(optimizer: Any) -> list[float]:
    return [float(g["lr"]) for g in _groups(optimizer)]


class LambdaLR(LRScheduler):
    """``torch.optim.lr_scheduler.LambdaLR`` (see ``schedules.lambda_lr``)."""

    def __init__(
        self, optimizer: Any, lr_lambda: Callable | Sequence[Callable], last_epoch: int = -1
    ) -> None:
        super().__init__(optimizer, _s.lambda_lr(_lrs(optimizer), lr_lambda), last_epoch)


class MultiplicativeLR(LRScheduler):
    """``torch.optim.lr_scheduler.MultiplicativeLR`` (see ``schedules.multiplicative_lr``)."""

    def __init__(
        self, optimizer: Any, lr_lambda: Callable | Sequence[Callable], last_epoch: int = -1
    ) -> None:
        super().__init__(optimizer, _s.multiplicative_lr(_lrs(optimizer), lr_lambda), last_epoch)


class StepLR(LRScheduler):
    """``torch.optim.lr_scheduler.StepLR`` (see ``schedules.step_lr``)."""

    def __init__(self, optimizer: Any, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        super().__init__(optimizer, _s.step_lr(_lrs(optimizer), step_size, gamma), last_epoch)


class MultiStepLR(LRScheduler):
    """``torch.optim.lr_scheduler.MultiStepLR`` (see ``schedules.multi_step_lr``)."""

    def __init__(
        self, optimizer: Any, milestones: Sequence[int], gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        super().__init__(optimizer, _s.multi_step_lr(_lrs(optimizer), milestones, gamma), last_epoch)


class ConstantLR(LRScheduler):
    """``torch.optim.lr_scheduler.ConstantLR`` (see ``schedules.constant_lr``)."""

    def __init__(
        self, optimizer: Any, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1
    ) -> None:
        super().__init__(optimizer, _s.constant_lr(_lrs(optimizer), factor, total_iters), last_epoch)


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
        super().__init__(optimizer, sched, last_epoch)


class ExponentialLR(LRScheduler):
    """``torch.optim.lr_scheduler.ExponentialLR`` (see ``schedules.exponential_lr``)."""

    def __init__(self, optimizer: Any, gamma: float, last_epoch: int = -1) -> None:
        super().__init__(optimizer, _s.exponential_lr(_lrs(optimizer), gamma), last_epoch)


class PolynomialLR(LRScheduler):
    """``torch.optim.lr_scheduler.PolynomialLR`` (see ``schedules.polynomial_lr``)."""

    def __init__(
        self, optimizer: Any, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1
    ) -> None:
        super().__init__(optimizer, _s.polynomial_lr(_lrs(optimizer), total_iters, power), last_epoch)


class CosineAnnealingLR(LRScheduler):
    """``torch.optim.lr_scheduler.CosineAnnealingLR`` (see ``schedules.cosine_annealing_lr``)."""

    def __init__(self, optimizer: Any, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        super().__init__(optimizer, _s.cosine_annealing_lr(_lrs(optimizer), T_max, eta_min), last_epoch)


class CosineAnnealingWarmRestarts(LRScheduler):
    """``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``."""

    def __init__(
        self, optimizer: Any, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1
    ) -> None:
        sched = _s.cosine_annealing_warm_restarts(_lrs(optimizer), T_0, T_mult, eta_min)
        super().__init__(optimizer, sched, last_epoch)


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
        super().__init__(optimizer, sched, last_epoch)


class CyclicLR(LRScheduler):
    """``torch.optim.lr_scheduler.CyclicLR`` (see ``schedules.cyclic_lr``); cycles momentum/beta1."""

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
        super().__init__(optimizer, sched, last_epoch)


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
        super().__init__(optimizer, sched, last_epoch)

    def step(self) -> None:
        if self.last_epoch + 1 > self.total_steps:
            raise ValueError(
                f"Tried to step {self.last_epoch + 1} times. "
                f"The specified number of total steps is {self.total_steps}"
            )
        super().step()


def _composite_schedules(optimizer: Any, schedulers: Sequence[Any]) -> list[_s.Schedule]:
    """The sub-schedulers' schedules, rebuilt in order from the groups' initial lrs."""
    initial = [float(g["initial_lr"]) for g in _groups(optimizer)]
    out = []
    for s in schedulers:
        if isinstance(s, ReduceLROnPlateau):
            out.append(s._plateau)
        else:
            out.append(_s.Schedule(s._spec, None, start_lr=initial))
    return out


class SequentialLR(LRScheduler):
    """``torch.optim.lr_scheduler.SequentialLR`` over schedulers built on the same optimizer.

    The sequence takes over its schedulers: step the ``SequentialLR``, not them.
    """

    def __init__(
        self, optimizer: Any, schedulers: Sequence[Any], milestones: Sequence[int], last_epoch: int = -1
    ) -> None:
        _check_same_optimizer("SequentialLR", optimizer, schedulers)
        for group in _groups(optimizer):
            group["lr"] = group["initial_lr"]  # torch resets to the initial lrs
        subs = _composite_schedules(optimizer, schedulers)
        super().__init__(optimizer, _s.sequential_lr(subs, milestones), last_epoch)


class ChainedScheduler(LRScheduler):
    """``torch.optim.lr_scheduler.ChainedScheduler`` over schedulers built on the same optimizer.

    The chain takes over its schedulers: step the ``ChainedScheduler``, not them.
    """

    def __init__(self, schedulers: Sequence[Any], optimizer: Any = None) -> None:
        if len(schedulers) < 1:
            raise ValueError(
                "ChainedScheduler expects at least one scheduler to be chained, but got no scheduler."
            )
        optimizer = optimizer or schedulers[0].optimizer
        _check_same_optimizer("ChainedScheduler", optimizer, schedulers)
        for group in _groups(optimizer):
            group["lr"] = group["initial_lr"]  # rebuilt below from the initial lrs, in order
        subs = _composite_schedules(optimizer, schedulers)
        super().__init__(optimizer, _s.chained_scheduler(subs))


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
    """``torch.optim.lr_scheduler.ReduceLROnPlateau``: ``step(metrics)`` on the groups' lrs."""

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
        self._static = _s._ByValue(self._plateau, self._plateau.update_key)
        self._last_lr = _lrs(optimizer)

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
        return {"state": jax.tree.map(np.asarray, self._state), "_last_lr": list(self._last_lr)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = type(self._state)(*(jnp.asarray(x) for x in state_dict["state"]))
        self._last_lr = list(state_dict["_last_lr"])
