"""Pytree helpers shared by every transformation.

Two conventions run through the package:

* A gradient leaf that is ``None`` means "this parameter got no gradient" (torch's
  ``p.grad is None``). JAX treats ``None`` as an empty subtree, so every walk over
  gradients here passes ``is_leaf=is_none`` to keep those positions.
* A ``None`` in the *params* is "not a parameter": no state, no update, and its
  gradient must be ``None`` too. That is what ``eqx.filter(model, eqx.is_inexact_array)``
  and ``optax.multi_transform``'s masked sub-trees hand an optimizer (an activation
  function, an integer field, another label's parameters).
* Structural mismatches are reported by the first differing key path, in
  ``jax.tree_util.keystr`` form (``['layer']['w']``), with both structures shown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def is_none(x: Any) -> bool:
    """``is_leaf`` predicate that keeps ``None`` as a leaf (a missing gradient)."""
    return x is None


def keystr(path: tuple) -> str:
    """A key path as text; the root is shown as ``<root>``."""
    return jax.tree_util.keystr(path) or "<root>"


def leaves_with_path(tree: PyTree, keep_none: bool = False) -> list[tuple[tuple, Any]]:
    """``(path, leaf)`` pairs, optionally keeping ``None`` leaves."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none if keep_none else None)[0]


def check_params(params: PyTree, allow_empty: bool = False) -> None:
    """Validate a parameter pytree before any state is built.

    Args:
      params: the parameter pytree (``None`` leaves are not parameters).
      allow_empty: accept a tree without parameters, as optax's transformations do
        (a parameter group or ``optax.multi_transform`` label that selects nothing);
        default False, torch's rule.

    Raises:
      ValueError: ``optimizer got an empty parameter list`` (torch's text) for a tree
        without leaves unless ``allow_empty``; a message naming the path of a leaf that
        is not a floating point array.
    """
    leaves = leaves_with_path(params)
    if not leaves and not allow_empty:
        raise ValueError("optimizer got an empty parameter list")
    for path, leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            kind = f"dtype {dtype}" if dtype is not None else f"type {type(leaf).__name__}"
            raise ValueError(
                f"parameter at {keystr(path)} has {kind}; only floating point arrays can be optimized"
            )


def check_like_params(params: PyTree, other: PyTree, what: str = "grads") -> None:
    """Check that ``other`` has ``params``' structure, shapes and dtypes.

    ``None`` leaves of ``other`` are allowed anywhere a parameter leaf stands (a
    parameter without gradient). Where ``params`` has a ``None`` (not a parameter),
    ``other`` must have one too. Runs on static information only, so under ``jit`` it
    raises at trace time, before anything is computed.

    Raises:
      ValueError: naming the first differing path and showing both structures.
    """
    p_leaves = leaves_with_path(params, keep_none=True)
    o_leaves = leaves_with_path(other, keep_none=True)
    p_paths = [path for path, _ in p_leaves]
    o_paths = [path for path, _ in o_leaves]
    where = None
    if p_paths != o_paths:
        first = next(
            (i for i, (a, b) in enumerate(zip(p_paths, o_paths)) if a != b),
            min(len(p_paths), len(o_paths)),
        )
        if first < len(p_paths) and first < len(o_paths):
            where = f"params have {keystr(p_paths[first])} where {what} have {keystr(o_paths[first])}"
        elif first < len(p_paths):
            where = f"{what} lack the parameter at {keystr(p_paths[first])}"
        else:
            where = f"{what} have an extra leaf at {keystr(o_paths[first])}"
    else:
        extra = next(
            (path for (path, p), (_, o) in zip(p_leaves, o_leaves) if p is None and o is not None), None
        )
        if extra is not None:
            where = f"{what} have a value at {keystr(extra)}, where params have None (not a parameter)"
    if where is not None:
        raise ValueError(
            f"{what} do not match the structure of params: {where}.\n"
            f"  params: {jax.tree.structure(params, is_leaf=is_none)}\n"
            f"  {what}: {jax.tree.structure(other, is_leaf=is_none)}"
        )
    for (path, p), (_, o) in zip(p_leaves, o_leaves):
        if o is None or p is None:
            continue
        if jnp.shape(o) != jnp.shape(p):
            raise ValueError(
                f"{what} at {keystr(path)} has shape {jnp.shape(o)}, but the parameter has "
                f"shape {jnp.shape(p)}"
            )


def map_with_none(fn: Callable[..., Any], grads: PyTree, *rest: PyTree) -> PyTree:
    """``jax.tree.map`` over ``grads`` that hands ``None`` gradient leaves to ``fn``."""
    return jax.tree.map(fn, grads, *rest, is_leaf=is_none)


def opmath_dtype(dtype: Any) -> jnp.dtype:
    """The dtype torch computes in for a tensor of ``dtype`` (float for half types)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype
