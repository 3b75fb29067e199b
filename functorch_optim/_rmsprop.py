"""RMSprop with momentum, centering and weight decay, as ``torch.optim.RMSprop``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, changeable, make_optimizer
from functorch_optim._checks import check_eps, check_lr, check_momentum, check_weight_decay
from functorch_optim._fused import fused_algorithm, rmsprop_kernel
from functorch_optim._hyperparams import fixed, to_python
from functorch_optim._torch_ops import fma, lerp_fma, op_casts, rounded_product, signed_grad


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    lr, eps, momentum = hp["lr"], hp["eps"], hp["momentum"]
    weight_decay, alpha = hp["weight_decay"], hp["alpha"]
    check_lr(lr)
    check_eps(eps)
    check_momentum(momentum)
    check_weight_decay(weight_decay)
    if not alpha >= 0.0:
        raise ValueError(f"Invalid alpha value: {alpha}")
    if momentum > 0 and not static["has_momentum"]:
        raise ValueError(
            f"Invalid momentum value: {momentum} for an RMSprop built with momentum=0, which "
            "keeps no momentum buffer; build it with momentum > 0 to change momentum later"
        )


def _init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    buffers = {"square_avg": jnp.zeros_like(param)}
    if static["has_momentum"]:
        buffers["momentum_buffer"] = jnp.zeros_like(param)
    if static["centered"]:
        buffers["grad_avg"] = jnp.zeros_like(param)
    return buffers


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    c, a, r = op_casts(dtype)
    lr, alpha, eps, wd = hp["lr"], hp["alpha"], hp["eps"], hp["weight_decay"]

    # torch's CPU kernels round addcmul, lerp and add(alpha=) once (fused multiply-adds);
    # under cancellation (centered, square_avg - grad_avg**2) a second rounding is
    # amplified by orders of magnitude, so each is an exact ``fma`` here

    # built with weight_decay=0 / a nonzero momentum, numbers: torch's branches are decided
    # here, and no pass reads the param for the decay, nor grad and square_avg again for
    # the momentum-free update
    decays = fixed(static, "weight_decay") != "zero"
    always_momentum = fixed(static, "momentum") == "nonzero"

    def effective_grad(param, grad):
        grad = signed_grad(grad, dtype, static["maximize"])
        if not decays:
            return grad
        # grad.add(param, alpha=weight_decay)
        return jnp.where(wd != 0, r(fma(c(param), a(wd), c(grad))), grad)

    def fresh(param, grad):
        # One pass over memory per written array, each fused by XLA and each reading the
        # arrays the earlier passes returned. The barrier makes every pass recompute its
        # intermediates (the decayed gradient, the denominator) from fresh reads instead
        # of XLA materializing them for all passes (parameter-sized temporaries and extra
        # loops); reading the returned buffers orders the in-place writes after every
        # read of the old values (no copies of donated buffers). Same operations, same
        # rounding.
        param, grad, new = jax.lax.optimization_barrier((param, grad, dict(out)))
        out.update(new)
        return param, effective_grad(param, grad)

    g = effective_grad(param, grad)
    # square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
    square_avg = r(c(buffers["square_avg"]) * c(alpha))
    out = {"square_avg": r(fma(c(1 - alpha) * c(g), c(g), c(square_avg)))}
    if static["centered"]:
        param, g = fresh(param, grad)
        # grad_avg.lerp_(grad, 1 - alpha)
        out["grad_avg"] = r(lerp_fma(c(buffers["grad_avg"]), c(g), c(1 - alpha)))

    def denominator():
        square_avg = out["square_avg"]
        if static["centered"]:
            # avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
            grad_avg = out["grad_avg"]
            avg = r(jnp.sqrt(fma(-c(grad_avg), c(grad_avg), c(square_avg))))
        else:
            avg = r(jnp.sqrt(c(square_avg)))
        # avg.add_(eps): eps outside the square root
        return r(c(avg) + a(eps))

    if static["has_momentum"]:
        param, g = fresh(param, grad)
        momentum = hp["momentum"]
        buf = buffers["momentum_buffer"]
        # buf.mul_(momentum).addcdiv_(grad, avg); param.add_(buf, alpha=-lr): lr after the buffer
        # (mul_ stores its product: ``rounded_product``, never contracted into the add, as
        # XLA would in some lanes of a loop and not in others)
        new_buf = r(rounded_product(c(buf), c(momentum)))
        new_buf = r(c(new_buf) + c(g) / c(denominator()))
        # torch takes the plain branch, buffer untouched, while momentum == 0
        use = momentum > 0
        out["momentum_buffer"] = new_buf if always_momentum else jnp.where(use, new_buf, buf)
    param, g = fresh(param, grad)
    if static["has_momentum"]:
        # where the momentum branch is taken, the returned buffer is the new one
        with_momentum = r(fma(c(out["momentum_buffer"]), a(-lr), c(param)))
        if always_momentum:
            return with_momentum, out
    # param.addcdiv_(grad, avg, value=-lr)
    new_param = r(c(param) + c(-lr) * c(g) / c(denominator()))
    if static["has_momentum"]:
        new_param = jnp.where(use, with_momentum, new_param)
    return new_param, out


RMSPROP_ALGORITHM = Algorithm(
    name="RMSprop",
    validate=_validate,
    init_leaf=_init_leaf,
    step_leaf=_step_leaf,
    reads_step=False,
    fixed_zero=("weight_decay",),
    fixed_nonzero=("momentum",),
)


def rmsprop(
    lr: Any = 1e-2,
    alpha: Any = 0.99,
    eps: Any = 1e-8,
    weight_decay: Any = 0,
    momentum: Any = 0,
    centered: bool = False,
    capturable: bool = False,
    foreach: bool | None = None,
    maximize: bool = False,
    differentiable: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""RMSprop with torch's exact semantics (``torch.optim.RMSprop``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included):

    .. math::

        g_t &\leftarrow -g_t \quad \text{if maximize} \\
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \quad \text{if } \lambda \ne 0 \\
        v_t &\leftarrow \alpha v_{t-1} + (1 - \alpha) g_t^2 \\
        \tilde v_t &\leftarrow \begin{cases} v_t - \bar g_t^2,\quad
            \bar g_t \leftarrow \operatorname{lerp}(\bar g_{t-1}, g_t, 1 - \alpha)
            & \text{if centered} \\ v_t & \text{otherwise} \end{cases} \\
        b_t &\leftarrow \mu b_{t-1} + g_t / (\sqrt{\tilde v_t} + \epsilon), \qquad
            \theta_t \leftarrow \theta_{t-1} - \gamma b_t \quad \text{if } \mu > 0 \\
        \theta_t &\leftarrow \theta_{t-1} - \gamma g_t / (\sqrt{\tilde v_t} + \epsilon)
            \quad \text{otherwise}

    with :math:`\gamma` = ``lr``, :math:`\alpha` = ``alpha``, :math:`\epsilon` = ``eps``,
    :math:`\lambda` = ``weight_decay``, :math:`\mu` = ``momentum``, :math:`v` =
    ``square_avg``, :math:`\bar g` = ``grad_avg``, :math:`b` = ``momentum_buffer``, all
    starting at zero.

    Args:
      lr: learning rate :math:`\gamma`, default 1e-2; a number, a 0-d (or 1-element)
        array, or a schedule ``count -> value``.
      alpha: smoothing constant :math:`\alpha`, default 0.99.
      eps: term :math:`\epsilon` added to the square root (outside it), default 1e-8.
      weight_decay: L2 penalty :math:`\lambda` added to the gradient, default 0.
        Built as the number 0, the decay is compiled out (no read of the parameter for
        it) and ``set_hparams`` refuses a nonzero value; a JAX array or a schedule keeps
        it changeable (performance guide, "A weight decay built as 0 is compiled in").
      momentum: momentum factor :math:`\mu`, default 0. With 0 no momentum buffer is kept
        at all; a momentum set later through ``set_hparams`` must then stay 0. A nonzero
        number is compiled in (the parameter pass reads no gradient), and ``set_hparams``
        then refuses 0. A schedule or a JAX array (``optax.inject_hyperparams``) always
        keeps the buffer and any value.
      centered: normalize by an estimate of the gradient's variance, default False
        (static; adds the ``grad_avg`` buffer).
      capturable: accepted for torch compatibility; no effect (every step is jittable).
      foreach: accepted for torch compatibility; no effect (XLA fuses the loop).
      maximize: maximize the objective instead of minimizing, default False (static).
      differentiable: accepted for torch compatibility; every step is differentiable.

    On the CPU the float32/float64 parameters are updated by a one-pass C++ kernel, with
    one CPU device (as by the default ``fused=None`` of ``sgd``, ``adam``, ``adamw`` and
    ``adagrad``: a dtype's parameters of fewer than 1024 elements in all take the rule),
    bit-identical to the jitted rule that runs everywhere else; torch has no fused
    RMSprop, so there is no ``fused`` argument (performance guide, "The fused CPU
    kernels").

    Returns:
      An optax ``GradientTransformationExtraArgs``. Its state is a ``TorchState`` with
      ``buffers["square_avg"]``, ``buffers["momentum_buffer"]`` (when momentum > 0),
      ``buffers["grad_avg"]`` (when centered), all in the parameter's dtype, and
      ``buffers["step"]`` (int32; torch keeps a float tensor).

    Raises:
      ValueError: ``Tensor lr must be 1-element``, ``Invalid learning rate: {lr}``,
        ``Invalid epsilon value: {eps}``, ``Invalid momentum value: {momentum}``,
        ``Invalid weight_decay value: {weight_decay}``, ``Invalid alpha value:
        {alpha}`` (torch's texts, in torch's order).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.rmsprop(lr=0.1, alpha=0.75, eps=0.0)
      >>> params = {"w": jnp.array([1.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([2.0])}, tx.init(params))
      >>> state.square_avg["w"].tolist(), params["w"].tolist()  # 0.25 * 4; 1 - 0.1 * 2 / 1
      ([1.0], [0.8])

    Note:
      ``optax.rmsprop`` defaults to ``decay=0.9`` (torch's ``alpha=0.99``) and puts
      ``eps`` inside the square root (``eps_in_sqrt=True``; torch adds it outside, as
      ``eps_in_sqrt=False`` does). With momentum optax scales by the learning rate
      *before* its trace (:math:`b_t = \mu b_{t-1} + \gamma g_t/\ldots`), torch
      *after* the buffer (:math:`\theta -= \gamma b_t`): the two agree while ``lr`` is
      constant and differ as soon as a schedule changes it. optax's centered variant
      subtracts the squared mean the same way.

    References:
      Hinton, "Neural Networks for Machine Learning", lecture 6e; Graves, "Generating
      Sequences With Recurrent Neural Networks", arXiv:1308.0850, 2013 (centered).
      Mirrors ``torch.optim.RMSprop`` (``_single_tensor_rmsprop``).
    """
    del capturable, foreach, differentiable
    return _build(lr, alpha, eps, weight_decay, momentum, centered, maximize, fused=None)


def rmsprop_variant(fused: bool | None, **kwargs: Any) -> optax.GradientTransformationExtraArgs:
    """``rmsprop(**kwargs)`` with the kernel choice that torch's ``fused`` flag makes for
    SGD, Adam, AdamW and Adagrad: ``None`` is ``rmsprop(**kwargs)`` (the kernel where it
    applies), ``True`` the kernel for every float32/float64 parameter (with several CPU
    devices too), ``False`` the jitted rule everywhere (what a GPU or TPU runs). RMSprop
    has no ``fused`` argument, in torch or here: this is for tests and the benchmark. The
    numbers are the same, bit for bit."""
    bound = inspect.signature(rmsprop).bind(**kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return _build(
        a["lr"], a["alpha"], a["eps"], a["weight_decay"], a["momentum"], a["centered"], a["maximize"], fused
    )


def _build(lr, alpha, eps, weight_decay, momentum, centered, maximize, fused):
    hparams = {
        "lr": lr,
        "alpha": alpha,
        "eps": eps,
        "weight_decay": weight_decay,
        "momentum": momentum,
    }
    # a schedule or a JAX array (an injected input) can change: keep the buffer
    has_momentum = (
        changeable() or callable(momentum) or isinstance(momentum, jax.Array) or to_python(momentum) > 0
    )
    static = {"centered": bool(centered), "maximize": bool(maximize), "has_momentum": has_momentum}
    # the one-pass CPU kernel where it applies (as the default fused=None of SGD, Adam,
    # AdamW and Adagrad), and the jitted rule elsewhere
    algorithm = RMSPROP_ALGORITHM
    if fused is not False:
        algorithm = fused_algorithm(RMSPROP_ALGORITHM, rmsprop_kernel, auto=fused is None)
    return make_optimizer(algorithm, hparams, static)
