"""torch's common constructor checks, with torch's exact texts, shared by every factory.

Each check is written as torch writes it (``if not 0.0 <= lr``), so a NaN is rejected
where torch rejects it; a check whose torch form differs (SGD's ``if lr < 0.0``,
SparseAdam's strict ``lr > 0``) stays in its own module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_lr(lr: Any) -> None:
    """Raises ``ValueError: Invalid learning rate: {lr}`` unless ``lr >= 0``; written as
    torch writes it, so a string raises torch's ``TypeError`` (``'<=' not supported
    between instances of 'float' and 'str'``)."""
    if not 0.0 <= lr:  # noqa: SIM300 (torch's form: its TypeError text)
        raise ValueError(f"Invalid learning rate: {lr}")


def check_eps(eps: Any) -> None:
    """Raises ``ValueError: Invalid epsilon value: {eps}`` unless ``eps >= 0``."""
    if not 0.0 <= eps:  # noqa: SIM300 (torch's form: its TypeError text)
        raise ValueError(f"Invalid epsilon value: {eps}")


def check_momentum(momentum: Any) -> None:
    """Raises ``ValueError: Invalid momentum value: {momentum}`` unless ``momentum >= 0``."""
    if not 0.0 <= momentum:  # noqa: SIM300 (torch's form: its TypeError text)
        raise ValueError(f"Invalid momentum value: {momentum}")


def check_weight_decay(weight_decay: Any) -> None:
    """Raises ``ValueError: Invalid weight_decay value: {wd}`` unless ``weight_decay >= 0``."""
    if not 0.0 <= weight_decay:  # noqa: SIM300 (torch's form: its TypeError text)
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_betas(betas: Any) -> None:
    """Raises ``ValueError: Invalid beta parameter at index {i}: {beta}`` unless each
    beta is in ``[0, 1)``."""
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")


def validate_lr_eps_betas_wd(hp: Mapping[str, Any], static: Mapping[str, Any] | None = None) -> None:
    """torch's checks, in torch's order, shared by Adam, AdamW, Adamax, NAdam and RAdam
    (an ``Algorithm.validate``: ``static`` is unused)."""
    check_lr(hp["lr"])
    check_eps(hp["eps"])
    check_betas(hp["betas"])
    check_weight_decay(hp["weight_decay"])


# ------------------------------------------------------------------ array hyperparameters


def is_tensor(x: Any) -> bool:
    """Whether a hyperparameter is given as an array (torch's "Tensor" hyperparameters)."""
    return isinstance(x, jax.Array | np.ndarray)


def tensor_lr_dtype(lr: Any) -> str | None:
    """The static record of a tensor ``lr``: the name of the dtype torch computes its
    products in, or None for a number or a schedule.

    torch keeps a tensor ``lr`` as a tensor: ``lr * ratio``, ``1 - lr * weight_decay``
    and ``lr / bias_correction1`` are 0-d tensor ops of its dtype (float32 for
    ``torch.tensor(0.001)``), where a Python-float ``lr`` computes them in doubles. An
    array ``lr`` here stands for torch's tensor: its floating dtype (the canonical one,
    float32 where x64 is off), or torch's default float32 for an integer or boolean one
    (torch's promotion of an integer tensor times a float).
    """
    if not is_tensor(lr):
        return None
    dtype = jnp.dtype(lr.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.dtype(jnp.float32)
    return jnp.dtype(jax.dtypes.canonicalize_dtype(dtype)).name


def tensor_to_scalar(name: str, x: Any) -> Any:
    """torch's ``_to_scalar``: a 1-element array becomes 0-d; any other size is rejected.

    Raises:
      ValueError: ``Tensor {name} must be 1-element`` (torch's text).
    """
    if is_tensor(x):
        if np.size(x) != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return jnp.reshape(x, ())
    return x


def betas_to_scalars(betas: Any) -> tuple[Any, Any]:
    """``betas`` as a pair of scalars (1-element arrays squeezed, as torch does)."""
    if callable(betas) or not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2) of numbers or 0-d arrays, got {betas!r}")
    return (tensor_to_scalar("betas[0]", betas[0]), tensor_to_scalar("betas[1]", betas[1]))


def squeeze_lr(lr: Any) -> Any:
    """``lr`` as torch accepts it: a number, a schedule, or a 1-element array (squeezed).

    torch's constructors start with ``if isinstance(lr, Tensor) and lr.numel() != 1``
    and later squeeze a 1-element tensor to 0-d (``_to_scalar``); this does both for any
    array-like (JAX, NumPy or torch).

    Raises:
      ValueError: ``Tensor lr must be 1-element`` (torch's text) for an array whose size
        is not 1.
    """
    shape = getattr(lr, "shape", None)
    if shape is None or callable(lr):
        return lr
    if math.prod(shape) != 1:
        raise ValueError("Tensor lr must be 1-element")
    return lr.reshape(()) if len(shape) else lr


def check_fused_flags(fused: Any, differentiable: Any, foreach: Any) -> None:
    """torch's constructor checks on ``fused=True`` (SGD, Adam, AdamW, Adagrad).

    Raises:
      RuntimeError: "`fused` does not support `differentiable`", "`fused` and `foreach`
        cannot be `True` together." (torch's texts, in torch's order).
    """
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


# ------------------------------------------------------------------ state dicts in torch's layout


def to_python(x: Any) -> Any:
    """A state value (array, tensor, number, container) as torch keeps it: Python objects."""
    if isinstance(x, dict) and type(x) is dict:
        return {k: to_python(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(to_python(v) for v in x)
    if hasattr(x, "detach"):  # a torch tensor (a tensor lr)
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray | jax.Array | np.generic):
        x = np.asarray(x)
        return x.tolist()
    return x


def check_state_dict_keys(
    owner: str, state_dict: Any, expected: Mapping[str, Any], optional: Any = ()
) -> None:
    """``state_dict`` has exactly ``expected``'s keys (``optional`` ones may be absent).

    Raises:
      TypeError: not a mapping.
      ValueError: ``{owner}.load_state_dict: not a {owner} state dict in torch's layout
        (missing [...]; unexpected [...])``.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{owner}.load_state_dict expects a dict, got {type(state_dict).__name__}")
    missing = sorted(set(expected) - set(state_dict) - set(optional))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        parts = [f"missing {missing}"] if missing else []
        parts += [f"unexpected {extra}"] if extra else []
        raise ValueError(
            f"{owner}.load_state_dict: not a {owner} state dict in torch's layout ({'; '.join(parts)})"
        )


def check_saved_constants(owner: str, state_dict: Mapping[str, Any], constants: Mapping[str, Any]) -> None:
    """The saved hyperparameters equal this object's (torch would silently adopt them).

    Raises:
      ValueError: ``{owner}.load_state_dict: the saved {key} is {saved}, but this {owner}
        was built with {mine}; build it with the saved arguments``.
    """
    for key, mine in constants.items():
        saved = to_python(state_dict[key])
        if saved != mine:
            raise ValueError(
                f"{owner}.load_state_dict: the saved {key} is {saved!r}, but this {owner} was "
                f"built with {mine!r}; build it with the saved arguments"
            )
