"""``torch.optim.LBFGS`` as an imperative class over the functional ``lbfgs``.

Small and separate from ``Optimizer``: LBFGS has one parameter group, gradients that
only its closure fills and one global state, which torch keeps under its first
parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from functorch_optim._hyperparams import set_hparams, to_python
from functorch_optim._lbfgs import LBFGSState, _lbfgs_eager_step, lbfgs, lbfgs_step
from functorch_optim._tree import PyTree, check_params, is_none
from functorch_optim.interop.torch import _to_numpy
from functorch_optim.optim._optimizer import (
    _BACKWARD,
    Optimizer,
    _as_tuples,
    _checked_grad,
    _Layout,
    _same,
    _torch_available,
    check_foreign_keys,
    check_names,
    closure_takes_params,
    export_state_dict,
    read_state_dict,
    whole_count,
)

#: The constructor's arguments, torch's order; the keys of ``param_groups[0]``.
_ARGS = ("lr", "max_iter", "max_eval", "tolerance_grad", "tolerance_change", "history_size", "line_search_fn")
#: torch's global state entry: the counters, then (after an iteration) the history, then the
#: two-loop scratch list ``al`` (optional: recomputed).
_COUNTERS = ("func_evals", "n_iter")
_HISTORY = ("d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss")
#: Those living in the functional state (``set_hparams``: no recompilation).
_NUMERIC = ("lr", "max_iter", "max_eval", "tolerance_grad", "tolerance_change")


def _run(tx, closure, params, state):
    return lbfgs_step(tx, closure, params, state)


# compiled once per (transformation, closure) pair; params and state donated
_STEP = jax.jit(_run, static_argnums=(0, 1), donate_argnums=(2, 3))


def _own(tree: PyTree) -> PyTree:
    # distinct buffers per leaf (init shares its zeros), as donation requires
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _scalar(x: Any) -> float:
    return float(_to_numpy(x))


class LBFGS:
    """``torch.optim.LBFGS`` on JAX: the imperative facade over ``functorch_optim.lbfgs``.

    ``LBFGS(params, lr=1, max_iter=20, max_eval=None, tolerance_grad=1e-7,
    tolerance_change=1e-9, history_size=100, line_search_fn=None)`` — torch's
    arguments, names and defaults (``max_eval=None`` becomes ``max_iter * 5 // 4``, as
    torch stores it). ``params`` is one pytree of floating point arrays (copied);
    ``opt.params`` returns the current ones. Parameter order (torch's numbering, the
    flat vectors' layout) is ``jax.tree.leaves`` order; parameter names
    (``param_names``) and their check on loading are ``Optimizer``'s.

    ``step(closure)`` takes either closure, told apart by its signature (see
    ``functorch_optim.optim.closure_takes_params``):

    * torch's ``closure() -> loss``, unchanged: ``opt.zero_grad(); loss =
      opt.backward(loss_fn, x, y); return loss``. The step then runs torch's algorithm
      with Python control flow, setting the parameters and calling the closure exactly
      when and as often as torch does (same ``n_iter`` and ``func_evals``); the
      bookkeeping in between is NumPy float64, the two-loop recursion jitted once.
    * a pure, jittable ``closure(params) -> loss``, whose gradient comes from
      ``jax.value_and_grad``: the whole ``step(closure)`` (up to ``max_iter``
      iterations, the line search included) is one jitted call, compiled once per
      closure object. Pass the same function every step (to feed new data, close over
      it in a ``jax.tree_util.Partial`` made once, or rebuild the closure and accept a
      recompilation).

    Both give the same numbers (torch's, to float64 rounding).

    Attributes:
      param_groups: a list with torch's one group dict: ``"params"`` (the current
        parameters) and every argument above. Assigning ``lr``, ``max_iter``,
        ``max_eval``, ``tolerance_grad`` or ``tolerance_change`` takes effect on the next
        ``step()`` without recompiling; ``history_size`` or ``line_search_fn`` rebuilds
        the transformation (one recompilation), keeping the history.
      defaults: the constructor's arguments, like torch's ``defaults``.

    Raises:
      ValueError: ``LBFGS doesn't support per-parameter options (parameter groups)``
        (torch's text) for a list of group dicts other than a single one;
        ``Invalid learning rate: {lr}``; ``optimizer got an empty parameter list``;
        ``some parameters appear in more than one parameter group`` (torch's text, checked
        first) when groups share an array.
      UserWarning: torch's "a parameter group with duplicate parameters" warning when the
        same array appears twice.
      RuntimeError: ``only 'strong_wolfe' is supported`` for another ``line_search_fn``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from functorch_optim.optim import LBFGS
      >>> opt = LBFGS({"x": jnp.zeros(2)})
      >>> def closure(params):
      ...     return jnp.sum((params["x"] - 3.0) ** 2)
      >>> float(opt.step(closure))
      18.0
      >>> opt.params["x"].tolist()
      [3.0, 3.0]
      >>> sorted(opt.state_dict()["state"][0])[:3]
      ['H_diag', 'al', 'd']
      >>> def torch_closure():  # torch's form: zero_grad, backward, return the loss
      ...     opt.zero_grad()
      ...     return opt.backward(closure)
      >>> float(opt.step(torch_closure))
      0.0

    Note:
      The parameters and state are donated to the jitted step: arrays read from
      ``opt.params`` or ``opt.state`` before a ``step()`` are deleted by it. The flat
      state vectors follow ``jax.flatten_util.ravel_pytree`` (leaves raveled in tree
      order), which is torch's layout for the same leaves in the same order.
    """

    def __init__(
        self,
        params: Any,
        lr: Any = 1,
        max_iter: int = 20,
        max_eval: int | None = None,
        tolerance_grad: float = 1e-7,
        tolerance_change: float = 1e-9,
        history_size: int = 100,
        line_search_fn: str | None = None,
    ) -> None:
        if max_eval is None:
            max_eval = max_iter * 5 // 4
        config = dict(
            zip(
                _ARGS,
                (lr, max_iter, max_eval, tolerance_grad, tolerance_change, history_size, line_search_fn),
                strict=True,
            )
        )
        self.defaults = dict(config)
        if (
            isinstance(params, list | tuple)
            and params
            and all(isinstance(g, Mapping) and "params" in g for g in params)
        ):
            # torch's Optimizer checks for duplicates before LBFGS looks at the group count
            Optimizer._check_duplicates([g["params"] for g in params])
            if len(params) != 1:
                raise ValueError("LBFGS doesn't support per-parameter options (parameter groups)")
            overrides = {k: v for k, v in params[0].items() if k != "params"}
            params = params[0]["params"]
        else:
            Optimizer._check_duplicates([params])
            overrides = {}
        if not jax.tree.leaves(params):
            raise ValueError("optimizer got an empty parameter list")
        check_params(params)
        (names,), _ = Optimizer._resolve_names([params], [overrides], [Optimizer._tree_names(params)])
        config.update({k: v for k, v in overrides.items() if k != "param_names"})
        tx = lbfgs(**config)
        self._params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        self._tx = tx
        self._state = _own(tx.init(self._params))
        self._grads: PyTree = jax.tree.map(lambda _: None, self._params)
        named = {} if names is None else {"param_names": names}
        self.param_groups: list[dict[str, Any]] = [{"params": self._params, **named, **config}]
        self._applied = dict(config)

    # -- parameters and state -------------------------------------------------------------

    @property
    def params(self) -> PyTree:
        """The current parameters, in the structure given to the constructor."""
        return self._params

    @property
    def state(self) -> LBFGSState:
        """The functional state, an ``LBFGSState`` (torch's names, ring-buffer history).

        Reading it first applies pending ``param_groups`` edits (as ``step()`` would), so
        a state saved right after a scheduler's ``step()`` holds the new lr.
        """
        self._sync_group()
        return self._state

    @property
    def grad(self) -> PyTree:
        """The gradients the closure's ``backward`` left, shaped like ``params``.

        ``None`` leaves after ``zero_grad()``. Writable like ``Optimizer.grad`` (a pytree
        like ``params``, the parameters' dtypes): what torch's closure leaves in
        ``p.grad`` (e.g. clipped with ``functorch_optim.nn.utils.clip_grad_norm_``) is
        what the step uses.
        """
        return self._grads

    @grad.setter
    def grad(self, value: PyTree) -> None:
        self._grads = _checked_grad(self._params, value)[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as torch's ``zero_grad``; torch's closure calls it first.

        Args:
          set_to_none: default True: every gradient becomes ``None``; with False,
            existing ones become zeros.
        """
        if set_to_none:
            self._grads = jax.tree.map(lambda _: None, self._params)
        else:
            self._grads = jax.tree.map(
                lambda g: None if g is None else jnp.zeros_like(g), self._grads, is_leaf=is_none
            )

    def backward(
        self, loss_fn: Callable[..., Any], *args: Any, has_aux: bool = False, **kwargs: Any
    ) -> jax.Array | tuple[jax.Array, Any]:
        """``loss_fn(opt.params, *args, **kwargs)``, its gradient ADDED into ``opt.grad``.

        ``Optimizer.backward``'s contract (one jitted ``value_and_grad`` per ``loss_fn``),
        for the body of torch's closure.

        Args:
          loss_fn: ``(params, *args, **kwargs) -> scalar loss`` (``-> (loss, aux)`` with
            ``has_aux=True``).
          *args: positional arguments for ``loss_fn``.
          has_aux: ``loss_fn`` returns ``(loss, aux)``; not passed to ``loss_fn``.
          **kwargs: keyword arguments for ``loss_fn``.

        Returns:
          The loss, a 0-d array; with ``has_aux=True``, ``(loss, aux)``.
        """
        layout = _Layout("tree")
        out, grads = _BACKWARD(loss_fn, layout, bool(has_aux), (self._params,), (self._grads,), args, kwargs)
        self._grads = grads[0]
        return out

    # -- the step -------------------------------------------------------------------------

    def step(self, closure: Callable[..., Any]) -> jax.Array:
        """One ``torch.optim.LBFGS.step(closure)``: up to ``max_iter`` iterations.

        Applies changed ``param_groups`` values first (torch's messages; on an error
        nothing changes).

        Args:
          closure: torch's ``closure() -> loss`` (it calls ``opt.zero_grad()`` and
            ``opt.backward(...)``; called as torch calls it, the step around it eager),
            or a pure, jittable ``closure(params) -> loss`` (the whole step one jitted
            call, compiled once per function object). Told apart by the signature: a
            closure callable without arguments is torch's.

        Returns:
          The loss at the parameters the step started from (torch's ``orig_loss``), a
          0-d array.

        Raises:
          TypeError: a closure that needs more than one argument.
        """
        pure = closure_takes_params(closure)
        self._sync_group()
        if pure:
            params, state, loss = _STEP(self._tx, closure, self._params, self._state)
        else:
            params, state, loss = self._eager_step(closure)
        self._params, self._state = params, state
        self.param_groups[0]["params"] = params
        return loss

    def _eager_step(self, closure: Callable[[], Any]) -> tuple[PyTree, LBFGSState, jax.Array]:
        x0, unravel = ravel_pytree(self._params)

        def evaluate(x: jax.Array) -> tuple[Any, jax.Array]:
            self._params = unravel(x)
            self.param_groups[0]["params"] = self._params
            loss = closure()
            grads = jax.tree.map(
                lambda g, p: jnp.zeros_like(p) if g is None else g, self._grads, self._params, is_leaf=is_none
            )
            return loss, ravel_pytree(grads)[0].astype(x0.dtype)

        x, state, loss = _lbfgs_eager_step(evaluate, x0, self._state)
        return unravel(x), state, loss

    def _sync_group(self) -> None:
        group = self.param_groups[0]
        changed = {k: group[k] for k in _ARGS if not _same(group[k], self._applied[k])}
        if not changed:
            return
        if any(k not in _NUMERIC for k in changed):
            self._rebuild({k: group[k] for k in _ARGS})
        else:
            self._state = set_hparams(self._state, **changed)
            self._applied.update(changed)

    def _rebuild(self, config: Mapping[str, Any]) -> None:
        """A new transformation for changed static flags; the state carried over by torch's layout."""
        entry = self._torch_entry()
        tx = lbfgs(**config)
        state = self._state_from_entry(tx, entry)
        self._tx, self._state = tx, state
        self._applied = dict(config)

    # -- torch's state_dict ---------------------------------------------------------------

    def _torch_entry(self) -> dict[str, Any]:
        """torch's global state dict (kept under the first parameter), host copies."""
        st = jax.device_get(self._state)
        n_iter, func_evals = int(st.n_iter), int(st.func_evals)
        if n_iter == 0 and func_evals == 0:
            return {}
        entry: dict[str, Any] = {"func_evals": func_evals, "n_iter": n_iter}
        if n_iter == 0:  # the first gradient was already optimal: torch stopped there
            return entry
        old_dirs, old_stps, ro = st.history()
        num_old = ro.shape[0]
        entry.update(
            d=np.array(st.d, copy=True),
            t=float(st.t),
            old_dirs=[np.array(v, copy=True) for v in old_dirs],
            old_stps=[np.array(v, copy=True) for v in old_stps],
            ro=[np.array(v, copy=True) for v in ro],
            H_diag=1 if int(st.history_count) == 0 else np.array(st.H_diag, copy=True),
            prev_flat_grad=np.array(st.prev_flat_grad, copy=True),
            prev_loss=float(st.prev_loss),
        )
        if n_iter >= 2:
            # torch's scratch list of the last two-loop recursion, recomputed from the
            # state it ran on (prev_flat_grad and the history are that iteration's)
            size = st.ro.shape[0]
            al: list[Any] = [None] * size
            q = -np.asarray(st.prev_flat_grad)
            for i in range(num_old - 1, -1, -1):
                al[i] = np.asarray(old_stps[i] @ q * ro[i])
                q = q - al[i] * old_dirs[i]
            entry["al"] = al
        return entry

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's ``LBFGS`` layout, with torch tensors and Python numbers.

        ``{"state": {0: {...}}, "param_groups": [{"lr": …, …, "params": [0, 1, …]}]}``:
        torch keeps LBFGS's global state under its first parameter: ``func_evals``,
        ``n_iter`` (ints); after an iteration also ``d``, ``t`` (float), ``old_dirs``,
        ``old_stps``, ``ro`` (lists, oldest first), ``H_diag`` (``1`` until a pair is
        stored, then a 0-d array), ``prev_flat_grad``, ``prev_loss`` (float); from the
        second iteration on ``al`` (torch's scratch list, recomputed). Empty before the
        first step. It loads into ``torch.optim.LBFGS`` as it is, and ``torch.load``
        reads what ``torch.save`` writes of it with ``weights_only=True`` (without torch
        installed: NumPy arrays, see ``Optimizer.state_dict``).

        Returns:
          The state dict; it can be pickled, and loaded by ``load_state_dict``.
        """
        entry = self._torch_entry()
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(jax.tree.leaves(self._params))))
        sd = {"state": {0: entry} if entry else {}, "param_groups": [group]}
        return export_state_dict(sd, tensors=_torch_available())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict in torch's layout: this class's own or ``torch.optim.LBFGS``'s.

        The saved group's hyperparameters replace the current ones (torch's behavior);
        the saved history becomes the ring buffers. ``LBFGSState.count`` (not part of
        torch's state) is kept.

        Args:
          state_dict: ``{"state": {...}, "param_groups": [one group]}``, arrays as
            NumPy, JAX or torch tensors.

        Raises:
          ValueError: ``loaded state dict has a different number of parameter groups``,
            ``loaded state dict contains a parameter group that doesn't match the size of
            optimizer's group`` (torch's texts); a saved parameter name that differs from
            this optimizer's (see ``Optimizer.load_state_dict``); another optimizer's
            hyperparameter in the group; state under another id than the first
            parameter's; an entry without ``func_evals`` or ``n_iter``, with a negative or
            fractional one, without the history after an iteration, or with a key LBFGS
            does not keep; a vector whose length or dtype differs from the parameters',
            history lists of different lengths, or a history longer than
            ``history_size``. Nothing changes when it raises.
        """
        groups, entries = read_state_dict(state_dict)
        if len(groups) != 1:
            raise ValueError("loaded state dict has a different number of parameter groups")
        saved = groups[0]
        if len(saved["params"]) != len(jax.tree.leaves(self._params)):
            raise ValueError(
                "loaded state dict contains a parameter group "
                "that doesn't match the size of optimizer's group"
            )
        first = saved["params"][0]
        check_names(0, saved, self.param_groups[0].get("param_names"))
        check_foreign_keys("LBFGS", 0, saved, set(_ARGS))
        if set(entries) - {first}:
            other = sorted(set(entries) - {first}, key=str)[0]
            raise ValueError(
                f"loaded state dict has state for parameter id {other!r}; LBFGS keeps its state "
                f"under the first parameter ({first!r}) only"
            )
        entry = entries.get(first, {})
        config = {k: self.param_groups[0][k] for k in _ARGS}
        config.update({k: _as_tuples(saved[k], config[k]) for k in _ARGS if k in saved})
        config = {k: to_python(v) if k in _NUMERIC else v for k, v in config.items()}
        tx = lbfgs(**config)
        state = self._state_from_entry(tx, entry, first)
        extra = {k: v for k, v in saved.items() if k not in _ARGS and k != "params"}
        self._tx, self._state = tx, state
        self.param_groups[0] = {**self.param_groups[0], **extra, **config, "params": self._params}
        self._applied = dict(config)

    def _state_from_entry(self, tx: Any, entry: Mapping[str, Any], first: Any = 0) -> LBFGSState:
        fresh = tx.init(self._params)
        fields: dict[str, Any] = {"count": self._state.count}
        if not entry:
            return _own(fresh._replace(**fields))
        who = f"parameter {first!r}"
        known = (*_COUNTERS, *_HISTORY, "al")
        for key in entry:
            if key not in known:
                raise ValueError(
                    f"loaded state dict: {who} has state {key!r}, which LBFGS does not keep "
                    f"(it keeps: {', '.join(known)})"
                )
        counters = {}
        for key in _COUNTERS:
            if key not in entry:
                raise ValueError(
                    f"loaded state dict: {who} has no {key!r}; LBFGS keeps {' and '.join(_COUNTERS)}"
                )
            counters[key] = whole_count(entry[key], who, key)
        missing = [key for key in _HISTORY if key not in entry]
        if counters["n_iter"] > 0 and missing:
            raise ValueError(
                f"loaded state dict: {who} has no {missing[0]!r}; after an iteration LBFGS keeps "
                f"{', '.join(_HISTORY)}"
            )
        fields["func_evals"] = jnp.asarray(counters["func_evals"], jnp.int32)
        fields["n_iter"] = jnp.asarray(counters["n_iter"], jnp.int32)
        if counters["n_iter"] > 0:
            n, dtype = fresh.d.shape[0], fresh.d.dtype
            size = fresh.ro.shape[0]

            def vector(name: str, value: Any) -> jax.Array:
                v = _to_numpy(value).reshape(-1)
                if v.shape != (n,):
                    raise ValueError(
                        f"loaded state dict: {name} of {who} has {v.shape[0]} entries, the parameters {n}"
                    )
                if v.dtype != dtype:
                    raise ValueError(
                        f"loaded state dict: {name} of {who} has dtype {v.dtype}, but LBFGS keeps it "
                        f"in {dtype} (the parameters' dtype)"
                    )
                return jnp.asarray(v, dtype)

            dirs, stps, ro = list(entry["old_dirs"]), list(entry["old_stps"]), list(entry["ro"])
            if not len(dirs) == len(stps) == len(ro):
                raise ValueError(
                    f"loaded state dict: old_dirs, old_stps and ro of {who} have {len(dirs)}, "
                    f"{len(stps)} and {len(ro)} entries; they must have one per history pair"
                )
            if len(ro) > size:
                raise ValueError(f"loaded state dict: {len(ro)} history pairs, more than history_size={size}")
            old_dirs, old_stps, ro_buf = fresh.old_dirs, fresh.old_stps, fresh.ro
            for i, (y, s, r) in enumerate(zip(dirs, stps, ro, strict=True)):
                old_dirs = old_dirs.at[i].set(vector("old_dirs", y))
                old_stps = old_stps.at[i].set(vector("old_stps", s))
                ro_buf = ro_buf.at[i].set(jnp.asarray(_scalar(r), dtype))
            fields.update(
                d=vector("d", entry["d"]),
                t=jnp.asarray(_scalar(entry["t"]), fresh.t.dtype),
                old_dirs=old_dirs,
                old_stps=old_stps,
                ro=ro_buf,
                history_count=jnp.asarray(len(ro), jnp.int32),
                H_diag=jnp.asarray(_scalar(entry["H_diag"]), fresh.H_diag.dtype),
                prev_flat_grad=vector("prev_flat_grad", entry["prev_flat_grad"]),
                prev_loss=jnp.asarray(_scalar(entry["prev_loss"]), fresh.prev_loss.dtype),
            )
        return _own(fresh._replace(**fields))

    def __repr__(self) -> str:
        group = self.param_groups[0]
        lines = ["LBFGS (", "Parameter Group 0"]
        lines.extend(f"    {k}: {group[k]}" for k in sorted(group) if k != "params")
        return "\n".join(lines) + "\n)"
