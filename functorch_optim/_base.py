"""The engine behind every torch-parity optimizer: one per-parameter rule, tree-mapped.

An algorithm is written once, as torch's ``_single_tensor_<name>`` loop body for one
parameter (``Algorithm.step_leaf``). ``make_optimizer`` turns it into an optax
``GradientTransformationExtraArgs`` whose state is a ``TorchState``:

* ``hparams``: an ``HParams`` node, numeric hyperparameters as arrays;
* ``count``: optimizer steps taken (schedules index with it);
* ``buffers``: torch's per-parameter state by torch's names (``step``,
  ``momentum_buffer``, ``exp_avg``, ...), each a tree shaped like the params.

Semantics shared by all algorithms:

* a ``None`` gradient leaf skips that parameter: its value and state stay bit-for-bit
  unchanged (torch's ``if p.grad is None: continue``), and its update is ``None``;
* ``step`` counts the gradients a parameter has received, so a parameter whose first
  gradient arrives late starts from step 1 (torch's lazy state);
* the optional extra argument ``grad_mask`` (a tree of boolean scalars) marks leaves as
  "no gradient" dynamically, with the same effect as a ``None`` leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from functorch_optim._hyperparams import HParams, Validator, as_hparam, to_python
from functorch_optim._tree import PyTree, check_like_params, check_params, is_none

StepFn = Callable[..., tuple[PyTree, PyTree]]

#: Attribute name under which a transformation's ``update`` function carries its exact
#: ``(params, grads, state) -> (params, state)`` step (see ``step``).
STEP_ATTR = "fo_step"


class TorchState(NamedTuple):
    """State of a torch-parity optimizer.

    Attributes:
      hparams: the numeric hyperparameters (``get_hparams`` / ``set_hparams``).
      count: number of optimizer steps taken, an int32 scalar.
      buffers: torch's per-parameter state by name; each value is a tree shaped like
        the params. Also readable as attributes: ``state.momentum_buffer``.
    """

    hparams: HParams
    count: jax.Array
    buffers: dict[str, PyTree]

    def __getattr__(self, name: str) -> PyTree:
        if name.startswith("__"):
            raise AttributeError(name)
        buffers = tuple.__getitem__(self, 2)
        if name in buffers:
            return buffers[name]
        raise AttributeError(f"{type(self).__name__} has no buffer {name!r}; it has {sorted(buffers)}")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One torch algorithm, as a rule for a single parameter.

    Attributes:
      name: torch's class name (``"SGD"``).
      validate: ``(hparams, static) -> None``; raises torch's ValueError texts.
      init_leaf: ``(param, static) -> dict`` of initial buffers besides ``step``.
      step_leaf: ``(param, grad, buffers, step, hparams, static) -> (new_param,
        new_buffers)``, torch's loop body for one parameter. ``step`` is the int32 count
        of gradients this parameter has received including this one (1 on its first
        step); ``hparams`` are arrays in the hyperparameter dtype (cast them to the
        parameter's compute dtype where torch would).
    """

    name: str
    validate: Validator
    init_leaf: Callable[[jax.Array, Mapping[str, Any]], dict[str, jax.Array]]
    step_leaf: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def make_optimizer(
    algorithm: Algorithm, hparams: Mapping[str, Any], static: Mapping[str, Any]
) -> optax.GradientTransformationExtraArgs:
    """Build the optax transformation of ``algorithm`` with validated hyperparameters.

    A hyperparameter given as a callable is a schedule: ``value = fn(count)``, where
    ``count`` is the number of optimizer steps taken; it is stored in the state and
    advances once per step.

    Raises:
      ValueError: torch's message for an invalid hyperparameter, raised here, at
        construction, before any state exists.
    """
    schedules = {k: v for k, v in hparams.items() if callable(v)}
    first = {k: (v(0) if k in schedules else v) for k, v in hparams.items()}
    algorithm.validate({k: to_python(v) for k, v in first.items()}, dict(static))
    static = dict(static)

    def init(params: PyTree) -> TorchState:
        check_params(params)
        step = jax.tree.map(lambda p: jnp.zeros((), jnp.int32), params)
        leaf_buffers = jax.tree.map(lambda p: algorithm.init_leaf(p, static), params)
        names = _buffer_names(leaf_buffers, params)
        buffers = {"step": step}
        for name in names:
            buffers[name] = jax.tree.map(lambda _, b, n=name: b[n], params, leaf_buffers)
        values = {k: as_hparam(v) for k, v in first.items()}
        return TorchState(
            HParams(values, algorithm.name, algorithm.validate, static, tuple(sorted(schedules))),
            jnp.zeros((), jnp.int32),
            buffers,
        )

    def step_fn(params, grads, state, *, grad_mask=None, **extra_args):
        del extra_args
        check_like_params(params, grads)
        treedef = jax.tree.structure(params)
        p_leaves = treedef.flatten_up_to(params)
        g_leaves = treedef.flatten_up_to(grads)
        m_leaves = treedef.flatten_up_to(grad_mask) if grad_mask is not None else [None] * len(p_leaves)
        names = list(state.buffers)
        b_leaves = [treedef.flatten_up_to(state.buffers[n]) for n in names]
        hp = dict(state.hparams)
        new_p, new_b = [], [[] for _ in names]
        for i, (p, g, m) in enumerate(zip(p_leaves, g_leaves, m_leaves)):
            old = {n: b_leaves[j][i] for j, n in enumerate(names)}
            if g is None:
                out_p, out = p, old
            else:
                # materialized once and read by the fusions: reading the old count in them
                # would make XLA copy it before overwriting it in place
                step = jax.lax.optimization_barrier(old["step"] + 1)
                bufs = {n: v for n, v in old.items() if n != "step"}
                out_p, out = algorithm.step_leaf(p, g, bufs, step, hp, static)
                out = {"step": step, **out}
                if m is not None:
                    out_p = jnp.where(m, out_p, p)
                    out = {n: jnp.where(m, out[n], old[n]) for n in names}
            new_p.append(out_p)
            for j, n in enumerate(names):
                new_b[j].append(out[n])
        count = state.count + 1
        hparams = state.hparams
        if schedules:
            hparams = hparams.replace(
                **{k: as_hparam(fn(count), jnp.result_type(hp[k])) for k, fn in schedules.items()}
            )
        buffers = {n: treedef.unflatten(new_b[j]) for j, n in enumerate(names)}
        return treedef.unflatten(new_p), TorchState(hparams, count, buffers)

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError(f"{algorithm.name}: update() needs params (torch's rule reads them)")
        new_params, state = step_fn(params, grads, state, **extra_args)
        updates = jax.tree.map(
            lambda g, new, p: None if g is None else new - p, grads, new_params, params, is_leaf=is_none
        )
        return updates, state

    setattr(update, STEP_ATTR, step_fn)
    return optax.GradientTransformationExtraArgs(init, update)


def _buffer_names(leaf_buffers: PyTree, params: PyTree) -> list[str]:
    per_leaf = jax.tree.structure(params).flatten_up_to(leaf_buffers)
    names = sorted(per_leaf[0]) if per_leaf else []
    return names


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leafwise, keeping a parameter whose update is ``None``.

    Like ``optax.apply_updates``, but a ``None`` update (a parameter without gradient)
    leaves the parameter untouched instead of failing. Results keep the params' dtypes.
    """
    return jax.tree.map(
        lambda u, p: p if u is None else jnp.asarray(p + u).astype(jnp.asarray(p).dtype),
        updates,
        params,
        is_leaf=is_none,
    )


def step(
    tx: optax.GradientTransformation, params: PyTree, grads: PyTree, state: PyTree, **extra_args: Any
) -> tuple[PyTree, PyTree]:
    """One optimizer step: update and apply, as a pure function.

    For this package's transformations the new parameters are computed in torch's own
    operation order (``param.add_(buf, alpha=-lr)``, not ``param + (new - param)``);
    any other optax transformation goes through ``tx.update`` and ``apply_updates``.
    Meant to be jitted with params and state donated::

        step = jax.jit(fo.step, static_argnums=0, donate_argnums=(1, 3))
        params, state = step(tx, params, grads, state)

    Args:
      tx: any optax-compatible gradient transformation.
      params: the parameter pytree.
      grads: gradients shaped like ``params``; a ``None`` leaf skips that parameter.
      state: ``tx``'s state.
      **extra_args: passed on to ``tx.update`` when it accepts extra arguments.

    Returns:
      ``(new_params, new_state)``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.sgd(lr=0.1)
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([1.0, 1.0])}, tx.init(params))
      >>> params["w"].tolist()
      [0.9, 1.9]
    """
    fast = getattr(tx.update, STEP_ATTR, None)
    if fast is not None:
        return fast(params, grads, state, **extra_args)
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        updates, state = tx.update(grads, state, params, **extra_args)
    else:
        updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates), state
