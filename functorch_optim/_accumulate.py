"""Gradient accumulation equal to one large batch: torch's "step every k" idiom."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from functorch_optim._base import STEP_ATTR, WINDOW_ATTR
from functorch_optim._base import step as _step
from functorch_optim._fused import Window, kernel_or_rule
from functorch_optim._sharding import sharded_init
from functorch_optim._tree import PyTree, check_like_params, check_params, grad_mask_leaves, is_none


class GradAccumulateState(NamedTuple):
    """State of ``grad_accumulate``.

    Attributes:
      mini_step: micro-steps accumulated in the current window (int32, ``0..every-1``).
      gradient_step: optimizer steps taken by the inner transformation (int32).
      acc_grads: the running sum of the window's gradients, one array per parameter, in
        at least float32 (bfloat16 and float16 gradients are summed in float32). After
        a step it holds what the step was given, the window's sum (``"sum"``) or mean
        (``"mean"``: the mean is written over the sum in the same pass that adds the
        last gradient in, so it takes no memory of its own); the next call starts the
        new window by overwriting it (no separate pass clears it). With ``every=1`` it
        is not used (the gradient goes straight to the step).
      has_grad: whether any gradient arrived in the window, one boolean per parameter
        stacked in one array of shape ``(number of parameters,)``, in the order of
        ``jax.tree.leaves(params)``; a parameter without one is skipped like torch's
        ``p.grad is None``. Like ``acc_grads``, it describes the closed window right
        after a step. (One array rather than a scalar per parameter: a micro-step then
        costs one operation for the flags, not one per parameter.)
      inner_state: the wrapped transformation's state; it moves only on steps.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    acc_grads: PyTree
    has_grad: jax.Array
    inner_state: PyTree

    @property
    def stepped(self) -> jax.Array:
        """Whether the call that produced this state ran an optimizer step."""
        return (self.mini_step == 0) & (self.gradient_step > 0)


def _acc_dtype(dtype: Any) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _map_masked(fn: Any, grads: PyTree, acc: PyTree, mask: list | None) -> PyTree:
    """``fn(g, a, m)`` over the leaves of ``grads`` (``None`` leaves included) and ``acc``,
    with ``m`` the leaf's ``grad_mask`` flag or None."""
    treedef = jax.tree.structure(acc)
    g_leaves = treedef.flatten_up_to(grads)
    masks = mask if mask is not None else [None] * len(g_leaves)
    return treedef.unflatten([fn(g, a, m) for g, a, m in zip(g_leaves, treedef.flatten_up_to(acc), masks)])


def _run_if(pred: jax.Array, fn: Any, carry: PyTree) -> PyTree:
    """``fn(carry)`` where ``pred`` holds, else ``carry``: a while loop of 0 or 1 trips.

    Not a ``lax.cond``: XLA gives a conditional's outputs buffers of their own, so on
    every call (stepping or not) it copies each carried value that the stepping branch
    both reads and overwrites (the inner state's per-parameter step counters: two
    copies per parameter). A while loop updates its carry in place; those copies move
    into the loop body, which runs on steps only.
    """

    def body(c):
        return jnp.zeros((), bool), fn(c[1])

    return jax.lax.while_loop(lambda c: c[0], body, (pred, carry))[1]


def grad_accumulate(
    tx: optax.GradientTransformation, every: int, reduction: str = "mean"
) -> optax.GradientTransformationExtraArgs:
    r"""Step ``tx`` once every ``every`` calls, on the mean or sum of the gradients.

    This is torch's accumulation idiom — call ``backward()`` ``k`` times without
    ``zero_grad()``, then ``step()`` — as a transformation. Calls ``1..every-1`` of a
    window only add the gradient into one accumulator: their updates are exactly zero
    and the inner state (step counters, buffers, schedules) does not move. Call
    ``every`` steps ``tx`` on

    .. math:: \bar g = \frac{1}{k}\sum_{i=1}^{k} g_i \ (\text{mean}) \quad\text{or}\quad
              \sum_{i=1}^{k} g_i \ (\text{sum}),

    so ``k`` micro-batches of size ``b`` with per-batch mean losses and
    ``reduction="mean"`` reproduce one batch of ``k·b`` up to rounding.

    Under ``jit`` a micro-step runs only the addition: one in-place pass per parameter
    and a few scalar operations, whatever the number of parameters; the inner optimizer
    runs only on the step (for this package's optimizers in a loop of zero or one trips,
    for any other transformation in a ``lax.cond``). With ``functorch_optim.step`` a
    micro-step does not touch the parameters at all. With a ``fused=True`` optimizer
    inside (``every >= 2``, on the CPU) each call is one kernel call per dtype instead:
    it adds the gradient in, or on the closing call steps on the window's mean in the
    same pass, with the same numbers.

    Args:
      tx: any optax-compatible transformation (this package's or optax's).
      every: the number of calls per optimizer step, an integer >= 1.
      reduction: ``"mean"`` (default) divides the accumulated sum by ``every``;
        ``"sum"`` keeps the sum (torch's plain accumulation without loss scaling).

    Returns:
      An optax ``GradientTransformationExtraArgs`` with a ``GradAccumulateState``;
      ``state.stepped`` tells whether the last call stepped.

    Raises:
      ValueError: ``every must be an integer >= 1, got …``; ``reduction must be 'mean' or
        'sum', got …``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.grad_accumulate(fo.sgd(lr=1.0), every=2)
      >>> params = {"w": jnp.array([0.0])}
      >>> state = tx.init(params)
      >>> params, state = fo.step(tx, params, {"w": jnp.array([1.0])}, state)
      >>> params["w"].tolist(), bool(state.stepped)
      ([0.0], False)
      >>> params, state = fo.step(tx, params, {"w": jnp.array([3.0])}, state)
      >>> params["w"].tolist(), bool(state.stepped)
      ([-2.0], True)

    Gradient clipping goes *inside*: ``grad_accumulate(optax.chain(
    clip_grad_norm_transform(max_norm), tx), every=k)``. torch clips once per optimizer
    step, the gradient accumulated over the ``k`` ``backward()`` calls (``clip_grad_norm_``
    between the last ``backward()`` and ``step()``); the chain inside runs only on the
    closing call, on the window's mean. A clip outside would scale each micro-batch's
    gradient by its own norm, which is not torch's run (and not one large batch's).

    Note:
      A parameter whose gradient is ``None`` in every call of a window is skipped by the
      step (its value and, for this package's optimizers, its state stay unchanged), as
      torch skips a parameter whose ``.grad`` stayed ``None``. An optax inner
      transformation cannot skip a leaf; it receives a zero gradient there. The extra
      argument ``grad_mask`` (a tree of boolean scalars, as this package's optimizers
      take it) marks parameters as having no gradient in this call, with the same
      effect as a ``None`` leaf: they are not added in.
      ``optax.MultiSteps`` instead runs the inner optimizer on every call and selects
      the result, and accumulates in float32 even under x64.

      With this package's optimizers inside, the step is a ``lax.while_loop`` (a
      conditional would copy their per-parameter step counters on every micro-step):
      ``jax.jvp`` goes through it, reverse-mode ``jax.grad`` through the update does
      not (differentiate through the inner transformation itself for that).
    """
    if isinstance(every, bool) or not isinstance(every, int | jnp.integer) or every < 1:
        raise ValueError(f"every must be an integer >= 1, got {every!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    every = int(every)
    inner_step = getattr(tx.update, STEP_ATTR, None)
    # fused=True inside: a call is one kernel call per dtype (add the gradient in, or on
    # the closing call step on the mean in the same pass); no conditional, no loop
    window_step = getattr(tx.update, WINDOW_ATTR, None) if every > 1 else None
    extra_ok = isinstance(tx, optax.GradientTransformationExtraArgs)

    def init(params: PyTree) -> GradAccumulateState:
        check_params(params, allow_empty=True)
        return GradAccumulateState(
            mini_step=jnp.zeros((), jnp.int32),
            gradient_step=jnp.zeros((), jnp.int32),
            acc_grads=jax.tree.map(lambda p: jnp.zeros(p.shape, _acc_dtype(p.dtype)), params),
            has_grad=jnp.zeros((len(jax.tree.leaves(params)),), bool),
            inner_state=tx.init(params),
        )

    def present_of(params, grads, mask):
        # which parameters have a gradient in this call, one bool per leaf: static (None
        # leaves), with a grad_mask one operation for all; None when every one has
        present = [g is not None for g in jax.tree.structure(params).flatten_up_to(grads)]
        if mask is None:
            return None if all(present) else jnp.asarray(present, bool)
        return jnp.asarray(present, bool) & jnp.stack([jnp.asarray(m, bool) for m in mask])

    def flags(state, fresh, present):
        # which parameters have a gradient in the window so far, and whether all have
        if present is None:
            return jnp.ones(state.has_grad.shape, bool), True
        return jnp.where(fresh, present, state.has_grad | present), False

    def add_in(grads, acc, fresh, mask):
        # A window opens (mini_step == 0) by overwriting the sum, so one in-place pass per
        # call is all a micro-step costs, and the step never has to write zeros back.
        def add(g, a, m):
            kept = jnp.where(fresh, jnp.zeros_like(a), a)
            if g is None:
                return kept
            g = g.astype(a.dtype)
            added = jnp.where(fresh, g, a + g)
            # grad_mask off: as if the gradient were None
            return added if m is None else jnp.where(m, added, kept)

        return _map_masked(add, grads, acc, mask)

    def given(grads, acc, mask):
        # every == 1: the call's own gradient is the window's sum (None, masked: zeros)
        def own(g, a, m):
            if g is None:
                return jnp.zeros_like(a)
            return g.astype(a.dtype) if m is None else jnp.where(m, g.astype(a.dtype), 0)

        return _map_masked(own, grads, acc, mask)

    def as_param_dtype(total, params):
        return jax.tree.map(lambda a, p: a.astype(p.dtype), total, params)

    def inner_kwargs(seen, all_seen, params, extra_args):
        if not extra_ok:
            return {}
        kwargs = {k: v for k, v in extra_args.items() if k != "grad_mask"}
        if not all_seen:
            # a call with a gradient for every parameter needs no mask (one of all True
            # would select the same values, at the price of a select per buffer)
            treedef = jax.tree.structure(params)
            kwargs["grad_mask"] = treedef.unflatten([seen[i] for i in range(treedef.num_leaves)])
        return kwargs

    def run(grads, state, params, carry, step, mask, fused=None):
        """Add the gradient in; on the window's closing call, ``step`` on the mean.
        ``mask``: the call's ``grad_mask``, one flag per leaf, or None.
        ``fused(carry, acc, grads, fresh, stepping, seen, all_seen, present) -> (carry, acc)``:
        the same as one kernel call, taken on the CPU."""
        fresh = state.mini_step == 0
        stepping = state.mini_step + 1 >= every
        present = present_of(params, grads, mask)
        seen, all_seen = flags(state, fresh, present)

        def jitted(carry, acc, grads):
            acc = add_in(grads, acc, fresh, mask)
            if reduction == "mean":
                # the closing call overwrites the sum with the mean, in the pass that adds
                # the last gradient in: a kernel that cannot fuse the division reads it
                # from there, and no parameter-sized temporary exists
                acc = jax.tree.map(lambda a: jnp.where(stepping, a / every, a), acc)

            def fn(c):
                return step(c, as_param_dtype(acc, params), seen, all_seen)

            if inner_step is not None:
                return _run_if(stepping, fn, carry), acc
            # an optax transformation keeps a few scalars, not one per parameter: a
            # conditional costs no per-parameter copies there, and XLA simplifies its
            # arithmetic inside a conditional as before (a loop body can round
            # differently in the last bit)
            return jax.lax.cond(stepping, fn, lambda c: c, carry), acc

        if every == 1:
            # every call steps: no branch, and no pass over the accumulator
            acc = state.acc_grads
            carry = step(carry, as_param_dtype(given(grads, acc, mask), params), seen, all_seen)
        elif fused is not None:
            # the kernel on the CPU; the jitted path elsewhere and for derivatives
            carry, acc = kernel_or_rule(
                lambda c, a, g: fused(c, a, g, fresh, stepping, seen, all_seen, present),
                jitted,
                carry,
                state.acc_grads,
                grads,
            )
        else:
            carry, acc = jitted(carry, state.acc_grads, grads)
        mini = jnp.where(stepping, 0, state.mini_step + 1).astype(jnp.int32)
        count = state.gradient_step + stepping.astype(jnp.int32)
        return carry, lambda inner: GradAccumulateState(mini, count, acc, seen, inner)

    def fused_window(params):
        """The kernel path of ``step_fn``, where every parameter can take it."""
        if window_step is None or not window_step.ready(jax.tree.leaves(params)):
            return None
        treedef = jax.tree.structure(params)

        def fused(carry, acc, grads, fresh, stepping, seen, all_seen, present):
            params, inner = carry
            active = treedef.unflatten(
                [stepping if all_seen else stepping & seen[i] for i in range(treedef.num_leaves)]
            )
            window = Window(acc, fresh, stepping, every if reduction == "mean" else None, present)
            params, acc, inner = window_step(params, grads, inner, window, active)
            return (params, inner), acc

        return fused

    def call_mask(params, extra_args):
        # a grad_mask leaf that is off: that parameter has no gradient in this call
        mask = extra_args.get("grad_mask")
        return None if mask is None else grad_mask_leaves(params, mask)

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("grad_accumulate: update() needs params")
        check_like_params(params, grads)
        mask = call_mask(params, extra_args)

        def step(carry, mean, seen, all_seen):
            _, inner = carry
            if extra_ok:
                kwargs = inner_kwargs(seen, all_seen, params, extra_args)
                updates, inner = tx.update(mean, inner, params, **kwargs)
            else:
                updates, inner = tx.update(mean, inner, params)
            updates = jax.tree.map(
                lambda u, p: u if u is not None or p is None else jnp.zeros_like(p),
                updates,
                params,
                is_leaf=is_none,
            )
            return updates, inner

        zeros = jax.tree.map(jnp.zeros_like, params)
        (updates, inner), new_state = run(grads, state, params, (zeros, state.inner_state), step, mask)
        updates = jax.tree.map(lambda g, u: None if g is None else u, grads, updates, is_leaf=is_none)
        return updates, new_state(inner)

    def step_fn(params, grads, state, **extra_args):
        check_like_params(params, grads)
        mask = call_mask(params, extra_args)

        def step(carry, mean, seen, all_seen):
            params, inner = carry
            kwargs = inner_kwargs(seen, all_seen, params, extra_args)
            if inner_step is not None:
                return inner_step(params, mean, inner, **kwargs)
            return _step(tx, params, mean, inner, **kwargs)

        carry = (params, state.inner_state)
        (params, inner), new_state = run(grads, state, params, carry, step, mask, fused_window(params))
        return params, new_state(inner)

    setattr(update, STEP_ATTR, step_fn)
    return optax.GradientTransformationExtraArgs(sharded_init(init), update)
