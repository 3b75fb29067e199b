"""SGD with momentum, dampening, Nesterov and weight decay, as ``torch.optim.SGD``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, changeable, make_optimizer
from functorch_optim._checks import check_fused_flags
from functorch_optim._fused import fused_algorithm, sgd_kernel
from functorch_optim._hyperparams import fixed, in_use, to_python
from functorch_optim._torch_ops import caster, fma, signed_grad, stored


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    lr, momentum, dampening, weight_decay = hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"]
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if momentum < 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if static["nesterov"] and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    if momentum != 0 and not static["has_momentum"]:
        raise ValueError(
            f"Invalid momentum value: {momentum} for an SGD built with momentum=0, which keeps "
            "no momentum buffer; build it with momentum > 0 to change momentum later"
        )


def _init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    return {"momentum_buffer": jnp.zeros_like(param)} if static["has_momentum"] else {}


def _prepare(hp: Mapping[str, Any], dtype: Any, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The rule's scalars for parameters of ``dtype``, computed once per step (not per leaf)."""
    c = caster(dtype)
    wd, momentum = hp["weight_decay"], hp["momentum"]
    return {
        "weight_decay": c(wd),
        # a Python bool where the compiled step fixes it (``Algorithm.fixed_zero``)
        "use_weight_decay": in_use(static, hp, "weight_decay"),
        "momentum": c(momentum),
        "one_minus_dampening": c(1 - hp["dampening"]),
        # torch skips the buffer entirely while momentum == 0 (set through set_hparams)
        "use_momentum": in_use(static, hp, "momentum"),
        "neg_lr": c(-hp["lr"]),
    }


def _step_leaf(param, grad, buffers, step, hp, static):
    # ``hp`` holds ``_prepare``'s scalars, already in the compute dtype
    dtype = param.dtype
    c = caster(dtype)

    # built with the number 0 / a nonzero number: torch's branch is decided here, and
    # no pass reads the param for the decay, nor the gradient for a momentum-free step
    decays = fixed(static, "weight_decay") != "zero"
    always_momentum = fixed(static, "momentum") == "nonzero"
    damped = _damped(static)

    def effective_grad(param, grad):
        grad = signed_grad(grad, dtype, static["maximize"])
        if not decays:
            return grad
        # torch: ``if weight_decay != 0: grad = grad.add(param, alpha=weight_decay)``
        decayed = (c(grad) + hp["weight_decay"] * c(param)).astype(dtype)
        use = hp["use_weight_decay"]  # True where a nonzero number is compiled in
        return decayed if use is True else jnp.where(use, decayed, grad)

    out = {}
    if not static["has_momentum"]:
        grad = effective_grad(param, grad)
    else:
        g = effective_grad(param, grad)
        momentum = hp["momentum"]
        buf = buffers["momentum_buffer"]
        # torch: buf.mul_(momentum).add_(grad, alpha=1 - dampening): the product stored,
        # then add(alpha=) one FMA (``fma`` stores its addend; left to XLA, the add took
        # the other product: buf * momentum contracted, the gradient's product rounded)
        decayed = (c(buf) * momentum).astype(dtype)
        if damped:
            new_buf = fma(c(g), hp["one_minus_dampening"], c(decayed)).astype(dtype)
        else:
            # dampening built as the number 0: the FMA's product ``g * 1`` is exact, so it
            # is the sum rounded once, torch's bits without an FMA to emulate (``stored``:
            # XLA would contract ``buf * momentum``, or a product computing the gradient
            # in a whole training step, into the add)
            new_buf = (stored(c(g)) + stored(c(decayed))).astype(dtype)
        # torch creates the buffer on the first step with momentum != 0, seeded with the
        # raw gradient (no dampening); ``step`` counts those steps: 1 = the buffer is new
        new_buf = jnp.where(step == 1, g, new_buf)
        use = hp["use_momentum"]
        if not always_momentum:
            new_buf = jnp.where(use, new_buf, buf)
        out["momentum_buffer"] = new_buf
        # Two passes over memory, each fused by XLA: this one writes the buffer, the next
        # reads it back together with fresh reads of param and grad. The barrier stops XLA
        # from sharing the decayed gradient between the passes (it would materialize it:
        # a param-sized temporary and a third loop) and the parameter pass reads the
        # returned buffer, not the old one (reading the old buffer forces copies of the
        # donated parameter and buffer). Same operations, same rounding.
        param, grad = jax.lax.optimization_barrier((param, grad))
        if static["nesterov"]:
            g = effective_grad(param, grad)
            direction = (c(g) + momentum * c(new_buf)).astype(dtype)
        else:
            direction = new_buf
        if always_momentum:
            grad = direction
        else:
            grad = jnp.where(use, direction, effective_grad(param, grad))
    new_param = (c(param) + hp["neg_lr"] * c(grad)).astype(dtype)
    return new_param, out


def _advances(hp: Mapping[str, Any], static: Mapping[str, Any]) -> Any:
    # with a buffer, ``step`` counts the steps taken with momentum != 0: torch's buffer
    # exists once there was one (``step > 0``), and the first one seeds it
    return in_use(static, hp, "momentum") if static["has_momentum"] else True


def _has_momentum(static: Mapping[str, Any]) -> bool:
    # only the momentum buffer's first step reads the counter
    return static["has_momentum"]


def _fixed_zero(static: Mapping[str, Any]) -> tuple[str, ...]:
    # dampening only with a buffer: without one it is read by nothing
    return (
        ("weight_decay", "momentum", "dampening") if static["has_momentum"] else ("weight_decay", "momentum")
    )


def _damped(static: Mapping[str, Any]) -> bool:
    # whether the buffer's update is an FMA (``fma``), the rule's only one (the rest are
    # plain expressions): not where dampening is built as the number 0 (torch's default),
    # whose ``add_(grad, alpha=1 - dampening)`` adds the gradient itself
    return static["has_momentum"] and fixed(static, "dampening") != "zero"


SGD_ALGORITHM = Algorithm(
    name="SGD",
    validate=_validate,
    init_leaf=_init_leaf,
    step_leaf=_step_leaf,
    torch_step=None,
    prepare=_prepare,
    advances=_advances,
    reads_step=_has_momentum,
    fused_fmas=_damped,
    # momentum: a number 0 keeps no buffer (``has_momentum``), a nonzero one skips the
    # momentum-0 branch; either way a param_groups edit across it rebuilds the facade's
    # group; dampening: a number 0 adds the gradient without the FMA (``_damped``)
    fixed_zero=_fixed_zero,
    fixed_nonzero=("momentum",),
)


def sgd(
    lr: Any = 1e-3,
    momentum: Any = 0,
    dampening: Any = 0,
    weight_decay: Any = 0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    differentiable: bool = False,
    fused: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Stochastic gradient descent with torch's exact semantics (``torch.optim.SGD``).

    For each parameter :math:`\theta` with gradient :math:`g_t` (parameters whose gradient
    is ``None`` are skipped, state included):

    .. math::

        g_t &\leftarrow -g_t \quad \text{if maximize} \\
        g_t &\leftarrow g_t + \lambda \theta_{t-1} \quad \text{if } \lambda \ne 0 \\
        b_t &\leftarrow \begin{cases} g_t & \text{first step of } \theta \text{ with } \mu \ne 0 \\
                       \mu b_{t-1} + (1 - \tau) g_t & \text{otherwise} \end{cases} \\
        g_t &\leftarrow g_t + \mu b_t \ \text{if nesterov, else}\ b_t
              \quad (\text{if } \mu \ne 0) \\
        \theta_t &\leftarrow \theta_{t-1} - \gamma g_t

    with :math:`\gamma` = ``lr``, :math:`\mu` = ``momentum``, :math:`\tau` = ``dampening``,
    :math:`\lambda` = ``weight_decay``.

    Args:
      lr: learning rate :math:`\gamma`, default 1e-3; a number, a 0-d array, or a
        schedule ``count -> value``.
      momentum: momentum factor :math:`\mu`, default 0. With 0 no momentum buffer is kept
        at all; a momentum set later through ``set_hparams`` must then stay 0. A nonzero
        number is compiled in (the parameter pass reads only the buffer), and
        ``set_hparams`` then refuses 0. A schedule or a JAX array
        (``optax.inject_hyperparams``) always keeps the buffer and any value.
      dampening: dampening :math:`\tau` for momentum, default 0.
      weight_decay: L2 penalty :math:`\lambda` added to the gradient, default 0.
        Built as the number 0, the decay is compiled out (no read of the parameter for
        it) and ``set_hparams`` refuses a nonzero value; a JAX array or a schedule keeps
        it changeable (performance guide, "A weight decay built as 0 is compiled in").
      nesterov: use Nesterov momentum, default False (static).
      maximize: maximize the objective instead of minimizing, default False (static).
      foreach: accepted for torch compatibility; no effect (XLA fuses the loop).
      differentiable: accepted for torch compatibility; every step is differentiable.
      fused: default None: the one-pass CPU kernel for the float32/float64 parameters
        where it applies, unless a dtype's have fewer than ``_fused.SMALL_STEP`` (1024)
        elements in all (so small a step runs the jitted rule, faster there); ``False``:
        always the rule; ``True``: the kernel for every such parameter, with several CPU
        devices too. Bit-identical either way; ``jax.grad``/``jax.jvp``
        differentiate the rule (performance guide, "The fused CPU kernels").

    Returns:
      An optax ``GradientTransformationExtraArgs``. Its state is a ``TorchState``; built
      with momentum > 0, its buffers are ``buffers["momentum_buffer"]`` and
      ``buffers["step"]`` (torch keeps no ``step`` for SGD; it is how the first-gradient
      rule survives ``jit``): the number of steps a parameter took with momentum != 0
      (torch creates the buffer, seeded with the raw gradient, on the first of them, so
      ``step > 0`` is torch's "the buffer exists"; a step while ``set_hparams`` holds
      momentum at 0 leaves it). Built with momentum 0 it keeps no per-parameter buffer
      at all, as torch keeps no state: only the hyperparameters and ``count``.

    Raises:
      ValueError: ``Invalid learning rate: {lr}``, ``Invalid momentum value: {momentum}``,
        ``Invalid weight_decay value: {weight_decay}``, ``Nesterov momentum requires a
        momentum and zero dampening`` (torch's texts).
      RuntimeError: torch's "`fused` does not support `differentiable`" and "`fused`
        and `foreach` cannot be `True` together." (only with ``fused=True``).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.sgd(lr=0.1, momentum=0.9, dampening=0.5)
      >>> params = {"w": jnp.array([1.0])}
      >>> state = tx.init(params)
      >>> params, state = fo.step(tx, params, {"w": jnp.array([1.0])}, state)
      >>> state.momentum_buffer["w"].tolist()  # step 1: the raw gradient, no dampening
      [1.0]
      >>> params, state = fo.step(tx, params, {"w": jnp.array([1.0])}, state)
      >>> state.momentum_buffer["w"].tolist()  # 0.9 * 1 + 0.5 * 1
      [1.4]

    Note:
      optax's ``sgd(momentum=...)`` starts its trace at zero and has no dampening; torch
      (and this function) seed the buffer with the first gradient and apply
      ``1 - dampening`` only from the second step on. The two agree only for
      ``dampening=0``.

    References:
      Sutskever et al., "On the importance of initialization and momentum in deep
      learning", ICML 2013. Mirrors ``torch.optim.SGD`` (``_single_tensor_sgd``).
    """
    check_fused_flags(fused, differentiable, foreach)
    hparams = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay}
    # a schedule or a JAX array (an injected input) can change: keep the buffer
    has_momentum = (
        changeable() or callable(momentum) or isinstance(momentum, jax.Array) or to_python(momentum) != 0
    )
    static = {"nesterov": bool(nesterov), "maximize": bool(maximize), "has_momentum": has_momentum}
    algorithm = (
        fused_algorithm(SGD_ALGORITHM, sgd_kernel, auto=fused is None)
        if fused is not False
        else SGD_ALGORITHM
    )
    return make_optimizer(algorithm, hparams, static)
