"""``torch.nn.utils``' in-place clipping, on a facade optimizer's gradients.

torch clips ``p.grad`` of the parameters in place::

    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

Here the gradients live in the optimizer (``opt.grad``, filled by ``opt.backward``), so the
same line takes the optimizer::

    functorch_optim.nn.utils.clip_grad_norm_(opt, 1.0)

The arithmetic is ``functorch_optim.clip_grad_norm`` / ``clip_grad_value`` (torch's
formulas, operation by operation, as torch's ``foreach=False`` path runs them); the
functional forms, for jitted steps and ``optax.chain``, are those and
``clip_grad_norm_transform`` / ``clip_grad_value_transform``.
"""

from __future__ import annotations

from typing import Any

import jax

from functorch_optim._clip import clip_grad_norm, clip_grad_value

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


def _holder(name: str, optimizer: Any) -> Any:
    grad = getattr(type(optimizer), "grad", None)
    if not isinstance(grad, property) or grad.fset is None:
        raise TypeError(
            f"{name} clips the gradients of a functorch_optim.optim optimizer in place "
            f"(its .grad, filled by opt.backward); got {type(optimizer).__name__}. For a "
            f"gradient pytree use functorch_optim.{name.rstrip('_')}(grads, ...), which returns them"
        )
    return optimizer


def clip_grad_norm_(
    optimizer: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> jax.Array:
    r"""``torch.nn.utils.clip_grad_norm_`` on ``optimizer.grad``, in place.

    .. math::

        N = \Bigl\| \bigl(\|g_1\|_p, \dots, \|g_n\|_p\bigr) \Bigr\|_p, \qquad
        g_i \leftarrow g_i \cdot \min\Bigl(\frac{\text{max\_norm}}{N + 10^{-6}}, 1\Bigr)

    over the parameters that have a gradient (``None`` ones are skipped, as torch skips
    ``p.grad is None``).

    Args:
      optimizer: a ``functorch_optim.optim`` optimizer (SGD, AdamW, …; LBFGS inside
        torch's closure, after ``backward``): its ``grad`` is read and replaced by the
        clipped gradients.
      max_norm: the largest allowed norm.
      norm_type: p, default 2; ``float("inf")`` for the max-abs norm.
      error_if_nonfinite: raise torch's error when the norm is NaN or infinite, default
        False (then the gradients are scaled by the non-finite norm, as torch does).
      foreach: accepted for torch compatibility; no effect.

    Returns:
      The total norm before clipping, a 0-d array in the gradients' dtype (torch's
      return value; ``0.0`` without gradients).

    Raises:
      RuntimeError: torch's ``The total norm of order … for gradients from `parameters`
        is non-finite, so it cannot be clipped. …``; the gradients are then untouched.
      TypeError: for something other than a facade optimizer.

    Examples:
      >>> import jax.numpy as jnp
      >>> from functorch_optim.optim import SGD
      >>> from functorch_optim.nn.utils import clip_grad_norm_
      >>> opt = SGD({"w": jnp.zeros(2)}, lr=0.1)
      >>> opt.grad = {"w": jnp.array([3.0, 4.0])}
      >>> float(clip_grad_norm_(opt, 1.0))
      5.0
      >>> [round(x, 6) for x in opt.grad["w"].tolist()]
      [0.6, 0.8]

    Note:
      The clipping coefficient and the scaled gradients are torch's, bit for bit, for a
      given norm; the norm is a sum whose order XLA and torch choose differently, equal
      to the last bit for small gradients and within a few ulps for large ones.
    """
    opt = _holder("clip_grad_norm_", optimizer)
    clipped, total = clip_grad_norm(opt.grad, max_norm, norm_type, error_if_nonfinite, foreach)
    opt.grad = clipped
    return total


def clip_grad_value_(optimizer: Any, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_`` on ``optimizer.grad``, in place.

    Clamps every gradient entry to ``[-clip_value, clip_value]`` (NaN stays NaN).

    Args:
      optimizer: a ``functorch_optim.optim`` optimizer whose ``grad`` is clamped.
      clip_value: the bound.
      foreach: accepted for torch compatibility; no effect.

    Returns:
      None, as torch.

    Raises:
      TypeError: for something other than a facade optimizer.

    Examples:
      >>> import jax.numpy as jnp
      >>> from functorch_optim.optim import SGD
      >>> from functorch_optim.nn.utils import clip_grad_value_
      >>> opt = SGD({"w": jnp.zeros(3)}, lr=0.1)
      >>> opt.grad = {"w": jnp.array([-3.0, 0.5, 2.0])}
      >>> clip_grad_value_(opt, 1.0)
      >>> opt.grad["w"].tolist()
      [-1.0, 0.5, 1.0]
    """
    opt = _holder("clip_grad_value_", optimizer)
    opt.grad = clip_grad_value(opt.grad, clip_value, foreach)
