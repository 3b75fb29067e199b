"""SparseAdam, as ``torch.optim.SparseAdam``, for dense JAX gradients."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim._checks import betas_to_scalars, check_betas, tensor_lr_dtype
from functorch_optim._torch_ops import signed_grad, stored, torch_lr, zero_buffers
from functorch_optim._tree import opmath_dtype


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    del static
    lr, (beta1, beta2), eps = hp["lr"], hp["betas"], hp["eps"]
    if not 0.0 < lr:  # noqa: SIM300 (torch's form: its TypeError text)
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps > 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    check_betas((beta1, beta2))


def _step_leaf(param, grad, buffers, step, hp, static):
    dtype = param.dtype
    ct = opmath_dtype(dtype)
    hdt = jnp.result_type(hp["lr"])
    lr, (beta1, beta2), eps = hp["lr"], hp["betas"], hp["eps"]

    def gradient(grad):
        g = signed_grad(grad, dtype, static["maximize"]).astype(ct)
        # The entries a sparse COO gradient (``grad.to_sparse()``) would carry.
        return g, g != 0

    g, mask = gradient(grad)
    old_m = buffers["exp_avg"].astype(ct)
    old_v = buffers["exp_avg_sq"].astype(ct)
    # torch: (grad_values - old) * (1 - beta), then old + that (on the mask only)
    # each op rounded, as torch's (``stored``: no product contracted into an FMA)
    upd_m = stored((g - old_m) * (1 - beta1).astype(ct))
    upd_v = stored((stored(g * g) - old_v) * (1 - beta2).astype(ct))
    new_m = old_m + upd_m
    new_v = old_v + upd_v
    out = {
        "exp_avg": jnp.where(mask, new_m, old_m).astype(dtype),
        "exp_avg_sq": jnp.where(mask, new_v, old_v).astype(dtype),
    }
    if dtype == ct:
        # One pass over memory per written array: the moments, then the parameter from
        # the returned moments (equal to the new ones wherever the parameter moves). The
        # barrier makes the parameter pass recompute the mask from a fresh read of grad,
        # so XLA neither materializes the new moments twice nor copies the donated old
        # ones. Same operations, same rounding. (bf16/fp16 moments are rounded when
        # stored; the parameter needs them unrounded: the plain form below.)
        grad, out = jax.lax.optimization_barrier((grad, out))
        g, mask = gradient(grad)
        new_m, new_v = out["exp_avg"], out["exp_avg_sq"]
    denom = jnp.sqrt(new_v) + eps.astype(ct)
    step_f = step.astype(hdt)
    bias_correction1 = 1 - beta1**step_f
    bias_correction2 = 1 - beta2**step_f
    # torch: ``lr * math.sqrt(bias_correction2) / bias_correction1`` in doubles, or with
    # a tensor lr as 0-d tensor ops of its dtype (float32 for torch.tensor(0.01))
    t_lr, c, r = torch_lr(lr, static)
    step_size = r(c(r(t_lr * c(jnp.sqrt(bias_correction2)))) / c(bias_correction1))
    delta = stored((-step_size).astype(ct) * (new_m / denom))
    new_param = jnp.where(mask, param.astype(ct) + delta, param.astype(ct))
    return new_param.astype(dtype), out


# torch's SparseAdam keeps ``step`` as a Python int
SPARSE_ADAM_ALGORITHM = Algorithm(
    name="SparseAdam",
    validate=_validate,
    init_leaf=zero_buffers("exp_avg", "exp_avg_sq"),
    step_leaf=_step_leaf,
    torch_step="int",
)


def sparse_adam(
    lr: Any = 1e-3,
    betas: tuple[Any, Any] = (0.9, 0.999),
    eps: Any = 1e-8,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Adam restricted to the nonzero gradient entries (``torch.optim.SparseAdam``).

    JAX gradients are dense, so the sparse gradient torch would receive is defined as the
    gradient's **nonzero entries**: exactly the entries ``grad.to_sparse()`` carries.
    Only those entries of the moments and of the parameter change; the others keep their
    values bit for bit. For each such entry, at the parameter's step :math:`t`:

    .. math::

        g &\leftarrow -g \quad \text{if maximize} \\
        m &\leftarrow m + (1 - \beta_1)(g - m), \qquad
        v \leftarrow v + (1 - \beta_2)(g^2 - v) \\
        \theta &\leftarrow \theta - \gamma \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}
            \cdot \frac{m}{\sqrt{v} + \epsilon}

    ``step`` counts every gradient a parameter receives, an all-zero one included (torch
    increments it for an empty sparse gradient too, then skips the update).

    Args:
      lr: learning rate :math:`\gamma`, default 1e-3; a number, a 0-d array, or a schedule
        ``count -> value``. An array stands for torch's tensor ``lr``: the step size are
        then formed in its dtype, as torch does (float32 for ``torch.tensor(1e-3)``;
        static, see the parity guide).
      betas: :math:`(\beta_1, \beta_2)`, default ``(0.9, 0.999)``.
      eps: :math:`\epsilon` added to the denominator, default 1e-8.
      maximize: maximize the objective instead of minimizing, default False (static).

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a ``TorchState`` with
      buffers ``step``, ``exp_avg`` and ``exp_avg_sq``.

    Raises:
      ValueError: torch's texts: ``Invalid learning rate: {lr}`` (lr must be > 0),
        ``Invalid epsilon value: {eps}``, ``Invalid beta parameter at index 0: {b}``,
        ``Invalid beta parameter at index 1: {b}``.

    Examples:
      >>> import jax, jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.sparse_adam(lr=0.1)
      >>> params = {"emb": jnp.ones(3)}
      >>> step = jax.jit(fo.step, static_argnums=0)
      >>> params, state = step(tx, params, {"emb": jnp.array([0.0, 2.0, 0.0])}, tx.init(params))
      >>> [round(x, 6) for x in params["emb"].tolist()]  # only the nonzero-gradient entry moves
      [1.0, 0.9, 1.0]
      >>> [round(x, 12) for x in state.exp_avg["emb"].tolist()]
      [0.0, 0.2, 0.0]

    Note:
      A gradient entry that is *exactly* zero is treated as absent. torch's
      ``nn.Embedding(sparse=True)`` carries whole rows, so an exact zero inside a touched
      row would update there (with a zero gradient) and not here; the difference only
      arises for exact zeros. optax has no SparseAdam; ``optax.adam`` updates every entry.

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015. Mirrors
      ``torch.optim.SparseAdam`` (``torch.optim._functional.sparse_adam``).
    """
    hparams = {"lr": lr, "betas": betas_to_scalars(betas), "eps": eps}
    # a tensor lr's dtype (None for a number): torch's step size is in that dtype
    static = {"maximize": bool(maximize), "tensor_lr": tensor_lr_dtype(lr)}
    return make_optimizer(SPARSE_ADAM_ALGORITHM, hparams, static)
