"""Weight averaging (SWA, EMA) like ``torch.optim.swa_utils.AveragedModel``, as pure functions."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._base import compiled_when_eager
from functorch_optim._checks import to_python
from functorch_optim._scaler import TorchAssertionError
from functorch_optim._torch_ops import lerp_fma, rounded_product
from functorch_optim._tree import PyTree, check_params, is_none

AvgFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _check_decay(decay: float) -> None:
    if decay < 0.0 or decay > 1.0:
        raise ValueError(f"Invalid decay value {decay} provided. Please provide a value in [0,1] range.")


def _true_div(a: jax.Array, b: jax.Array) -> jax.Array:
    # XLA turns ``x / broadcast(c)`` into ``x * (1/c)``; keep torch's true division
    b = jax.lax.optimization_barrier(jnp.broadcast_to(b, jnp.shape(a)))
    return a / b


def _lerp(start: jax.Array, end: jax.Array, weight: jax.Array) -> jax.Array:
    """``torch.lerp`` in ``start``'s precision (torch's two-sided formula, each side one
    fused multiply-add as its CPU kernel computes it: ``_torch_ops.lerp_fma``)."""
    ct = jnp.promote_types(start.dtype, jnp.float32)
    return lerp_fma(start.astype(ct), end.astype(ct), jnp.asarray(weight).astype(ct)).astype(start.dtype)


def get_ema_multi_avg_fn(decay: float = 0.999) -> AvgFn:
    r"""``swa_utils.get_ema_multi_avg_fn``: :math:`W^{EMA} \leftarrow \text{lerp}(W^{EMA}, W, 1 - d)`.

    Args:
      decay: :math:`d` in [0, 1], default 0.999.

    Returns:
      ``(averaged_leaf, current_leaf, num_averaged) -> new_leaf``, applied leafwise.

    Raises:
      ValueError: ``Invalid decay value … provided. Please provide a value in [0,1] range.``
    """
    _check_decay(decay)
    weight = 1 - decay

    def ema_update(averaged, current, num_averaged):
        del num_averaged
        return _lerp(averaged, current, weight)

    return ema_update


def get_swa_multi_avg_fn() -> AvgFn:
    r"""``swa_utils.get_swa_multi_avg_fn``: :math:`\text{lerp}(\bar W, W, 1/(n + 1))`.

    The weight is ``1 / (n + 1)`` computed in torch's default dtype (float32), as torch
    does with its integer ``n_averaged`` tensor.
    """

    def swa_update(averaged, current, num_averaged):
        w = 1.0 / (jnp.asarray(num_averaged).astype(jnp.float32) + 1)
        return _lerp(averaged, current, w)

    return swa_update


def get_ema_avg_fn(decay: float = 0.999) -> AvgFn:
    r"""``swa_utils.get_ema_avg_fn``: :math:`d\,W^{EMA} + (1 - d)\,W`.

    Each product is rounded before the sum, as torch's three tensor operations round
    (XLA would contract one of them into the addition).

    Raises:
      ValueError: ``Invalid decay value … provided. Please provide a value in [0,1] range.``
    """
    _check_decay(decay)

    def ema_update(averaged, current, num_averaged):
        del num_averaged
        dt = averaged.dtype
        return (rounded_product(averaged, decay) + rounded_product(current, 1 - decay)).astype(dt)

    return ema_update


def get_swa_avg_fn() -> AvgFn:
    r"""``swa_utils.get_swa_avg_fn``: :math:`\bar W + (W - \bar W) / (n + 1)`.

    Returns:
      ``avg_fn(averaged, current, num_averaged) -> averaged``, for one leaf, as torch's
      ``AveragedModel(avg_fn=...)`` takes it.
    """

    def swa_update(averaged, current, num_averaged):
        n1 = (jnp.asarray(num_averaged) + 1).astype(averaged.dtype)
        return (averaged + _true_div(current - averaged, n1)).astype(averaged.dtype)

    return swa_update


class AveragedModelState(NamedTuple):
    """State of ``averaged_model``.

    Attributes:
      params: the averaged parameters (torch's ``AveragedModel.module`` parameters).
      n_averaged: models averaged so far (torch's ``n_averaged``), int32.
    """

    params: PyTree
    n_averaged: jax.Array


@dataclasses.dataclass(frozen=True)
class AveragedModel:
    """Pure ``init`` / ``update`` functions of ``averaged_model``, and its torch state dicts."""

    init: Callable[[PyTree], AveragedModelState]
    update: Callable[[AveragedModelState, PyTree], AveragedModelState]

    def state_dict(self, state: AveragedModelState) -> OrderedDict[str, Any]:
        """``torch.optim.swa_utils.AveragedModel.state_dict()`` of ``state``: torch tensors.

        ``n_averaged`` (torch's 0-d int64 buffer) and ``module.<name>`` for each leaf
        of ``state.params``, named as ``interop.torch.tree_to_state_dict`` names them.
        It loads into ``AveragedModel(model).load_state_dict`` (include the module's
        buffers in ``params``, or pass ``strict=False`` there) and ``torch.load`` reads
        it with ``weights_only=True``.
        """
        import torch

        from functorch_optim.interop.torch import tree_to_state_dict

        out: OrderedDict[str, Any] = OrderedDict(n_averaged=torch.tensor(int(state.n_averaged)))
        out.update((_MODULE + k, v) for k, v in tree_to_state_dict(state.params).items())
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], like: AveragedModelState | None = None
    ) -> AveragedModelState:
        """The state of a torch ``AveragedModel.state_dict()`` (or of ``state_dict()``).

        Args:
          state_dict: ``{"n_averaged": …, "module.<name>": tensor, …}``.
          like: a state whose tree, shapes and dtypes the loaded one takes (e.g.
            ``init(params)``), matched by name; default: nested dicts by name, in the
            tensors' dtypes.

        Returns:
          An ``AveragedModelState``.

        Raises:
          ValueError: no ``n_averaged`` or a negative or non-integer one; with ``like``:
            the names that are missing or unexpected, a shape that differs. Nothing is
            half loaded.
        """
        from functorch_optim.interop.torch import flatten_names, tree_from_state_dict

        if "n_averaged" not in state_dict:
            raise ValueError("AveragedModel.load_state_dict: the state dict has no 'n_averaged'")
        n = np.asarray(to_python(state_dict["n_averaged"]))
        if n.shape != () or not np.issubdtype(n.dtype, np.integer) or n < 0:
            raise ValueError(f"AveragedModel.load_state_dict: n_averaged must be an integer >= 0, got {n!r}")
        named = {k[len(_MODULE) :]: v for k, v in state_dict.items() if k.startswith(_MODULE)}
        foreign = sorted(k for k in state_dict if k != "n_averaged" and not k.startswith(_MODULE))
        if like is None:
            if foreign:
                raise ValueError(f"AveragedModel.load_state_dict: unexpected names {foreign}")
            params = tree_from_state_dict(named)
        else:
            targets = flatten_names(like.params)
            missing = sorted(k for k, v in targets.items() if v is not None and k not in named)
            unexpected = foreign + sorted(_MODULE + k for k in set(named) - set(targets))
            if missing or unexpected:
                raise ValueError(
                    f"AveragedModel.load_state_dict: missing names {[_MODULE + k for k in missing]}, "
                    f"unexpected names {unexpected}"
                )
            leaves = []
            for name, ref in targets.items():
                if ref is None:
                    leaves.append(None)
                    continue
                value = np.asarray(to_python(named[name]))
                if value.shape != ref.shape:
                    raise ValueError(
                        f"AveragedModel.load_state_dict: {_MODULE + name!r} has shape {value.shape}, "
                        f"but the state's leaf has shape {ref.shape}"
                    )
                leaves.append(jnp.asarray(value, ref.dtype))
            params = jax.tree.unflatten(jax.tree.structure(like.params, is_leaf=is_none), leaves)
        return AveragedModelState(params, jnp.asarray(int(n), jnp.int32))


_MODULE = "module."  # torch's AveragedModel holds the model as ``self.module``


def averaged_model(avg_fn: AvgFn | None = None, multi_avg_fn: AvgFn | None = None) -> AveragedModel:
    r"""Running averages of parameters, as ``torch.optim.swa_utils.AveragedModel``.

    ``init(params)`` copies the parameters with ``n_averaged = 0``; ``update(state,
    params)`` (torch's ``update_parameters(model)``) copies them on the first call and
    applies the averaging function afterwards, then increments ``n_averaged``:

    .. math:: \bar W \leftarrow \begin{cases} W & n = 0 \\
              f(\bar W, W, n) & n > 0 \end{cases}, \qquad n \leftarrow n + 1

    Without a function the average is SWA's equal weighting
    :math:`\bar W + (W - \bar W)/(n + 1)` (torch's CPU path, ``get_swa_avg_fn``). Pass
    ``multi_avg_fn=get_ema_multi_avg_fn(0.999)`` for an EMA. Both kinds of function
    here act leafwise; ``avg_fn`` and ``multi_avg_fn`` differ only in torch's rounding
    (``lerp`` for the multi versions). Buffers are whatever leaves you pass.

    Args:
      avg_fn: ``(averaged, current, n) -> new``, default None.
      multi_avg_fn: same signature, torch's in-place list form, default None.

    Returns:
      An ``AveragedModel`` with pure ``init`` and ``update``.

    Raises:
      TorchAssertionError: ``Only one of avg_fn and multi_avg_fn should be provided``
        (an ``AssertionError`` as in torch, and a ``ValueError``).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> swa = fo.averaged_model()
      >>> state = swa.init({"w": jnp.array([0.0])})
      >>> for w in [1.0, 2.0, 6.0]:
      ...     state = swa.update(state, {"w": jnp.array([w])})
      >>> state.params["w"].tolist(), int(state.n_averaged)
      ([3.0], 3)

    References:
      Izmailov et al., "Averaging Weights Leads to Wider Optima and Better
      Generalization", UAI 2018. Mirrors ``torch.optim.swa_utils.AveragedModel``.
    """
    if avg_fn is not None and multi_avg_fn is not None:
        raise TorchAssertionError("Only one of avg_fn and multi_avg_fn should be provided")
    fn = multi_avg_fn or avg_fn or get_swa_avg_fn()

    def init(params: PyTree) -> AveragedModelState:
        check_params(params)
        return AveragedModelState(jax.tree.map(jnp.array, params), jnp.zeros((), jnp.int32))

    def update(state: AveragedModelState, params: PyTree) -> AveragedModelState:
        n = state.n_averaged
        new = jax.tree.map(
            lambda a, p: jnp.where(
                n == 0, jnp.asarray(p).astype(a.dtype), fn(a, jnp.asarray(p).astype(a.dtype), n)
            ),
            state.params,
            params,
        )
        return AveragedModelState(new, n + 1)

    # called outside jit, the update runs compiled (op by op the lerp's product would be
    # rounded apart from its sum)
    return AveragedModel(init, compiled_when_eager(update))
