"""Gradient accumulation equal to one large batch: torch's "step every k" idiom.

The window policy (``_Window``: when a window opens and closes, how its sum is reduced)
is written once; each execution strategy (``_direct``, ``_looped``, ``_fused``) runs one
call under it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functorch_optim._base import STEP_ATTR, WINDOW_ATTR, _all_staged, compiled_when_eager, own_counters
from functorch_optim._base import step as _step
from functorch_optim._fused import Window, kernel_or_rule, window_scale
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
      weight_sum: ``reduction="weighted"``: the window's sum of weights per parameter
        (of the calls in which it had a gradient), one array like ``has_grad`` in the
        widest accumulator dtype; like ``has_grad`` it describes the closed window right
        after a step. ``None`` for the other reductions.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    acc_grads: PyTree
    has_grad: jax.Array
    inner_state: PyTree
    weight_sum: jax.Array | None = None

    @property
    def stepped(self) -> jax.Array:
        """Whether the call that produced this state ran an optimizer step (a weighted
        window whose weights sum to 0 closes without one)."""
        stepped = (self.mini_step == 0) & (self.gradient_step > 0)
        if self.weight_sum is not None:
            stepped = stepped & jnp.any(self.weight_sum > 0)
        return stepped


#: Attribute under which ``grad_accumulate``'s ``update`` carries its ``flush``.
FLUSH_ATTR = "fo_flush"

_REDUCTIONS = ("mean", "sum", "weighted")


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


# ------------------------------------------------------------------------ the window policy


class _Call(NamedTuple):
    """The window policy's decisions for one call (``_Window.open``).

    Attributes:
      fresh: this call opens a window (it overwrites the sum), a bool scalar.
      stepping: it closes one (the optimizer steps on the reduced sum), a bool scalar.
      present: which parameters have a gradient in this call, a bool vector in leaf
        order, or None when every one has (no ``None`` leaf, no ``grad_mask``).
      seen: which parameters have a gradient in the window so far, a bool vector.
      all_seen: static: every parameter has one (``seen`` is all True).
      mask: the call's ``grad_mask``, one flag per leaf, or None.
      closing: the window ends with this call (``stepping`` unless a weighted window
        weighs nothing).
      divisor: what the closing call divides the sum by (``_fused.window_scale``):
        ``every`` (static, ``"mean"``), a vector over the parameters (the weight sums,
        or a flushed window's length), or None (``"sum"``).
      weight: ``"weighted"``: this call's weight in the accumulator dtype, else None.
      weight_sum: ``"weighted"``: the window's weight sums after this call, else None.
      counts: this call is one of the window's (``flush`` is not).
    """

    fresh: jax.Array
    stepping: jax.Array
    present: jax.Array | None
    seen: jax.Array
    all_seen: bool
    mask: list | None
    closing: jax.Array
    divisor: Any = None
    weight: jax.Array | None = None
    weight_sum: jax.Array | None = None
    counts: bool = True


class _Window:
    """When a window opens and closes, and how its gradients are reduced.

    Every execution strategy below shares it: ``open`` decides a call's place in the
    window, ``add`` puts the call's gradient into the accumulator (a window opens by
    overwriting the sum, so one in-place pass per call is all a micro-step costs and a
    step never writes zeros back), ``reduce`` turns the sum into what the step reads on
    the closing call, ``close`` writes the counters.
    """

    def __init__(self, every: int, reduction: str):
        self.every = every
        self.reduction = reduction

    def open(
        self, state: GradAccumulateState, grads: PyTree, mask: list | None, weight: jax.Array | None = None
    ) -> _Call:
        """A call with a gradient (``weight``: its weight, ``"weighted"`` only)."""
        fresh = state.mini_step == 0
        stepping = state.mini_step + 1 >= self.every
        # which parameters have a gradient in this call, one bool per leaf: static (None
        # leaves), with a grad_mask one operation for all; None when every one has
        present = [g is not None for g in jax.tree.structure(state.acc_grads).flatten_up_to(grads)]
        if mask is None:
            present = None if all(present) else jnp.asarray(present, bool)
        else:
            present = jnp.asarray(present, bool) & jnp.stack([jnp.asarray(m, bool) for m in mask])
        if present is None:
            seen, all_seen = jnp.ones(state.has_grad.shape, bool), True
        else:
            seen, all_seen = jnp.where(fresh, present, state.has_grad | present), False
        call = _Call(fresh, stepping, present, seen, all_seen, mask, stepping, self.divisor)
        if self.reduction != "weighted":
            return call
        weight = weight.astype(state.weight_sum.dtype)
        added = weight if present is None else jnp.where(present, weight, 0)
        return self.weighted(state, call, jnp.where(fresh, 0, state.weight_sum) + added, weight)

    def open_flush(self, state: GradAccumulateState) -> _Call:
        """``flush``: a call without a gradient that closes a non-empty window."""
        n = state.has_grad.shape[0]
        fresh = jnp.zeros((), bool)
        closing = state.mini_step > 0
        present = jnp.zeros((n,), bool)
        divisor = None if self.reduction == "sum" else jnp.broadcast_to(state.mini_step, (n,))
        call = _Call(fresh, closing, present, state.has_grad, False, None, closing, divisor, counts=False)
        if self.reduction != "weighted":
            return call
        return self.weighted(state, call, state.weight_sum, None)

    @staticmethod
    def weighted(state: GradAccumulateState, call: _Call, weight_sum: jax.Array, weight: Any) -> _Call:
        # a parameter takes the step where its window weighs something; the window steps
        # where any does (its weights summing to 0, it closes without a step)
        seen = weight_sum > 0
        return call._replace(
            seen=seen,
            all_seen=False,
            stepping=call.closing & jnp.any(seen),
            divisor=weight_sum,
            weight=weight,
            weight_sum=weight_sum,
        )

    @property
    def divisor(self) -> int | None:
        return self.every if self.reduction == "mean" else None

    def accumulate(self, grads: PyTree, acc: PyTree, call: _Call) -> PyTree:
        """The accumulator after this call (``_window_leaf`` per parameter): its gradient
        added in (on a window's first call written over the previous sum; a ``None`` or
        masked-off gradient adds nothing), and on the closing call divided by
        ``call.divisor`` (the sum itself without one), in the same pass (a kernel that
        cannot fuse the division reads it from there, and no parameter-sized temporary
        exists)."""
        divisor = call.divisor
        static = divisor if divisor is None or isinstance(divisor, int) else "array"
        treedef = jax.tree.structure(acc)
        g_leaves = treedef.flatten_up_to(grads)
        a_leaves = treedef.flatten_up_to(acc)
        masks = call.mask if call.mask is not None else [None] * len(g_leaves)
        if static == "array":
            # a vector divisor's scales computed once per dtype, for every parameter
            # together: a scalar's reciprocal per parameter was an XLA kernel of its own
            # per parameter (a division is not fused into a loop that would repeat it),
            # 200 of them a call over 200 parameters
            scales = {dtype: window_scale(divisor, dtype) for dtype in {a.dtype for a in a_leaves}}
        out = []
        for i, (g, a, m) in enumerate(zip(g_leaves, a_leaves, masks)):
            d = scales[a.dtype][i] if static == "array" else None
            args = (g, a, m, call.fresh, call.weight, call.stepping, d)
            # traced once per leaf signature inside ``jit`` (as ``_base.rule_step``)
            leaf = _staged_window_leaf if _all_staged(args) else _window_leaf
            out.append(leaf(static, *args))
        return treedef.unflatten(out)

    def own(self, grads: PyTree, acc: PyTree, call: _Call) -> PyTree:
        """``every == 1``: the call's own gradient is the window's sum (None, masked
        off: zeros)."""

        def own(g, a, m):
            if g is None:
                return jnp.zeros_like(a)
            return g.astype(a.dtype) if m is None else jnp.where(m, g.astype(a.dtype), 0)

        return _map_masked(own, grads, acc, call.mask)

    def fused_window(self, acc: PyTree, call: _Call) -> Window:
        """The same decisions as the kernels take them (``_fused.Window``)."""
        return Window(acc, call.fresh, call.stepping, call.divisor, call.present, call.weight)

    def close(
        self, state: GradAccumulateState, call: _Call, acc: PyTree
    ) -> Callable[[PyTree], GradAccumulateState]:
        """The counters after this call; returns ``inner_state -> GradAccumulateState``."""
        mini = jnp.where(call.closing, 0, state.mini_step + 1 if call.counts else state.mini_step)
        mini = mini.astype(jnp.int32)
        count = state.gradient_step + call.stepping.astype(jnp.int32)
        return lambda inner: GradAccumulateState(mini, count, acc, call.seen, inner, call.weight_sum)


def _window_leaf(divisor: Any, g, a, m, fresh, weight, stepping, scale) -> jax.Array:
    """``_Window.accumulate`` for one parameter: ``g`` its gradient (or None), ``a`` its
    accumulator, ``m`` its ``grad_mask`` flag (or None); ``divisor`` the static part of
    the window's divisor (None, ``every``, or ``"array"``: ``scale`` is this parameter's
    ``window_scale`` of it, in ``a``'s dtype)."""

    def kept():
        return jnp.where(fresh, jnp.zeros_like(a), a)

    if g is None:
        added = kept()
    else:
        g = g.astype(a.dtype)
        if weight is None:
            added = jnp.where(fresh, g, a + g)
        else:
            added = kept() + g * weight.astype(a.dtype)
        # grad_mask off: as if the gradient were None
        added = added if m is None else jnp.where(m, added, kept())
    if divisor is None:
        return added
    if isinstance(divisor, int):
        return jnp.where(stepping, added / divisor, added)
    return jnp.where(stepping, added * scale, added)


#: ``_window_leaf`` as a nested ``jit``: a call over 1000 equal leaves traces and lowers
#: it once; XLA inlines the calls before it optimizes (the same compiled step).
_staged_window_leaf = jax.jit(_window_leaf, static_argnums=0)


# ----------------------------------------------------------------- the execution strategies
# Each runs one call under the policy and returns ``(carry, acc)``; ``carry`` is what the
# inner step moves (``(params, inner_state)`` or ``(updates, inner_state)``), ``step(carry,
# reduced, call) -> carry`` runs the inner optimizer on the reduced gradient (cast to the
# parameters' dtypes).


def _as_param_dtype(total: PyTree, params: PyTree) -> PyTree:
    return jax.tree.map(lambda a, p: a.astype(p.dtype), total, params)


def _direct(policy, call, grads, acc, carry, step, params):
    """``every == 1``: every call steps on its own gradient; no branch, and no pass over
    the accumulator (it stays as it is)."""
    return step(carry, _as_param_dtype(policy.own(grads, acc, call), params), call), acc


def _looped(policy, call, grads, acc, carry, step, params, *, loop):
    """The jitted path: the add pass (the reduction written in it on the closing call),
    then the inner step where the call closes the window. ``loop``: in a 0/1-trip while
    loop (this package's optimizers, ``_run_if``), else in a ``lax.cond`` (an optax
    transformation keeps a few scalars, not one per parameter: a conditional costs no
    per-parameter copies there, and XLA simplifies its arithmetic inside a conditional
    as before; a loop body can round differently in the last bit)."""
    acc = policy.accumulate(grads, acc, call)
    if not call.all_seen:
        # the inner step runs under a grad_mask, which gives each parameter a counter
        # of its own: the carry starts in that layout (``own_counters``)
        carry = own_counters(carry)

    def fn(c):
        return step(c, _as_param_dtype(acc, params), call)

    if loop:
        return _run_if(call.stepping, fn, carry), acc
    return jax.lax.cond(call.stepping, fn, lambda c: c, carry), acc


def _fused(policy, call, grads, acc, carry, window_step, treedef):
    """A ``fused=True`` optimizer's window kernel: a dtype's kernel calls (one table) add the
    gradient in, or on the closing call reduces the sum and steps on it in the same pass;
    no loop or conditional around it."""
    params, inner = carry
    n = treedef.num_leaves
    active = treedef.unflatten(
        [call.stepping if call.all_seen else call.stepping & call.seen[i] for i in range(n)]
    )
    params, acc, inner = window_step(params, grads, inner, policy.fused_window(acc, call), active)
    return (params, inner), acc


def _fused_or_looped(policy, call, grads, acc, carry, step, params, window_step):
    """``_fused`` on the CPU, ``_looped`` elsewhere and for derivatives
    (``_fused.kernel_or_rule``: a JVP through the call is ``_looped``'s)."""
    treedef = jax.tree.structure(params)
    return kernel_or_rule(
        lambda c, a, g: _fused(policy, call, g, a, c, window_step, treedef),
        lambda c, a, g: _looped(policy, call, g, a, c, step, params, loop=True),
        carry,
        acc,
        grads,
    )


def grad_accumulate(
    tx: optax.GradientTransformation, every: int, reduction: str = "mean"
) -> optax.GradientTransformationExtraArgs:
    r"""Step ``tx`` once every ``every`` calls, on the mean, sum or weighted mean of the gradients.

    This is torch's accumulation idiom — call ``backward()`` ``k`` times without
    ``zero_grad()``, then ``step()`` — as a transformation. Calls ``1..every-1`` of a
    window only add the gradient into one accumulator: their updates are exactly zero
    and the inner state (step counters, buffers, schedules) does not move. Call
    ``every`` steps ``tx`` on

    .. math:: \bar g = \frac{1}{k}\sum_{i=1}^{k} g_i \ (\text{mean}), \quad
              \sum_{i=1}^{k} g_i \ (\text{sum}) \quad\text{or}\quad
              \frac{\sum_{i=1}^{k} w_i g_i}{\sum_{i=1}^{k} w_i} \ (\text{weighted}),

    so ``k`` micro-batches of size ``b`` with per-batch mean losses and
    ``reduction="mean"`` reproduce one batch of ``k·b`` up to rounding. With micro-batches
    of different sizes (variable-length sequences: ``w_i`` tokens each) the mean of the
    means is not the window's mean; ``reduction="weighted"`` takes each call's micro-batch
    mean-loss gradient with its ``weight=`` and steps on the gradient of the window's
    global mean (what transformers' ``num_items_in_batch`` computes in torch). ``flush``
    steps on a partially filled window (the end of an epoch).

    Under ``jit`` a micro-step runs only the addition: one in-place pass per parameter
    and a few scalar operations, whatever the number of parameters; the inner optimizer
    runs only on the step (for this package's optimizers in a loop of zero or one trips,
    for any other transformation in a ``lax.cond``). With ``functorch_optim.step`` a
    micro-step does not touch the parameters at all. With a ``fused=True`` optimizer
    inside (``every >= 2``, on the CPU) each call is a dtype's kernel calls instead:
    it adds the gradient in, or on the closing call steps on the window's mean in the
    same pass, with the same numbers.

    Args:
      tx: any optax-compatible transformation (this package's or optax's).
      every: the number of calls per optimizer step, an integer >= 1.
      reduction: ``"mean"`` (default) divides the accumulated sum by ``every``;
        ``"sum"`` keeps the sum (torch's plain accumulation without loss scaling);
        ``"weighted"`` adds each gradient in times the call's extra argument ``weight``
        (a scalar >= 0: the micro-batch's tokens or samples) and divides by the sum of
        the weights: one accumulator plus one weight sum per parameter (a parameter's
        weighted mean is over the calls in which it had a gradient). A window whose
        weights sum to 0 does not step (``state.stepped`` is False).

    Returns:
      An optax ``GradientTransformationExtraArgs`` with a ``GradAccumulateState``;
      ``state.stepped`` tells whether the last call stepped.

    Raises:
      ValueError: ``every must be an integer >= 1, got …``; ``reduction must be 'mean',
        'sum' or 'weighted', got …``; when called, a missing ``weight=`` with
        ``"weighted"`` (or one given with another reduction), a non-scalar, negative or
        non-finite weight. (A traced negative weight cannot raise under ``jit``: it makes
        the window's ``weight_sum`` NaN, and the window closes without a step.)

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
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'weighted', got {reduction!r}")
    every = int(every)
    weighted = reduction == "weighted"
    # every call closes its window and steps on its own gradient (``_direct``)
    every_call_steps = every == 1 and not weighted
    policy = _Window(every, reduction)
    inner_step = getattr(tx.update, STEP_ATTR, None)
    # fused=True inside: a call is a dtype's kernel calls (``_fused``)
    window_step = getattr(tx.update, WINDOW_ATTR, None) if every > 1 else None
    extra_ok = isinstance(tx, optax.GradientTransformationExtraArgs)

    def init(params: PyTree) -> GradAccumulateState:
        check_params(params, allow_empty=True)
        acc = jax.tree.map(lambda p: jnp.zeros(p.shape, _acc_dtype(p.dtype)), params)
        n = len(jax.tree.leaves(params))
        weight_sum = None
        if weighted:
            weight_sum = jnp.zeros((n,), jnp.result_type(jnp.float32, *jax.tree.leaves(acc)))
        return GradAccumulateState(
            mini_step=jnp.zeros((), jnp.int32),
            gradient_step=jnp.zeros((), jnp.int32),
            acc_grads=acc,
            has_grad=jnp.zeros((n,), bool),
            # a weighted window steps its parameters under a mask (those whose window
            # weighs something): their counters are their own from the start, so the
            # state keeps one structure (``own_counters``)
            inner_state=own_counters(tx.init(params)) if weighted else tx.init(params),
            weight_sum=weight_sum,
        )

    def inner_kwargs(call, params, extra_args):
        if not extra_ok:
            return {}
        kwargs = {k: v for k, v in extra_args.items() if k not in ("grad_mask", "weight")}
        if not call.all_seen:
            # a call with a gradient for every parameter needs no mask (one of all True
            # would select the same values, at the price of a select per buffer)
            treedef = jax.tree.structure(params)
            kwargs["grad_mask"] = treedef.unflatten([call.seen[i] for i in range(treedef.num_leaves)])
        return kwargs

    def run(call, grads, state, params, carry, step, window=None):
        """One call: the policy's decisions (``call``), executed by one strategy.
        ``window``: the inner optimizer's window kernel, where every parameter can take it."""
        acc = state.acc_grads
        if every_call_steps:
            carry, acc = _direct(policy, call, grads, acc, carry, step, params)
        elif window is not None:
            carry, acc = _fused_or_looped(policy, call, grads, acc, carry, step, params, window)
        else:
            carry, acc = _looped(policy, call, grads, acc, carry, step, params, loop=inner_step is not None)
        return carry, policy.close(state, call, acc)

    def open_call(grads, state, params, extra_args):
        # a grad_mask leaf that is off: that parameter has no gradient in this call
        mask = extra_args.get("grad_mask")
        mask = None if mask is None else grad_mask_leaves(params, mask)
        return policy.open(state, grads, mask, _weight_of(extra_args, reduction))

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("grad_accumulate: update() needs params")
        check_like_params(params, grads)
        call = open_call(grads, state, params, extra_args)

        def step(carry, reduced, call):
            _, inner = carry
            if extra_ok:
                updates, inner = tx.update(reduced, inner, params, **inner_kwargs(call, params, extra_args))
            else:
                updates, inner = tx.update(reduced, inner, params)
            updates = jax.tree.map(
                lambda u, p: u if u is not None or p is None else jnp.zeros_like(p),
                updates,
                params,
                is_leaf=is_none,
            )
            return updates, inner

        if every_call_steps:
            # the carry's updates are never returned as they came in
            start = jax.tree.map(jnp.zeros_like, params)
        else:
            # a call that does not step returns zeros, selected below (fused into
            # ``apply_updates``' add). The carry starts in the gradient's own buffer, dead
            # once added in: a zero tree here would be a new buffer the size of the
            # parameters on every micro-step, written (and page-faulted) for nothing
            def start_leaf(g, p):
                if p is None:  # not a parameter (e.g. an equinox module's filtered-out field)
                    return None
                return jnp.zeros_like(p) if g is None else g.astype(p.dtype)

            start = jax.tree.map(start_leaf, grads, params, is_leaf=is_none)
        (updates, inner), new_state = run(call, grads, state, params, (start, state.inner_state), step)
        if not every_call_steps:
            updates = jax.tree.map(lambda u: jnp.where(call.stepping, u, jnp.zeros_like(u)), updates)
        updates = jax.tree.map(lambda g, u: None if g is None else u, grads, updates, is_leaf=is_none)
        return updates, new_state(inner)

    def execute(call, params, grads, state, extra_args):
        # a call of ``step`` (or ``flush``) in the exact (params, grads, state) form
        def step(carry, reduced, call):
            params, inner = carry
            kwargs = inner_kwargs(call, params, extra_args)
            if inner_step is not None:
                return inner_step(params, reduced, inner, **kwargs)
            return _step(tx, params, reduced, inner, **kwargs)

        window = (
            window_step
            if window_step is not None and window_step.ready(jax.tree.leaves(params), jax.tree.leaves(grads))
            else None
        )
        carry = (params, state.inner_state)
        (params, inner), new_state = run(call, grads, state, params, carry, step, window)
        return params, new_state(inner)

    def step_fn(params, grads, state, **extra_args):
        check_like_params(params, grads)
        return execute(open_call(grads, state, params, extra_args), params, grads, state, extra_args)

    def flush_fn(params, state, **extra_args):
        # each accumulator in its parameter's accumulation dtype (float32 for bf16)
        acc_like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), _acc_dtype(p.dtype)), params)
        check_like_params(acc_like, state.acc_grads, "state.acc_grads")
        if every == 1:
            return params, state  # every window is closed by its own call
        return flush_window(params, state, **extra_args)

    @compiled_when_eager
    def flush_window(params, state, **extra_args):
        grads = jax.tree.map(lambda _: None, params)
        return execute(policy.open_flush(state), params, grads, state, extra_args)

    def weight_checked(fn):
        # outside jit a call runs compiled (op by op the weighted ``acc + g * w`` rounds
        # twice where the jitted call rounds once); the weight's value is checked first,
        # as the compiled call sees a tracer
        compiled = compiled_when_eager(fn)

        @functools.wraps(fn)
        def call(*args, **extra_args):
            _weight_of(extra_args, reduction)
            return compiled(*args, **extra_args)

        return call

    update, step_fn = weight_checked(update), weight_checked(step_fn)
    setattr(update, STEP_ATTR, step_fn)
    setattr(update, FLUSH_ATTR, flush_fn)
    return optax.GradientTransformationExtraArgs(sharded_init(init), update)


def _weight_of(extra_args: dict, reduction: str) -> jax.Array | None:
    """The call's ``weight=``, checked: required (a scalar >= 0) with ``"weighted"``,
    refused otherwise."""
    weight = extra_args.get("weight")
    if reduction != "weighted":
        if weight is not None:
            raise ValueError(
                f"grad_accumulate: weight= needs reduction='weighted', this one has {reduction!r}"
            )
        return None
    if weight is None:
        raise ValueError(
            "grad_accumulate(reduction='weighted'): every call needs weight= (the micro-batch's "
            "number of tokens or samples), got none"
        )
    w = jnp.asarray(weight)
    if w.ndim != 0:
        raise ValueError(f"grad_accumulate: weight must be a scalar, got an array of shape {w.shape}")
    if isinstance(w, jax.core.Tracer):
        # nothing raises inside jit (a host callback would cost a micro-step several times
        # the addition): a negative weight makes the window's weight sum NaN, so the window
        # does not step
        return jnp.where(w >= 0, w, jnp.nan)
    if not float(w) >= 0 or not np.isfinite(float(w)):
        raise ValueError(f"grad_accumulate: weight must be a finite number >= 0, got {float(w)}")
    return w


def flush(
    tx: optax.GradientTransformation, params: PyTree, state: GradAccumulateState, **extra_args: Any
) -> tuple[PyTree, GradAccumulateState]:
    r"""Step now on the partially filled window of a ``grad_accumulate`` state.

    The step is exactly the one the window's closing call would take had ``every`` been
    the number of calls made so far, ``n = state.mini_step``: on :math:`\frac1n\sum_i
    g_i` (``"mean"``), the sum (``"sum"``), or :math:`\sum_i w_i g_i / \sum_i w_i`
    (``"weighted"``; a window whose weights sum to 0 does not step); the next call opens
    a new window. With an empty window (``mini_step == 0``) nothing changes. For the end
    of an epoch whose length is not a multiple of ``every``. Jittable.

    Args:
      tx: a ``grad_accumulate`` transformation.
      params: the parameters.
      state: ``tx``'s state.
      **extra_args: passed on to the inner transformation, as by ``step``.

    Returns:
      ``(params, state)``; ``state.stepped`` tells whether it stepped.

    Raises:
      ValueError: ``flush: tx is not a grad_accumulate transformation, got …``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.grad_accumulate(fo.sgd(lr=1.0), every=4)
      >>> params = {"w": jnp.array([0.0])}
      >>> state = tx.init(params)
      >>> for g in (1.0, 3.0):
      ...     params, state = fo.step(tx, params, {"w": jnp.array([g])}, state)
      >>> params, state = fo.flush(tx, params, state)
      >>> params["w"].tolist(), bool(state.stepped), int(state.mini_step)
      ([-2.0], True, 0)
    """
    flush_fn = getattr(tx.update, FLUSH_ATTR, None)
    if flush_fn is None:
        raise ValueError(f"flush: tx is not a grad_accumulate transformation, got {type(tx).__name__}")
    return flush_fn(params, state, **extra_args)
