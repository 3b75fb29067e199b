"""RAdam (rectified Adam), as ``torch.optim.RAdam``."""

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
    coupled_weight_decay,
    decay_square,
    lerp,
    signed_grad,
    step_as_float,
    stored,
    true_divide,
    zero_buffers,
)


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    c = caster(dtype)
    lr, (beta1, beta2), eps = hp["lr"], hp["betas"], hp["eps"]
    grad = signed_grad(grad, dtype, static["maximize"])
    t = step_as_float(step, hp)
    param, grad = apply_weight_decay(
        param, grad, lr, hp["weight_decay"], static["decoupled_weight_decay"], static
    )
    exp_avg = lerp(buffers["exp_avg"], grad, 1 - beta1)
    exp_avg_sq = decay_square(buffers["exp_avg_sq"], grad, beta2)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    bias_corrected_exp_avg = true_divide(c(exp_avg), c(bias_correction1)).astype(dtype)
    # maximum length of the approximated SMA, and its length at step t
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * (beta2**t) / bias_correction2
    rectify = rho_t > 5.0
    ratio = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
    # the unused branch must stay finite, or jax.grad multiplies a NaN by zero
    rect = jnp.sqrt(jnp.where(rectify, ratio, 1.0))
    # adaptive lr = bias_correction2**0.5 / (v.sqrt() + eps): eps scaled by sqrt(bc2);
    # ``float / tensor`` is ``tensor.reciprocal() * float`` in torch
    root = jnp.sqrt(c(exp_avg_sq)).astype(dtype)
    root = (c(root) + c(eps)).astype(dtype)
    adaptive_lr = (1 / c(root)).astype(dtype)
    adaptive_lr = (c(adaptive_lr) * c(jnp.sqrt(bias_correction2))).astype(dtype)
    scaled = (c(bias_corrected_exp_avg) * c(lr)).astype(dtype)
    rectified = (c(scaled) * c(adaptive_lr)).astype(dtype)
    rectified = (c(rectified) * c(rect)).astype(dtype)
    # torch stores the product (``param.add_(bias_corrected_exp_avg * lr, alpha=-1)``):
    # left to XLA, it was contracted into the subtraction, one rounding where torch has two
    update = stored(jnp.where(rectify, rectified, scaled))
    new_param = (c(param) - c(update)).astype(dtype)
    return new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


RADAM_ALGORITHM = Algorithm(
    name="RAdam",
    validate=validate_lr_eps_betas_wd,
    init_leaf=zero_buffers("exp_avg", "exp_avg_sq"),
    step_leaf=_step_leaf,
    fixed_zero=coupled_weight_decay,
)


def radam(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0,
    decoupled_weight_decay: bool = False,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
    capturable: bool = False,
    differentiable: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""RAdam with torch's exact semantics (``torch.optim.RAdam``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included):

    .. math::

        g_t &\leftarrow \pm \nabla_\theta f_t(\theta_{t-1}) \quad (- \text{ if maximize}) \\
        \theta_{t-1} &\leftarrow \theta_{t-1}(1 - \gamma\lambda)
            \quad \text{if decoupled and } \lambda \ne 0 \\
        g_t &\leftarrow g_t + \lambda\theta_{t-1}
            \quad \text{if not decoupled and } \lambda \ne 0 \\
        m_t &\leftarrow \operatorname{lerp}(m_{t-1}, g_t, 1 - \beta_1), \qquad
        v_t \leftarrow \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        \hat m_t &\leftarrow m_t / (1 - \beta_1^t) \\
        \rho_\infty &\leftarrow 2 / (1 - \beta_2) - 1, \qquad
        \rho_t \leftarrow \rho_\infty - 2 t \beta_2^t / (1 - \beta_2^t) \\
        \theta_t &\leftarrow \begin{cases}
            \theta_{t-1} - \gamma \hat m_t \, \dfrac{\sqrt{1 - \beta_2^t}}{\sqrt{v_t} + \epsilon}
            \, r_t & \text{if } \rho_t > 5 \\
            \theta_{t-1} - \gamma \hat m_t & \text{otherwise} \end{cases} \\
        r_t &= \sqrt{\frac{(\rho_t - 4)(\rho_t - 2)\rho_\infty}
                          {(\rho_\infty - 4)(\rho_\infty - 2)\rho_t}}

    with :math:`\gamma` = ``lr``, :math:`(\beta_1, \beta_2)` = ``betas``,
    :math:`\epsilon` = ``eps``, :math:`\lambda` = ``weight_decay`` and :math:`t` the
    parameter's ``step``.

    Args:
      lr: learning rate :math:`\gamma`, default 1e-3; a number, a 1-element array, or a
        schedule ``count -> value``. An array stands for torch's tensor ``lr``:
        ``1 - lr * weight_decay`` is then formed in its dtype, as torch does (float32 for
        ``torch.tensor(1e-3)``; static, see the parity guide).
      betas: :math:`(\beta_1, \beta_2)`, default (0.9, 0.999).
      eps: added to :math:`\sqrt{v_t}`, default 1e-8.
      weight_decay: :math:`\lambda`, default 0 (an L2 penalty, or decoupled decay).
        The L2 penalty built as the number 0 is compiled out and ``set_hparams``
        refuses a nonzero value; a JAX array or a schedule keeps it changeable.
      decoupled_weight_decay: decay the parameter (AdamW style, "RAdamW") instead of
        adding :math:`\lambda\theta` to the gradient, default False (static).
      foreach: accepted for torch compatibility; no effect.
      maximize: maximize the objective instead of minimizing, default False (static).
      capturable: accepted for torch compatibility; no effect.
      differentiable: accepted for torch compatibility; no effect: every step is
        differentiable with ``jax.grad``.

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a ``TorchState`` with
      hyperparameters ``lr``, ``betas``, ``eps``, ``weight_decay`` and buffers ``step``
      (int32), ``exp_avg`` and ``exp_avg_sq``.

    Raises:
      ValueError: torch's texts: ``Tensor lr must be 1-element``, ``Invalid learning
        rate: {lr}``, ``Invalid epsilon value: {eps}``, ``Invalid beta parameter at index
        0: {betas[0]}`` (and index 1), ``Invalid weight_decay value: {weight_decay}``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.radam(lr=0.1)
      >>> params = {"w": jnp.array([1.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([2.0])}, tx.init(params))
      >>> round(params["w"].item(), 6)  # rho_1 = 1 <= 5: plain momentum step, 1 - 0.1 * 2
      0.8

    Note:
      Where optax differs: ``optax.radam`` rectifies when :math:`\rho_t \ge 5` (torch:
      :math:`> 5`) and adds :math:`\epsilon` to the *bias-corrected* root,
      :math:`\sqrt{v_t / (1 - \beta_2^t)} + \epsilon`; torch (and this function) use
      :math:`\sqrt{1 - \beta_2^t} / (\sqrt{v_t} + \epsilon)`, i.e. :math:`\epsilon` scaled
      by :math:`\sqrt{1 - \beta_2^t}`. Scalars (:math:`\rho_t`, :math:`r_t`, bias
      corrections) are computed in the hyperparameter dtype (float64 under x64), as
      torch uses doubles.

    References:
      Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond", ICLR 2020.
      Mirrors ``torch.optim.RAdam`` (``_single_tensor_radam``).
    """
    del foreach, capturable, differentiable
    # a tensor lr's dtype (None for a number): torch's 1 - lr * weight_decay is in it
    static = {
        "maximize": bool(maximize),
        "decoupled_weight_decay": bool(decoupled_weight_decay),
        "tensor_lr": tensor_lr_dtype(lr),
    }
    lr = tensor_to_scalar("lr", lr)
    hparams = {"lr": lr, "betas": betas_to_scalars(betas), "eps": eps, "weight_decay": weight_decay}
    return make_optimizer(RADAM_ALGORITHM, hparams, static)
