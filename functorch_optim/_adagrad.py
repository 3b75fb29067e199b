"""Adagrad with learning-rate decay and weight decay, as ``torch.optim.Adagrad``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import (
    check_eps,
    check_fused_flags,
    check_lr,
    check_weight_decay,
    tensor_lr_dtype,
)
from functorch_optim._fused import adagrad_kernel, fused_algorithm
from functorch_optim._hyperparams import fixed, to_python
from functorch_optim._torch_ops import decayed_lr, op_casts, signed_grad


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    lr, lr_decay, weight_decay, eps = hp["lr"], hp["lr_decay"], hp["weight_decay"], hp["eps"]
    initial_accumulator_value = static["initial_accumulator_value"]
    check_lr(lr)
    if not lr_decay >= 0.0:
        raise ValueError(f"Invalid lr_decay value: {lr_decay}")
    check_weight_decay(weight_decay)
    if not initial_accumulator_value >= 0.0:
        raise ValueError(f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
    check_eps(eps)


def _init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    # torch fills ``sum`` in the constructor, for every parameter, gradient or not
    return {"sum": jnp.full_like(param, static["initial_accumulator_value"])}


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    c, a, _ = op_casts(dtype)
    grad = signed_grad(grad, dtype, static["maximize"])
    wd = hp["weight_decay"]
    # torch: ``if weight_decay != 0: grad = grad.add(param, alpha=weight_decay)`` (decided
    # here for a weight_decay built as the number 0: then no read of the param for it)
    if fixed(static, "weight_decay") != "zero":
        grad = jnp.where(wd != 0, (c(grad) + a(wd) * c(param)).astype(dtype), grad)
    # torch reads ``step`` as a Python float: the decayed rate is a double (a tensor lr:
    # in its dtype)
    clr = decayed_lr(hp["lr"], step.astype(hp["lr"].dtype), hp["lr_decay"], static)
    # state_sum.addcmul_(grad, grad, value=1)
    new_sum = (c(buffers["sum"]) + c(grad) * c(grad)).astype(dtype)
    # std = state_sum.sqrt().add_(eps): eps outside the square root
    std = jnp.sqrt(c(new_sum)).astype(dtype)
    std = (c(std) + a(hp["eps"])).astype(dtype)
    # param.addcdiv_(grad, std, value=-clr)
    new_param = (c(param) + c(-clr) * c(grad) / c(std)).astype(dtype)
    return new_param, {"sum": new_sum}


# torch fills Adagrad's state (step 0, `sum`) for every parameter in __init__
ADAGRAD_ALGORITHM = Algorithm(
    name="Adagrad",
    validate=_validate,
    init_leaf=_init_leaf,
    step_leaf=_step_leaf,
    torch_state_at_init=True,
    fixed_zero=("weight_decay",),
    fused_fmas=False,  # addcmul_ and addcdiv_ are plain expressions (no ``fma``)
)


def adagrad(
    lr: Any = 1e-2,
    lr_decay: Any = 0,
    weight_decay: Any = 0,
    initial_accumulator_value: float = 0,
    eps: Any = 1e-10,
    foreach: bool | None = None,
    *,
    maximize: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Adagrad with torch's exact semantics (``torch.optim.Adagrad``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included), where :math:`t` counts the gradients this
    parameter has received:

    .. math::

        g_t &\leftarrow -g_t \quad \text{if maximize} \\
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \quad \text{if } \lambda \ne 0 \\
        \tilde\gamma &\leftarrow \gamma / (1 + (t - 1) \eta) \\
        s_t &\leftarrow s_{t-1} + g_t^2, \qquad s_0 = \tau \\
        \theta_t &\leftarrow \theta_{t-1} - \tilde\gamma \, \frac{g_t}{\sqrt{s_t} + \epsilon}

    with :math:`\gamma` = ``lr``, :math:`\eta` = ``lr_decay``, :math:`\lambda` =
    ``weight_decay``, :math:`\tau` = ``initial_accumulator_value``, :math:`\epsilon` =
    ``eps``.

    Args:
      lr: learning rate :math:`\gamma`, default 1e-2; a number, a 0-d (or 1-element) array,
        or a schedule ``count -> value``. An array stands for torch's tensor ``lr``: the
        decayed rate is then formed in its dtype, as torch does (float32 for
        ``torch.tensor(1e-2)``; static, see the parity guide).
      lr_decay: learning-rate decay :math:`\eta`, default 0.
      weight_decay: L2 penalty :math:`\lambda` added to the gradient, default 0.
        Built as the number 0, the decay is compiled out (no read of the parameter for
        it) and ``set_hparams`` refuses a nonzero value; a JAX array or a schedule keeps
        it changeable (performance guide, "A weight decay built as 0 is compiled in").
      initial_accumulator_value: initial value :math:`\tau` of the ``sum`` accumulator,
        default 0. Fixed at construction (static): torch reads it only when it builds
        the state, in its constructor.
      eps: term :math:`\epsilon` added to the square root for numerical stability,
        default 1e-10.
      foreach: accepted for torch compatibility; no effect (XLA fuses the loop).
      maximize: maximize the objective instead of minimizing, default False (static).
      differentiable: accepted for torch compatibility; every step is differentiable.
      fused: default None: the one-pass CPU kernel for the float32/float64 parameters
        where it applies, unless a dtype's have fewer than ``_fused.SMALL_STEP`` (1024)
        elements in all (so small a step runs the jitted rule, faster there); ``False``:
        always the rule; ``True``: the kernel for every such parameter, with several CPU
        devices too. Bit-identical either way; ``jax.grad``/``jax.jvp``
        differentiate the rule (performance guide, "The fused CPU kernels").

    Returns:
      An optax ``GradientTransformationExtraArgs``. Its state is a ``TorchState`` with
      ``buffers["sum"]`` (the squared-gradient accumulator, in the parameter's dtype, set
      to ``initial_accumulator_value`` at ``init`` for every parameter, as torch's
      constructor does) and ``buffers["step"]`` (int32; torch keeps a float tensor).

    Raises:
      ValueError: ``Tensor lr must be 1-element``, ``Invalid learning rate: {lr}``,
        ``Invalid lr_decay value: {lr_decay}``, ``Invalid weight_decay value:
        {weight_decay}``, ``Invalid initial_accumulator_value value: {value}``,
        ``Invalid epsilon value: {eps}`` (torch's texts).
      RuntimeError: torch's texts when ``fused=True`` comes with
        ``differentiable=True`` or ``foreach=True``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.adagrad(lr=0.1, eps=0.0)
      >>> params = {"w": jnp.array([1.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([2.0])}, tx.init(params))
      >>> params["w"].tolist(), state.sum["w"].tolist()  # 1 - 0.1 * 2 / sqrt(4)
      ([0.9], [4.0])

    Note:
      ``optax.adagrad`` differs from torch in three ways: it puts ``eps`` *inside* the
      square root (:math:`g/\sqrt{s + \epsilon}`), its defaults are
      ``initial_accumulator_value=0.1`` and ``eps=1e-7`` (torch: 0 and 1e-10), and it
      has neither ``lr_decay`` (torch's per-parameter :math:`\gamma / (1 + (t-1)\eta)`)
      nor ``weight_decay``. With matching values, ``eps=0`` and a nonzero accumulator
      the two agree to rounding.

    References:
      Duchi, Hazan and Singer, "Adaptive Subgradient Methods for Online Learning and
      Stochastic Optimization", JMLR 2011. Mirrors ``torch.optim.Adagrad``
      (``_single_tensor_adagrad``).
    """
    hparams = {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay, "eps": eps}
    static = {
        "maximize": bool(maximize),
        "initial_accumulator_value": to_python(initial_accumulator_value),
        # a tensor lr's dtype (None for a number): torch's clr is in it
        "tensor_lr": tensor_lr_dtype(lr),
    }
    tx = make_optimizer(ADAGRAD_ALGORITHM, hparams, static)
    # torch's constructor checks these after the values, in this order
    check_fused_flags(fused, differentiable, foreach)
    if fused is not False:
        tx = make_optimizer(
            fused_algorithm(ADAGRAD_ALGORITHM, adagrad_kernel, auto=fused is None), hparams, static
        )
    return tx
