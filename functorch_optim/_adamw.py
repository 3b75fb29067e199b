"""AdamW, as ``torch.optim.AdamW``: Adam's rule with decoupled weight decay.

torch 2.13's ``AdamW`` is ``Adam(..., decoupled_weight_decay=True)`` with a weight decay
default of 1e-2; so is this module: one rule (``_adam.py``), two names.
"""

from __future__ import annotations

from typing import Any

import optax

from functorch_optim._adam import ADAMW_ALGORITHM, build_adam


def adamw(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    weight_decay: Any = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""AdamW with torch's exact semantics (``torch.optim.AdamW``).

    Adam whose weight decay is applied to the parameter, not folded into the gradient
    (always the decoupled branch below). For each parameter :math:`\theta` with gradient
    :math:`g_t`:

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
      weight_decay: decoupled decay coefficient :math:`\lambda`, default 1e-2: each step
        multiplies the parameter by :math:`1 - \gamma\lambda` first.
      amsgrad: use the AMSGrad variant, default False (static).
      maximize: maximize the objective instead of minimizing, default False (static).
      foreach: accepted for torch compatibility; no effect.
      capturable: accepted for torch compatibility; no effect.
      differentiable: torch's differentiable path's float32 step scalars (see Note;
        static). With it the default (``fused=None``) runs that jitted rule.
      fused: default None: the one-pass CPU kernel for the float32/float64 parameters
        where it applies, unless a dtype's have fewer than ``_fused.SMALL_STEP`` (1024)
        elements in all (so small a step runs the jitted rule, faster there); ``False``:
        always the rule; ``True``: the kernel for every such parameter, with several CPU
        devices too. Bit-identical either way; ``jax.grad``/``jax.jvp``
        differentiate the rule (performance guide, "The fused CPU kernels").

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
      >>> tx = fo.adamw(lr=0.1, weight_decay=0.5)
      >>> params = {"w": jnp.array([2.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([1.0])}, tx.init(params))
      >>> round(params["w"].item(), 6)  # 2 * (1 - 0.1 * 0.5) - 0.1
      1.8

    Note:
      Where optax differs: ``optax.adamw`` multiplies the decay by the learning rate the
      same way, but its AMSGrad variant (``optax.amsgrad`` has no decoupled decay at all)
      and operation order differ as described for ``adam``; torch's AMSGrad keeps the max
      of the raw second moment. ``optax.adamw``'s default ``weight_decay`` is 1e-4; torch's
      is 1e-2. ``foreach`` and ``capturable`` have no effect; every step is
      differentiable with ``jax.grad``, and ``differentiable=True`` reproduces torch's
      differentiable path (bias corrections and step size from the float32 ``step``
      tensor, or float64 with ``lr`` given as an array), as for ``adam``.

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019. Mirrors
      ``torch.optim.AdamW`` (``Adam`` with ``decoupled_weight_decay=True``).
    """
    return build_adam(
        ADAMW_ALGORITHM,
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
        decoupled_weight_decay=True,
    )
