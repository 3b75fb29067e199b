"""Adam (and the rule AdamW reuses), as ``torch.optim.Adam``.

The checks it shares with the Adam family live in ``_checks.py``, the emulation of
torch's per-op kernels in ``_torch_ops.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import (
    betas_to_scalars,
    check_fused_flags,
    is_tensor,
    tensor_lr_dtype,
    tensor_to_scalar,
    validate_lr_eps_betas_wd,
)
from functorch_optim._fused import adam_kernel, fused_algorithm
from functorch_optim._hyperparams import fixed, in_use
from functorch_optim._torch_ops import (
    caster,
    coupled_weight_decay,
    fma,
    lerp_fma,
    lr_decay_factor,
    lr_over,
    rdiv,
    rounded_product,
    signed_grad,
    step_as_float,
    torch_lr,
    true_divide,
)

# ------------------------------------------------------------------------------ Adam rule


def _init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    buffers = {"exp_avg": jnp.zeros_like(param), "exp_avg_sq": jnp.zeros_like(param)}
    if static["amsgrad"]:
        buffers["max_exp_avg_sq"] = jnp.zeros_like(param)
    return buffers


def _prepare(hp: Mapping[str, Any], dtype: Any, static: Mapping[str, Any]) -> dict[str, Any]:
    """The rule's scalars for parameters of ``dtype``, computed once per step (not per leaf).

    The same operations as torch's per-op emulation in ``_torch_ops`` (``lerp``,
    ``decay_square``, ``apply_weight_decay``), on the scalar operands only; the raw
    ``lr`` and betas stay for the bias corrections, which depend on each leaf's step.
    """
    c = caster(dtype)
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    weight = c(1 - beta1)  # exp_avg.lerp_(grad, 1 - beta1)
    out = {
        "lr": lr,
        "betas": (beta1, beta2),
        # a Python bool where the compiled step fixes it (``Algorithm.fixed_zero``)
        "use_weight_decay": in_use(static, hp, "weight_decay"),
        "lerp_weight": weight,
        "lerp_small_weight": jnp.abs(weight) < 0.5,
        "lerp_one_minus_weight": 1 - weight,
        "beta2": c(beta2),
        "one_minus_beta2": c(1 - beta2),
        "eps": c(eps),
    }
    if static["decoupled_weight_decay"]:
        # param.mul_(1 - lr * weight_decay), a multiply by exactly 1 without decay (as
        # apply_weight_decay: stored, one rounding before the update is added)
        # (with a tensor lr, ``1 - lr * weight_decay`` is a 0-d tensor of its dtype)
        out["param_decay"] = c(jnp.where(wd != 0, lr_decay_factor(lr, wd, static), 1))
    else:
        out["weight_decay"] = c(wd)  # grad.add(param, alpha=weight_decay)
    return out


def _step_leaf(param, grad, buffers, step, hp, static):
    # ``hp`` holds ``_prepare``'s scalars; each line is the op of the ``_torch_ops``
    # helper named beside it, with its scalar operands taken from ``hp``
    dtype = param.dtype
    c = caster(dtype)
    grad = signed_grad(grad, dtype, static["maximize"])
    if static["decoupled_weight_decay"]:  # apply_weight_decay(..., decoupled=True)
        param = rounded_product(c(param), hp["param_decay"]).astype(dtype)
    elif fixed(static, "weight_decay") != "zero":  # apply_weight_decay(..., decoupled=False)
        # (built with weight_decay=0, a number: torch's branch is decided here, and no
        # moment pass reads the param)
        coupled = (c(grad) + hp["weight_decay"] * c(param)).astype(dtype)
        use = hp["use_weight_decay"]  # True where a nonzero number is compiled in
        grad = coupled if use is True else jnp.where(use, coupled, grad)
    # lerp(exp_avg, grad, 1 - beta1) and decay_square(exp_avg_sq, grad, beta2): torch's
    # lerp_ and addcmul_ are FMAs on the CPU, each an exact ``fma`` here (whatever XLA
    # would contract in the fusions around them)
    exp_avg = lerp_fma(c(buffers["exp_avg"]), c(grad), hp["lerp_weight"]).astype(dtype)
    decayed_sq = (c(buffers["exp_avg_sq"]) * hp["beta2"]).astype(dtype)
    exp_avg_sq = fma(hp["one_minus_beta2"] * c(grad), c(grad), c(decayed_sq)).astype(dtype)
    out = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    lr, (beta1, beta2) = hp["lr"], hp["betas"]
    if static["differentiable"]:
        return _differentiable_step(param, dtype, exp_avg, exp_avg_sq, buffers, step, hp, static, out)
    # torch: scalars from ``step`` as a Python float, i.e. in double
    t = step_as_float(step, hp)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    step_size = lr_over(lr, bias_correction1, static)  # a tensor lr: in its dtype
    bias_correction2_sqrt = jnp.sqrt(bias_correction2)
    second = exp_avg_sq
    if static["amsgrad"]:
        # the max of the RAW second moment; bias correction comes after (optax: corrected)
        second = jnp.maximum(buffers["max_exp_avg_sq"], exp_avg_sq)
        out["max_exp_avg_sq"] = second
    # denom = (v.sqrt() / bias_correction2_sqrt).add_(eps), one rounding per op
    denom = jnp.sqrt(c(second)).astype(dtype)
    denom = true_divide(c(denom), c(bias_correction2_sqrt)).astype(dtype)
    denom = (c(denom) + hp["eps"]).astype(dtype)
    # param.addcdiv_(exp_avg, denom, value=-step_size): (value * t1) / t2 on CPU
    new_param = (c(param) + c(-step_size) * c(exp_avg) / c(denom)).astype(dtype)
    return new_param, out


def _differentiable_step(param, dtype, exp_avg, exp_avg_sq, buffers, step, hp, static, out):
    """torch's ``differentiable=True`` branch: the bias corrections and step size are
    tensors computed from the ``step`` tensor, in torch's default dtype (float32), and
    the update is ``param.addcdiv_(exp_avg, v.sqrt() / (sqrt(bc2) * -step_size) + eps /
    -step_size)``; a tensor ``lr`` (given as an array, float64) makes the step size and
    what follows float64 (torch's promotion)."""
    c = caster(dtype)
    f32 = jnp.float32  # torch's default dtype, which holds ``step``
    (beta1, beta2), t = hp["betas"], step.astype(f32)
    # ``beta ** step``: a Python double to the power of a float32 tensor, in float32
    bias_correction1 = 1 - beta1.astype(f32) ** t
    bias_correction2 = 1 - beta2.astype(f32) ** t
    if static["tensor_lr"]:
        # a tensor lr: tensor / tensor, in the promoted dtype (float32 for a float32 lr)
        t_lr = torch_lr(hp["lr"], static)[0]
        dt = jnp.promote_types(t_lr.dtype, f32)
        step_size_neg = -(t_lr.astype(dt) / bias_correction1.astype(dt))
    else:
        # a Python float lr over a float32 tensor: float32
        step_size_neg = -rdiv(hp["lr"], bias_correction1)
    bias_correction2_sqrt = jnp.sqrt(bias_correction2)
    second = exp_avg_sq
    if static["amsgrad"]:
        second = jnp.maximum(buffers["max_exp_avg_sq"], exp_avg_sq)
        out["max_exp_avg_sq"] = second
    denom = jnp.sqrt(c(second)).astype(dtype)
    denom = true_divide(c(denom), c(bias_correction2_sqrt.astype(step_size_neg.dtype) * step_size_neg))
    denom = denom.astype(dtype)
    denom = (c(denom) + c(rdiv(hp["eps"], step_size_neg))).astype(dtype)
    return (c(param) + c(exp_avg) / c(denom)).astype(dtype), out


ADAM_ALGORITHM = Algorithm(
    name="Adam",
    validate=validate_lr_eps_betas_wd,
    init_leaf=_init_leaf,
    step_leaf=_step_leaf,
    prepare=_prepare,
    fixed_zero=coupled_weight_decay,
)
ADAMW_ALGORITHM = Algorithm(
    name="AdamW",
    validate=validate_lr_eps_betas_wd,
    init_leaf=_init_leaf,
    step_leaf=_step_leaf,
    prepare=_prepare,
)


def build_adam(
    algorithm: Algorithm,
    *,
    lr: Any,
    betas: Any,
    eps: Any,
    weight_decay: Any,
    amsgrad: bool,
    maximize: bool,
    foreach: bool | None,
    capturable: bool,
    differentiable: bool,
    fused: bool | None,
    decoupled_weight_decay: bool,
) -> optax.GradientTransformationExtraArgs:
    """The Adam rule with torch ``Adam.__init__``'s checks, in torch's order."""
    tensor_lr = tensor_lr_dtype(lr)
    if tensor_lr:
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        lr = tensor_to_scalar("lr", lr)
    if callable(betas) or not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2) of numbers or 0-d arrays, got {betas!r}")
    hparams = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
    static = {
        "amsgrad": bool(amsgrad),
        "maximize": bool(maximize),
        "decoupled_weight_decay": bool(decoupled_weight_decay),
        # torch's differentiable branch computes the step's scalars as tensors, in float32
        # (the step's dtype) or, with a tensor lr, in the promoted dtype
        "differentiable": bool(differentiable),
        # a tensor lr's dtype (None for a number): torch's lr products are in that dtype
        "tensor_lr": tensor_lr,
    }
    # value checks first (make_optimizer runs them), then the type checks, as torch orders them
    for i, b in enumerate(betas):
        if is_tensor(b) and np.size(b) != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
    hparams["betas"] = betas_to_scalars(betas)
    tx = make_optimizer(algorithm, hparams, static)
    # a schedule counts as a float: torch's schedulers (OneCycleLR's beta1) write floats
    floats = [isinstance(b, float) or callable(b) for b in betas]
    if not (all(floats) or (is_tensor(betas[0]) and is_tensor(betas[1]))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if is_tensor(b) and not capturable and foreach:
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
    check_fused_flags(fused, differentiable, foreach)
    # the default takes the kernel, except for torch's differentiable path (its own scalars)
    if fused or (fused is None and not differentiable):
        tx = make_optimizer(fused_algorithm(algorithm, adam_kernel, auto=fused is None), hparams, static)
    return tx


def adam(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 0,
    amsgrad: bool = False,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
    decoupled_weight_decay: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Adam with torch's exact semantics (``torch.optim.Adam``).

    For each parameter :math:`\theta` with gradient :math:`g_t`:

    .. math::

        g_t &\leftarrow \pm \nabla_\theta f_t(\theta_{t-1}) \quad (- \text{ if maximize}) \\
        \theta_{t-1} &\leftarrow \theta_{t-1}(1 - \gamma\lambda)
            \quad \text{if decoupled and } \lambda \ne 0 \\
        g_t &\leftarrow g_t + \lambda\theta_{t-1}
            \quad \text{if not decoupled and } \lambda \ne 0 \\
        m_t &\leftarrow \operatorname{lerp}(m_{t-1}, g_t, 1 - \beta_1) \\
        v_t &\leftarrow \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        v^{max}_t &\leftarrow \max(v^{max}_{t-1}, v_t) \quad \text{if amsgrad
            (raw } v_t\text{, not bias-corrected)} \\
        \hat v_t &\leftarrow v^{max}_t \text{ if amsgrad else } v_t \\
        \theta_t &\leftarrow \theta_{t-1} - \frac{\gamma}{1 - \beta_1^t} \cdot
            \frac{m_t}{\sqrt{\hat v_t} / \sqrt{1 - \beta_2^t} + \epsilon}

    with :math:`\gamma` = ``lr``, :math:`(\beta_1, \beta_2)` = ``betas``,
    :math:`\epsilon` = ``eps``, :math:`\lambda` = ``weight_decay`` and :math:`t` the
    number of gradients the parameter has received (its ``step``). Parameters whose
    gradient is ``None`` are skipped, state included.

    Args:
      lr: learning rate :math:`\gamma`, default 1e-3; a number, a 1-element array, or a
        schedule ``count -> value``. An array stands for torch's tensor ``lr``: ``lr /
        bias_correction1`` and ``1 - lr * weight_decay`` are then formed in its dtype, as
        torch does (float32 for ``torch.tensor(1e-3)``; static, see the parity guide).
      betas: :math:`(\beta_1, \beta_2)`, default (0.9, 0.999): both Python floats or both
        1-element arrays (torch's rule).
      eps: added to the denominator, default 1e-8.
      weight_decay: :math:`\lambda`, default 0: an L2 penalty added to the gradient, or
        decoupled (AdamW) decay with ``decoupled_weight_decay=True``. The L2 penalty
        built as the number 0 is compiled out (no read of the parameter for it) and
        ``set_hparams`` refuses a nonzero value; a JAX array or a schedule keeps it
        changeable (performance guide, "A weight decay built as 0 is compiled in").
      amsgrad: use the AMSGrad variant, default False (static).
      foreach: accepted for torch compatibility; no effect.
      maximize: maximize the objective instead of minimizing, default False (static).
      capturable: accepted for torch compatibility; no effect.
      differentiable: torch's differentiable path's float32 step scalars (see Note;
        static). With it the default (``fused=None``) runs that jitted rule.
      fused: default None: the one-pass CPU kernel for the float32/float64 parameters
        where it applies, unless a dtype's have fewer than ``_fused.SMALL_STEP`` (1024)
        elements in all (so small a step runs the jitted rule, faster there); ``False``:
        always the rule; ``True``: the kernel for every such parameter, with several CPU
        devices too. Bit-identical either way; ``jax.grad``/``jax.jvp``
        differentiate the rule (performance guide, "The fused CPU kernels").
      decoupled_weight_decay: apply weight decay to the parameter, not the gradient (the
        AdamW rule), default False (static).

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a ``TorchState`` with
      hyperparameters ``lr``, ``betas``, ``eps``, ``weight_decay`` and buffers ``step``
      (int32), ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq``.

    Raises:
      ValueError: torch's texts: ``Invalid learning rate: {lr}``, ``Invalid epsilon
        value: {eps}``, ``Invalid beta parameter at index 0: {betas[0]}`` (and index 1),
        ``Invalid weight_decay value: {weight_decay}``, ``Tensor lr must be 1-element``,
        ``betas must be either both floats or both Tensors``, ``lr as a Tensor is not
        supported for capturable=False and foreach=True``.
      RuntimeError: torch's "`fused` does not support `differentiable`" and "`fused`
        and `foreach` cannot be `True` together." (only with ``fused=True``).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.adam(lr=0.1)
      >>> params = {"w": jnp.array([1.0, -1.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([0.5, -2.0])}, tx.init(params))
      >>> [round(x, 6) for x in params["w"].tolist()]  # step 1 moves by lr * sign(g)
      [0.9, -0.9]
      >>> sorted(state.buffers)
      ['exp_avg', 'exp_avg_sq', 'step']

    Note:
      Where optax differs: ``optax.amsgrad`` takes the maximum of the *bias-corrected*
      second moment; torch (and this function) keep ``max(max_exp_avg_sq, exp_avg_sq)`` of
      the *raw* moment and divide by :math:`\sqrt{1 - \beta_2^t}` afterwards — identical
      at step 1, different from step 2 on. Even where optax's formula agrees, its operation
      order differs (``sqrt(v / bc2)`` vs torch's ``sqrt(v) / sqrt(bc2)``), a 1e-16..1e-13
      effect; this function copies torch's order. Bias corrections are computed in the
      hyperparameter dtype (float64 under x64), as torch computes them in Python doubles.

      ``foreach`` and ``capturable`` have no effect (XLA fuses the loop). Every step is
      differentiable with ``jax.grad``; ``differentiable=True`` reproduces torch's
      differentiable path, which computes the bias corrections and step size from its
      float ``step`` tensor in torch's default dtype (float32; a 1e-7..2e-6 relative
      effect in float64), or with ``lr`` given as an array (torch: a tensor ``lr``) in
      float64. torch's checks on these flags are kept (e.g. a 0-d array ``lr`` with
      ``foreach=True``).

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015; Reddi et al.,
      "On the Convergence of Adam and Beyond", ICLR 2018. Mirrors ``torch.optim.Adam``
      (``_single_tensor_adam``).
    """
    return build_adam(
        ADAM_ALGORITHM,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=foreach,
        capturable=capturable,
        differentiable=differentiable,
        fused=fused,
        decoupled_weight_decay=decoupled_weight_decay,
    )
