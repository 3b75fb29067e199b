"""Muon (momentum + Newton–Schulz orthogonalization), as ``torch.optim.Muon``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import tensor_lr_dtype
from functorch_optim._torch_ops import fma, lerp_formula, lr_decay_factor, stored, torch_lr
from functorch_optim._tree import opmath_dtype

#: torch's constants (from Keller Jordan's Muon): coefficients, steps and eps.
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
EPS = 1e-7
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    lr, momentum, weight_decay = hp["lr"], hp["momentum"], hp["weight_decay"]
    if not 0.0 <= lr:  # noqa: SIM300 (torch's form: its TypeError text)
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not momentum >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    adjust_lr_fn = static["adjust_lr_fn"]
    if adjust_lr_fn is not None and adjust_lr_fn not in ["original", "match_rms_adamw"]:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    # torch raises these two at step time, from _zeropower_via_newtonschulz
    if static["ns_steps"] >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(hp["ns_coefficients"]) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def _init_leaf(param: jax.Array, static: Mapping[str, Any]) -> dict[str, jax.Array]:
    del static
    if param.ndim != 2:
        raise ValueError(
            "Muon only supports 2D parameters whereas we found a parameter with size: "
            f"torch.Size({list(param.shape)})"
        )
    return {"momentum_buffer": jnp.zeros_like(param)}


def zeropower_via_newtonschulz(
    grad: jax.Array, ns_coefficients: tuple[Any, Any, Any], ns_steps: int, eps: Any
) -> jax.Array:
    """torch's quintic Newton–Schulz orthogonalization, in bfloat16 like torch.

    Every matrix product takes bfloat16 inputs, accumulates in float32 and rounds the
    whole ``beta * C + alpha * (A @ B)`` once to bfloat16 (torch's CPU ``addmm``), which
    reproduces torch bit for bit on small matrices.

    Args:
      grad: a 2-D array.
      ns_coefficients: ``(a, b, c)``.
      ns_steps: number of iterations (static).
      eps: lower bound of the Frobenius norm the input is divided by.

    Returns:
      A bfloat16 array shaped like ``grad``.
    """
    a, b, c = (jnp.asarray(x).astype(jnp.float32) for x in ns_coefficients)
    f32, bf16 = jnp.float32, jnp.bfloat16
    hi = jax.lax.Precision.HIGHEST

    def mm(x, y):
        return jnp.matmul(x.astype(f32), y.astype(f32), precision=hi)

    # torch: grad.bfloat16(); a double goes through float first (c10::BFloat16(float))
    x = grad.astype(f32).astype(bf16)
    transposed = grad.shape[0] > grad.shape[1]
    if transposed:
        x = x.T
    norm = jnp.sqrt(jnp.sum(x.astype(f32) ** 2)).astype(bf16)
    norm = jnp.maximum(norm.astype(f32), jnp.asarray(eps).astype(f32)).astype(bf16)
    x = (x.astype(f32) / norm.astype(f32)).astype(bf16)

    def iteration(_, x):
        gram = mm(x, x.T).astype(bf16)
        gram_update = (b * gram.astype(f32) + c * mm(gram, gram)).astype(bf16)
        return (a * x.astype(f32) + mm(gram_update, x)).astype(bf16)

    # a loop rather than unrolled: compile time does not grow with ns_steps
    x = jax.lax.fori_loop(0, ns_steps, iteration, x)
    if transposed:
        x = x.T
    return x


def _adjusted_ratio(adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def _step_leaf(param, grad, buffers, step, hp, static):
    del step
    dtype = param.dtype
    ct = opmath_dtype(dtype)
    lr, momentum, wd = hp["lr"], hp["momentum"], hp["weight_decay"]
    g = grad.astype(dtype).astype(ct)
    # each lerp stored in the parameter dtype, as torch's (a bf16 buffer is rounded)
    buf = lerp_formula(buffers["momentum_buffer"].astype(ct), g, (1 - momentum).astype(ct)).astype(dtype)
    update = lerp_formula(g, buf.astype(ct), momentum.astype(ct)).astype(dtype) if static["nesterov"] else buf
    ortho = zeropower_via_newtonschulz(update, hp["ns_coefficients"], static["ns_steps"], hp["eps"])
    # torch: ``adjusted_lr = lr * ratio`` and ``1 - lr * weight_decay``, in doubles, or
    # with a tensor lr as 0-d tensor ops of its dtype (float32 for torch.tensor(0.02))
    t_lr, c, r = torch_lr(lr, static)
    adjusted_lr = r(t_lr * c(_adjusted_ratio(static["adjust_lr_fn"], param.shape)))
    decay = lr_decay_factor(lr, wd, static)
    # param.mul_(decay), stored (rounded) before param.add_(update, alpha=-adjusted_lr),
    # which torch's CPU kernel computes as one fused multiply-add
    p = stored(param.astype(ct) * decay.astype(ct)).astype(dtype).astype(ct)
    # (``alpha`` rounded to the parameter dtype first, as torch's ``add`` takes it)
    new_param = fma((-adjusted_lr).astype(dtype).astype(ct), ortho.astype(ct), p)
    return new_param.astype(dtype), {"momentum_buffer": buf}


# torch's Muon keeps only ``momentum_buffer`` per parameter, no ``step``
MUON_ALGORITHM = Algorithm(
    name="Muon", validate=_validate, init_leaf=_init_leaf, step_leaf=_step_leaf, torch_step=None
)


def muon(
    lr: Any = 1e-3,
    weight_decay: Any = 0.1,
    momentum: Any = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[Any, Any, Any] = DEFAULT_NS_COEFFICIENTS,
    eps: Any = EPS,
    ns_steps: int = DEFAULT_NS_STEPS,
    adjust_lr_fn: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Muon with torch's exact semantics (``torch.optim.Muon``), for 2-D parameters.

    For each (2-D) parameter :math:`\theta` of shape :math:`A \times B` with gradient
    :math:`g_t`:

    .. math::

        B_t &= \mathrm{lerp}(B_{t-1}, g_t, 1 - \mu) = \mu B_{t-1} + (1 - \mu) g_t \\
        \tilde B_t &= \mathrm{lerp}(g_t, B_t, \mu) \ \text{if nesterov, else}\ B_t \\
        O_t &= \mathrm{NS}^{(a,b,c)}_k(\tilde B_t; \varepsilon) \\
        \theta_t &= \theta_{t-1}(1 - \gamma\lambda) - \gamma\, r(A, B)\, O_t

    where :math:`\mathrm{NS}` normalizes :math:`X = \tilde B_t / \max(\|\tilde B_t\|_F,
    \varepsilon)` (transposed when :math:`A > B`) and iterates :math:`k` times
    :math:`X \leftarrow aX + (bXX^\top + c(XX^\top)^2)X` in bfloat16, and
    :math:`r = \sqrt{\max(1, A/B)}` (``adjust_lr_fn`` None or ``"original"``) or
    :math:`0.2\sqrt{\max(A, B)}` (``"match_rms_adamw"``).

    Args:
      lr: learning rate :math:`\gamma`, default 1e-3; a number, a 0-d array, or a schedule
        ``count -> value``. An array stands for torch's tensor ``lr``: the adjusted lr and
        ``1 - lr * weight_decay`` are then formed in its dtype, as torch does (float32 for
        ``torch.tensor(1e-3)``; static, see the parity guide).
      weight_decay: decoupled weight decay :math:`\lambda`, default 0.1.
      momentum: momentum factor :math:`\mu`, default 0.95.
      nesterov: use Nesterov momentum, default True (static).
      ns_coefficients: :math:`(a, b, c)`, default ``(3.4445, -4.7750, 2.0315)``.
      eps: :math:`\varepsilon`, default 1e-7.
      ns_steps: Newton–Schulz iterations :math:`k`, default 5 (static, < 100).
      adjust_lr_fn: ``None`` (same as ``"original"``) or ``"match_rms_adamw"`` (static).

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a ``TorchState`` with
      ``momentum_buffer`` and ``step`` (torch keeps no ``step`` for Muon).

    Raises:
      ValueError: torch's texts: ``Learning rate should be >= 0 but is: {lr}``,
        ``momentum should be >= 0 but is: {momentum}``, ``weight decay should be >= 0 but
        is: {weight_decay}``, ``Adjust learning rate function {adjust_lr_fn} is not
        supported``, ``Number of steps must be less than 100 for computational
        efficiency``, ``Coefficients must be a tuple of exactly 3 values`` (the last two
        at construction here, at the first step in torch), and from ``init``: ``Muon
        only supports 2D parameters whereas we found a parameter with size:
        torch.Size([...])``.

    Examples:
      >>> import jax, jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.muon(lr=0.02, weight_decay=0.0)
      >>> params = {"w": jnp.zeros((2, 2))}
      >>> step = jax.jit(fo.step, static_argnums=0)
      >>> params, state = step(tx, params, {"w": jnp.eye(2)}, tx.init(params))
      >>> float(params["w"][0, 0]) == -0.02 * 1.125  # -lr * NS(I): NS(I) = 1.125 I in bfloat16
      True
      >>> float(params["w"][0, 1])
      0.0
      >>> fo.muon().init({"b": jnp.zeros(3)})
      Traceback (most recent call last):
      ...
      ValueError: Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([3])

    Note:
      The iteration runs in bfloat16 exactly as torch's (so the update carries bfloat16
      resolution even for float64 parameters). It matches torch bit for bit on small
      matrices; on large ones a different float32 summation order inside a matrix
      product can flip one bfloat16 rounding, after which the two differ at bfloat16
      resolution. optax's ``contrib.muon`` uses other defaults (its own coefficient
      schedule, float32 iteration, no decoupled weight decay by ``lr``).

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024;
      Liu et al., "Muon is Scalable for LLM Training", 2025. Mirrors
      ``torch.optim.Muon`` (``_single_tensor_muon``).
    """
    static = {
        "nesterov": bool(nesterov),
        "ns_steps": int(ns_steps),
        "adjust_lr_fn": adjust_lr_fn,
        # a tensor lr's dtype (None for a number): torch's lr products are in that dtype
        "tensor_lr": tensor_lr_dtype(lr),
    }
    hparams = {
        "lr": lr,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "ns_coefficients": tuple(ns_coefficients),
        "eps": eps,
    }
    return make_optimizer(MUON_ALGORITHM, hparams, static)
