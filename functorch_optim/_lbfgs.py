"""L-BFGS with torch's closure-driven step and strong-Wolfe line search (``torch.optim.LBFGS``).

One call of the step is one ``torch.optim.LBFGS.step(closure)``: up to ``max_iter``
inner iterations, all inside one ``lax.while_loop``, so the whole step jits. The loss
function plays torch's closure: ``value_fn(params) -> scalar``; its gradient comes from
``jax.value_and_grad``. Torch's global state (kept on its first parameter) is the
``LBFGSState`` here, with torch's names; the curvature history lives in fixed-size ring
buffers of ``history_size`` rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from functorch_optim._base import STEP_ATTR
from functorch_optim._checks import squeeze_lr
from functorch_optim._hyperparams import HParams, hparam_dtype, to_python
from functorch_optim._tree import PyTree, check_like_params, check_params, is_none


class LBFGSState(NamedTuple):
    """State of ``lbfgs``: torch's ``LBFGS`` state, by torch's names.

    ``n`` is the number of parameter entries (all leaves, raveled in tree order); the
    vectors are that flat layout (torch's ``_gather_flat_grad``).

    Attributes:
      hparams: ``lr``, ``tolerance_grad``, ``tolerance_change`` (floats) and
        ``max_iter``, ``max_eval`` (int32): change them with ``set_hparams``.
      count: number of ``step`` calls, an int32 scalar.
      d: the last search direction, shape ``(n,)``.
      t: the last step length (a scalar).
      old_dirs: curvature vectors ``y`` in a ring buffer, shape ``(history_size, n)``.
      old_stps: step vectors ``s`` in a ring buffer, shape ``(history_size, n)``.
      ro: ``1 / (y . s)`` per ring-buffer row, shape ``(history_size,)``.
      history_count: pairs stored since the first iteration (int32); the
        ``min(history_count, history_size)`` newest rows are torch's lists, the oldest
        at row ``(history_count - num_old) % history_size`` (see ``history``).
      H_diag: scale of the initial inverse-Hessian approximation.
      prev_flat_grad: the flat gradient of the previous iteration.
      prev_loss: the loss of the previous iteration.
      n_iter: inner iterations over all steps (int32).
      func_evals: loss evaluations over all steps (int32), counted as torch does.

    Before the first step the vectors are zeros, ``t`` is 0 and ``H_diag`` is 1 (torch
    has no entries yet).
    """

    hparams: HParams
    count: jax.Array
    d: jax.Array
    t: jax.Array
    old_dirs: jax.Array
    old_stps: jax.Array
    ro: jax.Array
    history_count: jax.Array
    H_diag: jax.Array
    prev_flat_grad: jax.Array
    prev_loss: jax.Array
    n_iter: jax.Array
    func_evals: jax.Array

    def history(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """torch's ``(old_dirs, old_stps, ro)`` lists as arrays, oldest first.

        Returns:
          Three NumPy arrays of shapes ``(num_old, n)``, ``(num_old, n)``, ``(num_old,)``.
        """
        size = self.ro.shape[0]
        count = int(self.history_count)
        num_old = min(count, size)
        rows = [(count - num_old + i) % size for i in range(num_old)]
        return np.asarray(self.old_dirs)[rows], np.asarray(self.old_stps)[rows], np.asarray(self.ro)[rows]


def _validate(hp: Mapping[str, Any], static: Mapping[str, Any]) -> None:
    lr = hp["lr"]
    if not 0.0 <= lr:  # noqa: SIM300 (torch's form: its TypeError text)
        raise ValueError(f"Invalid learning rate: {lr}")
    history_size = static["history_size"]
    if not isinstance(history_size, int) or history_size < 1:
        raise ValueError(f"history_size must be an integer >= 1, got {history_size!r}")


def _cubic_interpolate(x1, f1, g1, x2, f2, g2, bounds=None, xp=jnp):
    """torch's ``_cubic_interpolate`` (from minFunc's polyinterp), branch-free."""
    if bounds is not None:
        xmin_bound, xmax_bound = bounds
    else:
        xmin_bound = xp.where(x1 <= x2, x1, x2)
        xmax_bound = xp.where(x1 <= x2, x2, x1)
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    d2_square = d1**2 - g1 * g2
    real = d2_square >= 0
    d2 = xp.sqrt(xp.where(real, d2_square, 0))
    min_pos = xp.where(
        x1 <= x2,
        x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2)),
        x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2)),
    )
    # torch: min(max(min_pos, xmin_bound), xmax_bound), Python's min and max
    clipped = _py_min(xp, _py_max(xp, min_pos, xmin_bound), xmax_bound)
    return xp.where(real, clipped, (xmin_bound + xmax_bound) / 2.0)


def _py_max(xp: Any, first: Any, second: Any) -> Any:
    """Python's ``max(first, second)`` (``_torch_ops.py_max``) in the namespace ``xp``: a
    NaN ``second`` gives ``first``."""
    return xp.where(second > first, second, first)


def _py_min(xp: Any, first: Any, second: Any) -> Any:
    """Python's ``min(first, second)`` in the namespace ``xp`` (see ``_py_max``)."""
    return xp.where(second < first, second, first)


class _Traced:
    """``lax`` control flow over ``jax.numpy``: the whole step is one jittable computation."""

    xp = jnp
    while_loop = staticmethod(jax.lax.while_loop)
    cond = staticmethod(jax.lax.cond)

    @staticmethod
    def host(tree):
        return tree


class _Eager:
    """Python control flow on concrete values, so ``evaluate`` may have side effects.

    torch's closure (``opt.zero_grad(); loss = opt.backward(...); return loss``) reads
    and writes the facade's parameters and gradients: it runs between the iterations,
    called exactly when and as often as torch calls it, never inside a trace. The
    bookkeeping between the calls is NumPy float64 (torch's is Python floats and small
    tensors): op-by-op JAX would compile every small operation once, seconds in all.
    """

    xp = np

    @staticmethod
    def host(tree):
        return jax.tree.map(np.asarray, tree)

    @staticmethod
    def while_loop(cond_fun, body_fun, carry):
        while bool(cond_fun(carry)):
            carry = body_fun(carry)
        return carry

    @staticmethod
    def cond(pred, true_fun, false_fun, *operands):
        return true_fun(*operands) if bool(pred) else false_fun(*operands)


def _axpy(x: jax.Array, t: jax.Array, d: jax.Array, xp: Any = jnp) -> jax.Array:
    # torch's p.add_(d, alpha=t): the scalar in the parameters' dtype
    return x + xp.asarray(t).astype(x.dtype) * d


def _strong_wolfe(evaluate, x, t, d, f, g, gtd, max_ls, ops=_Traced, c1=1e-4, c2=0.9, tolerance_change=1e-9):
    """torch's ``_strong_wolfe`` (from minFunc's lswolfe) as two while loops (``ops``'s).

    A point of the search is one packed row ``[t, f, gtd, g...]`` (in the wider of the
    scalar and gradient dtypes, so packing is exact), which keeps the traced graph, and
    the compile time, small. Returns ``(f_new, g_new, t, ls_func_evals)``. As in torch,
    ``tolerance_change`` here is always its default (LBFGS.step does not pass its own).
    """
    xp = ops.xp
    dtype = xp.result_type(t, f, g)

    def point(t, f, g):
        g = g.astype(x.dtype)
        return xp.concatenate([xp.stack([t, f, xp.dot(g, d)]).astype(dtype), g.astype(dtype)])

    def at(t):
        f_t, g_t = evaluate(_axpy(x, t, d, xp))
        return point(t, f_t, g_t)

    def unpack(row):
        return row[0], row[1], row[2], row[3:]

    d_norm = xp.max(xp.abs(d))
    start = xp.concatenate([xp.stack([xp.zeros_like(t), f, gtd]).astype(dtype), g.astype(dtype)])
    f, gtd = start[1], start[2]

    # bracket an interval containing a point satisfying the Wolfe criteria
    def conditions(c):
        _, f_prev, _, _ = unpack(c["prev"])
        t_new, f_new, gtd_new, _ = unpack(c["new"])
        armijo = (f_new > (f + c1 * t_new * gtd)) | ((c["ls_iter"] > 1) & (f_new >= f_prev))
        wolfe = xp.abs(gtd_new) <= -c2 * gtd
        return armijo, wolfe, gtd_new >= 0

    def bracket_cond(c):
        armijo, wolfe, positive = conditions(c)
        return (c["ls_iter"] < max_ls) & ~(armijo | wolfe | positive)

    def bracket_body(c):
        t_prev, f_prev, gtd_prev, _ = unpack(c["prev"])
        t, f_new, gtd_new, _ = unpack(c["new"])
        min_step = t + 0.01 * (t - t_prev)
        max_step = t * 10
        t_next = _cubic_interpolate(
            t_prev, f_prev, gtd_prev, t, f_new, gtd_new, bounds=(min_step, max_step), xp=xp
        )
        return {"prev": c["new"], "new": at(t_next), "ls_iter": c["ls_iter"] + 1}

    c = {"prev": start, "new": at(t), "ls_iter": xp.zeros((), xp.int32)}
    c = ops.while_loop(bracket_cond, bracket_body, c)
    armijo, wolfe, _ = conditions(c)
    reached_max = c["ls_iter"] >= max_ls
    one_point = ~reached_max & ~armijo & wolfe
    first = xp.where(
        reached_max,
        xp.concatenate([xp.zeros_like(start[:1]), start[1:]]),
        xp.where(one_point, c["new"], c["prev"]),
    )
    bracket = xp.stack([first, c["new"]])

    # zoom phase: refine the bracket until a point satisfies the criteria
    low = xp.where(bracket[0, 1] <= bracket[1, 1], 0, 1)
    z = {
        "bracket": bracket,
        "low": low,
        "done": one_point,
        "insuf": xp.zeros((), bool),
        "ls_iter": c["ls_iter"],
    }

    def zoom_cond(z):
        b = z["bracket"]
        small = xp.abs(b[1, 0] - b[0, 0]) * d_norm < tolerance_change
        return ~z["done"] & (z["ls_iter"] < max_ls) & ~small

    def zoom_body(z):
        b, low = z["bracket"], z["low"]
        high = 1 - low
        t = _cubic_interpolate(b[0, 0], b[0, 1], b[0, 2], b[1, 0], b[1, 1], b[1, 2], xp=xp)
        b_max, b_min = _py_max(xp, b[0, 0], b[1, 0]), _py_min(xp, b[0, 0], b[1, 0])
        eps = 0.1 * (b_max - b_min)
        near = _py_min(xp, b_max - t, t - b_min) < eps
        at_edge = z["insuf"] | (t >= b_max) | (t <= b_min)
        moved = xp.where(xp.abs(t - b_max) < xp.abs(t - b_min), b_max - eps, b_min + eps)
        t = xp.where(near & at_edge, moved, t)
        new = at(t)
        _, f_new, gtd_new, _ = unpack(new)
        # Armijo condition not satisfied or not lower than lowest point: new point is high
        fail = (f_new > (f + c1 * t * gtd)) | (f_new >= b[low, 1])
        done = ~fail & (xp.abs(gtd_new) <= -c2 * gtd)
        # otherwise the old high becomes the new low if the slope says so, and the new
        # point becomes the low
        swap = ~fail & ~done & (gtd_new * (b[high, 0] - b[low, 0]) >= 0)
        target = xp.where(fail, high, low)
        rows = []
        for pos in (0, 1):
            kept = xp.where(swap & (high == pos), b[low], b[pos])
            rows.append(xp.where(target == pos, new, kept))
        b = xp.stack(rows)
        low = xp.where(fail, xp.where(b[0, 1] <= b[1, 1], 0, 1), low)
        return {"bracket": b, "low": low, "done": done, "insuf": near & ~at_edge, "ls_iter": z["ls_iter"] + 1}

    z = ops.while_loop(zoom_cond, zoom_body, z)
    t_best, f_best, _, g_best = unpack(z["bracket"][z["low"]])
    # every iteration of either loop evaluated once, plus the first evaluation
    evals = z["ls_iter"] + 1
    return f_best.astype(f.dtype), g_best.astype(x.dtype), t_best.astype(t.dtype), evals


def _lbfgs_step(params, grads, state, value_fn, value, static):
    """One traced step from a pure loss function: ``(new_params, new_state, loss0)``."""
    check_params(params)
    x0, unravel = ravel_pytree(params)
    sdt = hparam_dtype()

    def evaluate(x):
        loss, g = jax.value_and_grad(value_fn)(unravel(x))
        return jnp.asarray(loss).astype(sdt), ravel_pytree(g)[0].astype(x0.dtype)

    # torch: orig_loss = closure(); flat_grad = self._gather_flat_grad()
    if grads is None:
        loss0, g0 = evaluate(x0)
    else:
        check_like_params(params, grads)
        grads = jax.tree.map(
            lambda g, p: g if g is not None or p is None else jnp.zeros_like(p),
            grads,
            params,
            is_leaf=is_none,
        )
        g0 = ravel_pytree(grads)[0].astype(x0.dtype)
        loss0 = jnp.asarray(value_fn(params) if value is None else value).astype(sdt)
    x, new_state = _lbfgs_iterate(evaluate, x0, loss0, g0, state, static, _Traced)
    return unravel(x), new_state, loss0


def _lbfgs_eager_step(
    evaluate: Callable[[jax.Array], tuple[Any, jax.Array]], x0: jax.Array, state: LBFGSState
) -> tuple[jax.Array, LBFGSState, jax.Array]:
    """One torch ``LBFGS.step(closure)`` with Python control flow around a side-effecting closure.

    Args:
      evaluate: ``flat_params -> (loss, flat_grad)``: set the parameters, call the
        closure, read the gradients; called exactly when torch calls its closure.
      x0: the current parameters, raveled (``jax.flatten_util.ravel_pytree``).
      state: an ``lbfgs`` state.

    Returns:
      ``(flat_new_params, new_state, loss0)``: the same numbers as the jitted step.
    """
    sdt = hparam_dtype()

    def on_host(x):
        loss, g = evaluate(jnp.asarray(x))
        return np.asarray(loss).astype(sdt), np.asarray(g).astype(x0.dtype)

    loss0, g0 = on_host(x0)  # torch: orig_loss = closure()
    x, new_state = _lbfgs_iterate(on_host, x0, loss0, g0, state, state.hparams.static, _Eager)
    return jnp.asarray(x), jax.tree.map(jnp.asarray, new_state), jnp.asarray(loss0)


def _direction(c, first, history_size):
    """The L-BFGS two-loop recursion, after updating the curvature memory."""
    g = c["g"]
    y = g - c["prev_flat_grad"]
    s = c["d"] * c["t"].astype(g.dtype)
    ys = jnp.dot(y, s)
    push = ~first & (ys > 1e-10)
    slot = c["history_count"] % history_size
    old_dirs = c["old_dirs"].at[slot].set(jnp.where(push, y, c["old_dirs"][slot]))
    old_stps = c["old_stps"].at[slot].set(jnp.where(push, s, c["old_stps"][slot]))
    ro = c["ro"].at[slot].set(jnp.where(push, 1.0 / ys, c["ro"][slot]))
    count = jnp.where(first, 0, c["history_count"] + push.astype(jnp.int32))
    h_diag = jnp.where(first, jnp.ones_like(c["H_diag"]), c["H_diag"])
    h_diag = jnp.where(push, (ys / jnp.dot(y, y)).astype(h_diag.dtype), h_diag)
    num_old = jnp.minimum(count, history_size)
    base = count - num_old

    def row(i):
        return (base + i) % history_size

    def backward(k, carry):
        q, al = carry
        i = num_old - 1 - k
        a = jnp.dot(old_stps[row(i)], q) * ro[row(i)]
        return q + (-a) * old_dirs[row(i)], al.at[i].set(a)

    q, al = jax.lax.fori_loop(0, num_old, backward, (-g, jnp.zeros_like(ro)))
    r = q * h_diag.astype(q.dtype)

    def forward(i, r):
        be_i = jnp.dot(old_dirs[row(i)], r) * ro[row(i)]
        return r + (al[i] - be_i) * old_stps[row(i)]

    d = jax.lax.fori_loop(0, num_old, forward, r)
    return d, old_dirs, old_stps, ro, count, h_diag


# pure, so jitted once (also when the step around it runs eagerly); inlined under a trace
_DIRECTION = jax.jit(_direction, static_argnums=2)
_DIRECTION_KEYS = ("g", "prev_flat_grad", "d", "t", "old_dirs", "old_stps", "ro", "history_count", "H_diag")


def _lbfgs_iterate(evaluate, x0, loss0, g0, state, static, ops):
    """torch's iterations of one step from ``(x0, loss0, g0)``: ``(x, new_state)``."""
    history_size, line_search = static["history_size"], static["line_search_fn"]
    xp, sdt, hparams = ops.xp, hparam_dtype(), state.hparams
    state, x0, loss0, g0 = ops.host((state, x0, loss0, g0))
    hp = state.hparams
    lr = hp["lr"].astype(sdt)
    tolerance_grad, tolerance_change = hp["tolerance_grad"], hp["tolerance_change"]
    max_iter, max_eval = hp["max_iter"], hp["max_eval"]

    c = {
        "x": x0,
        "loss": loss0,
        "g": g0,
        "d": state.d,
        "t": state.t,
        "old_dirs": state.old_dirs,
        "old_stps": state.old_stps,
        "ro": state.ro,
        "history_count": state.history_count,
        "H_diag": state.H_diag,
        "prev_flat_grad": state.prev_flat_grad,
        "prev_loss": state.prev_loss,
        "state_n_iter": state.n_iter,
        "func_evals": state.func_evals + 1,
        "current_evals": xp.ones((), xp.int32),
        "n_iter": xp.zeros((), xp.int32),
        # torch returns at once when the first gradient is already optimal
        "stop": (xp.max(xp.abs(g0)) <= tolerance_grad) | (max_iter <= 0),
    }

    def body(c):
        n_iter = c["n_iter"] + 1
        state_n_iter = c["state_n_iter"] + 1
        first = state_n_iter == 1
        d, old_dirs, old_stps, ro, count, h_diag = ops.host(
            _DIRECTION({k: c[k] for k in _DIRECTION_KEYS}, first, history_size)
        )
        g, loss = c["g"], c["loss"]
        # reset initial guess for step size: the first ever iteration scales by the L1 norm
        # torch: min(1.0, 1.0 / flat_grad.abs().sum()) * lr, Python's min (a NaN norm: 1)
        t = xp.where(first, _py_min(xp, 1.0, 1.0 / xp.sum(xp.abs(g)).astype(sdt)) * lr, lr)
        gtd = xp.dot(g, d)
        new = {
            **c,
            "d": d,
            "t": t,
            "old_dirs": old_dirs,
            "old_stps": old_stps,
            "ro": ro,
            "history_count": count,
            "H_diag": h_diag,
            "prev_flat_grad": g,
            "prev_loss": loss,
            "state_n_iter": state_n_iter,
            "n_iter": n_iter,
        }

        def move(c):
            x = c["x"]
            if line_search == "strong_wolfe":
                loss, g, t, ls_evals = _strong_wolfe(
                    evaluate, x, c["t"], c["d"], c["loss"], c["g"], gtd, c["max_ls"], ops
                )
                opt_cond = xp.max(xp.abs(g)) <= tolerance_grad
            else:
                t = c["t"]

                def reevaluate(x):
                    loss, g = evaluate(x)
                    return loss, g, xp.max(xp.abs(g)) <= tolerance_grad, xp.ones((), xp.int32)

                def keep(x):
                    del x
                    return c["loss"], c["g"], xp.zeros((), bool), xp.zeros((), xp.int32)

                # torch re-evaluates only if this is not the last iteration
                loss, g, opt_cond, ls_evals = ops.cond(
                    c["n_iter"] != max_iter, reevaluate, keep, _axpy(x, t, c["d"], xp)
                )
            x = _axpy(x, t, c["d"], xp)
            current_evals = c["current_evals"] + ls_evals
            stop = (
                (c["n_iter"] == max_iter)
                | (current_evals >= max_eval)
                | opt_cond
                | (xp.max(xp.abs(c["d"] * t.astype(x.dtype))) <= tolerance_change)
                | (xp.abs(loss - c["prev_loss"]) < tolerance_change)
            )
            return {
                **{k: v for k, v in c.items() if k != "max_ls"},
                "x": x,
                "loss": loss,
                "g": g,
                "t": t,
                "func_evals": c["func_evals"] + ls_evals,
                "current_evals": current_evals,
                "stop": stop,
            }

        def halt(c):
            return {**{k: v for k, v in c.items() if k != "max_ls"}, "stop": xp.ones((), bool)}

        # directional derivative is below tolerance: stop before moving
        new["max_ls"] = max_eval - c["current_evals"]
        return ops.cond(gtd > -tolerance_change, halt, move, new)

    c = ops.while_loop(lambda c: ~c["stop"], body, c)
    new_state = LBFGSState(
        hparams=hparams,
        count=state.count + 1,
        d=c["d"],
        t=c["t"],
        old_dirs=c["old_dirs"],
        old_stps=c["old_stps"],
        ro=c["ro"],
        history_count=c["history_count"],
        H_diag=c["H_diag"],
        prev_flat_grad=c["prev_flat_grad"],
        prev_loss=c["prev_loss"],
        n_iter=c["state_n_iter"],
        func_evals=c["func_evals"],
    )
    return c["x"], new_state


def lbfgs(
    lr: Any = 1,
    max_iter: int = 20,
    max_eval: int | None = None,
    tolerance_grad: Any = 1e-7,
    tolerance_change: Any = 1e-9,
    history_size: int = 100,
    line_search_fn: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""L-BFGS with torch's exact semantics (``torch.optim.LBFGS``), jitted as a whole.

    One step is one ``torch.optim.LBFGS.step(closure)`` with the loss function
    ``value_fn(params) -> scalar`` as the closure: up to ``max_iter`` iterations of

    .. math::

        d_k &= -H_k g_k \quad (\text{two-loop recursion over the last
            } m = \text{history\_size pairs},\ H_0 = \tfrac{y^\top s}{y^\top y} I) \\
        t_k &= \begin{cases} \min(1, 1/\|g_0\|_1)\,\gamma & \text{the very first
            iteration} \\ \gamma & \text{otherwise} \end{cases} \\
        \theta_{k+1} &= \theta_k + t_k d_k \quad (t_k \text{ from the strong-Wolfe
            search when } \text{line\_search\_fn} = \text{"strong\_wolfe"})

    with :math:`\gamma` = ``lr``; a pair :math:`(y, s)` enters the memory only when
    :math:`y^\top s > 10^{-10}`. The step ends (torch's order) when the first gradient
    already has :math:`\max|g| \le` ``tolerance_grad``, when :math:`g^\top d >
    -`\ ``tolerance_change``, after ``max_iter`` iterations, after ``max_eval`` loss
    evaluations, when :math:`\max|g| \le` ``tolerance_grad``, when
    :math:`\max|t d| \le` ``tolerance_change``, or when the loss changed by less than
    ``tolerance_change``.

    Use it through ``lbfgs_step`` (the closure form) or ``fo.step`` / ``tx.update`` with
    the extra argument ``value_fn`` (optax's convention for ``optax.lbfgs``)::

        tx = fo.lbfgs(line_search_fn="strong_wolfe")
        state = tx.init(params)
        params, state, loss = fo.lbfgs_step(tx, loss_fn, params, state)
        # or, with gradients at hand:
        params, state = fo.step(tx, params, grads, state, value_fn=loss_fn, value=loss)

    Args:
      lr: learning rate :math:`\gamma`, default 1 (a number or a 0-d array).
      max_iter: maximal number of iterations per step, default 20.
      max_eval: maximal number of loss evaluations per step, default ``max_iter * 5 //
        4`` (torch's rounding).
      tolerance_grad: termination tolerance on first-order optimality, default 1e-7.
      tolerance_change: termination tolerance on loss and parameter changes, default
        1e-9.
      history_size: number of curvature pairs kept, default 100 (static: it sizes the
        ring buffers).
      line_search_fn: ``None`` (fixed steps) or ``"strong_wolfe"`` (static).

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is an ``LBFGSState``.
      Its ``update(grads, state, params, *, value_fn, value=None)`` takes the loss
      function as an extra argument; ``grads`` may be ``None`` (then it evaluates
      ``value_fn`` for them) and ``value`` is the loss at ``params`` (evaluated when
      omitted). It counts as torch's first closure call.

    Raises:
      ValueError: ``Invalid learning rate: {lr}`` (torch's text); ``history_size must be
        an integer >= 1, got {history_size}``.
      RuntimeError: ``only 'strong_wolfe' is supported`` for another
        ``line_search_fn`` (torch's text, raised at construction, not at the first step).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.lbfgs(history_size=10, line_search_fn="strong_wolfe")
      >>> state = tx.init({"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)})
      >>> state.old_dirs.shape, state.d.shape, int(fo.get_hparams(state)["max_eval"])
      ((10, 9), (9,), 25)

    Note:
      ``optax.lbfgs`` is one L-BFGS iteration per update with a zoom line search, no
      L1-norm scaling of the first step and other stopping rules; this is torch's whole
      closure-driven step. Differences from torch: the flat vectors are the leaves raveled
      in tree order (``jax.flatten_util.ravel_pytree``) rather than torch's parameter
      order; torch's scratch list ``al`` is not kept in the state; a ``None`` gradient leaf
      counts as zeros (as torch's ``_gather_flat_grad``); an invalid ``line_search_fn``
      raises at construction. With float32 parameters the scalars (loss, ``t``) are kept
      in float64 under x64 as torch's Python floats, but torch mixes float32 0-d tensors
      into some of them, so float32 parity is approximate.

    References:
      Nocedal, "Updating Quasi-Newton Matrices with Limited Storage", Math. Comp. 1980;
      Schmidt, minFunc. Mirrors ``torch.optim.LBFGS``.
    """
    if line_search_fn is not None and line_search_fn != "strong_wolfe":
        raise RuntimeError("only 'strong_wolfe' is supported")
    if callable(lr):
        raise TypeError("lbfgs: lr must be a number or a 0-d array, not a schedule")
    if max_eval is None:
        max_eval = max_iter * 5 // 4
    static = {"history_size": history_size, "line_search_fn": line_search_fn}
    values = {"lr": squeeze_lr(lr), "tolerance_grad": tolerance_grad, "tolerance_change": tolerance_change}
    _validate({k: to_python(v) for k, v in values.items()}, static)
    hdt = hparam_dtype()
    hp_values = {k: jnp.asarray(v, hdt) for k, v in values.items()}
    hp_values["max_iter"] = jnp.asarray(max_iter, jnp.int32)
    hp_values["max_eval"] = jnp.asarray(max_eval, jnp.int32)

    def init(params: PyTree) -> LBFGSState:
        check_params(params)
        flat, _ = ravel_pytree(params)
        n, dtype = flat.shape[0], flat.dtype
        zeros = jnp.zeros((n,), dtype)
        return LBFGSState(
            hparams=HParams(hp_values, "LBFGS", _validate, static),
            count=jnp.zeros((), jnp.int32),
            d=zeros,
            t=jnp.zeros((), hdt),
            old_dirs=jnp.zeros((history_size, n), dtype),
            old_stps=jnp.zeros((history_size, n), dtype),
            ro=jnp.zeros((history_size,), dtype),
            history_count=jnp.zeros((), jnp.int32),
            H_diag=jnp.ones((), dtype),
            prev_flat_grad=zeros,
            prev_loss=jnp.zeros((), hdt),
            n_iter=jnp.zeros((), jnp.int32),
            func_evals=jnp.zeros((), jnp.int32),
        )

    def step_fn(
        params, grads, state, *, value_fn: Callable[[PyTree], Any] | None = None, value=None, **extra
    ):
        del extra
        if value_fn is None:
            raise ValueError(
                "lbfgs needs the loss function: pass value_fn=loss_fn (fo.step(tx, params, grads, "
                "state, value_fn=loss_fn)) or use fo.lbfgs_step(tx, loss_fn, params, state)"
            )
        new_params, new_state, _ = _lbfgs_step(params, grads, state, value_fn, value, static)
        return new_params, new_state

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("LBFGS: update() needs params (the loss function is evaluated at them)")
        new_params, state = step_fn(params, grads, state, **extra_args)
        updates = jax.tree.map(lambda new, p: new - p, new_params, params)
        return updates, state

    setattr(update, STEP_ATTR, step_fn)
    update.fo_lbfgs = _lbfgs_step
    return optax.GradientTransformationExtraArgs(init, update)


def lbfgs_step(
    tx: optax.GradientTransformationExtraArgs,
    value_fn: Callable[[PyTree], Any],
    params: PyTree,
    state: LBFGSState,
) -> tuple[PyTree, LBFGSState, jax.Array]:
    """One closure-driven L-BFGS step: torch's ``loss = opt.step(closure)``, functionally.

    Args:
      tx: a transformation built by ``lbfgs``.
      value_fn: the loss function ``params -> scalar`` (torch's closure, without the
        ``backward``: the gradient comes from ``jax.value_and_grad``). To feed data
        without recompiling, pass a ``jax.tree_util.Partial`` and jit with ``value_fn``
        as an argument.
      params: the parameter pytree.
      state: ``tx``'s state.

    Returns:
      ``(new_params, new_state, loss)``, where ``loss`` is the loss at ``params``
      (torch's step returns the closure's first value).

    Raises:
      TypeError: if ``tx`` was not built by ``lbfgs``.

    Examples:
      >>> import jax, jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.lbfgs()
      >>> loss_fn = lambda p: jnp.sum((p["x"] - 3.0) ** 2)
      >>> step = jax.jit(lambda p, s: fo.lbfgs_step(tx, loss_fn, p, s))
      >>> params = {"x": jnp.zeros(2)}
      >>> params, state, loss = step(params, tx.init(params))
      >>> float(loss), params["x"].tolist(), int(state.func_evals), int(state.n_iter)
      (18.0, [3.0, 3.0], 3, 2)
    """
    inner = getattr(tx.update, "fo_lbfgs", None)
    if inner is None:
        raise TypeError("lbfgs_step: tx must be built by functorch_optim.lbfgs")
    static = state.hparams.static
    new_params, new_state, loss = inner(params, None, state, value_fn, None, static)
    return new_params, new_state, loss
