"""Averaged stochastic gradient descent, as ``torch.optim.ASGD``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import check_lr, check_weight_decay, tensor_lr_dtype
from functorch_optim._hyperparams import fixed
from functorch_optim._torch_ops import fma, op_casts, rounded_product, signed_grad, torch_lr

#: torch keeps ``eta`` and ``mu`` as 0-d tensors of its *default* dtype
#: (``_get_scalar_dtype()``), float32 unless ``torch.set_default_dtype`` changed it,
#: whatever the parameter's dtype.
SCALAR_DTYPE = jnp.float32


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    check_lr(hp["lr"])
    check_weight_decay(hp["weight_decay"])


def _init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    # ``eta`` gets its value, lr, on the parameter's first gradient (torch's lazy state)
    return {
        "eta": jnp.zeros((), SCALAR_DTYPE),
        "mu": jnp.ones((), SCALAR_DTYPE),
        "ax": jnp.zeros_like(param),
    }


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    c, a, r = op_casts(dtype)
    grad = signed_grad(grad, dtype, static["maximize"])
    lr, lambd, alpha, t0, wd = hp["lr"], hp["lambd"], hp["alpha"], hp["t0"], hp["weight_decay"]
    hdt = lr.dtype
    eta = jnp.where(step == 1, lr.astype(SCALAR_DTYPE), buffers["eta"])
    mu = buffers["mu"]
    # torch reads eta as a Python number (``eta.item()``): no gradient flows through it
    eta_value = jax.lax.stop_gradient(eta).astype(hdt)
    if fixed(static, "weight_decay") != "zero":  # built with the number 0: no param read
        grad = jnp.where(wd != 0, r(c(grad) + a(wd) * c(param)), grad)
    # param.mul_(1 - lambd * eta_value) stored; param.add_(grad, alpha=-eta_value) one FMA
    # (left to XLA, the decayed parameter's product was the one contracted)
    # (``1 - lambd * eta_value``: Python arithmetic, the product rounded before the add)
    new_param = r(c(param) * c(1 - rounded_product(lambd, eta_value)))
    new_param = r(fma(c(grad), a(-eta_value), c(new_param)))
    # ax.add_(param.sub(ax).mul_(mu)) when mu != 1, else ax.copy_(param): the product stored
    ax = buffers["ax"]
    averaged = r(c(ax) + c(r(rounded_product(c(r(c(new_param) - c(ax))), c(mu)))))
    new_ax = jnp.where(mu != 1, averaged, new_param)
    # torch computes both from ``step`` as a Python float, then stores them as float32
    step_f = step.astype(hdt)
    if static["tensor_lr"]:
        # a tensor lr: ``lr / ((1 + lambd * lr * step) ** alpha)`` as 0-d tensor ops of its
        # dtype; torch's ``pow`` by a Python number is C's double ``pow``, then rounded
        t_lr, lc, lr_r = torch_lr(lr, static)
        base = lr_r(rounded_product(lr_r(rounded_product(t_lr, lc(lambd))), lc(step_f)))
        base = lr_r(1 + base)
        powered = lr_r(lc(base.astype(hdt) ** alpha))
        new_eta = lr_r(t_lr / powered).astype(SCALAR_DTYPE)
    else:
        new_eta = (lr / ((1 + rounded_product(lambd * lr, step_f)) ** alpha)).astype(SCALAR_DTYPE)
    new_mu = (1 / jnp.maximum(jnp.ones((), hdt), step_f - t0)).astype(SCALAR_DTYPE)
    return new_param, {"eta": new_eta, "mu": new_mu, "ax": new_ax}


ASGD_ALGORITHM = Algorithm(
    name="ASGD", validate=_validate, init_leaf=_init_leaf, step_leaf=_step_leaf, fixed_zero=("weight_decay",)
)


def asgd(
    lr: Any = 1e-2,
    lambd: Any = 1e-4,
    alpha: Any = 0.75,
    t0: Any = 1e6,
    weight_decay: Any = 0,
    foreach: bool | None = None,
    maximize: bool = False,
    differentiable: bool = False,
    capturable: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Averaged SGD with torch's exact semantics (``torch.optim.ASGD``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included), where :math:`t` counts the gradients this
    parameter has received:

    .. math::

        g_t &\leftarrow -g_t \quad \text{if maximize} \\
        g_t &\leftarrow g_t + \kappa \theta_{t-1} \quad \text{if } \kappa \ne 0 \\
        \theta_t &\leftarrow \theta_{t-1} (1 - \lambda \eta_{t-1}) - \eta_{t-1} g_t \\
        \bar\theta_t &\leftarrow \begin{cases} \bar\theta_{t-1}
            + \mu_{t-1} (\theta_t - \bar\theta_{t-1}) & \mu_{t-1} \ne 1 \\
            \theta_t & \mu_{t-1} = 1 \end{cases} \\
        \eta_t &\leftarrow \gamma / (1 + \lambda \gamma t)^{\alpha}, \qquad
        \mu_t \leftarrow 1 / \max(1, t - t_0)

    with :math:`\eta_0 = \gamma` = ``lr``, :math:`\mu_0 = 1`, :math:`\lambda` =
    ``lambd``, :math:`\alpha` = ``alpha``, :math:`t_0` = ``t0``, :math:`\kappa` =
    ``weight_decay``; :math:`\bar\theta` = ``ax`` is the averaged parameter (read it
    from the state; the parameters themselves follow plain decayed SGD).

    Args:
      lr: learning rate :math:`\gamma`, default 1e-2; a number, a 0-d (or 1-element)
        array, or a schedule ``count -> value``. A parameter's first step uses the
        ``lr`` of that moment; later steps use the stored ``eta``, recomputed from
        ``lr`` at the end of each step. An array stands for torch's tensor ``lr``: the
        new ``eta`` is then formed in its dtype, as torch does (float32 for
        ``torch.tensor(1e-2)``; static, see the parity guide).
      lambd: decay term :math:`\lambda`, default 1e-4.
      alpha: power :math:`\alpha` for the ``eta`` update, default 0.75.
      t0: the step at which averaging starts, default 1e6.
      weight_decay: L2 penalty :math:`\kappa` added to the gradient, default 0.
        Built as the number 0, the decay is compiled out (no read of the parameter for
        it) and ``set_hparams`` refuses a nonzero value; a JAX array or a schedule keeps
        it changeable (performance guide, "A weight decay built as 0 is compiled in").
      foreach: accepted for torch compatibility; no effect (XLA fuses the loop).
      maximize: maximize the objective instead of minimizing, default False (static).
      differentiable: accepted for torch compatibility; every step is differentiable.
      capturable: accepted for torch compatibility; no effect (every step is jittable).
        The arithmetic is that of torch's default ``capturable=False`` path.

    Returns:
      An optax ``GradientTransformationExtraArgs``. Its state is a ``TorchState`` with
      ``buffers["eta"]`` and ``buffers["mu"]`` (0-d float32 per parameter, as torch's
      default dtype keeps them), ``buffers["ax"]`` (in the parameter's dtype) and
      ``buffers["step"]`` (int32; torch keeps a float tensor).

    Raises:
      ValueError: ``Tensor lr must be 1-element``, ``Invalid learning rate: {lr}``,
        ``Invalid weight_decay value: {weight_decay}`` (torch's texts; torch checks
        nothing else).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.asgd(lr=0.5, lambd=0.0, t0=0.0)
      >>> params = {"w": jnp.array([1.0])}
      >>> state = tx.init(params)
      >>> for g in (1.0, -1.0, 1.0):
      ...     params, state = fo.step(tx, params, {"w": jnp.array([g])}, state)
      >>> params["w"].tolist(), state.ax["w"].tolist()  # ax copies w while mu == 1
      ([0.5], [0.75])
      >>> state.eta["w"].dtype, round(float(state.mu["w"]), 6)  # mu = 1 / max(1, 3 - 0)
      (dtype('float32'), 0.333333)

    Note:
      torch stores ``eta`` and ``mu`` as float32 tensors (its default dtype) even for
      float64 parameters, so the learning rate a float64 parameter sees is rounded to
      float32 — a 1e-10..1e-9 relative effect reproduced here. If you run torch with
      ``torch.set_default_dtype(torch.float64)`` the two differ by that much. torch
      reads ``eta`` with ``.item()``, so no gradient flows from ``lr`` into the
      parameters; likewise here, ``jax.grad`` with respect to ``lr`` is zero (the
      derivative with respect to the initial parameters is exact). optax has no ASGD;
      the closest construction (SGD plus an averaging of the iterates) does not apply
      torch's ``(1 - lambd * eta)`` decay or its ``eta``/``mu`` schedules.

    References:
      Polyak and Juditsky, "Acceleration of Stochastic Approximation by Averaging",
      SIAM J. Control Optim. 1992. Mirrors ``torch.optim.ASGD`` (``_single_tensor_asgd``).
    """
    del foreach, differentiable, capturable
    hparams = {"lr": lr, "lambd": lambd, "alpha": alpha, "t0": t0, "weight_decay": weight_decay}
    # a tensor lr's dtype (None for a number): torch's new eta is formed in it
    static = {"maximize": bool(maximize), "tensor_lr": tensor_lr_dtype(lr)}
    return make_optimizer(ASGD_ALGORITHM, hparams, static)
