"""Adamax (Adam in the infinity norm), as ``torch.optim.Adamax``."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import (
    betas_to_scalars,
    tensor_lr_dtype,
    tensor_to_scalar,
    validate_lr_eps_betas_wd,
)
from functorch_optim._torch_ops import (
    apply_weight_decay,
    caster,
    lerp,
    lr_over,
    signed_grad,
    step_as_float,
    zero_buffers,
)


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    c = caster(dtype)
    lr, (beta1, beta2), eps = hp["lr"], hp["betas"], hp["eps"]
    grad = signed_grad(grad, dtype, static["maximize"])
    param, grad = apply_weight_decay(param, grad, lr, hp["weight_decay"], False, static)
    exp_avg = lerp(buffers["exp_avg"], grad, 1 - beta1)
    # torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps)): eps inside the max
    decayed = (c(buffers["exp_inf"]) * c(beta2)).astype(dtype)
    floor = (c(jnp.abs(grad)) + c(eps)).astype(dtype)
    exp_inf = jnp.maximum(decayed, floor)
    bias_correction = 1 - beta1 ** step_as_float(step, hp)
    clr = lr_over(lr, bias_correction, static)  # a tensor lr: in its dtype
    new_param = (c(param) + c(-clr) * c(exp_avg) / c(exp_inf)).astype(dtype)
    return new_param, {"exp_avg": exp_avg, "exp_inf": exp_inf}


ADAMAX_ALGORITHM = Algorithm(
    name="Adamax",
    validate=validate_lr_eps_betas_wd,
    init_leaf=zero_buffers("exp_avg", "exp_inf"),
    step_leaf=_step_leaf,
    fixed_zero=("weight_decay",),
)


def adamax(
    lr: Any = 2e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0,
    foreach: bool | None = None,
    *,
    maximize: bool = False,
    differentiable: bool = False,
    capturable: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Adamax with torch's exact semantics (``torch.optim.Adamax``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included):

    .. math::

        g_t &\leftarrow \pm \nabla_\theta f_t(\theta_{t-1}) \quad (- \text{ if maximize}) \\
        g_t &\leftarrow g_t + \lambda\theta_{t-1} \quad \text{if } \lambda \ne 0 \\
        m_t &\leftarrow \operatorname{lerp}(m_{t-1}, g_t, 1 - \beta_1) \\
        u_t &\leftarrow \max(\beta_2 u_{t-1}, |g_t| + \epsilon) \\
        \theta_t &\leftarrow \theta_{t-1} - \frac{\gamma}{1 - \beta_1^t} \frac{m_t}{u_t}

    with :math:`\gamma` = ``lr``, :math:`(\beta_1, \beta_2)` = ``betas``,
    :math:`\epsilon` = ``eps``, :math:`\lambda` = ``weight_decay``, :math:`u` the buffer
    ``exp_inf`` and :math:`t` the parameter's ``step``.

    Args:
      lr: learning rate :math:`\gamma`, default 2e-3; a number, a 1-element array, or a
        schedule ``count -> value``. An array stands for torch's tensor ``lr``:
        ``lr / bias_correction`` is then formed in its dtype, as torch does (float32 for
        ``torch.tensor(2e-3)``; static, see the parity guide).
      betas: :math:`(\beta_1, \beta_2)`, default (0.9, 0.999).
      eps: added to :math:`|g_t|` inside the maximum, default 1e-8.
      weight_decay: L2 penalty :math:`\lambda` added to the gradient, default 0.
        Built as the number 0, the decay is compiled out (no read of the parameter for
        it) and ``set_hparams`` refuses a nonzero value; a JAX array or a schedule keeps
        it changeable (performance guide, "A weight decay built as 0 is compiled in").
      foreach: accepted for torch compatibility; no effect.
      maximize: maximize the objective instead of minimizing, default False (static).
      differentiable: accepted for torch compatibility; no effect: every step is
        differentiable with ``jax.grad``.
      capturable: accepted for torch compatibility; no effect.

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a ``TorchState`` with
      hyperparameters ``lr``, ``betas``, ``eps``, ``weight_decay`` and buffers ``step``
      (int32), ``exp_avg`` and ``exp_inf``.

    Raises:
      ValueError: torch's texts: ``Tensor lr must be 1-element``, ``Invalid learning
        rate: {lr}``, ``Invalid epsilon value: {eps}``, ``Invalid beta parameter at index
        0: {betas[0]}`` (and index 1), ``Invalid weight_decay value: {weight_decay}``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.adamax(lr=0.1)
      >>> params = {"w": jnp.array([1.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([4.0])}, tx.init(params))
      >>> round(params["w"].item(), 6), round(state.exp_inf["w"].item(), 6)
      (0.9, 4.0)

    Note:
      Where optax differs: ``optax.adamax`` computes
      :math:`u_t = \max(\beta_2 u_{t-1}, |g_t|)` and adds :math:`\epsilon` to the
      denominator outside the maximum; torch (and this function) put :math:`\epsilon`
      inside, so :math:`u_t \ge \epsilon` is stored in the state. The bias correction is
      computed in the hyperparameter dtype (float64 under x64), as torch uses doubles.

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, section 7.
      Mirrors ``torch.optim.Adamax`` (``_single_tensor_adamax``).
    """
    del foreach, differentiable, capturable
    # a tensor lr's dtype (None for a number): torch's lr / bias_correction is in it
    static = {"maximize": bool(maximize), "tensor_lr": tensor_lr_dtype(lr)}
    lr = tensor_to_scalar("lr", lr)
    hparams = {"lr": lr, "betas": betas_to_scalars(betas), "eps": eps, "weight_decay": weight_decay}
    return make_optimizer(ADAMAX_ALGORITHM, hparams, static)
