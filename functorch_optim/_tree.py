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
    parameter without gradient); every other leaf must be an array (JAX or NumPy) of
    the parameter's shape and dtype, as torch requires of ``p.grad`` (a complex, integer,
    boolean or lower-precision gradient is not cast). Where ``params`` has a ``None``
    (not a parameter), ``other`` must have one too. Runs on static information only, so
    under ``jit`` it raises at trace time, before anything is computed.

    Raises:
      ValueError: naming the first differing path and showing both structures; or the
        path of a leaf that is not an array, or whose shape or dtype differs from the
        parameter's.
    """
    p_leaves, o_leaves = _check_structure(params, other, what)
    for (path, p), (_, o) in zip(p_leaves, o_leaves):
        if o is None or p is None:
            continue
        if not hasattr(o, "dtype") or not hasattr(o, "shape"):
            raise ValueError(
                f"{what} at {keystr(path)} is a {type(o).__name__}, not an array (give an array "
                f"of the parameter's shape {jnp.shape(p)} and dtype {p.dtype}, or None)"
            )
        if jnp.shape(o) != jnp.shape(p):
            raise ValueError(
                f"{what} at {keystr(path)} has shape {jnp.shape(o)}, but the parameter has "
                f"shape {jnp.shape(p)}"
            )
        if o.dtype != p.dtype:
            raise ValueError(
                f"{what} at {keystr(path)} has dtype {o.dtype}, but the parameter has dtype "
                f"{p.dtype} (torch: assigned grad has data of a different type)"
            )


def grad_mask_leaves(params: PyTree, grad_mask: PyTree) -> list[Any]:
    """``grad_mask``'s flags, one per parameter leaf, after checking its structure and leaves.

    Like ``check_like_params``, static: under ``jit`` it raises at trace time.

    Raises:
      ValueError: naming the first path where ``grad_mask``'s structure differs from
        the params' (a missing or extra key), or a leaf that is not a boolean scalar
        (a Python bool or a 0-d bool array), with its shape and dtype.
    """
    p_leaves, m_leaves = _check_structure(params, grad_mask, "grad_mask")
    for (path, p), (_, m) in zip(p_leaves, m_leaves):
        if p is None or isinstance(m, bool):
            continue
        dtype = getattr(m, "dtype", None)
        if dtype != jnp.bool_ or jnp.shape(m) != ():
            got = type(m).__name__ if dtype is None else f"an array of shape {jnp.shape(m)} and dtype {dtype}"
            raise ValueError(
                f"grad_mask at {keystr(path)} must be a boolean scalar (True: the parameter has a "
                f"gradient in this call), got {got}"
            )
    # one flag per parameter (a None in params is not one)
    return [m for (_, p), (_, m) in zip(p_leaves, m_leaves) if p is not None]


def _check_structure(params: PyTree, other: PyTree, what: str) -> tuple[list, list]:
    """``(path, leaf)`` pairs of ``params`` and ``other`` (``None`` kept), after checking
    that both have the same paths."""
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
    same = jax.tree.structure(params, is_leaf=is_none) == jax.tree.structure(other, is_leaf=is_none)
    mismatch = None if same else _first_node_mismatch(params, other)
    if mismatch is not None:
        path, p_node, o_node = mismatch
        raise ValueError(
            f"{what} do not match the structure of params: at {keystr(path)} params have a "
            f"{type(p_node).__name__} where {what} have a {type(o_node).__name__}.\n"
            f"  params: {jax.tree.structure(params, is_leaf=is_none)}\n"
            f"  {what}: {jax.tree.structure(other, is_leaf=is_none)}"
        )
    return p_leaves, o_leaves


def _children(node: Any) -> list[tuple[tuple, Any]]:
    """A pytree node's immediate children with their keys (none for a leaf)."""
    pairs = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    return [] if len(pairs) == 1 and pairs[0][1] is node else pairs


def _first_node_mismatch(a: Any, b: Any, path: tuple = ()) -> tuple[tuple, Any, Any] | None:
    """The first path (same keys on both sides) where the container types differ: a tuple
    where the params have a list, say (``None`` in ``b`` matches any parameter leaf)."""
    if a is None or b is None:
        return None
    a_children, b_children = _children(a), _children(b)
    if not a_children and not b_children:
        return None
    if type(a) is not type(b):
        return path, a, b
    for (key, x), (_, y) in zip(a_children, b_children):
        found = _first_node_mismatch(x, y, path + key)
        if found is not None:
            return found
    return None


def map_with_none(fn: Callable[..., Any], grads: PyTree, *rest: PyTree) -> PyTree:
    """``jax.tree.map`` over ``grads`` that hands ``None`` gradient leaves to ``fn``."""
    return jax.tree.map(fn, grads, *rest, is_leaf=is_none)


def opmath_dtype(dtype: Any) -> jnp.dtype:
    """The dtype torch computes in for a tensor of ``dtype`` (float for half types)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype
