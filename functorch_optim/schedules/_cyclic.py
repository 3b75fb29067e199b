"""The cyclic schedules, which also cycle momentum: ``CyclicLR`` and ``OneCycleLR``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from functorch_optim.schedules._core import (
    Schedule,
    _as_lr,
    _cos,
    _div,
    _f,
    _format_param,
    _mul,
    _pow,
    _select,
    _Spec,
    python_arithmetic,
)


class _CyclicLR(_Spec):
    name = "CyclicLR"

    def __init__(self, base_lr, max_lr, step_size_up, step_size_down, mode, gamma, scale_fn, scale_mode,
                 cycle_momentum, base_momentum, max_momentum):  # fmt: skip
        self.base_lr, self.max_lr = base_lr, max_lr
        up = float(step_size_up)
        down = float(step_size_down) if step_size_down is not None else up
        self.total_size = up + down
        self.step_ratio = up / self.total_size
        self.mode, self.gamma, self.custom = mode, gamma, scale_fn
        if scale_fn is None:
            scale_mode = "iterations" if mode == "exp_range" else "cycle"
        self.scale_mode = scale_mode
        self.cycles_momentum = cycle_momentum
        self.base_momentum, self.max_momentum = base_momentum, max_momentum

    def scale_fn(self, x):
        if self.custom is not None and self.eager:  # the facade: a Python int, as torch
            return _f(self.custom(int(x)))
        if self.custom is not None:  # int64 under x64, as lambda_lr
            return _f(python_arithmetic(self.custom, jnp.asarray(x, jnp.result_type(int))))
        if self.mode == "triangular":
            return _f(1.0)
        if self.mode == "triangular2":
            return _div(1, _pow(2.0, _f(x) - 1))
        return _pow(self.gamma, x)

    def attach(self, group):
        shape = jnp.shape(group["lr"])
        group["lr"] = group["cyc_base_lr"] = _format_param("base_lr", shape, self.base_lr)
        group["cyc_max_lr"] = _format_param("max_lr", shape, self.max_lr)
        if self.cycles_momentum:
            group["cyc_base_momentum"] = _format_param("base_momentum", shape, self.base_momentum)
            group["cyc_max_momentum"] = _format_param("max_momentum", shape, self.max_momentum)
            group["momentum"] = group["cyc_max_momentum"]
        return group

    def extra_state(self, group):
        st = {"cyc_base_lrs": group.pop("cyc_base_lr"), "max_lrs": group.pop("cyc_max_lr")}
        return {**st, **self._momentum_state(group)}

    def _momentum_state(self, group):
        if not self.cycles_momentum:
            return {}
        return {
            "base_momentums": group.pop("cyc_base_momentum"),
            "max_momentums": group.pop("cyc_max_momentum"),
        }

    def post_init(self, group, st):
        st = dict(st)
        st["base_lrs"] = st.pop("cyc_base_lrs")  # torch reassigns base_lrs after the initial step
        return st

    def get_lr(self, group, st, is_initial):
        e = st["last_epoch"]
        cycle = jnp.floor(1 + _div(e, self.total_size))
        x = 1.0 + _div(e, self.total_size) - cycle
        scale_factor = jnp.where(
            x <= self.step_ratio, _div(x, self.step_ratio), _div(x - 1, self.step_ratio - 1)
        )
        arg = cycle.astype(jnp.int32) if self.scale_mode == "cycle" else e
        scale = self.scale_fn(arg)
        base_height = _mul(st["max_lrs"] - st["base_lrs"], scale_factor)
        lrs = st["base_lrs"] + _mul(base_height, scale)
        if self.cycles_momentum:
            height = _mul(st["max_momentums"] - st["base_momentums"], scale_factor)
            group = {**group, "momentum": st["max_momentums"] - _mul(height, scale)}
        return lrs, group


class _OneCycleLR(_Spec):
    name = "OneCycleLR"

    def __init__(self, max_lr, total_steps, pct_start, anneal_strategy, cycle_momentum, base_momentum,
                 max_momentum, div_factor, final_div_factor, phases):  # fmt: skip
        self.max_lr, self.total_steps, self.strategy = max_lr, total_steps, anneal_strategy
        self.cycles_momentum = cycle_momentum
        self.base_momentum, self.max_momentum = base_momentum, max_momentum
        self.div_factor, self.final_div_factor = div_factor, final_div_factor
        self.phases = phases

    def attach(self, group):
        shape = jnp.shape(group["lr"])
        max_lrs = _format_param("max_lr", shape, self.max_lr)
        group["initial_lr"] = _div(max_lrs, self.div_factor)
        group["max_lr"] = max_lrs
        group["min_lr"] = _div(group["initial_lr"], self.final_div_factor)
        if self.cycles_momentum:
            max_m = _format_param("max_momentum", shape, self.max_momentum)
            base_m = _format_param("base_momentum", shape, self.base_momentum)
            group["momentum"] = max_m
            group["max_momentum"] = max_m
            group["base_momentum"] = base_m
        return group

    def _anneal(self, start, end, pct):
        if self.strategy == "cos":
            cos_out = _cos(math.pi * pct) + 1
            return end + _mul(_div(start - end, 2.0), cos_out)
        return _mul(end - start, pct) + start

    def get_lr(self, group, st, is_initial):
        step_num = st["last_epoch"]
        lrs, moms, start_step = [], [], 0.0
        conds = []
        for phase in self.phases:
            end_step = phase["end_step"]
            pct = _div(_f(step_num) - start_step, end_step - start_step)
            lrs.append(self._anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct))
            if self.cycles_momentum:
                moms.append(self._anneal(group[phase["start_momentum"]], group[phase["end_momentum"]], pct))
            conds.append(step_num <= end_step)
            start_step = phase["end_step"]
        # the first phase whose end is not passed, else the last one
        index = jnp.int32(len(self.phases) - 1)
        for i in range(len(self.phases) - 2, -1, -1):
            index = jnp.where(conds[i], i, index)
        over = step_num > self.total_steps  # torch raises "Tried to step ..."
        lr = jnp.where(over, jnp.nan, _select(index, lrs))
        if self.cycles_momentum:
            group = {**group, "momentum": jnp.where(over, jnp.nan, _select(index, moms))}
        return lr, group


def cyclic_lr(
    base_lr: float | Sequence[float],
    max_lr: float | Sequence[float],
    step_size_up: int = 2000,
    step_size_down: int | None = None,
    mode: str = "triangular",
    gamma: float = 1.0,
    scale_fn: Callable[[Any], Any] | None = None,
    scale_mode: str = "cycle",
    cycle_momentum: bool = True,
    base_momentum: float | Sequence[float] = 0.8,
    max_momentum: float | Sequence[float] = 0.9,
    *,
    lr: Any = None,
) -> Schedule:
    r"""``torch.optim.lr_scheduler.CyclicLR`` (triangular, triangular2, exp_range).

    With :math:`c = \lfloor 1 + t / S \rfloor`, :math:`x = 1 + t/S - c` and the
    up-fraction :math:`r`, the scale is :math:`x / r` rising, :math:`(x - 1)/(r - 1)`
    falling, and :math:`\eta_t = \eta_{base} + (\eta_{max} - \eta_{base})\,
    \text{scale}\cdot f(c \text{ or } t)`; momentum cycles inversely between
    ``max_momentum`` and ``base_momentum``.

    Args:
      base_lr: lower boundary (or one per group); also the value after construction.
      max_lr: upper boundary (or one per group).
      step_size_up: steps in the rising half, default 2000.
      step_size_down: steps in the falling half, default ``step_size_up``.
      mode: ``"triangular"`` (default), ``"triangular2"`` or ``"exp_range"``.
      gamma: the ``exp_range`` base, default 1.
      scale_fn: a custom ``x -> scale`` (jax.numpy-traceable; ``x``, the cycle or the
        iteration, an integer array, int64 under x64); overrides ``mode``.
      scale_mode: ``"cycle"`` (default) or ``"iterations"``, for ``scale_fn``.
      cycle_momentum: cycle momentum too (default True, as torch): pass
        ``momentum=sched.momentum`` or ``betas=(sched.momentum, beta2)`` to the
        optimizer.
      base_momentum: lower momentum boundary, default 0.8.
      max_momentum: upper momentum boundary, default 0.9.
      lr: the optimizer's learning rate before the scheduler (torch overwrites it with
        ``base_lr``); default ``base_lr``. Only matters inside chains and sequences.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``mode is invalid and scale_fn is None``; ``base_lr must have the same
        length as optimizer.param_groups. …``; and, when an optimizer is built with it,
        ``optimizer must support momentum or beta1 with `cycle_momentum` option enabled``.

    Examples:
      >>> import functorch_optim as fo
      >>> s = fo.schedules.cyclic_lr(0.1, 0.5, step_size_up=2, cycle_momentum=False)
      >>> s.values(4).round(6).tolist()
      [0.1, 0.3, 0.5, 0.3, 0.1]

    References:
      Smith, "Cyclical Learning Rates for Training Neural Networks", WACV 2017. Mirrors
      ``torch.optim.lr_scheduler.CyclicLR``.
    """
    start = lr
    if start is None:
        start = (
            base_lr
            if isinstance(base_lr, list | tuple) or not isinstance(max_lr, list | tuple)
            else ([base_lr] * len(max_lr))
        )
    spec = _CyclicLR(base_lr, max_lr, step_size_up, step_size_down, mode, gamma, scale_fn, scale_mode,
                     cycle_momentum, base_momentum, max_momentum)  # fmt: skip
    # torch's checks, in its order
    shape = jnp.shape(_as_lr(start))
    _format_param("base_lr", shape, base_lr)
    _format_param("max_lr", shape, max_lr)
    if mode not in ["triangular", "triangular2", "exp_range"] and scale_fn is None:
        raise ValueError("mode is invalid and scale_fn is None")
    if cycle_momentum:
        _format_param("base_momentum", shape, base_momentum)
        _format_param("max_momentum", shape, max_momentum)
    return Schedule(spec, lr, start_lr=start)


def one_cycle_lr(
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
    *,
    lr: Any = None,
) -> Schedule:
    r"""``torch.optim.lr_scheduler.OneCycleLR`` (cos or linear, two or three phases).

    Phases end at ``pct_start * total_steps - 1`` and ``total_steps - 1`` (torch's
    indices; optax's ``cosine_onecycle_schedule`` is one step off). Within a phase from
    step :math:`a` to :math:`b` the value anneals from its start to its end value with
    :math:`p = (t - a)/(b - a)`: ``cos``: :math:`e + \frac{s - e}{2}(1 + \cos \pi p)`,
    ``linear``: :math:`(e - s)p + s`. Momentum anneals inversely.

    Args:
      max_lr: peak learning rate (or one per group).
      total_steps: steps in the cycle; or give ``epochs`` and ``steps_per_epoch``.
      epochs: epochs, with ``steps_per_epoch``.
      steps_per_epoch: steps per epoch, with ``epochs``.
      pct_start: fraction of the cycle spent increasing, a float, default 0.3.
      anneal_strategy: ``"cos"`` (default) or ``"linear"``.
      cycle_momentum: cycle momentum too (default True): pass ``momentum=sched.momentum``
        or ``betas=(sched.momentum, beta2)`` to the optimizer.
      base_momentum: momentum at the peak, default 0.85.
      max_momentum: momentum at the start and end, default 0.95.
      div_factor: ``initial_lr = max_lr / div_factor``, default 25.
      final_div_factor: ``min_lr = initial_lr / final_div_factor``, default 1e4.
      three_phase: use torch's three-phase variant, default False.
      lr: the optimizer's learning rate before the scheduler (torch overwrites it);
        default ``max_lr / div_factor``. Only matters inside chains and sequences.

    Returns:
      A :class:`Schedule`. Stepping past ``total_steps`` makes the value NaN (torch
      raises ``Tried to step … times``; nothing can raise inside ``jit``).

    Raises:
      ValueError: torch's texts: ``Expected positive integer total_steps, but got …``,
        ``Expected positive integer epochs, …``, ``… steps_per_epoch …``, ``You must
        define either total_steps OR (epochs AND steps_per_epoch)``, ``Expected float
        between 0 and 1 pct_start, but got …``, ``anneal_strategy must be one of 'cos'
        or 'linear', instead got …``.
      ZeroDivisionError: where torch divides by a zero-length first phase.

    Examples:
      >>> import functorch_optim as fo
      >>> s = fo.schedules.one_cycle_lr(1.0, total_steps=5, pct_start=0.4, div_factor=10.0,
      ...                               final_div_factor=1.0, anneal_strategy="linear",
      ...                               cycle_momentum=False)
      >>> s.values(4).round(6).tolist()
      [0.1, 1.0, 0.7, 0.4, 0.1]

    References:
      Smith & Topin, "Super-Convergence: Very Fast Training of Neural Networks Using Large
      Learning Rates", 2017. Mirrors ``torch.optim.lr_scheduler.OneCycleLR``.
    """
    if total_steps is not None:
        if total_steps <= 0 or not isinstance(total_steps, int):
            raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
    elif epochs is not None and steps_per_epoch is not None:
        if not isinstance(epochs, int) or epochs <= 0:
            raise ValueError(f"Expected positive integer epochs, but got {epochs}")
        if not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
            raise ValueError(f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
        total_steps = epochs * steps_per_epoch
    else:
        raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
    if three_phase:
        phases = [
            {"end_step": float(pct_start * total_steps) - 1, "start_lr": "initial_lr", "end_lr": "max_lr",
             "start_momentum": "max_momentum", "end_momentum": "base_momentum"},
            {"end_step": float(2 * pct_start * total_steps) - 2, "start_lr": "max_lr", "end_lr": "initial_lr",
             "start_momentum": "base_momentum", "end_momentum": "max_momentum"},
            {"end_step": total_steps - 1, "start_lr": "initial_lr", "end_lr": "min_lr",
             "start_momentum": "max_momentum", "end_momentum": "max_momentum"},
        ]  # fmt: skip
    else:
        phases = [
            {"end_step": float(pct_start * total_steps) - 1, "start_lr": "initial_lr", "end_lr": "max_lr",
             "start_momentum": "max_momentum", "end_momentum": "base_momentum"},
            {"end_step": total_steps - 1, "start_lr": "max_lr", "end_lr": "min_lr",
             "start_momentum": "base_momentum", "end_momentum": "max_momentum"},
        ]  # fmt: skip
    if pct_start < 0 or pct_start > 1 or not isinstance(pct_start, float):
        raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
    if anneal_strategy not in ["cos", "linear"]:
        raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
    spec = _OneCycleLR(max_lr, total_steps, pct_start, anneal_strategy, cycle_momentum, base_momentum,
                       max_momentum, div_factor, final_div_factor, phases)  # fmt: skip
    start = lr
    if start is None:
        start = [m / div_factor for m in max_lr] if isinstance(max_lr, list | tuple) else max_lr / div_factor
    shape = jnp.shape(_as_lr(start))
    for name, value in [("max_lr", max_lr)] + (
        [("max_momentum", max_momentum), ("base_momentum", base_momentum)] if cycle_momentum else []
    ):
        _format_param(name, shape, value)  # torch's per-group length checks, in its order
    if phases[0]["end_step"] == 0.0:  # torch's initial step divides by the phase length
        raise ZeroDivisionError("float division by zero")
    return Schedule(spec, lr, start_lr=start)
