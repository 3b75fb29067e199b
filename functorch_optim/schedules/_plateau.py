"""``ReduceLROnPlateau``: a schedule driven by a metric, as a pure ``(state, metric)`` function."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._hyperparams import HParams
from functorch_optim._tree import PyTree
from functorch_optim.schedules._core import (
    Schedule,
    _as_lr,
    _f,
    _i,
    _n_groups,
    _value_key,
)


class PlateauState(NamedTuple):
    """The state of ``reduce_lr_on_plateau``, torch's attribute names.

    Attributes:
      best: the best metric seen (``inf`` / ``-inf`` before the first).
      num_bad_epochs: consecutive steps without improvement (int32).
      cooldown_counter: steps of cooldown left (int32).
      last_epoch: metric steps taken (int32).
    """

    best: jax.Array
    num_bad_epochs: jax.Array
    cooldown_counter: jax.Array
    last_epoch: jax.Array


class _PlateauSchedule(Schedule):
    def __init__(
        self, lr, mode, factor, patience, threshold, threshold_mode, cooldown, min_lrs, eps
    ):  # fmt: skip
        self._spec = None
        self.lr, self.key = lr, "lr"
        self._start_lr = _as_lr(lr)
        self.mode, self.factor, self.patience = mode, factor, patience
        self.threshold, self.threshold_mode = threshold, threshold_mode
        self.cooldown, self.eps = cooldown, eps
        self.min_lrs = min_lrs
        self.mode_worse = math.inf if mode == "min" else -math.inf

    @property
    def name(self) -> str:
        return "ReduceLROnPlateau"

    @property
    def momentum(self) -> Schedule:
        raise ValueError("ReduceLROnPlateau does not cycle momentum")

    def init_state(self) -> PlateauState:
        return PlateauState(_f(self.mode_worse), _i(0), _i(0), _i(0))

    def init_schedule(self):
        return self._start_lr, self.init_state()

    def step_schedule(self, value, state, count=None):
        return value, state  # the lr moves only with a metric: ``step(state, metric)``

    @property
    def step_key(self) -> Any:
        return (type(self), self.key)  # the step leaves the lr alone, whatever the arguments

    @property
    def update_key(self) -> Any:
        """Hashable, equal for two plateau schedules whose ``update`` computes the same
        (every argument but the starting lr)."""
        return _value_key({k: v for k, v in vars(self).items() if k not in ("lr", "_start_lr")})

    def check_hparams(self, name, hparams):
        return None

    def _is_better(self, a, best):
        if self.mode == "min" and self.threshold_mode == "rel":
            return a < best * (1.0 - self.threshold)
        if self.mode == "min":
            return a < best - self.threshold
        if self.threshold_mode == "rel":
            return a > best * (self.threshold + 1.0)
        return a > best + self.threshold

    def update(self, lr: Any, state: PlateauState, metric: Any) -> tuple[jax.Array, PlateauState]:
        """torch's ``ReduceLROnPlateau.step(metrics)`` on a learning rate (or per-group lrs).

        Args:
          lr: the current learning rate(s).
          state: a ``PlateauState``.
          metric: the monitored quantity (a number or 0-d array; may be traced).

        Returns:
          ``(new_lr, new_state)``.
        """
        current = _f(metric)
        lr = jnp.asarray(lr)
        better = self._is_better(current, state.best)
        best = jnp.where(better, current, state.best)
        bad = jnp.where(better, 0, state.num_bad_epochs + 1)
        in_cooldown = state.cooldown_counter > 0
        cooldown = jnp.where(in_cooldown, state.cooldown_counter - 1, state.cooldown_counter)
        bad = jnp.where(in_cooldown, 0, bad)
        reduce = bad > self.patience
        old = _f(lr)
        new = jnp.maximum(old * self.factor, jnp.asarray(self.min_lrs).reshape(old.shape))
        new_lr = jnp.where(reduce & (old - new > self.eps), new, old).astype(lr.dtype)
        cooldown = jnp.where(reduce, self.cooldown, cooldown)
        bad = jnp.where(reduce, 0, bad)
        new_state = PlateauState(
            best, bad.astype(jnp.int32), cooldown.astype(jnp.int32), state.last_epoch + 1
        )
        return new_lr, new_state

    def step(self, opt_state: PyTree, metric: Any) -> PyTree:
        """``scheduler.step(metric)`` on an optimizer state: a new state with the lr updated.

        Every optimizer (sub-)state whose ``lr`` is driven by a ``reduce_lr_on_plateau``
        schedule is updated (one per param group; all see the same metric, as torch's
        groups do). Pure and jit-compatible.

        Raises:
          ValueError: if no ``lr`` in ``opt_state`` is driven by ``reduce_lr_on_plateau``.
        """
        found = []

        def visit(node):
            if isinstance(node, HParams) and isinstance(node.schedule_state.get("lr"), PlateauState):
                found.append(True)
                lr, st = self.update(node["lr"], node.schedule_state["lr"], metric)
                return node.replace(lr=lr).with_schedule_state({**node.schedule_state, "lr": st})
            return node

        new = jax.tree.map(visit, opt_state, is_leaf=lambda x: isinstance(x, HParams))
        if not found:
            raise ValueError(
                "ReduceLROnPlateau.step: no lr in the optimizer state is driven by reduce_lr_on_plateau; "
                "build the optimizer with lr=fo.schedules.reduce_lr_on_plateau(...)"
            )
        return new

    def values(self, n: int) -> np.ndarray:
        raise ValueError("ReduceLROnPlateau needs metrics: use update(lr, state, metric)")


def reduce_lr_on_plateau(
    lr: Any,
    mode: str = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    threshold_mode: str = "rel",
    cooldown: int = 0,
    min_lr: float | Sequence[float] = 0,
    eps: float = 1e-8,
) -> Schedule:
    r"""``torch.optim.lr_scheduler.ReduceLROnPlateau``, a pure function of (state, metric).

    Each ``step(opt_state, metric)``: the metric is *better* if below ``best * (1 -
    threshold)`` (``min``/``rel``; ``best - threshold`` for ``abs``; mirrored for
    ``max``); otherwise ``num_bad_epochs`` grows. During cooldown bad epochs are
    ignored. When ``num_bad_epochs > patience`` (torch's strict ``>``) each lr becomes
    ``max(lr * factor, min_lr)`` unless that changes it by ``eps`` or less, and cooldown
    starts. Optimizer steps never move it.

    Args:
      lr: the optimizer's learning rate (or one per group).
      mode: ``"min"`` (default) or ``"max"``.
      factor: reduction factor, < 1, default 0.1.
      patience: tolerated bad steps, default 10.
      threshold: significance threshold, default 1e-4.
      threshold_mode: ``"rel"`` (default) or ``"abs"``.
      cooldown: steps to wait after a reduction, default 0.
      min_lr: lower bound, or one per group, default 0.
      eps: minimal change applied, default 1e-8.

    Returns:
      A :class:`Schedule` with ``step(opt_state, metric) -> opt_state`` and
      ``update(lr, state, metric) -> (lr, state)``.

    Raises:
      ValueError: torch's texts: ``Factor should be < 1.0.``, ``expected {n} min_lrs, got
        {m}``, ``mode … is unknown!``, ``threshold mode … is unknown!``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> plateau = fo.schedules.reduce_lr_on_plateau(0.1, patience=0)
      >>> tx = fo.sgd(lr=plateau)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for loss in [1.0, 2.0]:
      ...     state = plateau.step(state, loss)
      >>> round(float(fo.get_hparams(state)["lr"]), 6)
      0.01
    """
    if factor >= 1.0:
        raise ValueError("Factor should be < 1.0.")
    n = _n_groups(lr)
    shape = jnp.shape(_as_lr(lr))
    if isinstance(min_lr, list | tuple):
        if len(min_lr) != n:
            raise ValueError(f"expected {n} min_lrs, got {len(min_lr)}")
        min_lrs = _f(list(min_lr)).reshape(shape)
    else:
        min_lrs = jnp.broadcast_to(_f(min_lr), shape)
    if mode not in {"min", "max"}:
        raise ValueError("mode " + mode + " is unknown!")
    if threshold_mode not in {"rel", "abs"}:
        raise ValueError("threshold mode " + threshold_mode + " is unknown!")
    return _PlateauSchedule(lr, mode, factor, patience, threshold, threshold_mode, cooldown, min_lrs, eps)
