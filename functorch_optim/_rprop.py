"""Resilient backpropagation (Rprop), as ``torch.optim.Rprop``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import check_lr
from functorch_optim._torch_ops import op_casts, sign, signed_grad, zero_buffers


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    lr, etas = hp["lr"], hp["etas"]
    check_lr(lr)
    if not 0.0 < etas[0] < 1.0 < etas[1]:
        raise ValueError(f"Invalid eta values: {etas[0]}, {etas[1]}")


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    c, _, r = op_casts(dtype)
    etaminus, etaplus = hp["etas"]
    step_size_min, step_size_max = hp["step_sizes"]
    grad = signed_grad(grad, dtype, static["maximize"])
    prev = buffers["prev"]
    # torch.full_like(grad, lr) when the state is created
    step_size = jnp.where(step == 1, r(jnp.full_like(buffers["step_size"], hp["lr"])), buffers["step_size"])
    # sign = grad.mul(prev).sign(); > 0 -> etaplus, < 0 -> etaminus, == 0 -> 1 (in the param dtype)
    prod = r(c(grad) * c(prev))
    # torch's CPU sign of a NaN is 0: the factor is 1 there, like a zero product
    factor = jnp.where(prod > 0, r(c(etaplus)), jnp.where(prod < 0, r(c(etaminus)), jnp.ones((), dtype)))

    def clamp(step_size):
        return r(jnp.minimum(jnp.maximum(c(step_size), c(step_size_min)), c(step_size_max)))

    # step_size.mul_(sign).clamp_(step_size_min, step_size_max); where the factor is 1 the
    # product is the step size itself, bit for bit. Selecting on the factor makes the new
    # step size an array XLA writes once and the parameter pass reads back, instead of
    # recomputing it there from the old one (which would force a copy of the donated
    # buffer).
    step_size = jnp.where(factor == 1, clamp(step_size), clamp(r(c(step_size) * c(factor))))
    # Three passes over memory, each writing one array in place: step_size, prev, then the
    # parameter from the returned two. The barriers make each pass recompute
    # ``grad * prev`` from fresh reads instead of XLA materializing it for all of them.
    grad, prev, _ = jax.lax.optimization_barrier((grad, prev, step_size))
    # the sign flipped: no step, and the next step sees ``prev = 0``
    prod = r(c(grad) * c(prev))
    flipped = prod < 0
    if step_size.size:
        # The step-size pass reads the old ``prev`` that this pass overwrites, and XLA
        # orders an in-place write after the reads it depends on, else it copies the
        # buffer. This always-true test of one new step size (any float is >= 0, < 0 or
        # NaN) is that dependency: one element read, no copy, the same values.
        x = step_size.ravel()[0]
        flipped = flipped & ((x >= 0) | (x < 0) | (x != x))
    grad = jnp.where(flipped, jnp.zeros((), dtype), grad)
    param, grad, step_size = jax.lax.optimization_barrier((param, grad, step_size))
    # param.addcmul_(grad.sign(), step_size, value=-1)
    new_param = r(c(param) + c(-1.0) * c(sign(grad)) * c(step_size))
    return new_param, {"prev": grad, "step_size": step_size}


# ``step_size`` gets its value, lr, on the parameter's first gradient (torch's lazy state)
RPROP_ALGORITHM = Algorithm(
    name="Rprop", validate=_validate, init_leaf=zero_buffers("prev", "step_size"), step_leaf=_step_leaf
)


def rprop(
    lr: Any = 1e-2,
    etas: tuple[Any, Any] = (0.5, 1.2),
    step_sizes: tuple[Any, Any] = (1e-6, 50),
    *,
    capturable: bool = False,
    foreach: bool | None = None,
    maximize: bool = False,
    differentiable: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Rprop with torch's exact semantics (``torch.optim.Rprop``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included), elementwise:

    .. math::

        g_t &\leftarrow -g_t \quad \text{if maximize} \\
        \eta_t &\leftarrow \begin{cases} \min(\eta_{t-1} \eta_+, \Gamma_{\max})
            & g_t g_{t-1} > 0 \\
            \max(\eta_{t-1} \eta_-, \Gamma_{\min}) & g_t g_{t-1} < 0 \\
            \operatorname{clamp}(\eta_{t-1}, \Gamma_{\min}, \Gamma_{\max}) & \text{otherwise}
            \end{cases} \\
        g_t &\leftarrow 0 \quad \text{where } g_t g_{t-1} < 0 \\
        \theta_t &\leftarrow \theta_{t-1} - \eta_t \operatorname{sign}(g_t)

    where :math:`g_{t-1}` is the stored ``prev`` (the previous gradient *after* zeroing,
    0 before the first step), :math:`\eta` is the per-element ``step_size``, set to
    ``lr`` on the parameter's first gradient, :math:`(\eta_-, \eta_+)` = ``etas`` and
    :math:`(\Gamma_{\min}, \Gamma_{\max})` = ``step_sizes``.

    Args:
      lr: learning rate, the initial step size, default 1e-2; a number, a 0-d (or
        1-element) array, or a schedule ``count -> value``. As in torch it is read only
        when a parameter receives its first gradient; later changes do not move
        existing step sizes.
      etas: multiplicative decrease and increase factors :math:`(\eta_-, \eta_+)`,
        default (0.5, 1.2).
      step_sizes: minimal and maximal step size :math:`(\Gamma_{\min}, \Gamma_{\max})`,
        default (1e-6, 50).
      capturable: accepted for torch compatibility; no effect (every step is jittable).
      foreach: accepted for torch compatibility; no effect (XLA fuses the loop).
      maximize: maximize the objective instead of minimizing, default False (static).
      differentiable: accepted for torch compatibility; every step is differentiable
        (the sign logic has zero derivative almost everywhere, as in torch).

    Returns:
      An optax ``GradientTransformationExtraArgs``. Its state is a ``TorchState`` with
      ``buffers["prev"]``, ``buffers["step_size"]`` (in the parameter's dtype) and
      ``buffers["step"]`` (int32; torch keeps a float tensor).

    Raises:
      ValueError: ``Tensor lr must be 1-element``, ``Invalid learning rate: {lr}``,
        ``Invalid eta values: {etas[0]}, {etas[1]}`` (torch's texts; torch requires
        ``0 < etaminus < 1 < etaplus`` and does not check ``step_sizes``).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.rprop(lr=0.1)
      >>> params = {"w": jnp.array([1.0])}
      >>> state = tx.init(params)
      >>> for g in (1.0, 1.0, -1.0):
      ...     params, state = fo.step(tx, params, {"w": jnp.array([g])}, state)
      >>> round(float(params["w"][0]), 6)  # -0.1, -0.12, then a flip: no step
      0.78
      >>> round(float(state.step_size["w"][0]), 6), state.prev["w"].tolist()
      (0.06, [0.0])

    Note:
      ``optax.rprop`` 0.2.8 returns the *previous* step's update (its first update is
      zero), so it lags torch by one step; this function follows torch's
      ``_single_tensor_rprop``.

    References:
      Riedmiller and Braun, "A Direct Adaptive Method for Faster Backpropagation
      Learning: The RPROP Algorithm", ICNN 1993. Mirrors ``torch.optim.Rprop``
      (``_single_tensor_rprop``).
    """
    del capturable, foreach, differentiable
    hparams = {"lr": lr, "etas": tuple(etas), "step_sizes": tuple(step_sizes)}
    return make_optimizer(RPROP_ALGORITHM, hparams, {"maximize": bool(maximize)})
