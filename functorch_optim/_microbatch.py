"""Micro-batching inside one jitted step: a batch's gradient from a ``lax.scan`` over its parts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from functorch_optim._tree import PyTree, keystr, leaves_with_path


def microbatch_grad(
    loss_fn: Callable[..., Any], micro_batches: int, *, has_aux: bool = False, weighted: bool = False
) -> Callable[[PyTree, PyTree], tuple[Any, PyTree]]:
    r"""The loss and gradient of a batch, computed ``micro_batches`` parts at a time.

    Every leaf of ``batch`` is split along its leading axis into ``m = micro_batches``
    equal parts; a ``lax.scan`` runs ``jax.value_and_grad(loss_fn)`` on one part per
    iteration and adds the results up, so the activations of one part live at a time
    (peak memory: one micro-batch's activations, not the batch's). The result is the
    whole batch's mean loss and its gradient, up to summation order:

    .. math:: L = \frac1m\sum_{j=1}^m L_j, \quad g = \frac1m\sum_{j=1}^m \nabla L_j
              \qquad\text{or, weighted,}\qquad
              L = \frac{\sum_j w_j L_j}{\sum_j w_j}, \quad
              g = \frac{\sum_j w_j \nabla L_j}{\sum_j w_j}.

    The weighted form is for parts of unequal size (padded variable-length sequences:
    ``w_j`` real tokens, ``L_j`` their mean loss): it is the gradient of the batch's
    global token mean, where the plain mean of part means is not.

    Args:
      loss_fn: ``(params, batch) -> mean_loss``; with ``weighted=True`` it returns
        ``(mean_loss, weight)`` (``weight`` a scalar: the part's tokens or samples);
        with ``has_aux=True`` ``(that, aux)``.
      micro_batches: the number of parts, an integer >= 1.
      has_aux: ``loss_fn`` returns auxiliary data as well, default False.
      weighted: weight each part's loss and gradient, default False.

    Returns:
      ``fn(params, batch) -> (loss, grads)``; with ``has_aux``, ``((loss, aux), grads)``
      where ``aux`` holds each part's auxiliary data stacked along a new leading axis of
      length ``micro_batches``. A weighted batch whose weights sum to 0 gives a zero loss
      and zero gradients.

    Raises:
      ValueError: ``micro_batches must be an integer >= 1, got …``; (when called) a batch
        leaf whose leading dimension is not divisible by ``micro_batches``, named by its
        path.

    Examples:
      >>> import jax, jax.numpy as jnp, functorch_optim as fo
      >>> loss = lambda p, b: jnp.mean((b * p["w"]) ** 2)
      >>> grad_fn = fo.microbatch_grad(loss, 2)
      >>> l, g = jax.jit(grad_fn)({"w": jnp.array(1.0)}, jnp.array([1.0, 2.0, 3.0, 4.0]))
      >>> float(l), float(g["w"])
      (7.5, 15.0)
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    k = micro_batches

    def split(params, chunk):
        # loss_fn's result as (mean loss, (weight or None, aux or None))
        out, weight, aux = loss_fn(params, chunk), None, None
        if has_aux:
            out, aux = out
        if weighted:
            out, weight = out
        return out, (weight, aux)

    value_and_grad = jax.value_and_grad(split, has_aux=True)

    def part(params, chunk):
        # one part's (loss, weight, aux) and grads; weighted: loss and grads times the
        # weight, so that the parts add up
        (loss, (weight, aux)), grads = value_and_grad(params, chunk)
        if not weighted:
            return (loss, None, aux), grads
        weight = jnp.asarray(weight, jnp.result_type(loss))
        return (loss * weight, weight, aux), jax.tree.map(lambda g: g * weight.astype(g.dtype), grads)

    def fn(params, batch):
        for path, x in leaves_with_path(batch):
            lead = jnp.shape(x)[0] if jnp.ndim(x) else None
            if lead is None or lead % k:
                raise ValueError(
                    f"microbatch_grad: the batch leaf at {keystr(path)} has leading dimension "
                    f"{lead}, not divisible by {k} micro-batches"
                )
        chunks = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
        (loss, weight, aux), grads = part(params, jax.tree.map(lambda x: x[0], chunks))
        if k > 1:
            # the first part outside the loop: its results start the sums (no zero tree)
            def body(carry, chunk):
                (value, w, a), g = part(params, chunk)
                total = (carry[0] + value, None if w is None else carry[1] + w)
                return (*total, jax.tree.map(jnp.add, carry[2], g)), a

            (loss, weight, grads), rest = jax.lax.scan(
                body, (loss, weight, grads), jax.tree.map(lambda x: x[1:], chunks)
            )
            if has_aux:
                aux = jax.tree.map(lambda a, r: jnp.concatenate([jnp.asarray(a)[None], r]), aux, rest)
        elif has_aux:
            aux = jax.tree.map(lambda a: jnp.asarray(a)[None], aux)
        if weighted:
            scale = jnp.where(weight > 0, 1 / jnp.where(weight > 0, weight, 1), 0)
            loss = loss * scale
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        elif k > 1:
            loss = loss / k
            grads = jax.tree.map(lambda g: g / k, grads)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return fn
