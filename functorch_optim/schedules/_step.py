"""The closed-form step schedules: a value that is a function of the step count.

StepLR, MultiStepLR, ConstantLR, LinearLR, ExponentialLR, PolynomialLR, CosineAnnealingLR,
CosineAnnealingWarmRestarts, and ``torch.optim.swa_utils.SWALR``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from functorch_optim._hyperparams import hparam_dtype
from functorch_optim.schedules._core import (
    Schedule,
    _as_lr,
    _check_count,
    _cos,
    _div,
    _f,
    _format_param,
    _i,
    _mul,
    _pow,
    _Spec,
    _stored_lr,
)


class _StepLR(_Spec):
    name = "StepLR"

    def __init__(self, step_size: int, gamma: float) -> None:
        self.step_size, self.gamma = step_size, gamma

    def get_lr(self, group, st, is_initial):
        e = st["last_epoch"]
        keep = (e == 0) | (e % self.step_size != 0)
        return jnp.where(keep, group["lr"], group["lr"] * self.gamma), group

    def closed_form(self, group, st):
        return st["base_lrs"] * _pow(self.gamma, st["last_epoch"] // self.step_size)


class _MultiStepLR(_Spec):
    name = "MultiStepLR"

    def __init__(self, milestones: Counter, gamma: float) -> None:
        self.milestones, self.gamma = milestones, gamma
        keys = sorted(milestones)
        self._keys = np.asarray(keys if keys else [-(2**31)], np.int32)
        self._counts = np.asarray([milestones[k] for k in keys] if keys else [0], np.int32)
        self._sorted = np.asarray(sorted(milestones.elements()) or [2**31 - 1], np.int32)

    def get_lr(self, group, st, is_initial):
        e = st["last_epoch"]
        hit = jnp.asarray(self._keys) == e
        n = jnp.sum(jnp.where(hit, jnp.asarray(self._counts), 0))
        return jnp.where(n == 0, group["lr"], group["lr"] * _pow(self.gamma, n)), group

    def closed_form(self, group, st):
        n = jnp.searchsorted(jnp.asarray(self._sorted), st["last_epoch"], side="right")
        n = n if sum(self.milestones.values()) else 0
        return st["base_lrs"] * _pow(self.gamma, n)


class _ConstantLR(_Spec):
    name = "ConstantLR"

    def __init__(self, factor: float, total_iters: int) -> None:
        self.factor, self.total_iters = factor, total_iters

    def get_lr(self, group, st, is_initial):
        e, lr = st["last_epoch"], group["lr"]
        out = jnp.where(e != self.total_iters, lr, lr * _div(1.0, self.factor))
        return jnp.where(e == 0, lr * self.factor, out), group

    def closed_form(self, group, st):
        reached = (st["last_epoch"] >= self.total_iters).astype(hparam_dtype())
        return st["base_lrs"] * (self.factor + _mul(reached, 1 - self.factor))


class _LinearLR(_Spec):
    name = "LinearLR"

    def __init__(self, start_factor: float, end_factor: float, total_iters: int) -> None:
        self.start, self.end, self.total = start_factor, end_factor, total_iters

    def get_lr(self, group, st, is_initial):
        e, lr = st["last_epoch"], group["lr"]
        d = self.end - self.start
        ratio = 1.0 + _div(d, self.total * self.start + _mul(_f(e - 1), d))
        out = lr if is_initial else jnp.where(e > self.total, lr, lr * ratio)
        return jnp.where(e == 0, lr * self.start, out), group

    def closed_form(self, group, st):
        m = jnp.minimum(self.total, st["last_epoch"])
        return st["base_lrs"] * (self.start + _div((self.end - self.start) * _f(m), self.total))


class _ExponentialLR(_Spec):
    name = "ExponentialLR"

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def get_lr(self, group, st, is_initial):
        if is_initial:
            return group["lr"], group
        return group["lr"] * self.gamma, group

    def closed_form(self, group, st):
        return st["base_lrs"] * _pow(self.gamma, st["last_epoch"])


class _PolynomialLR(_Spec):
    name = "PolynomialLR"

    def __init__(self, total_iters: int, power: float) -> None:
        self.total, self.power = total_iters, power

    def get_lr(self, group, st, is_initial):
        e, lr = st["last_epoch"], group["lr"]
        if is_initial:
            return lr, group
        num = 1.0 - _div(e, self.total)
        den = 1.0 - _div(e - 1, self.total)
        decay = _pow(_div(num, den), self.power)
        return jnp.where(e > self.total, lr, lr * decay), group

    def closed_form(self, group, st):
        m = jnp.minimum(self.total, st["last_epoch"])
        return st["base_lrs"] * _pow(1.0 - _div(m, self.total), self.power)


class _CosineAnnealingLR(_Spec):
    name = "CosineAnnealingLR"

    def __init__(self, T_max: int, eta_min: float) -> None:
        self.T_max, self.eta_min = T_max, eta_min

    def get_lr(self, group, st, is_initial):
        if is_initial:
            return group["lr"], group
        e, lr, base, eta, T = st["last_epoch"], group["lr"], st["base_lrs"], self.eta_min, self.T_max
        resumed = eta + _div((base - eta) * (1 + _cos(_div(_f(e) * math.pi, T))), 2)
        restart = lr + _div((base - eta) * (1 - _cos(_div(math.pi, T))), 2)
        ratio = _div(1 + _cos(_div(math.pi * _f(e), T)), 1 + _cos(_div(math.pi * _f(e - 1), T)))
        recursive = _mul(ratio, lr - eta) + eta
        out = jnp.where((e - 1 - T) % (2 * T) == 0, restart, recursive)
        return jnp.where((st["step_count"] == 1) & (e > 0), resumed, out), group

    def closed_form(self, group, st):
        e, eta = st["last_epoch"], self.eta_min
        return eta + _div((st["base_lrs"] - eta) * (1 + _cos(_div(math.pi * _f(e), self.T_max))), 2)


class _CosineAnnealingWarmRestarts(_Spec):
    name = "CosineAnnealingWarmRestarts"

    def __init__(self, T_0: int, T_mult: int, eta_min: float) -> None:
        self.T_0, self.T_mult, self.eta_min = T_0, T_mult, eta_min

    def extra_state(self, group):
        return {"T_cur": _i(-1), "T_i": _i(self.T_0)}

    def get_lr(self, group, st, is_initial):
        cos = _cos(_div(math.pi * _f(st["T_cur"]), st["T_i"]))
        return self.eta_min + _div((st["base_lrs"] - self.eta_min) * (1 + cos), 2), group

    def step(self, group, st, is_initial=False):
        e = st["last_epoch"]
        # torch: ``if epoch is None and self.last_epoch < 0: epoch = 0`` -> T_i = T_0, T_cur = 0
        t_cur = st["T_cur"] + 1
        wrap = t_cur >= st["T_i"]
        t_cur_n = jnp.where(wrap, t_cur % st["T_i"], t_cur)
        t_i_n = jnp.where(wrap, st["T_i"] * self.T_mult, st["T_i"])
        first = e < 0
        st = {
            **st,
            "T_cur": jnp.where(first, 0, t_cur_n).astype(jnp.int32),
            "T_i": jnp.where(first, self.T_0, t_i_n).astype(jnp.int32),
            "last_epoch": jnp.where(first, 0, e + 1).astype(jnp.int32),
        }
        lr, group = self.get_lr(dict(group), st, is_initial)
        group["lr"] = _stored_lr(lr, group["lr"])
        return group, st


class _SWALR(_Spec):
    name = "SWALR"

    def __init__(self, swa_lr: Any, anneal_epochs: int, anneal_strategy: str) -> None:
        self.swa_lr, self.anneal_epochs, self.strategy = swa_lr, anneal_epochs, anneal_strategy

    def attach(self, group):
        group["swa_lr"] = _format_param("swa_lr", jnp.shape(group["lr"]), self.swa_lr)
        return group

    def _anneal(self, t):
        if self.strategy == "cos":
            return _div(1 - _cos(math.pi * t), 2)
        return t

    def get_lr(self, group, st, is_initial):
        step = st["step_count"] - 1
        if self.anneal_epochs == 0:
            step = jnp.maximum(1, step)
        denom = max(1, self.anneal_epochs)
        prev_t = jnp.clip(_div(step - 1, denom), 0, 1)
        prev_alpha = self._anneal(prev_t)
        swa, lr = group["swa_lr"], group["lr"]
        prev_lr = jnp.where(prev_alpha == 1, swa, _div(lr - _mul(prev_alpha, swa), 1 - prev_alpha))
        alpha = self._anneal(jnp.clip(_div(step, denom), 0, 1))
        return _mul(swa, alpha) + _mul(prev_lr, 1 - alpha), group


def step_lr(lr: Any, step_size: int, gamma: float = 0.1) -> Schedule:
    r"""``torch.optim.lr_scheduler.StepLR``: multiply by ``gamma`` every ``step_size`` steps.

    Args:
      lr: the optimizer's learning rate (or one per group).
      step_size: period of decay, an integer >= 1 (torch fails with a division by zero).
      gamma: multiplicative factor, default 0.1.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``step_size must be an integer >= 1, got …``.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.step_lr(1.0, step_size=2, gamma=0.5).values(4).tolist()
      [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    return Schedule(_StepLR(_check_count("step_size", step_size), gamma), lr)


def multi_step_lr(lr: Any, milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    r"""``torch.optim.lr_scheduler.MultiStepLR``: multiply by ``gamma`` at each milestone.

    A milestone listed ``n`` times multiplies by ``gamma ** n`` (torch's ``Counter``).

    Args:
      lr: the optimizer's learning rate (or one per group).
      milestones: step indices, e.g. ``[30, 80]``.
      gamma: multiplicative factor, default 0.1.

    Returns:
      A :class:`Schedule`.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.multi_step_lr(1.0, [1, 3], gamma=0.5).values(4).tolist()
      [1.0, 0.5, 0.5, 0.25, 0.25]
    """
    return Schedule(_MultiStepLR(Counter(int(m) for m in milestones), gamma), lr)


def constant_lr(lr: Any, factor: float = 1.0 / 3, total_iters: int = 5) -> Schedule:
    r"""``torch.optim.lr_scheduler.ConstantLR``: ``lr * factor`` until ``total_iters``.

    Args:
      lr: the optimizer's learning rate (or one per group).
      factor: multiplier until the milestone, default 1/3.
      total_iters: steps with the factor applied, default 5.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Constant multiplicative factor expected to be between 0 and 1.``

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.constant_lr(1.0, factor=0.5, total_iters=2).values(3).tolist()
      [0.5, 0.5, 1.0, 1.0]
    """
    if factor > 1.0 or factor < 0:
        raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
    return Schedule(_ConstantLR(factor, total_iters), lr)


def linear_lr(
    lr: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5
) -> Schedule:
    r"""``torch.optim.lr_scheduler.LinearLR``: a linear ramp of the factor over ``total_iters``.

    Computed recursively, as torch does:
    :math:`\eta_t = \eta_{t-1}\bigl(1 + \frac{e - s}{T s + (t - 1)(e - s)}\bigr)`.

    Args:
      lr: the optimizer's learning rate (or one per group).
      start_factor: factor at step 0, in (0, 1], default 1/3.
      end_factor: factor from ``total_iters`` on, in [0, 1], default 1.
      total_iters: length of the ramp, default 5.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Starting multiplicative factor expected to be greater than 0 and less
        or equal to 1.``; ``Ending multiplicative factor expected to be between 0 and 1.``

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.linear_lr(1.0, 0.5, 1.0, total_iters=2).values(3).tolist()
      [0.5, 0.75, 1.0, 1.0]
    """
    if start_factor > 1.0 or start_factor <= 0:
        raise ValueError(
            "Starting multiplicative factor expected to be greater than 0 and less or equal to 1."
        )
    if end_factor > 1.0 or end_factor < 0:
        raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
    return Schedule(_LinearLR(start_factor, end_factor, total_iters), lr)


def exponential_lr(lr: Any, gamma: float) -> Schedule:
    r"""``torch.optim.lr_scheduler.ExponentialLR``: :math:`\eta_t = \gamma\,\eta_{t-1}`.

    Args:
      lr: the optimizer's learning rate (or one per group).
      gamma: multiplicative factor per step.

    Returns:
      A :class:`Schedule`.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.exponential_lr(1.0, gamma=0.5).values(2).tolist()
      [1.0, 0.5, 0.25]
    """
    return Schedule(_ExponentialLR(gamma), lr)


def polynomial_lr(lr: Any, total_iters: int = 5, power: float = 1.0) -> Schedule:
    r"""``torch.optim.lr_scheduler.PolynomialLR``: decay to 0 over ``total_iters`` steps.

    Recursive, as torch: :math:`\eta_t = \eta_{t-1}\bigl(\frac{1 - t/T}{1 - (t-1)/T}\bigr)^p`
    for :math:`t \le T`, then constant.

    Args:
      lr: the optimizer's learning rate (or one per group).
      total_iters: decay steps :math:`T`, default 5.
      power: polynomial power :math:`p`, default 1.

    Returns:
      A :class:`Schedule`.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.polynomial_lr(1.0, total_iters=4).values(5).round(6).tolist()
      [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    return Schedule(_PolynomialLR(total_iters, power), lr)


def cosine_annealing_lr(lr: Any, T_max: int, eta_min: float = 0.0) -> Schedule:
    r"""``torch.optim.lr_scheduler.CosineAnnealingLR``, in torch's recursive form.

    .. math::

        \eta_{t} = \eta_{\min} + (\eta_{t-1} - \eta_{\min})
        \frac{1 + \cos(\pi t / T_{max})}{1 + \cos(\pi (t - 1) / T_{max})}

    with torch's restart branch where the denominator vanishes. Past ``T_max`` the value
    keeps following the cosine (period ``2 T_max``) as in torch.

    Args:
      lr: the optimizer's learning rate :math:`\eta_{max}` (or one per group).
      T_max: half period in steps.
      eta_min: minimum learning rate, default 0.

    Returns:
      A :class:`Schedule`.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.cosine_annealing_lr(1.0, T_max=2).values(4).round(6).tolist()
      [1.0, 0.5, 0.0, 0.5, 1.0]

    Note:
      optax's ``cosine_decay_schedule`` stays at its final value after the decay; torch
      (and this) go back up.

    References:
      Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", ICLR
      2017. Mirrors ``torch.optim.lr_scheduler.CosineAnnealingLR``.
    """
    return Schedule(_CosineAnnealingLR(T_max, eta_min), lr)


def cosine_annealing_warm_restarts(lr: Any, T_0: int, T_mult: int = 1, eta_min: float = 0.0) -> Schedule:
    r"""``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts`` (SGDR).

    :math:`\eta_t = \eta_{min} + \frac12(\eta_0 - \eta_{min})(1 + \cos(\pi T_{cur}/T_i))`,
    with :math:`T_{cur}` reset to 0 and :math:`T_i \leftarrow T_{mult} T_i` at each restart.

    Args:
      lr: the optimizer's learning rate (or one per group).
      T_0: steps until the first restart.
      T_mult: growth factor of the period after a restart, default 1.
      eta_min: minimum learning rate, default 0.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Expected positive integer T_0, but got …``, ``Expected integer T_mult
        >= 1, but got …``, ``Expected float or int eta_min, but got … of type …``.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.cosine_annealing_warm_restarts(1.0, T_0=2).values(4).round(6).tolist()
      [1.0, 0.5, 1.0, 0.5, 1.0]

    References:
      Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", ICLR
      2017. Mirrors ``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``.
    """
    if T_0 <= 0 or not isinstance(T_0, int):
        raise ValueError(f"Expected positive integer T_0, but got {T_0}")
    if T_mult < 1 or not isinstance(T_mult, int):
        raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
    if not isinstance(eta_min, float | int):
        raise ValueError(f"Expected float or int eta_min, but got {eta_min} of type {type(eta_min)}")
    return Schedule(_CosineAnnealingWarmRestarts(T_0, T_mult, eta_min), lr)


def swalr(
    lr: Any, swa_lr: float | Sequence[float], anneal_epochs: int = 10, anneal_strategy: str = "cos"
) -> Schedule:
    r"""``torch.optim.swa_utils.SWALR``: anneal from ``lr`` to ``swa_lr`` over ``anneal_epochs``.

    With :math:`\alpha(t)` = :math:`\frac{1 - \cos \pi t}{2}` (cos) or :math:`t`
    (linear) and :math:`t = \min(1, s / \max(1, A))` at scheduler step :math:`s`, each
    step recovers the previous start value and returns
    :math:`\eta = \alpha\,\eta_{swa} + (1 - \alpha)\,\eta_{prev}`, as torch.

    Args:
      lr: the optimizer's learning rate (or one per group).
      swa_lr: the SWA learning rate (or one per group).
      anneal_epochs: steps of annealing, an integer >= 0, default 10.
      anneal_strategy: ``"cos"`` (default) or ``"linear"``.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``anneal_strategy must be one of 'cos' or 'linear', instead got …``;
        ``anneal_epochs must be equal or greater than 0, got …``; ``swa_lr must have
        the same length as optimizer.param_groups. …``.

    Examples:
      >>> import functorch_optim as fo
      >>> s = fo.schedules.swalr(1.0, swa_lr=0.5, anneal_epochs=2, anneal_strategy="linear")
      >>> s.values(3).round(6).tolist()
      [1.0, 0.75, 0.5, 0.5]

    References:
      Izmailov et al., "Averaging Weights Leads to Wider Optima and Better
      Generalization", UAI 2018. Mirrors ``torch.optim.swa_utils.SWALR``.
    """
    shape = jnp.shape(_as_lr(lr))
    _format_param("swa_lr", shape, swa_lr)
    if anneal_strategy not in ["cos", "linear"]:
        raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
    if not isinstance(anneal_epochs, int) or anneal_epochs < 0:
        raise ValueError(f"anneal_epochs must be equal or greater than 0, got {anneal_epochs}")
    return Schedule(_SWALR(swa_lr, anneal_epochs, anneal_strategy), lr)
