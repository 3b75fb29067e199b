"""Adadelta with weight decay, as ``torch.optim.Adadelta``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import check_eps, check_lr, check_weight_decay
from functorch_optim._hyperparams import fixed
from functorch_optim._torch_ops import decay_square, op_casts, signed_grad, stored, zero_buffers


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    lr, rho, eps, weight_decay = hp["lr"], hp["rho"], hp["eps"], hp["weight_decay"]
    check_lr(lr)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"Invalid rho value: {rho}")
    check_eps(eps)
    check_weight_decay(weight_decay)


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    c, a, r = op_casts(dtype)
    rho, eps, wd = hp["rho"], hp["eps"], hp["weight_decay"]

    def effective_grad(param, grad):
        grad = signed_grad(grad, dtype, static["maximize"])
        if fixed(static, "weight_decay") == "zero":  # built with the number 0: no param read
            return grad
        return jnp.where(wd != 0, r(c(grad) + a(wd) * c(param)), grad)

    def delta(param, grad, square_avg, acc_delta):
        grad = effective_grad(param, grad)
        # std = square_avg.add(eps).sqrt_(); delta = acc_delta.add(eps).sqrt_()
        std = r(jnp.sqrt(c(r(c(square_avg) + a(eps)))))
        delta = r(jnp.sqrt(c(r(c(acc_delta) + a(eps)))))
        # delta.div_(std).mul_(grad): a division by the stored std (XLA rewrites a
        # division by a square root into a multiply by its reciprocal square root)
        return r(c(r(c(delta) / stored(c(std)))) * c(grad))

    g = effective_grad(param, grad)
    # square_avg.mul_(rho).addcmul_(grad, grad, value=1 - rho)
    # (the decayed average stored, addcmul one FMA: ``decay_square``)
    square_avg = decay_square(buffers["square_avg"], g, rho)
    # One pass over memory per written array (square_avg, acc_delta, the parameter), each
    # recomputing the delta from fresh reads: the barriers stop XLA from materializing
    # the decayed gradient and both square roots for all passes (three parameter-sized
    # temporaries, three extra loops). acc_delta and the parameter each need the other's
    # old value, so one of them must be saved: XLA copies the old acc_delta (one
    # temporary). Same operations, same rounding.
    fresh = (param, grad, square_avg, buffers["acc_delta"])
    # acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho)
    d = delta(*jax.lax.optimization_barrier(fresh))
    acc_delta = decay_square(buffers["acc_delta"], d, rho)
    # param.add_(delta, alpha=-lr); a barrier of its own (not merged with the one above)
    d = delta(*jax.lax.optimization_barrier((*fresh, acc_delta))[:4])
    new_param = r(c(param) + a(-hp["lr"]) * c(d))
    if acc_delta.size:
        # XLA orders an in-place write after the reads it depends on, else it copies the
        # buffer: this always-true test of one new acc_delta element (any float is >= 0,
        # < 0 or NaN) puts the parameter pass after the acc_delta pass, which reads the
        # old parameter, so only acc_delta is copied, not both. The same values.
        x = acc_delta.ravel()[0]
        new_param = jnp.where((x >= 0) | (x < 0) | (x != x), new_param, param)
    return new_param, {"square_avg": square_avg, "acc_delta": acc_delta}


ADADELTA_ALGORITHM = Algorithm(
    name="Adadelta",
    validate=_validate,
    init_leaf=zero_buffers("square_avg", "acc_delta"),
    step_leaf=_step_leaf,
    reads_step=False,
    fixed_zero=("weight_decay",),
)


def adadelta(
    lr: Any = 1.0,
    rho: Any = 0.9,
    eps: Any = 1e-6,
    weight_decay: Any = 0,
    foreach: bool | None = None,
    *,
    capturable: bool = False,
    maximize: bool = False,
    differentiable: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Adadelta with torch's exact semantics (``torch.optim.Adadelta``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included):

    .. math::

        g_t &\leftarrow -g_t \quad \text{if maximize} \\
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \quad \text{if } \lambda \ne 0 \\
        v_t &\leftarrow \rho v_{t-1} + (1 - \rho) g_t^2 \\
        \Delta x_t &\leftarrow \frac{\sqrt{u_{t-1} + \epsilon}}{\sqrt{v_t + \epsilon}} \, g_t \\
        u_t &\leftarrow \rho u_{t-1} + (1 - \rho) \Delta x_t^2 \\
        \theta_t &\leftarrow \theta_{t-1} - \gamma \Delta x_t

    with :math:`\gamma` = ``lr``, :math:`\rho` = ``rho``, :math:`\epsilon` = ``eps``,
    :math:`\lambda` = ``weight_decay``, :math:`v` = ``square_avg``, :math:`u` =
    ``acc_delta``, both starting at zero.

    Args:
      lr: coefficient :math:`\gamma` that scales the delta before it is applied, default
        1.0; a number, a 0-d (or 1-element) array, or a schedule ``count -> value``.
      rho: decay :math:`\rho` of both running averages, default 0.9.
      eps: term :math:`\epsilon` added inside both square roots, default 1e-6.
      weight_decay: L2 penalty :math:`\lambda` added to the gradient, default 0.
        Built as the number 0, the decay is compiled out (no read of the parameter for
        it) and ``set_hparams`` refuses a nonzero value; a JAX array or a schedule keeps
        it changeable (performance guide, "A weight decay built as 0 is compiled in").
      foreach: accepted for torch compatibility; no effect (XLA fuses the loop).
      capturable: accepted for torch compatibility; no effect (every step is jittable).
      maximize: maximize the objective instead of minimizing, default False (static).
      differentiable: accepted for torch compatibility; every step is differentiable.

    Returns:
      An optax ``GradientTransformationExtraArgs``. Its state is a ``TorchState`` with
      ``buffers["square_avg"]``, ``buffers["acc_delta"]`` (in the parameter's dtype) and
      ``buffers["step"]`` (int32; torch keeps a float tensor).

    Raises:
      ValueError: ``Tensor lr must be 1-element``, ``Invalid learning rate: {lr}``,
        ``Invalid rho value: {rho}``, ``Invalid epsilon value: {eps}``, ``Invalid
        weight_decay value: {weight_decay}`` (torch's texts).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.adadelta(rho=0.0, eps=0.0)
      >>> params = {"w": jnp.array([1.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([2.0])}, tx.init(params))
      >>> params["w"].tolist()  # acc_delta starts at 0: with eps = 0 nothing moves
      [1.0]

    Note:
      ``optax.adadelta`` (``add_decayed_weights``, ``scale_by_adadelta``,
      ``scale_by_learning_rate``) computes the same rule with the same defaults for
      ``rho`` and ``eps``, but its ``learning_rate`` has no default (torch: 1.0); with
      matching values the two agree to rounding (operation order differs at the last
      bits: torch divides the two square roots before multiplying by the gradient).

    References:
      Zeiler, "ADADELTA: An Adaptive Learning Rate Method", arXiv:1212.5701, 2012.
      Mirrors ``torch.optim.Adadelta`` (``_single_tensor_adadelta``).
    """
    del foreach, capturable, differentiable
    hparams = {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay}
    return make_optimizer(ADADELTA_ALGORITHM, hparams, {"maximize": bool(maximize)})
