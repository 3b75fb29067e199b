"""Skip optimizer steps whose gradients hold NaN or Inf."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import STEP_ATTR
from functorch_optim._base import step as _step
from functorch_optim._tree import PyTree, is_none


class SkipNonfiniteState(NamedTuple):
    """State of ``skip_nonfinite``.

    Attributes:
      skipped: number of steps skipped so far (int32).
      last_finite: whether the last call's gradients were all finite (it stepped).
      inner_state: the wrapped transformation's state; it does not move on a skip.
    """

    skipped: jax.Array
    last_finite: jax.Array
    inner_state: PyTree


def all_finite(grads: PyTree) -> jax.Array:
    """Whether every entry of every non-``None`` gradient leaf is finite.

    Args:
      grads: a gradient pytree; ``None`` leaves (no gradient) are ignored.

    Returns:
      A boolean scalar array, ``True`` when no leaf holds a NaN or an infinity.
    """
    leaves = [g for g in jax.tree.leaves(grads, is_leaf=is_none) if g is not None]
    out = jnp.ones((), bool)
    for g in leaves:
        out = out & jnp.all(jnp.isfinite(g))
    return out


def skip_nonfinite(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Wrap ``tx`` so that a step with a NaN/Inf gradient changes nothing.

    On such a step the update is zero (``None`` where the gradient is ``None``), and the
    inner state — buffers, step counters, schedule position — is left as it was; only
    ``skipped`` grows. Under ``jit`` the branch is a ``lax.cond``, so a skipped step does
    not run the inner update. This is ``torch.amp.GradScaler.step``'s skip, without the
    scaling.

    With gradient accumulation, wrap the *inner* optimizer:
    ``grad_accumulate(skip_nonfinite(tx), every=k)``. A NaN/Inf micro-batch then poisons
    the sum of its own window only: that window's step is skipped, the accumulator is
    reset as after any step, and the next window starts clean (``grad_accumulate``'s own
    ``gradient_step`` still counts the window). The other order,
    ``skip_nonfinite(grad_accumulate(tx, k))``, would drop single micro-batches and still
    divide by ``k``.

    Args:
      tx: any optax-compatible transformation.

    Returns:
      An optax ``GradientTransformationExtraArgs`` with a ``SkipNonfiniteState``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.skip_nonfinite(fo.sgd(lr=1.0))
      >>> params = {"w": jnp.array([1.0])}
      >>> state = tx.init(params)
      >>> params, state = fo.step(tx, params, {"w": jnp.array([jnp.nan])}, state)
      >>> params["w"].tolist(), int(state.skipped)
      ([1.0], 1)
    """

    def init(params: PyTree) -> SkipNonfiniteState:
        return SkipNonfiniteState(jnp.zeros((), jnp.int32), jnp.ones((), bool), tx.init(params))

    def advance(state, finite, inner):
        return SkipNonfiniteState(state.skipped + (~finite).astype(jnp.int32), finite, inner)

    def update(grads, state, params=None, **extra_args):
        finite = all_finite(grads)
        do, skip = update_branches(tx, grads, params, extra_args)
        if params is None:
            # without params the update structure is the gradients'; keep a cond-free select
            updates, inner = do(state.inner_state)
            updates = jax.tree.map(
                lambda u: None if u is None else jnp.where(finite, u, jnp.zeros_like(u)),
                updates,
                is_leaf=is_none,
            )
            inner = jax.tree.map(lambda a, b: jnp.where(finite, a, b), inner, state.inner_state)
            return updates, advance(state, finite, inner)
        updates, inner = jax.lax.cond(finite, do, skip, state.inner_state)
        return updates, advance(state, finite, inner)

    def step_fn(params, grads, state, **extra_args):
        finite = all_finite(grads)
        params, inner = step_if(finite, tx, params, grads, state.inner_state, extra_args)
        return params, advance(state, finite, inner)

    setattr(update, STEP_ATTR, step_fn)
    return optax.GradientTransformationExtraArgs(init, update)


def update_branches(tx: optax.GradientTransformation, grads: PyTree, params: PyTree | None, extra_args: dict):
    """``(do, skip)`` branches for ``lax.cond`` over an inner state: ``tx.update`` (with
    ``None`` where the gradient is ``None``), or zero updates and the state unchanged."""
    extra_ok = isinstance(tx, optax.GradientTransformationExtraArgs)

    def do(inner):
        if extra_ok:
            updates, inner = tx.update(grads, inner, params, **extra_args)
        else:
            updates, inner = tx.update(grads, inner, params)
        return jax.tree.map(lambda g, u: None if g is None else u, grads, updates, is_leaf=is_none), inner

    def skip(inner):
        like = params if params is not None else grads
        zeros = jax.tree.map(
            lambda g, p: None if g is None else jnp.zeros_like(p), grads, like, is_leaf=is_none
        )
        return zeros, inner

    return do, skip


def step_if(
    pred: jax.Array,
    tx: optax.GradientTransformation,
    params: PyTree,
    grads: PyTree,
    inner: Any,
    extra_args: dict,
) -> tuple[PyTree, Any]:
    """``fo.step`` of ``tx`` (its own step function where it has one) under ``lax.cond``:
    ``(params, inner)`` unchanged where ``pred`` is false."""
    inner_step = getattr(tx.update, STEP_ATTR, None)

    def do(params, inner):
        if inner_step is not None:
            return inner_step(params, grads, inner, **extra_args)
        return _step(tx, params, grads, inner, **extra_args)

    def skip(params, inner):
        return params, inner

    return jax.lax.cond(pred, do, skip, params, inner)
