"""Adafactor with factored second moments, as ``torch.optim.Adafactor``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import tensor_lr_dtype
from functorch_optim._torch_ops import (
    lerp_formula,
    lr_decay_factor,
    py_max,
    py_min,
    signed_grad,
    stored,
    torch_lr,
    true_divide,
)
from functorch_optim._tree import opmath_dtype


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    del static
    lr, beta2_decay, (eps1, eps2) = hp["lr"], hp["beta2_decay"], hp["eps"]
    d, weight_decay = hp["d"], hp["weight_decay"]
    if not 0.0 <= lr:  # noqa: SIM300 (torch's form: its TypeError text)
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not beta2_decay <= 0.0:
        raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
    # eps1 = None (torch's default) is stored as NaN: "the machine epsilon of the dtype"
    if eps1 is not None and not math.isnan(eps1) and not eps1 >= 0.0:
        raise ValueError(f"epsilon1 should be >= 0 but is: {eps1}")
    if not eps2 >= 0.0:
        raise ValueError(f"epsilon2 should be >= 0 but is: {eps2}")
    if not d >= 1.0:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")


def _init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    del static
    if param.ndim > 1:
        row_shape = (*param.shape[:-1], 1)
        col_shape = (*param.shape[:-2], 1, param.shape[-1])
        return {"row_var": jnp.zeros(row_shape, param.dtype), "col_var": jnp.zeros(col_shape, param.dtype)}
    return {"variance": jnp.zeros_like(param)}


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    ct = opmath_dtype(dtype)
    hdt = jnp.result_type(hp["lr"])
    p = param.astype(ct)
    g = signed_grad(grad, dtype, static["maximize"]).astype(ct)
    lr, beta2_decay, d, wd = hp["lr"], hp["beta2_decay"], hp["d"], hp["weight_decay"]
    eps1_hp, eps2 = hp["eps"]
    # torch: ``if eps1 is None: eps1 = torch.finfo(param.dtype).eps``
    eps1 = jnp.where(jnp.isnan(eps1_hp), jnp.asarray(jnp.finfo(dtype).eps, hdt), eps1_hp)

    # torch does these scalars in Python floats (step_t.item(), param.norm().item())
    step_f = step.astype(hdt)
    one_minus_beta2_t = step_f**beta2_decay
    rho_t = py_min(lr, 1 / step_f**0.5)
    rms = jnp.sqrt(jnp.sum(p * p)).astype(hdt) / math.sqrt(param.size)
    # Python's max: a NaN (or NaN-producing) norm gives eps2, as in torch
    alpha = py_max(eps2, rms) * rho_t

    # torch: ``if weight_decay != 0: param.mul_(1 - lr * weight_decay)``
    p = jnp.where(wd != 0, p * lr_decay_factor(lr, wd, static).astype(ct), p)

    w = one_minus_beta2_t.astype(ct)
    out = {"row_var": None, "col_var": None, "variance": None}
    if param.ndim > 1:
        # torch: torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        # (``true_divide``: XLA would multiply by the reciprocal, where torch divides)
        row_mean = jnp.sqrt(jnp.sum(g * g, axis=-1, keepdims=True))
        row_mean = true_divide(row_mean * row_mean, g.shape[-1])
        row_var = lerp_formula(buffers["row_var"].astype(ct), row_mean, w)
        col_mean = jnp.sqrt(jnp.sum(g * g, axis=-2, keepdims=True))
        col_mean = true_divide(col_mean * col_mean, g.shape[-2])
        col_var = lerp_formula(buffers["col_var"].astype(ct), col_mean, w)
        var_estimate = row_var * col_var  # torch: row_var @ col_var, an outer product
        # torch's ``mean`` divides the sum by n; ``div_`` by the broadcast row divides
        row_mean_all = true_divide(jnp.sum(row_var, axis=-2, keepdims=True), row_var.shape[-2])
        var_estimate = true_divide(var_estimate, jnp.maximum(row_mean_all, eps1.astype(ct)))
        out["row_var"], out["col_var"] = row_var.astype(dtype), col_var.astype(dtype)
    else:
        variance = lerp_formula(buffers["variance"].astype(ct), g * g, w)
        var_estimate = variance
        out["variance"] = variance.astype(dtype)

    # torch: var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad); torch's CPU rsqrt
    # is 1 / sqrt(x), two roundings, where XLA's rsqrt of float32 is an approximation
    # (32% of its values differ): the square root stored, then divided
    update = 1 / stored(jnp.sqrt(jnp.maximum(var_estimate, (eps1 * eps1).astype(ct)))) * g
    update_rms = jnp.sqrt(jnp.sum(update * update)).astype(hdt)
    # Python's max: a NaN update norm gives 1 (only the NaN elements of the update
    # reach the parameter), where jnp.maximum would turn the whole tensor NaN
    denom = py_max(jnp.ones((), hdt), update_rms / (math.sqrt(param.size) * d))
    coef = -alpha / denom
    if static["tensor_lr"]:
        # a tensor lr: ``min(lr, 1 / sqrt(t))`` is the tensor unless ``1 / sqrt(t) < lr``
        # (compared in its dtype); then ``alpha`` and ``-alpha / denom`` are 0-d tensors
        # of its dtype
        t_lr, lc, lr_r = torch_lr(lr, static)
        tensor_alpha = lr_r(lc(py_max(eps2, rms)) * t_lr)
        tensor_coef = lr_r(-tensor_alpha / lc(denom)).astype(hdt)
        coef = jnp.where(lc(1 / step_f**0.5) < t_lr, coef, tensor_coef)
    new_param = p + coef.astype(ct) * update
    return new_param.astype(dtype), out


ADAFACTOR_ALGORITHM = Algorithm(
    name="Adafactor", validate=_validate, init_leaf=_init_leaf, step_leaf=_step_leaf
)


def adafactor(
    lr: Any = 1e-2,
    beta2_decay: Any = -0.8,
    eps: tuple[Any, Any] = (None, 1e-3),
    d: Any = 1.0,
    weight_decay: Any = 0.0,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Adafactor with torch's exact semantics (``torch.optim.Adafactor``).

    For each parameter :math:`\theta` with gradient :math:`G_t` (``-G_t`` if maximize),
    at its step :math:`t`:

    .. math::

        \hat\beta_{2_t} &= 1 - t^{\tau}, \quad \rho_t = \min(\gamma, 1/\sqrt t), \quad
            \alpha_t = \max(\epsilon_2, \mathrm{RMS}(\theta_{t-1}))\,\rho_t \\
        \theta &\leftarrow \theta_{t-1}(1 - \gamma\lambda) \\
        R_t &= \mathrm{lerp}(R_{t-1}, \mathrm{mean}_{-1}(G_t^2), 1 - \hat\beta_{2_t}),\
        C_t = \mathrm{lerp}(C_{t-1}, \mathrm{mean}_{-2}(G_t^2), 1 - \hat\beta_{2_t}) \\
        \hat V_t &= \frac{R_t C_t}{\max(\mathrm{mean}_{-2}(R_t), \epsilon_1)}
            \quad (\dim \theta > 1), \qquad
            \hat V_t = \mathrm{lerp}(\hat V_{t-1}, G_t^2, 1 - \hat\beta_{2_t}) \quad
            (\dim \theta \le 1) \\
        U_t &= G_t / \sqrt{\max(\hat V_t, \epsilon_1^2)}, \quad
        \theta_t = \theta - \frac{\alpha_t}{\max(1, \mathrm{RMS}(U_t)/d)} U_t

    with :math:`\gamma` = ``lr``, :math:`\tau` = ``beta2_decay``, :math:`\lambda` =
    ``weight_decay``; a tensor with more than one dimension is factored along its last
    two dimensions.

    Args:
      lr: learning rate :math:`\gamma`, default 1e-2: the cap of the relative step size
        and the weight-decay factor. A number, a 0-d array, or a schedule
        ``count -> value``. An array stands for torch's tensor ``lr``: ``alpha`` and
        ``1 - lr * weight_decay`` are then formed in its dtype, as torch does (float32 for
        ``torch.tensor(1e-2)``; static, see the parity guide).
      beta2_decay: :math:`\tau`, the decay exponent of :math:`\beta_2`, default -0.8.
      eps: ``(epsilon1, epsilon2)``, default ``(None, 1e-3)``. ``epsilon1 = None`` means
        the machine epsilon of each parameter's dtype; it is stored in the state as NaN
        (``set_hparams(eps=(float("nan"), 1e-3))`` restores it).
      d: clipping threshold :math:`d`, default 1.0.
      weight_decay: decoupled weight decay :math:`\lambda`, default 0.0.
      foreach: accepted for torch compatibility; no effect (XLA fuses the loop).
      maximize: maximize the objective instead of minimizing, default False (static).

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a ``TorchState`` with
      ``step`` and, per parameter, ``row_var`` and ``col_var`` (more than one dimension;
      shapes ``(..., m, 1)`` and ``(..., 1, n)``) or ``variance`` (at most one dimension);
      the buffers a parameter does not have are ``None``.

    Raises:
      ValueError: torch's texts: ``Learning rate should be >= 0 but is: {lr}``,
        ``beta2_decay should be <= 0 but is: {beta2_decay}``, ``epsilon1 should be >= 0
        but is: {eps[0]}``, ``epsilon2 should be >= 0 but is: {eps[1]}``, ``Clipping
        threshold d should be >= 1 but is: {d}``, ``weight_decay should be >= 0 but is:
        {weight_decay}``.

    Examples:
      >>> import jax, jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.adafactor(lr=0.01)
      >>> params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> step = jax.jit(fo.step, static_argnums=0)
      >>> params, state = step(tx, params, {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}, state)
      >>> params["w"][0, 0].item()  # RMS(theta) * min(lr, 1) = 0.01 on step 1
      0.99
      >>> state.row_var["w"].shape, state.col_var["w"].shape, state.variance["w"]
      ((2, 1), (1, 3), None)

    Note:
      Like torch (and unlike the paper and ``optax.adafactor``), ``lr`` caps
      :math:`\rho_t` and scales decoupled weight decay, :math:`\epsilon_1` is applied to
      the variance estimate instead of to the squared gradient, the factors keep means
      instead of sums, and there is no first moment. torch takes the machine epsilon of
      the *first* parameter with a gradient for the whole group when ``eps[0]`` is None;
      here each parameter uses its own dtype's (the same for a single-dtype tree).

    References:
      Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
      ICML 2018. Mirrors ``torch.optim.Adafactor`` (``_single_tensor_adafactor``).
    """
    del foreach
    eps1, eps2 = eps
    hparams = {
        "lr": lr,
        "beta2_decay": beta2_decay,
        "eps": (float("nan") if eps1 is None else eps1, eps2),
        "d": d,
        "weight_decay": weight_decay,
    }
    # a tensor lr's dtype (None for a number): torch's lr products are formed in it
    static = {"maximize": bool(maximize), "tensor_lr": tensor_lr_dtype(lr)}
    return make_optimizer(ADAFACTOR_ALGORITHM, hparams, static)
