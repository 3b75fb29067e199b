"""Dynamic loss scaling with ``torch.amp.GradScaler``'s semantics, state in the pytree."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import STEP_ATTR
from functorch_optim._checks import check_saved_constants, check_state_dict_keys, to_python
from functorch_optim._nonfinite import step_if, update_branches
from functorch_optim._tree import PyTree, is_none


class TorchAssertionError(ValueError, AssertionError):
    """A bad argument torch rejects with ``AssertionError``; also a ``ValueError``."""


class GradScalerState(NamedTuple):
    """State of a ``GradScaler``, torch's names.

    Attributes:
      scale: the current scale, float32 (torch's ``_scale``).
      growth_tracker: consecutive steps without inf/NaN, int32 (``_growth_tracker``).
      found_inf: whether the last unscale found inf/NaN, float32 0/1 (torch's per-step
        ``found_inf``).
    """

    scale: jax.Array
    growth_tracker: jax.Array
    found_inf: jax.Array


def _f64() -> Any:
    return jnp.result_type(float)


@dataclasses.dataclass(frozen=True)
class GradScaler:
    """``torch.amp.GradScaler`` as pure functions over a ``GradScalerState``.

    The torch loop ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``
    becomes::

        scaler = fo.GradScaler()
        tx = scaler.wrap(fo.sgd(lr=0.1))          # unscale, skip on inf, update
        state = tx.init(params)
        loss, grads = jax.value_and_grad(lambda p: scaler.scale(state.scaler, loss_fn(p)))(params)
        params, state = fo.step(tx, params, grads, state)

    or by hand with ``unscale`` / ``update``.

    Attributes:
      init_scale: initial scale, default ``2.0**16``.
      growth_factor: factor applied after ``growth_interval`` finite steps, > 1, default 2.
      backoff_factor: factor applied on a step with inf/NaN, < 1, default 0.5.
      growth_interval: consecutive finite steps before growing, default 2000.
      enabled: if False, scale is 1 and nothing is skipped.

    Raises:
      TorchAssertionError: torch's ``The growth factor must be > 1.0.`` / ``The backoff
        factor must be < 1.0.`` (an ``AssertionError`` as in torch, and a ``ValueError``).

    Note:
      optax has no loss scaler; this one keeps torch's float32 scale, its float32
      ``1 / scale`` (from a double reciprocal) and its growth/backoff rule, so scaled
      float16/bfloat16 training skips the same steps as torch.

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018. Mirrors
      ``torch.amp.GradScaler`` (``_amp_foreach_non_finite_check_and_unscale_``,
      ``_amp_update_scale_``).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.enabled:
            if self.growth_factor <= 1.0:
                raise TorchAssertionError("The growth factor must be > 1.0.")
            if self.backoff_factor >= 1.0:
                raise TorchAssertionError("The backoff factor must be < 1.0.")

    def init(self) -> GradScalerState:
        """The initial state: ``init_scale`` (float32), tracker 0."""
        scale = self.init_scale if self.enabled else 1.0
        return GradScalerState(
            jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
        )

    def scale(self, state: GradScalerState, outputs: PyTree) -> PyTree:
        """``outputs * scale`` leafwise (torch's ``scaler.scale``); identity when disabled."""
        if not self.enabled:
            return outputs
        return jax.tree.map(lambda x: x * state.scale, outputs)

    def unscale(self, state: GradScalerState, grads: PyTree) -> tuple[PyTree, GradScalerState]:
        """Divide gradients by the scale and look for inf/NaN (torch's ``unscale_``).

        ``inv_scale`` is ``float32(1 / float64(scale))`` and each gradient is multiplied
        by it in its own precision, as torch's ``_amp_foreach_non_finite_check_and_unscale_``.

        Returns:
          ``(unscaled_grads, state)`` with ``state.found_inf`` set (1.0 if any entry is
          not finite).

        Raises:
          ValueError: ``Attempting to unscale FP16 gradients.`` (torch's text) for a
            float16 gradient.
        """
        if not self.enabled:
            return grads, state
        leaves = [g for g in jax.tree.leaves(grads, is_leaf=is_none) if g is not None]
        if any(jnp.asarray(g).dtype == jnp.float16 for g in leaves):
            raise ValueError("Attempting to unscale FP16 gradients.")
        inv = (1.0 / state.scale.astype(_f64())).astype(jnp.float32)
        found = jnp.zeros((), bool)
        for g in leaves:
            found = found | ~jnp.all(jnp.isfinite(g))

        def unscale(g):
            if g is None:
                return None
            ct = jnp.promote_types(g.dtype, jnp.float32)
            return (g.astype(ct) * inv.astype(ct)).astype(g.dtype)

        out = jax.tree.map(unscale, grads, is_leaf=is_none)
        return out, state._replace(found_inf=found.astype(jnp.float32))

    def update(self, state: GradScalerState, new_scale: Any = None) -> GradScalerState:
        """Back off on inf/NaN, grow after ``growth_interval`` clean steps (torch's ``update``).

        torch's ``_amp_update_scale_``: with ``found_inf`` the scale is multiplied by
        ``backoff_factor`` and the tracker reset; otherwise the tracker grows and, on
        reaching ``growth_interval``, the scale is multiplied by ``growth_factor`` (kept
        only if finite) and the tracker reset. Products are taken in double and stored
        in float32. ``new_scale`` sets the scale directly.
        """
        if not self.enabled:
            return state
        if new_scale is not None:
            return state._replace(scale=jnp.asarray(new_scale, jnp.float32))
        scale64 = state.scale.astype(_f64())
        backed = (scale64 * self.backoff_factor).astype(jnp.float32)
        successful = state.growth_tracker + 1
        grown = (scale64 * self.growth_factor).astype(jnp.float32)
        at_interval = successful == self.growth_interval
        clean_scale = jnp.where(at_interval & jnp.isfinite(grown), grown, state.scale)
        clean_tracker = jnp.where(at_interval, 0, successful)
        found = state.found_inf != 0
        return GradScalerState(
            jnp.where(found, backed, clean_scale),
            jnp.where(found, 0, clean_tracker).astype(jnp.int32),
            state.found_inf,
        )

    def state_dict(self, state: GradScalerState) -> dict[str, Any]:
        """``torch.amp.GradScaler.state_dict()`` of ``state``: Python numbers, torch's keys.

        ``{"scale": float, "growth_factor": float, "backoff_factor": float,
        "growth_interval": int, "_growth_tracker": int}``, or ``{}`` when disabled, as
        torch. It loads into ``torch.amp.GradScaler(...).load_state_dict`` and
        ``torch.load`` reads it with ``weights_only=True``. Take it after ``update``
        (after a step of ``wrap(tx)``), as torch says.

        Examples:
          >>> import functorch_optim as fo
          >>> scaler = fo.GradScaler(init_scale=8.0)
          >>> sd = scaler.state_dict(scaler.init())
          >>> sd["scale"], sd["growth_interval"], sd["_growth_tracker"]
          (8.0, 2000, 0)
          >>> scaler.load_state_dict(sd).scale.item()
          8.0
        """
        if not self.enabled:
            return {}
        return {
            "scale": float(state.scale),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(state.growth_tracker),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> GradScalerState:
        """The state of a saved ``state_dict()``: this class's or a ``torch.amp.GradScaler``'s.

        Put it back where the state lives: ``state._replace(scaler=scaler.load_state_dict(sd))``
        for ``wrap(tx)``'s state. Disabled: the initial state (torch's no-op).

        Raises:
          RuntimeError: ``The source state dict is empty, possibly because it was saved
            from a disabled instance of GradScaler.`` (torch's text).
          ValueError: missing or unexpected keys; a saved ``growth_factor``,
            ``backoff_factor`` or ``growth_interval`` that differs from this scaler's
            (torch would adopt it; build the scaler with the saved values).
        """
        if not self.enabled:
            return self.init()
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        check_state_dict_keys("GradScaler", state_dict, self.state_dict(self.init()))
        constants = {k: getattr(self, k) for k in ("growth_factor", "backoff_factor", "growth_interval")}
        check_saved_constants("GradScaler", state_dict, constants)
        tracker = to_python(state_dict["_growth_tracker"])
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
            raise ValueError(
                f"GradScaler.load_state_dict: _growth_tracker must be an integer >= 0, got {tracker!r}"
            )
        return GradScalerState(
            jnp.asarray(float(state_dict["scale"]), jnp.float32),
            jnp.asarray(tracker, jnp.int32),
            jnp.zeros((), jnp.float32),
        )

    def wrap(self, tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
        """``tx`` fed with *scaled* gradients: unscale, step unless inf/NaN, update the scale.

        One call is torch's ``scaler.step(optimizer); scaler.update()``. On a step with
        inf/NaN the parameters and the inner state (buffers, counters, schedule) do not
        move. With accumulation use ``grad_accumulate(scaler.wrap(tx), k)``: the scaled
        gradients of a window are summed, then unscaled, checked and stepped once, and the
        scale moves once per window (torch's ``backward()`` k times, then ``step`` and
        ``update``).

        Returns:
          An optax ``GradientTransformationExtraArgs`` with a ``LossScaleState``.

        Examples:
          >>> import jax.numpy as jnp, functorch_optim as fo
          >>> scaler = fo.GradScaler(init_scale=4.0, growth_interval=1)
          >>> tx = scaler.wrap(fo.sgd(lr=1.0))
          >>> params = {"w": jnp.array([1.0])}
          >>> state = tx.init(params)
          >>> params, state = fo.step(tx, params, {"w": jnp.array([jnp.inf])}, state)
          >>> params["w"].tolist(), float(state.scaler.scale)
          ([1.0], 2.0)
          >>> params, state = fo.step(tx, params, {"w": jnp.array([2.0])}, state)  # scaled by 2
          >>> params["w"].tolist(), float(state.scaler.scale)
          ([0.0], 4.0)
        """

        def init(params):
            return LossScaleState(self.init(), tx.init(params))

        def update(grads, state, params=None, **extra_args):
            grads, sc = self.unscale(state.scaler, grads)
            do, skip = update_branches(tx, grads, params, extra_args)
            updates, inner = jax.lax.cond(sc.found_inf == 0, do, skip, state.inner_state)
            return updates, LossScaleState(self.update(sc), inner)

        def step_fn(params, grads, state, **extra_args):
            grads, sc = self.unscale(state.scaler, grads)
            params, inner = step_if(sc.found_inf == 0, tx, params, grads, state.inner_state, extra_args)
            return params, LossScaleState(self.update(sc), inner)

        setattr(update, STEP_ATTR, step_fn)
        return optax.GradientTransformationExtraArgs(init, update)


class LossScaleState(NamedTuple):
    """State of ``GradScaler.wrap(tx)``: the scaler's state and the inner state."""

    scaler: GradScalerState
    inner_state: PyTree
