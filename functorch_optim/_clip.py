"""Gradient clipping with ``torch.nn.utils``' numbers: ``clip_grad_norm_`` and ``clip_grad_value_``."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from functorch_optim._tree import PyTree, is_none

_NONFINITE = (
    "The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
    "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`"
)


def _vector_norm(x: jax.Array, p: float) -> jax.Array:
    """``torch.linalg.vector_norm(x, p)`` over all elements, in ``x``'s dtype."""
    x = jnp.abs(jnp.ravel(x))
    if p == math.inf:
        return jnp.max(x, initial=jnp.zeros((), x.dtype))
    if p == -math.inf:
        return jnp.min(x, initial=jnp.asarray(jnp.inf, x.dtype))
    if p == 0:
        return jnp.sum(x != 0).astype(x.dtype)
    if p == 1:
        return jnp.sum(x)
    if p == 2:
        return jnp.sqrt(jnp.sum(x * x))
    return jnp.sum(x**p) ** (1.0 / p)


def _raise_nonfinite(norm_type: float):
    def callback(total):
        if not math.isfinite(float(total)):
            raise RuntimeError(_NONFINITE.format(norm_type=norm_type))

    return callback


def get_total_norm(grads: PyTree, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> jax.Array:
    """``torch.nn.utils.get_total_norm``: the norm of the per-leaf norms of ``grads``.

    ``None`` leaves are skipped; with no gradient at all the norm is ``0.0``.

    Args:
      grads: a gradient pytree.
      norm_type: the p of the p-norm, default 2; ``float("inf")`` for the max norm.
      error_if_nonfinite: raise if the norm is NaN or infinite, default False.

    Returns:
      The total norm, a 0-d array in the gradients' (promoted) dtype.

    Raises:
      RuntimeError: torch's ``The total norm of order … is non-finite, so it cannot be
        clipped. …`` when ``error_if_nonfinite`` and the norm is not finite (immediately
        for concrete gradients; under ``jit`` when the computation runs).
    """
    norm_type = float(norm_type)
    leaves = [g for g in jax.tree.leaves(grads, is_leaf=is_none) if g is not None]
    if not leaves:
        return jnp.asarray(0.0, jnp.float32)
    norms = [_vector_norm(jnp.asarray(g), norm_type) for g in leaves]
    dtype = jnp.result_type(*norms)
    total = _vector_norm(jnp.stack([n.astype(dtype) for n in norms]), norm_type)
    if error_if_nonfinite:
        if isinstance(total, jax.core.Tracer):
            jax.debug.callback(_raise_nonfinite(norm_type), total)
        elif not bool(jnp.isfinite(total)):
            raise RuntimeError(_NONFINITE.format(norm_type=norm_type))
    return total


def clip_grads_with_norm(grads: PyTree, max_norm: float, total_norm: jax.Array) -> PyTree:
    """``torch.nn.utils.clip_grads_with_norm_``: scale by ``min(max_norm / (total_norm + 1e-6), 1)``.

    Args:
      grads: a gradient pytree (``None`` leaves stay ``None``).
      max_norm: the largest norm allowed.
      total_norm: the norm already computed, e.g. by ``get_total_norm``.

    Returns:
      The scaled gradients, in their own dtypes.
    """
    max_norm = float(max_norm)
    # torch: ``max_norm / (total_norm + 1e-6)`` is ``Tensor.__rtruediv__``, i.e.
    # ``(total_norm + 1e-6).reciprocal() * max_norm``, then clamped to 1
    coef = jnp.minimum((1.0 / (total_norm + 1e-6)) * max_norm, 1.0)
    return jax.tree.map(
        lambda g: None if g is None else (g * coef.astype(g.dtype)).astype(g.dtype), grads, is_leaf=is_none
    )


def clip_grad_norm(
    grads: PyTree,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> tuple[PyTree, jax.Array]:
    r"""Clip the global norm of ``grads``, as ``torch.nn.utils.clip_grad_norm_``.

    .. math::

        N = \Bigl\| \bigl(\|g_1\|_p, \dots, \|g_n\|_p\bigr) \Bigr\|_p, \qquad
        g_i \leftarrow g_i \cdot \min\Bigl(\frac{\text{max\_norm}}{N + 10^{-6}}, 1\Bigr)

    Args:
      grads: a gradient pytree; ``None`` leaves stay ``None``.
      max_norm: the largest allowed norm.
      norm_type: p, default 2; ``float("inf")`` for the max-abs norm.
      error_if_nonfinite: raise torch's error for a NaN/inf norm, default False (then
        the gradients are scaled by the non-finite norm anyway, as torch does).
      foreach: accepted for torch compatibility; no effect.

    Returns:
      ``(clipped_grads, total_norm)``; ``total_norm`` is the norm *before* clipping.

    Raises:
      RuntimeError: torch's ``The total norm of order … is non-finite …`` (see
        ``get_total_norm``).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> g, n = fo.clip_grad_norm({"w": jnp.array([3.0, 4.0])}, max_norm=1.0)
      >>> float(n), [round(x, 6) for x in g["w"].tolist()]
      (5.0, [0.6, 0.8])

    Note:
      ``optax.clip_by_global_norm`` scales by ``max_norm / N`` without the ``+ 1e-6`` and
      only supports the 2-norm.

    References:
      Pascanu, Mikolov & Bengio, "On the difficulty of training recurrent neural
      networks", ICML 2013. Mirrors ``torch.nn.utils.clip_grad_norm_``.
    """
    del foreach
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    return clip_grads_with_norm(grads, max_norm, total), total


def clip_grad_value(grads: PyTree, clip_value: float, foreach: bool | None = None) -> PyTree:
    r"""Clamp every gradient entry to ``[-clip_value, clip_value]`` (``clip_grad_value_``).

    Args:
      grads: a gradient pytree; ``None`` leaves stay ``None``; NaN stays NaN.
      clip_value: the bound.
      foreach: accepted for torch compatibility; no effect.

    Returns:
      The clamped gradients.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> fo.clip_grad_value({"w": jnp.array([-3.0, 0.5, 2.0])}, 1.0)["w"].tolist()
      [-1.0, 0.5, 1.0]
    """
    del foreach
    clip_value = float(clip_value)

    def clamp(g):
        if g is None:
            return None
        lo, hi = jnp.asarray(-clip_value, g.dtype), jnp.asarray(clip_value, g.dtype)
        return jnp.minimum(jnp.maximum(g, lo), hi)

    return jax.tree.map(clamp, grads, is_leaf=is_none)


class ClipGradNormState(NamedTuple):
    """State of ``clip_grad_norm_transform``: the norm before clipping, of the last update.

    Attributes:
      total_norm: a 0-d array in the parameters' (promoted) dtype, the dtype
        ``get_total_norm`` computes in (float64 for float64 gradients); float32 for a
        tree without leaves.
    """

    total_norm: jax.Array


def clip_grad_norm_transform(
    max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> optax.GradientTransformation:
    """``clip_grad_norm`` as an optax transformation (for ``optax.chain``).

    Args:
      max_norm: the largest allowed norm.
      norm_type: p, default 2.
      error_if_nonfinite: see ``clip_grad_norm``.

    Returns:
      An optax ``GradientTransformation``; its state holds the last ``total_norm``.

    Examples:
      >>> import jax.numpy as jnp, optax, functorch_optim as fo
      >>> tx = optax.chain(fo.clip_grad_norm_transform(1.0), fo.sgd(lr=1.0))
      >>> params = {"w": jnp.array([0.0, 0.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([3.0, 4.0])}, tx.init(params))
      >>> [round(x, 6) for x in params["w"].tolist()], float(state[0].total_norm)
      ([-0.6, -0.8], 5.0)
    """

    def init(params):
        dtypes = [jnp.result_type(x) for x in jax.tree.leaves(params)]
        return ClipGradNormState(jnp.zeros((), jnp.result_type(*dtypes) if dtypes else jnp.float32))

    def update(grads, state, params=None):
        del params
        clipped, total = clip_grad_norm(grads, max_norm, norm_type, error_if_nonfinite)
        return clipped, ClipGradNormState(jnp.asarray(total).astype(state.total_norm.dtype))

    return optax.GradientTransformation(init, update)


def clip_grad_value_transform(clip_value: float) -> optax.GradientTransformation:
    """``clip_grad_value`` as an optax transformation (for ``optax.chain``).

    Examples:
      >>> import jax.numpy as jnp, optax, functorch_optim as fo
      >>> tx = optax.chain(fo.clip_grad_value_transform(0.5), fo.sgd(lr=1.0))
      >>> params = {"w": jnp.array([0.0, 0.0])}
      >>> params, _ = fo.step(tx, params, {"w": jnp.array([3.0, -0.25])}, tx.init(params))
      >>> params["w"].tolist()
      [-0.5, 0.25]
    """

    def init(params):
        del params
        return optax.EmptyState()

    def update(grads, state, params=None):
        del params
        return clip_grad_value(grads, clip_value), state

    return optax.GradientTransformation(init, update)
