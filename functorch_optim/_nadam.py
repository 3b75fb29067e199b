"""NAdam (Adam with Nesterov momentum and a momentum schedule), as ``torch.optim.NAdam``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
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
    rdiv,
    rounded_product,
    signed_grad,
    step_as_float,
    torch_lr,
    true_divide,
)

#: torch keeps ``mu_product`` as a 0-d tensor of its *default* dtype, float32 unless
#: ``torch.set_default_dtype`` changed it, even for float64 parameters.
MU_PRODUCT_DTYPE = jnp.float32


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    validate_lr_eps_betas_wd(hp)
    if not hp["momentum_decay"] >= 0.0:
        raise ValueError(f"Invalid momentum_decay value: {hp['momentum_decay']}")


def _init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    return {
        "exp_avg": jnp.zeros_like(param),
        "exp_avg_sq": jnp.zeros_like(param),
        "mu_product": jnp.ones((), MU_PRODUCT_DTYPE),
    }


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    c = caster(dtype)
    lr, (beta1, beta2), eps = hp["lr"], hp["betas"], hp["eps"]
    momentum_decay = hp["momentum_decay"]
    grad = signed_grad(grad, dtype, static["maximize"])
    t = step_as_float(step, hp)
    bias_correction2 = 1 - beta2**t
    param, grad = apply_weight_decay(
        param, grad, lr, hp["weight_decay"], static["decoupled_weight_decay"], static
    )
    # the momentum cache mu_t and mu_{t+1} (torch: Python doubles)
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * momentum_decay)))
    # ``mu_product *= mu`` on a float32 tensor: mu rounded to float32, product too
    mp_dtype = buffers["mu_product"].dtype
    mu_product = buffers["mu_product"] * mu.astype(mp_dtype)
    exp_avg = lerp(buffers["exp_avg"], grad, 1 - beta1)
    exp_avg_sq = decay_square(buffers["exp_avg_sq"], grad, beta2)
    denom = true_divide(c(exp_avg_sq), c(bias_correction2)).astype(dtype)
    denom = jnp.sqrt(c(denom)).astype(dtype)
    denom = (c(denom) + c(eps)).astype(dtype)
    hd = t.dtype
    # ``-lr * (1.0 - mu)`` and ``-lr * mu_next``: doubles, or with a tensor lr 0-d tensors
    # of its dtype
    t_lr, lc, lr_r = torch_lr(lr, static)
    grad_num = lr_r(-t_lr * lc(1.0 - mu))
    avg_num = lr_r(-t_lr * lc(mu_next))
    if static["differentiable"]:
        # torch's differentiable path keeps the tensors: ``1.0 - mu_product``,
        # ``mu_product * mu_next`` and the two coefficients (a Python double divided by a
        # float32 tensor, which torch computes as ``tensor.reciprocal() * number``) are
        # computed and rounded in mu_product's float32
        # each product rounded before ``1.0 - ...``, as torch's tensor ops are (not one FMA)
        mu_product = rounded_product(buffers["mu_product"], mu.astype(mp_dtype))
        mu_product_next = rounded_product(mu_product, mu_next.astype(mp_dtype))
        if static["tensor_lr"]:
            # a tensor lr: tensor / tensor, in the promoted dtype (float32 for a float32 lr)
            dt = jnp.promote_types(grad_num.dtype, mp_dtype)
            coef_grad = grad_num.astype(dt) / (1.0 - mu_product).astype(dt)
            coef_avg = avg_num.astype(dt) / (1.0 - mu_product_next).astype(dt)
        else:
            # a Python float lr: a number over a float32 tensor, in float32
            coef_grad = rdiv(-lr * (1.0 - mu), 1.0 - mu_product).astype(hd)
            coef_avg = rdiv(-lr * mu_next, 1.0 - mu_product_next).astype(hd)
    else:
        # ``_get_value(mu_product)``: the float32 value, then double arithmetic
        # (the product rounded before ``1.0 - ...``: XLA contracted the two into one FMA)
        mu_product_next = rounded_product(mu_product.astype(hd), mu_next)
        coef_grad = lr_r(grad_num / lc(1.0 - mu_product.astype(hd)))
        coef_avg = lr_r(avg_num / lc(1.0 - mu_product_next))
    new_param = (c(param) + c(coef_grad) * c(grad) / c(denom)).astype(dtype)
    new_param = (c(new_param) + c(coef_avg) * c(exp_avg) / c(denom)).astype(dtype)
    return new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "mu_product": mu_product}


NADAM_ALGORITHM = Algorithm(
    name="NAdam",
    validate=_validate,
    init_leaf=_init_leaf,
    step_leaf=_step_leaf,
    fixed_zero=coupled_weight_decay,
)


def nadam(
    lr: Any = 2e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0,
    momentum_decay: Any = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
    capturable: bool = False,
    differentiable: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""NAdam with torch's exact semantics (``torch.optim.NAdam``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included):

    .. math::

        g_t &\leftarrow \pm \nabla_\theta f_t(\theta_{t-1}) \quad (- \text{ if maximize}) \\
        \theta_{t-1} &\leftarrow \theta_{t-1}(1 - \gamma\lambda)
            \quad \text{if decoupled and } \lambda \ne 0 \\
        g_t &\leftarrow g_t + \lambda\theta_{t-1}
            \quad \text{if not decoupled and } \lambda \ne 0 \\
        \mu_t &\leftarrow \beta_1 \big(1 - \tfrac{1}{2}\, 0.96^{t\psi}\big), \qquad
        \mu_{t+1} \leftarrow \beta_1 \big(1 - \tfrac{1}{2}\, 0.96^{(t+1)\psi}\big) \\
        P_t &\leftarrow P_{t-1}\,\mu_t \quad (P_0 = 1,\ \text{the buffer mu\_product}) \\
        m_t &\leftarrow \operatorname{lerp}(m_{t-1}, g_t, 1 - \beta_1) \\
        v_t &\leftarrow \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        d_t &\leftarrow \sqrt{v_t / (1 - \beta_2^t)} + \epsilon \\
        \theta_t &\leftarrow \theta_{t-1}
            - \gamma \frac{1 - \mu_t}{1 - P_t} \frac{g_t}{d_t}
            - \gamma \frac{\mu_{t+1}}{1 - P_t \mu_{t+1}} \frac{m_t}{d_t}

    with :math:`\gamma` = ``lr``, :math:`(\beta_1, \beta_2)` = ``betas``,
    :math:`\epsilon` = ``eps``, :math:`\lambda` = ``weight_decay``, :math:`\psi` =
    ``momentum_decay`` and :math:`t` the parameter's ``step``.

    Args:
      lr: learning rate :math:`\gamma`, default 2e-3; a number, a 1-element array, or a
        schedule ``count -> value``. An array stands for torch's tensor ``lr``: the step
        coefficients and ``1 - lr * weight_decay`` are then formed in its dtype, as torch
        does (float32 for ``torch.tensor(2e-3)``; static, see the parity guide).
      betas: :math:`(\beta_1, \beta_2)`, default (0.9, 0.999).
      eps: added to the denominator, default 1e-8.
      weight_decay: :math:`\lambda`, default 0 (an L2 penalty, or decoupled decay).
        The L2 penalty built as the number 0 is compiled out and ``set_hparams``
        refuses a nonzero value; a JAX array or a schedule keeps it changeable.
      momentum_decay: :math:`\psi`, default 4e-3.
      decoupled_weight_decay: decay the parameter (AdamW style, "NAdamW") instead of
        adding :math:`\lambda\theta` to the gradient, default False (static).
      foreach: accepted for torch compatibility; no effect.
      maximize: maximize the objective instead of minimizing, default False (static).
      capturable: accepted for torch compatibility; no effect.
      differentiable: every step is differentiable with ``jax.grad`` either way. With
        True, :math:`1 - P_t` and :math:`P_t \mu_{t+1}` are rounded to ``mu_product``'s
        float32, as torch's ``differentiable=True`` path computes them, and so are the
        two step coefficients when ``lr`` is a number (torch: a Python float over a
        float32 tensor); with ``lr`` given as an array (torch: a tensor ``lr``, as
        meta-learning uses it) they are float64. A 1e-8 relative effect (static).

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a ``TorchState`` with
      hyperparameters ``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum_decay`` and
      buffers ``step`` (int32), ``exp_avg``, ``exp_avg_sq`` and ``mu_product`` (a float32
      scalar per parameter).

    Raises:
      ValueError: torch's texts: ``Tensor lr must be 1-element``, ``Invalid learning
        rate: {lr}``, ``Invalid epsilon value: {eps}``, ``Invalid beta parameter at index
        0: {betas[0]}`` (and index 1), ``Invalid weight_decay value: {weight_decay}``,
        ``Invalid momentum_decay value: {momentum_decay}``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.nadam(lr=0.1)
      >>> params = {"w": jnp.array([1.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([1.0])}, tx.init(params))
      >>> state.mu_product["w"].dtype, round(state.mu_product["w"].item(), 6)
      (dtype('float32'), 0.450073)

    Note:
      Where optax differs: ``optax.nadam`` uses a constant :math:`\beta_1` in place of
      torch's schedule :math:`\mu_t` and its running product :math:`P_t`, so the two
      differ from step 1. torch keeps ``mu_product`` as a tensor of torch's *default*
      dtype — float32 unless ``torch.set_default_dtype(torch.float64)`` — even for float64
      parameters; this function keeps it in float32 too, a 1e-10..1e-8 effect on float64
      parameters that parity with torch's defaults requires. The other scalars are
      computed in the hyperparameter dtype (float64 under x64), as torch uses doubles.

    References:
      Dozat, "Incorporating Nesterov Momentum into Adam", ICLR 2016 workshop. Mirrors
      ``torch.optim.NAdam`` (``_single_tensor_nadam``).
    """
    del foreach, capturable
    tensor_lr = tensor_lr_dtype(lr)
    lr = tensor_to_scalar("lr", lr)
    hparams = {
        "lr": lr,
        "betas": betas_to_scalars(betas),
        "eps": eps,
        "weight_decay": weight_decay,
        "momentum_decay": momentum_decay,
    }
    static = {
        "maximize": bool(maximize),
        "decoupled_weight_decay": bool(decoupled_weight_decay),
        "differentiable": bool(differentiable),
        # a tensor lr's dtype (None for a number): torch's lr products are in that dtype
        # (and its differentiable path in the dtype of lr: a tensor's, or float32)
        "tensor_lr": tensor_lr,
    }
    return make_optimizer(NADAM_ALGORITHM, hparams, static)
