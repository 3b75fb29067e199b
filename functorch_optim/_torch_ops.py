"""torch's CPU tensor ops, emulated one op at a time; shared by every torch-parity rule.

Each op is computed in torch's opmath dtype (float32 for bf16/fp16 parameters, the
parameter's own dtype otherwise) and rounded back to the parameter dtype after each op,
as torch's CPU kernels do: ``c`` casts to opmath, ``r`` rounds back, and ``a`` is the
scalar of torch's ``add`` (tensor + scalar, or ``alpha=``), which torch rounds to the
tensor's dtype first (bf16!), where mul/addcmul/addcdiv/lerp scalars stay in opmath.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from functorch_optim._tree import opmath_dtype

Cast = Callable[[Any], jax.Array]


def caster(dtype: Any) -> Cast:
    """``c(x)``: ``x`` in torch's opmath dtype for parameters of ``dtype``.

    A Python-double scalar meets a float32 tensor as float32 in torch; a bf16 tensor is
    computed in float32 and rounded back after each op (``.astype(dtype)``).
    """
    ct = opmath_dtype(dtype)

    def c(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        # already there: skip ``astype``'s no-op (a step over many leaves calls this
        # thousands of times while tracing); a weak type must still become strong
        if x.dtype == ct and not x.weak_type:
            return x
        return x.astype(ct)

    return c


def op_casts(dtype: Any) -> tuple[Cast, Cast, Cast]:
    """``(c, a, r)`` for parameters of ``dtype``: cast to opmath, torch ``add``'s scalar
    (rounded to ``dtype`` first, then opmath), and round an opmath result back to ``dtype``.
    """
    c = caster(dtype)

    def a(x: Any) -> jax.Array:
        return c(jnp.asarray(x).astype(dtype))

    def r(x: jax.Array) -> jax.Array:
        return x.astype(dtype)

    return c, a, r


def signed_grad(grad: jax.Array, dtype: Any, maximize: bool) -> jax.Array:
    """The gradient in the parameter dtype, negated with ``maximize`` (torch's first line)."""
    grad = grad.astype(dtype)
    return -grad if maximize else grad


def sign(x: jax.Array) -> jax.Array:
    """torch's ``sign`` on the CPU: like ``jnp.sign``, but 0 for a NaN (``jnp.sign`` gives NaN)."""
    return jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), jnp.sign(x))


def py_max(first: Any, second: Any) -> jax.Array:
    """Python's ``max(first, second)`` on the scalars torch computes in Python floats:
    ``second`` only where it is greater, so a NaN ``second`` gives ``first`` (and a NaN
    ``first`` stays), where ``jnp.maximum`` propagates either NaN."""
    return jnp.where(second > first, second, first)


def py_min(first: Any, second: Any) -> jax.Array:
    """Python's ``min(first, second)``: ``second`` only where it is smaller (see ``py_max``)."""
    return jnp.where(second < first, second, first)


def lerp_formula(start: jax.Array, end: jax.Array, weight: Any) -> jax.Array:
    """torch's CPU ``lerp`` formula (``aten/src/ATen/native/Lerp.h``), on values already in
    the compute dtype: two branches split at ``|weight| < 0.5``, exact at both ends."""
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


def lerp(start: jax.Array, end: jax.Array, weight: Any) -> jax.Array:
    """``start.lerp_(end, weight)``: computed in opmath, rounded to ``start``'s dtype."""
    dtype = start.dtype
    c = caster(dtype)
    return lerp_formula(c(start), c(end), c(weight)).astype(dtype)


def decay_square(exp_avg_sq: jax.Array, grad: jax.Array, beta2: Any) -> jax.Array:
    """``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)``, rounded per op."""
    dtype = exp_avg_sq.dtype
    c = caster(dtype)
    decayed = (c(exp_avg_sq) * c(beta2)).astype(dtype)
    return (c(decayed) + c(1 - beta2) * c(grad) * c(grad)).astype(dtype)


def apply_weight_decay(
    param: jax.Array, grad: jax.Array, lr: Any, weight_decay: Any, decoupled: bool
) -> tuple[jax.Array, jax.Array]:
    """torch's ``if weight_decay != 0`` block: decoupled ``param.mul_(1 - lr * wd)``, else
    ``grad = grad.add(param, alpha=wd)``. Returns ``(param, grad)``."""
    dtype = param.dtype
    c = caster(dtype)
    if decoupled:
        # ``* 1`` is exact: one multiply either way, so XLA contracts it the same way into
        # what follows (an FMA), whatever the surrounding selects
        factor = jnp.where(weight_decay != 0, 1 - lr * weight_decay, 1)
        return (c(param) * c(factor)).astype(dtype), grad
    coupled = (c(grad) + c(weight_decay) * c(param)).astype(dtype)
    return param, jnp.where(weight_decay != 0, coupled, grad)


def zero_buffers(*names: str) -> Callable[[jax.Array, Mapping[str, Any]], dict[str, jax.Array]]:
    """An ``init_leaf`` whose buffers ``names`` all start as zeros like the parameter
    (torch's ``torch.zeros_like(p, memory_format=torch.preserve_format)``)."""

    def init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
        return {name: jnp.zeros_like(param) for name in names}

    return init_leaf


def step_as_float(step: jax.Array, hp: Mapping[str, Any]) -> jax.Array:
    """The int32 ``step`` as the float torch uses (a double under x64)."""
    return step.astype(jnp.result_type(hp["lr"]))
