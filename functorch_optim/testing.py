"""Side-by-side equivalence checks against ``torch.optim``, for users' own test suites.

Run a ``torch.optim`` optimizer and its ``functorch_optim`` counterpart on the same
parameters and the same gradient sequence (or the same loss function and data), and get
a per-step, per-leaf report of absolute and relative errors of the parameters and of
the optimizer state (torch's buffer names: ``momentum_buffer``, ``exp_avg``, ...)::

    from functorch_optim.testing import assert_matches_torch

    def test_my_port():
        assert_matches_torch("adam", params, grads, lr=1e-3, amsgrad=True)

Every optimizer of the registry (``functorch_optim._registry.OPTIMIZERS``) works, by its
factory name (``"sgd"``) or torch's class name (``"SGD"``), with any keyword arguments
both libraries accept. torch is imported on first use only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._base import step as _fo_step
from functorch_optim._hyperparams import set_hparams
from functorch_optim._registry import OptimizerSpec, get_spec
from functorch_optim._tree import PyTree, is_none, keystr

__all__ = [
    "DEFAULT_RTOL",
    "LeafError",
    "ParityReport",
    "assert_matches_torch",
    "compare_with_torch",
]

DEFAULT_RTOL: dict[str, float] = {"float64": 1e-10, "float32": 1e-5}
"""Default relative tolerance of ``assert_matches_torch`` and the parity report, by dtype name."""

_TINY = 1e-300


@dataclasses.dataclass(frozen=True)
class LeafError:
    """The error of one leaf (a parameter or one of its state buffers) after one step.

    Attributes:
      step: the optimizer step, counted from 1.
      kind: ``"param"`` or torch's state name (``"momentum_buffer"``, ``"exp_avg"``, ...).
      path: the leaf's key path in the parameter tree (``['layer']['w']``).
      abs_err: ``max |jax - torch|`` over the leaf's elements.
      rel_err: ``abs_err / scale`` (``scale`` floored at 1e-300).
      scale: the largest ``|torch|`` of the leaf so far: over its elements, at this
        step and every earlier one (a parameter's initial value included). A leaf that
        passes near zero thus keeps the scale it had, and one ulp of rounding there does
        not read as a large relative error.
    """

    step: int
    kind: str
    path: str
    abs_err: float
    rel_err: float
    scale: float

    @property
    def where(self) -> str:
        """The leaf as text: ``param ['w']`` or ``momentum_buffer ['w']``."""
        return f"{self.kind} {self.path}"

    def exceeds(self, rtol: float, atol: float = 0.0) -> bool:
        """Whether ``abs_err > atol + rtol * scale`` (also true for NaN errors)."""
        return not (self.abs_err <= atol + rtol * self.scale)


@dataclasses.dataclass
class ParityReport:
    """Per-step, per-leaf errors of a functorch_optim run against the torch run.

    Attributes:
      optimizer: torch's class name (``"SGD"``).
      config: the keyword arguments both optimizers were built with.
      dtype: the parameters' dtype name (``"float64"``).
      steps: the number of optimizer steps taken.
      records: one ``LeafError`` per step, leaf and kind (params first, then buffers).
    """

    optimizer: str
    config: dict[str, Any]
    dtype: str
    steps: int
    records: list[LeafError]

    @property
    def max_abs(self) -> float:
        """The largest absolute error over all steps, leaves and kinds (0 if none)."""
        return _nanmax(r.abs_err for r in self.records)

    @property
    def max_rel(self) -> float:
        """The largest relative error over all steps, leaves and kinds (0 if none)."""
        return _nanmax(r.rel_err for r in self.records)

    def per_step(self) -> list[float]:
        """The largest relative error of each step, as a list of ``steps`` floats."""
        out = [0.0] * self.steps
        for r in self.records:
            out[r.step - 1] = _nanmax((out[r.step - 1], r.rel_err))
        return out

    def worst(self) -> LeafError | None:
        """The record with the largest relative error (``None`` for an empty report)."""
        if not self.records:
            return None
        return max(self.records, key=lambda r: math.inf if math.isnan(r.rel_err) else r.rel_err)

    def first_divergence(self, rtol: float | None = None, atol: float = 0.0) -> LeafError | None:
        """The first record (by step, then leaf) with ``abs_err > atol + rtol * scale``.

        Args:
          rtol: relative tolerance; default ``DEFAULT_RTOL`` for the report's dtype.
          atol: absolute tolerance, default 0.

        Returns:
          That record, or ``None`` when every record is within tolerance.
        """
        rtol = _default_rtol(self.dtype) if rtol is None else rtol
        return next((r for r in self.records if r.exceeds(rtol, atol)), None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary: config, steps, max errors and per-step maxima."""
        return {
            "optimizer": self.optimizer,
            "config": _jsonable(self.config),
            "dtype": self.dtype,
            "steps": self.steps,
            "max_abs_err": self.max_abs,
            "max_rel_err": self.max_rel,
            "per_step_max_rel_err": self.per_step(),
        }

    def __str__(self) -> str:
        lines = [
            f"{describe(self.optimizer, self.config)} vs torch.optim.{self.optimizer}, {self.dtype}, "
            f"{self.steps} steps: max rel err {self.max_rel:.3g}, max abs err {self.max_abs:.3g}"
        ]
        worst = self.worst()
        if worst is not None:
            lines.append(f"  worst: step {worst.step}, {worst.where}: rel {worst.rel_err:.3g}")
        return "\n".join(lines)


def describe(optimizer: str, config: Mapping[str, Any]) -> str:
    """``"SGD(lr=0.1, momentum=0.9)"``: an optimizer call as text."""
    args = ", ".join(f"{k}={v!r}" for k, v in config.items())
    return f"{optimizer}({args})"


def compare_with_torch(
    optimizer: str | OptimizerSpec,
    params: PyTree,
    grads: Sequence[PyTree] | None = None,
    *,
    loss_fn: Callable[[PyTree, Any], Any] | None = None,
    data: Iterable[Any] | None = None,
    torch_loss_fn: Callable[[PyTree, Any], Any] | None = None,
    dtype: Any = None,
    buffers: Sequence[str] | None = None,
    hparams_at: Mapping[int, Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> ParityReport:
    """Run torch's optimizer and functorch_optim's side by side; report every step's errors.

    Both sides start from the same ``params`` and are built with the same ``kwargs``
    (torch's with ``foreach=False``, its reference single-tensor loop). Then either

    * ``grads`` is given: step ``t`` feeds ``grads[t]`` to both sides (a ``None`` leaf is
      a parameter without gradient, torch's ``p.grad = None``); or
    * ``loss_fn`` and ``data`` are given: step ``t`` differentiates ``loss_fn(params,
      batch_t)`` at each side's *own* current parameters (``jax.grad`` for functorch_optim;
      ``torch_loss_fn`` through torch autograd for torch if given, else ``jax.grad`` at
      torch's parameters), so the two trajectories differ only by the optimizers.

    After every step the parameters and the state buffers named by the registry (or by
    ``buffers``) are compared leaf by leaf, in float64.

    Args:
      optimizer: a registry name (``"sgd"``) or torch class name (``"SGD"``), or an
        ``OptimizerSpec``. A spec with ``closure=True`` (LBFGS) is driven by the loss:
        torch's ``step(closure)`` against ``functorch_optim.<name>_step(tx, value_fn,
        params, state)``; one with ``sparse_grad=True`` (SparseAdam) gets sparse torch
        gradients.
      params: the initial parameters, a pytree of arrays (NumPy or JAX).
      grads: a sequence of gradient pytrees shaped like ``params``; or ``None`` when
        ``loss_fn`` and ``data`` are given.
      loss_fn: ``loss_fn(params, batch) -> scalar``, a JAX-differentiable loss.
      data: the batches, one per step (any pytrees of arrays).
      torch_loss_fn: ``torch_loss_fn(params, batch) -> scalar tensor`` on a pytree of
        torch tensors and a batch of tensors; default: torch's gradients come from
        ``jax.grad(loss_fn)`` evaluated at torch's parameters.
      dtype: cast params, gradients and data to this floating dtype (e.g.
        ``np.float32``); default: keep the params' dtype.
      buffers: the state names to compare; default the registry's for this optimizer.
      hparams_at: mid-run hyperparameter changes, ``{step: {name: value}}``: before step
        ``step`` (counted from 1) both sides take the new values, functorch_optim's through
        ``set_hparams`` on its state, torch's by assignment into every ``param_groups``
        entry (as a torch user changes ``lr`` mid-run). Default none.
      **kwargs: the optimizer's keyword arguments, given to both libraries.

    Returns:
      A ``ParityReport`` with one ``LeafError`` per step, leaf and kind.

    Raises:
      ValueError: for an unknown optimizer name, neither or both of ``grads`` and
        ``loss_fn``/``data``, float64 requested with ``jax_enable_x64`` off, a
        gradient tree that does not match ``params``, or a ``hparams_at`` step outside
        the run (and ``set_hparams``' errors for its values).

    Examples:
      >>> import numpy as np
      >>> from functorch_optim.testing import compare_with_torch
      >>> params = {"w": np.array([1.0, -2.0])}
      >>> grads = [{"w": np.array([0.5, 0.5])}, {"w": np.array([-1.0, 2.0])}]
      >>> report = compare_with_torch("sgd", params, grads, lr=0.1, momentum=0.9)
      >>> report.steps, report.max_rel
      (2, 0.0)
      >>> [r.where for r in report.records if r.step == 1]
      ["param ['w']", "momentum_buffer ['w']"]
    """
    spec = get_spec(optimizer) if isinstance(optimizer, str) else optimizer
    names = tuple(spec.buffers if buffers is None else buffers)
    if (grads is None) == (loss_fn is None):
        raise ValueError("compare_with_torch: give either grads or loss_fn and data (exactly one)")
    if loss_fn is not None and data is None:
        raise ValueError("compare_with_torch: loss_fn needs data (one batch per step)")
    params_np = _as_numpy_tree(params, dtype)
    dtype_name = _tree_dtype_name(params_np)
    if dtype_name == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(
            "compare_with_torch: float64 parameters need jax_enable_x64; call "
            'jax.config.update("jax_enable_x64", True) first or pass dtype=np.float32'
        )
    if grads is not None:
        grads = [_as_numpy_tree(g, dtype_name) for g in grads]
        feed = _GradFeed(grads)
    else:
        feed = _LossFeed(loss_fn, list(data), torch_loss_fn, dtype_name)
    changes = {int(t): dict(v) for t, v in (hparams_at or {}).items()}
    bad = sorted(t for t in changes if not 1 <= t <= len(feed))
    if bad:
        raise ValueError(
            f"compare_with_torch: hparams_at step {bad[0]} is outside the run (steps 1..{len(feed)})"
        )
    runner = _FoRunner(spec, kwargs, params_np)
    torch_runner = _TorchRunner(spec, kwargs, params_np)
    return _run(spec, kwargs, dtype_name, runner, torch_runner, feed, names, changes)


def assert_matches_torch(
    optimizer: str | OptimizerSpec,
    params: PyTree,
    grads: Sequence[PyTree] | None = None,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    loss_fn: Callable[[PyTree, Any], Any] | None = None,
    data: Iterable[Any] | None = None,
    torch_loss_fn: Callable[[PyTree, Any], Any] | None = None,
    dtype: Any = None,
    buffers: Sequence[str] | None = None,
    hparams_at: Mapping[int, Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> ParityReport:
    """Assert that functorch_optim follows torch.optim within tolerance at every step.

    Runs ``compare_with_torch`` (same arguments) and checks every step, leaf and state
    buffer with ``|jax - torch| <= atol + rtol * max|torch leaf|``.

    Args:
      optimizer: a registry name (``"sgd"``), torch class name or ``OptimizerSpec``.
      params: the initial parameters.
      grads: the gradient sequence (or give ``loss_fn`` and ``data``).
      rtol: relative tolerance; default ``DEFAULT_RTOL`` (1e-10 for float64, 1e-5 for
        float32).
      atol: absolute tolerance, default 0.
      loss_fn: see ``compare_with_torch``.
      data: see ``compare_with_torch``.
      torch_loss_fn: see ``compare_with_torch``.
      dtype: see ``compare_with_torch``.
      buffers: see ``compare_with_torch``.
      hparams_at: see ``compare_with_torch``.
      **kwargs: the optimizer's keyword arguments, given to both libraries.

    Returns:
      The ``ParityReport``, for further checks.

    Raises:
      AssertionError: naming the first step and leaf that diverge, with both errors and
        the tolerance, e.g. ``SGD(lr=0.1) diverges from torch.optim.SGD (float64) at step
        3, param ['w']: abs err 1e-06, rel err 5e-07 > rtol 1e-10 ...``.
      ValueError: as ``compare_with_torch``.

    Examples:
      >>> import numpy as np
      >>> from functorch_optim.testing import assert_matches_torch
      >>> params = {"w": np.array([1.0, -2.0])}
      >>> grads = [{"w": np.array([0.5, 0.5])}] * 3
      >>> assert_matches_torch("sgd", params, grads, lr=0.1, nesterov=True, momentum=0.9).steps
      3
    """
    report = compare_with_torch(
        optimizer,
        params,
        grads,
        loss_fn=loss_fn,
        data=data,
        torch_loss_fn=torch_loss_fn,
        dtype=dtype,
        buffers=buffers,
        hparams_at=hparams_at,
        **kwargs,
    )
    rtol = _default_rtol(report.dtype) if rtol is None else rtol
    bad = report.first_divergence(rtol, atol)
    if bad is not None:
        raise AssertionError(
            f"{describe(report.optimizer, report.config)} diverges from torch.optim."
            f"{report.optimizer} ({report.dtype}) at step {bad.step} of {report.steps}, "
            f"{bad.where}: abs err {bad.abs_err:.3g}, rel err {bad.rel_err:.3g} > rtol {rtol:g} "
            f"(atol {atol:g}, max |torch| {bad.scale:.3g}); worst over the run: rel err "
            f"{report.max_rel:.3g}"
        )
    return report


# --------------------------------------------------------------------------- internals


def _nanmax(values: Iterable[float]) -> float:
    out = 0.0
    for v in values:
        if math.isnan(v):
            return math.nan
        out = max(out, v)
    return out


def _default_rtol(dtype_name: str) -> float:
    return DEFAULT_RTOL.get(dtype_name, DEFAULT_RTOL["float32"])


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic | jax.Array):
        return np.asarray(value).item()
    return value


def _as_numpy_tree(tree: PyTree, dtype: Any) -> PyTree:
    def conv(x):
        if x is None:
            return None
        arr = np.asarray(x)
        if dtype is not None:
            return arr.astype(dtype)
        return arr

    return jax.tree.map(conv, tree, is_leaf=is_none)


def _tree_dtype_name(tree: PyTree) -> str:
    dtypes = {np.asarray(x).dtype for x in jax.tree.leaves(tree)}
    if not dtypes:
        raise ValueError("optimizer got an empty parameter list")
    return str(max(dtypes, key=lambda d: d.itemsize))


def _maxabs(x: Any) -> float:
    x = np.asarray(x, np.float64)
    return float(np.max(np.abs(x))) if x.size else 0.0


def _err(ours: Any, ref: Any, scale: float = 0.0) -> tuple[float, float, float]:
    """``(abs_err, rel_err, scale)``, the scale being at least ``max |ref|``."""
    a = np.asarray(ours, np.float64)
    b = np.asarray(ref, np.float64)
    if a.shape != b.shape:
        # torch keeps some scalars (``step``) as 0-d tensors shared by shape
        a, b = np.broadcast_arrays(a, b)
    if b.size == 0:
        return 0.0, 0.0, scale
    abs_err = float(np.max(np.abs(a - b)))
    scale = max(scale, _maxabs(b))
    return abs_err, abs_err / max(scale, _TINY), scale


class _GradFeed:
    def __init__(self, grads: Sequence[PyTree]):
        self.grads = grads

    def __len__(self) -> int:
        return len(self.grads)

    def jax_grads(self, t: int, params: PyTree) -> PyTree:
        return self.grads[t]

    def torch_grads(self, t: int, tensors: list[Any], treedef: Any) -> list[Any]:
        return treedef.flatten_up_to(self.grads[t])


class _LossFeed:
    def __init__(self, loss_fn, data, torch_loss_fn, dtype_name):
        self.loss_fn = loss_fn
        self.data = [
            jax.tree.map(
                lambda x: (
                    np.asarray(x).astype(dtype_name)
                    if np.issubdtype(np.asarray(x).dtype, np.floating)
                    else np.asarray(x)
                ),
                batch,
            )
            for batch in data
        ]
        self.torch_loss_fn = torch_loss_fn
        self._grad = jax.jit(jax.grad(loss_fn))
        self._value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
        # one function object for every step, so a jitted closure step compiles once
        self._swapped = functools.partial(_call_swapped, loss_fn)

    def __len__(self) -> int:
        return len(self.data)

    def jax_grads(self, t: int, params: PyTree) -> PyTree:
        return self._grad(params, self.data[t])

    def torch_grads(self, t: int, tensors: list[Any], treedef: Any) -> list[Any]:
        import torch

        batch = self.data[t]
        if self.torch_loss_fn is None:
            current = treedef.unflatten([t_.detach().numpy() for t_ in tensors])
            grads = self._grad(jax.tree.map(jnp.asarray, current), batch)
            return [np.asarray(g) for g in treedef.flatten_up_to(grads)]
        for t_ in tensors:
            t_.grad = None
        loss = self.torch_loss_fn(treedef.unflatten(tensors), jax.tree.map(torch.as_tensor, batch))
        loss.backward()
        return [None if t_.grad is None else t_.grad.detach().numpy().copy() for t_ in tensors]

    def jax_value_fn(self, t: int) -> Callable[[PyTree], Any]:
        """``params -> loss`` on batch ``t``: the closure of a closure-driven optimizer."""
        return jax.tree_util.Partial(self._swapped, self.data[t])

    def torch_closure(self, t: int, tensors: list[Any], treedef: Any) -> Callable[[], Any]:
        """torch's ``closure()`` on batch ``t``: zero the grads, compute the loss, backward."""
        import torch

        batch = self.data[t]

        def closure():
            for t_ in tensors:
                t_.grad = None
            if self.torch_loss_fn is not None:
                loss = self.torch_loss_fn(treedef.unflatten(tensors), jax.tree.map(torch.as_tensor, batch))
                loss.backward()
                return loss
            current = treedef.unflatten([t_.detach().numpy() for t_ in tensors])
            loss, grads = self._value_and_grad(jax.tree.map(jnp.asarray, current), batch)
            for t_, g in zip(tensors, treedef.flatten_up_to(grads), strict=True):
                t_.grad = torch.tensor(np.array(g))
            return torch.tensor(float(loss), dtype=tensors[0].dtype)

        return closure


def _call_swapped(loss_fn: Callable[[PyTree, Any], Any], batch: Any, params: PyTree) -> Any:
    return loss_fn(params, batch)


class _FoRunner:
    """functorch_optim's side: one jitted ``step`` per transformation."""

    def __init__(self, spec: OptimizerSpec, config: Mapping[str, Any], params: PyTree, step_fn=None):
        self.spec = spec
        self._closure_fn = None
        self.tx = spec.factory(**config)
        self.params = jax.tree.map(jnp.asarray, params)
        self.state = self.tx.init(self.params)
        tx = self.tx
        self.step_fn = step_fn or jax.jit(lambda p, g, s: _fo_step(tx, p, g, s))

    def step(self, grads: PyTree) -> None:
        grads = jax.tree.map(lambda g: None if g is None else jnp.asarray(g), grads, is_leaf=is_none)
        self.params, self.state = self.step_fn(self.params, grads, self.state)

    def closure_step(self, value_fn: Callable[[PyTree], Any]) -> None:
        """One step of a closure-driven optimizer (``<name>_step(tx, value_fn, params, state)``)."""
        if self._closure_fn is None:
            import functorch_optim

            driver = getattr(functorch_optim, f"{self.spec.name}_step", None)
            tx = self.tx
            if driver is not None:
                fn = lambda vf, p, s: driver(tx, vf, p, s)[:2]
            else:
                fn = lambda vf, p, s: _fo_step(tx, p, jax.grad(vf)(p), s, value_fn=vf)
            # value_fn is a ``jax.tree_util.Partial``: new data, same compiled step
            self._closure_fn = jax.jit(fn)
        self.params, self.state = self._closure_fn(value_fn, self.params, self.state)

    def buffers(self) -> Mapping[str, PyTree]:
        return getattr(self.state, "buffers", {})

    def set_hparams(self, values: Mapping[str, Any]) -> None:
        self.state = set_hparams(self.state, **values)


class _TorchRunner:
    """torch's side: tensors in the params' tree order, ``foreach=False``."""

    def __init__(self, spec: OptimizerSpec, config: Mapping[str, Any], params: PyTree):
        import torch

        leaves, self.treedef = jax.tree.flatten(params)
        self.np_dtypes = [np.asarray(p).dtype for p in leaves]
        self.tensors = [torch.tensor(np.array(p)).requires_grad_(True) for p in leaves]
        cls = getattr(torch.optim, spec.torch_name)
        kwargs = dict(config)
        if "foreach" in inspect.signature(cls).parameters and "foreach" not in kwargs:
            kwargs["foreach"] = False
        self.opt = cls(self.tensors, **kwargs)
        self.sparse = bool(getattr(spec, "sparse_grad", False))

    def step(self, grad_leaves: Sequence[Any]) -> None:
        import torch

        for t, g, dt in zip(self.tensors, grad_leaves, self.np_dtypes, strict=True):
            t.grad = None if g is None else torch.tensor(np.asarray(g, dtype=dt))
            if self.sparse and t.grad is not None:  # SparseAdam takes sparse gradients only
                t.grad = t.grad.to_sparse()
        self.opt.step()

    def closure_step(self, closure: Callable[[], Any]) -> None:
        self.opt.step(closure)

    def set_hparams(self, values: Mapping[str, Any]) -> None:
        for group in self.opt.param_groups:
            group.update(values)

    def params(self) -> list[np.ndarray]:
        return [t.detach().numpy().copy() for t in self.tensors]

    def buffer(self, name: str, i: int) -> Any:
        value = self.opt.state.get(self.tensors[i], {}).get(name)
        if value is None:
            return None
        if hasattr(value, "detach"):
            return value.detach().to(dtype=value.dtype).cpu().numpy().copy()
        return np.asarray(value)


def _run(spec, config, dtype_name, runner, torch_runner, feed, names, changes) -> ParityReport:
    treedef = torch_runner.treedef
    paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(runner.params)[0]]
    records: list[LeafError] = []
    # running scale per (kind, leaf): parameters start from their initial magnitude
    scales = {("param", i): _maxabs(x) for i, x in enumerate(torch_runner.params())}

    def record(t, kind, i, a, b):
        rec = LeafError(t + 1, kind, paths[i], *_err(a, b, scales.get((kind, i), 0.0)))
        scales[(kind, i)] = rec.scale
        records.append(rec)

    closure = bool(getattr(spec, "closure", False))
    if closure and not isinstance(feed, _LossFeed):
        raise ValueError(
            f"{spec.torch_name} is closure-driven: compare it on a loss function (loss_fn and data), "
            "not on a gradient sequence"
        )
    for t in range(len(feed)):
        if t + 1 in changes:
            runner.set_hparams(changes[t + 1])  # validated first: torch's groups change only if it passes
            torch_runner.set_hparams(changes[t + 1])
        if closure:
            runner.closure_step(feed.jax_value_fn(t))
            torch_runner.closure_step(feed.torch_closure(t, torch_runner.tensors, treedef))
        else:
            g_jax = feed.jax_grads(t, runner.params)
            g_torch = feed.torch_grads(t, torch_runner.tensors, treedef)
            runner.step(g_jax)
            torch_runner.step(g_torch)
        ours = treedef.flatten_up_to(runner.params)
        for i, (a, b) in enumerate(zip(ours, torch_runner.params(), strict=True)):
            record(t, "param", i, a, b)
        buffers = {} if closure else runner.buffers()  # a closure optimizer's state is global
        for name in names:
            if name not in buffers:
                continue
            mine = treedef.flatten_up_to(buffers[name])
            for i, a in enumerate(mine):
                b = torch_runner.buffer(name, i)
                if b is None or a is None:
                    continue  # torch has no state for a parameter that never had a gradient
                record(t, name, i, a, b)
    return ParityReport(spec.torch_name, dict(config), dtype_name, len(feed), records)
