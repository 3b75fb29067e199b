"""torch's own optimizer test tables, run against the library.

torch describes every optimizer's test inputs in ``torch.testing._internal.common_optimizers``:
``optim_db`` holds one ``OptimizerInfo`` per class, whose ``optim_inputs_func`` lists the
constructor configurations torch's own suite runs (``_get_optim_inputs_including_global_cliquey_kwargs``
adds the ``differentiable=True`` and ``fused=True`` variants) and whose
``optim_error_inputs_func`` lists the inputs that must raise (type and message regex).

Every CPU configuration runs here in float64 and float32, with its parameter groups built
as torch's ``TestOptimRenewed.test_param_groups_weight_decay`` (a weight group and a bias
group with ``weight_decay=0``) and ``test_param_groups_lr`` (both in a group with the
configuration, a third parameter in a group with the outer ``lr=1e-28``) build them, on
torch's loss ``(weight @ input + bias).pow(2).sum()``: torch's optimizer and the facade
``functorch_optim.optim.<Name>`` take the same gradients (torch's, at torch's parameters)
for ``STEPS`` steps, and the parameters and every entry of the state dict must agree.
LBFGS, which has no parameter groups, runs torch's closure on both sides.

An input the library cannot take in torch's form (a torch-only layout, named or complex
or sparse tensors) is listed with its reason by ``inapplicable_config`` /
``inapplicable_error`` and shows up as a skipped test with that reason; ``test_coverage``
pins how many inputs torch's tables hold, so a torch upgrade that adds some fails here
until they are looked at.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.testing._internal import common_optimizers as torch_tables

import functorch_optim.optim as fo_optim
from functorch_optim._registry import OPTIMIZERS, get_spec
from tests.helpers import FLOAT32_SQRT_RTOL, torch_float32_sqrt_is_exact

STEPS = 4
#: torch's two group layouts (``_build``): both in float64, the weight-decay one in float32
#: (each distinct layout and flag set is a compilation, the bulk of this module's time).
LAYOUTS = {"float64": ("weight_decay", "lr"), "float32": ("weight_decay",)}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: Relative tolerance (of the largest ``|torch|`` of each compared array): float64 rounding,
#: and a few float32 ulps.
RTOL = {"float64": 1e-12, "float32": 8 * 2.0**-23}


# --------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class ConfigCase:
    """One configuration of torch's table, in one dtype and one parameter-group layout."""

    optimizer: str
    desc: str
    dtype: str
    layout: str
    kwargs: Mapping[str, Any] = dataclasses.field(compare=False, hash=False)

    @property
    def id(self) -> str:
        return f"{self.optimizer}-{self.desc}-{self.dtype}-{self.layout}".replace(" ", "_")


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    """One error input of torch's table, in one dtype."""

    optimizer: str
    index: int
    desc: str
    dtype: str
    error: Any = dataclasses.field(compare=False, hash=False)

    @property
    def id(self) -> str:
        return f"{self.optimizer}-{self.index}-{self.desc}-{self.dtype}".replace(" ", "_")


def _config_cases() -> list[ConfigCase]:
    cases = []
    for info in torch_tables.optim_db:
        for dtype, torch_dtype in DTYPES.items():
            inputs = torch_tables._get_optim_inputs_including_global_cliquey_kwargs("cpu", torch_dtype, info)
            for optim_input in inputs:
                for layout in LAYOUTS[dtype] if info.supports_param_groups else ("single",):
                    cases.append(ConfigCase(info.name, optim_input.desc, dtype, layout, optim_input.kwargs))
    return cases


def _error_cases() -> list[ErrorCase]:
    cases = []
    for info in torch_tables.optim_db:
        for dtype, torch_dtype in DTYPES.items():
            for i, error in enumerate(info.optim_error_inputs_func("cpu", torch_dtype)):
                cases.append(ErrorCase(info.name, i, error.optimizer_error_input.desc, dtype, error))
    return cases


CONFIG_CASES = _config_cases()
ERROR_CASES = _error_cases()


def inapplicable_config(case: ConfigCase) -> str | None:
    """Why the library cannot run this configuration in torch's form (None: it can)."""
    kwargs = case.kwargs
    if kwargs.get("foreach"):
        return "foreach=True: torch's multi-tensor layout; here XLA fuses and the flag has no effect"
    if kwargs.get("capturable"):
        return "capturable=True: torch's CUDA-graph mode, not a CPU configuration"
    if any(isinstance(v, torch.Tensor) and v.is_complex() for v in _flat(kwargs)):
        return "complex hyperparameters: the library takes real ones"
    return None


def inapplicable_error(case: ErrorCase) -> str | None:
    """Why the library cannot take this error input in torch's form (None: it can)."""
    optim_input = case.error.optimizer_error_input
    params, kwargs = optim_input.params, optim_input.kwargs
    if isinstance(params, torch.Tensor):
        return "one tensor as params: the facade takes any pytree, and one array is a one-leaf tree"
    entries = _param_entries(params)
    if any(isinstance(p, tuple) for p in entries):
        return "named parameters ((name, tensor) pairs): the facade names parameters by pytree paths"
    tensors = [p for p in entries if isinstance(p, torch.Tensor)]
    if any(t.layout != torch.strided for t in tensors):
        return "sparse parameter tensors: JAX arrays are dense"
    if any(t.is_complex() for t in tensors):
        return "complex parameters: the library takes real floating-point parameters"
    if kwargs.get("foreach"):
        return (
            "foreach=True: torch's multi-tensor layout, whose tensor-hyperparameter limits do not apply here"
        )
    return None


#: Configurations the library does not match yet, (optimizer, desc, dtype) -> why. Each is a
#: strict xfail: remove its entry once it passes.
PENDING_CONFIGS: dict[tuple[str, str, str], str] = {}

#: Error inputs the library does not match yet, (optimizer, desc) -> why (strict xfails, as above).
PENDING_ERRORS: dict[tuple[str, str], str] = {}


def _pending(key: tuple, table: Mapping[tuple, str]) -> list[Any]:
    reason = table.get(key)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _config_param(case: ConfigCase) -> Any:
    reason = inapplicable_config(case)
    marks = (
        [pytest.mark.skip(reason=reason)]
        if reason
        else _pending((case.optimizer, case.desc, case.dtype), PENDING_CONFIGS)
    )
    return pytest.param(case, id=case.id, marks=marks)


def _error_param(case: ErrorCase) -> Any:
    reason = inapplicable_error(case)
    marks = (
        [pytest.mark.skip(reason=reason)] if reason else _pending((case.optimizer, case.desc), PENDING_ERRORS)
    )
    return pytest.param(case, id=case.id, marks=marks)


# --------------------------------------------------------------------------- helpers


def _flat(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _flat(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flat(v)]
    return [value]


def _param_entries(params: Any) -> list[Any]:
    """The parameters of torch's ``params`` argument (groups unpacked), as given."""
    if params is None:
        return []
    entries = []
    for item in params:
        if isinstance(item, Mapping):
            group = item["params"]
            entries.extend([group] if isinstance(group, torch.Tensor) else list(group))
        else:
            entries.append(item)
    return entries


def _to_library(value: Any) -> Any:
    """A torch hyperparameter as the library takes it: tensors become JAX arrays."""
    if isinstance(value, torch.Tensor):
        return jnp.asarray(value.detach().numpy())
    if isinstance(value, tuple):
        return tuple(_to_library(v) for v in value)
    if isinstance(value, list):
        return [_to_library(v) for v in value]
    return value


def _facade_class(name: str) -> Callable[..., Any]:
    return getattr(fo_optim, name)


def _takes(optimizer: str, arg: str) -> bool:
    return arg in inspect.signature(get_spec(optimizer).factory).parameters


def _numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return (x.to_dense() if x.layout != torch.strided else x).numpy().copy()
    return np.asarray(x)


def _leaves(value: Any, where: str) -> list[tuple[str, Any]]:
    """A state-dict value as ``(where, leaf)`` pairs: lists unpacked, leaves as NumPy or None."""
    if isinstance(value, list | tuple):
        return [pair for i, v in enumerate(value) for pair in _leaves(v, f"{where}[{i}]")]
    return [(where, None if value is None else _numpy(value))]


def _assert_close(ours: Any, theirs: Any, rtol: float, where: str, scale: float | None = None) -> float:
    """Assert ``|ours - theirs| <= rtol * scale`` (default scale ``max|theirs|``; exact where
    it is zero); return the relative error."""
    a, b = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert a.shape == b.shape or a.size == b.size == 1, f"{where}: shape {a.shape} != torch's {b.shape}"
    a, b = a.reshape(b.shape), b
    if b.size == 0:
        return 0.0
    err = float(np.max(np.abs(a - b)))
    scale = float(np.max(np.abs(b))) if scale is None else scale
    rel = err / scale if scale > 0 else (0.0 if err == 0 else np.inf)
    assert rel <= rtol, f"{where}: rel err {rel:.3g} > {rtol:.3g} (abs {err:.3g}, scale {scale:.3g})"
    return rel


def _assert_state_dicts_match(
    ours: Mapping, theirs: Mapping, rtol: float, floors: Mapping[str, float] | None = None
) -> None:
    """Equal ids, keys and list lengths; every array within ``rtol`` of torch's (scale: the
    largest ``|torch|`` of the array, at least ``floors[name]``)."""
    floors = floors or {}
    assert sorted(ours) == sorted(theirs), f"state for parameter ids {sorted(ours)}, torch's {sorted(theirs)}"
    for pid, entry in theirs.items():
        mine = ours[pid]
        assert sorted(mine) == sorted(entry), (
            f"param {pid}: state keys {sorted(mine)}, torch's {sorted(entry)}"
        )
        for name, value in entry.items():
            ref = _leaves(value, f"param {pid} {name}")
            got = _leaves(mine[name], f"param {pid} {name}")
            assert [w for w, _ in got] == [w for w, _ in ref], f"param {pid} {name}: list lengths differ"
            for i, ((where, g), (_, r)) in enumerate(zip(got, ref, strict=True)):
                assert (g is None) == (r is None), f"{where}: {g!r} vs torch's {r!r}"
                if r is not None:
                    if name == "al":
                        scale = _lbfgs_al_scale(entry, i, floors.get("al", 0.0))
                    else:
                        scale = max(float(np.max(np.abs(r), initial=0)), floors.get(name, 0.0))
                    _assert_close(g, r, rtol, where, scale)


def _lbfgs_al_scale(entry: Mapping[str, Any], i: int, grad_floor: float = 0.0) -> float:
    """The size of the terms behind LBFGS's ``al[i] = ro[i] * old_stps[i] . q``, with ``q``
    built by torch's two-loop recursion (``q = -g``, then ``q -= al[j] old_dirs[j]``):
    ``|ro[i]| |old_stps[i]| (|g| + sum_j |al[j]| |old_dirs[j]|)``, replayed in float64 from
    torch's state (``|g|`` at least ``grad_floor``). Near convergence ``al`` is rounding
    noise of cancelling terms; its error is judged against their size rather than its value."""
    ro = [float(_numpy(r)) for r in entry["ro"]]
    stps = [_numpy(v).astype(np.float64) for v in entry["old_stps"]]
    dirs = [_numpy(v).astype(np.float64) for v in entry["old_dirs"]]
    q = -_numpy(entry["prev_flat_grad"]).astype(np.float64)
    size = max(float(np.linalg.norm(q)), grad_floor)
    for j in range(len(ro) - 1, i, -1):
        al = stps[j] @ q * ro[j]
        q = q - al * dirs[j]
        size += abs(al) * float(np.linalg.norm(dirs[j]))
    return abs(ro[i]) * float(np.linalg.norm(stps[i])) * size


# --------------------------------------------------------------------------- the runs


def _build(case: ConfigCase, rng: np.random.Generator):
    """torch's parameters, groups and loss input for the case's layout (NumPy arrays).

    Returns ``(arrays, groups, outer, inputs)``: the parameter arrays, the groups as lists
    of indices into ``arrays`` with their keyword overrides, the outer keyword arguments and
    the loss's input vector.
    """
    dt = np.dtype(case.dtype)
    muon = case.optimizer == "Muon"  # 2-D parameters only: a column bias and input
    weight = rng.standard_normal((5, 3)).astype(dt)
    bias = rng.standard_normal((5, 1) if muon else (5,)).astype(dt)
    inputs = rng.standard_normal((3, 1) if muon else (3,)).astype(dt)
    kwargs = dict(case.kwargs)
    # torch reads ``differentiable`` from the constructor's defaults (grad mode, non-leaf
    # parameters): outside the groups too
    flags = {k: kwargs[k] for k in ("differentiable",) if kwargs.get(k)}
    if case.layout == "single":
        return [weight, bias], [([0, 1], kwargs)], {}, inputs
    if case.layout == "weight_decay":
        bias_kwargs = dict(kwargs)
        # torch's test sets it for every optimizer (torch ignores unknown group keys); the
        # facade rejects unknown keys, so only where the optimizer has a weight decay
        if _takes(case.optimizer, "weight_decay"):
            bias_kwargs["weight_decay"] = 0.0
        return [weight, bias], [([0], kwargs), ([1], bias_kwargs)], flags, inputs
    # "lr": torch's test_param_groups_lr
    if "lr" not in kwargs or (not isinstance(kwargs["lr"], torch.Tensor) and kwargs["lr"] == 0):
        kwargs["lr"] = 1e-3
    outer: dict[str, Any] = {"lr": 1e-28, **flags}
    if case.optimizer == "Rprop":
        outer["step_sizes"] = (0, 50)
    irrelevant = rng.standard_normal((2, 2) if muon else (2,)).astype(dt)
    return [weight, bias, irrelevant], [([0, 1], kwargs), ([2], {})], outer, inputs


def _loss_grads(weight: np.ndarray, bias: np.ndarray, inputs: np.ndarray) -> list[np.ndarray]:
    """torch's gradients of ``(weight @ inputs + bias).pow(2).sum()``."""
    w = torch.tensor(weight, requires_grad=True)
    b = torch.tensor(bias, requires_grad=True)
    loss = (w @ torch.tensor(inputs) + b).pow(2).sum()
    return [g.numpy() for g in torch.autograd.grad(loss, (w, b))]


def _run_torch(case, arrays, groups, outer, grads_fn):
    """torch's optimizer over the case; returns (final params, state dict)."""
    cls = getattr(torch.optim, case.optimizer)
    differentiable = bool(case.kwargs.get("differentiable"))
    tensors = []
    for a in arrays:
        t = torch.tensor(a)
        # differentiable=True steps with autograd on: torch writes into non-leaf tensors
        tensors.append(t.requires_grad_(True).clone() if differentiable else torch.nn.Parameter(t))
    torch_groups = [{"params": [tensors[i] for i in idx], **copy.deepcopy(dict(kw))} for idx, kw in groups]
    opt = cls(torch_groups, **outer)
    sparse = case.optimizer == "SparseAdam"
    for t_step in range(STEPS):
        grads = grads_fn(t_step, [t.detach().numpy() for t in tensors])
        for t, g in zip(tensors, grads, strict=True):
            g = torch.tensor(g)
            t.grad = g.to_sparse() if sparse else g
        opt.step()
    return [t.detach().numpy().copy() for t in tensors], opt.state_dict()["state"]


def _run_facade(case, arrays, groups, outer, grads_fn):
    cls = _facade_class(case.optimizer)
    params = [jnp.asarray(a) for a in arrays]
    fo_groups = [
        {"params": [params[i] for i in idx], **{k: _to_library(v) for k, v in kw.items()}}
        for idx, kw in groups
    ]
    opt = cls(fo_groups, **{k: _to_library(v) for k, v in outer.items()})
    for t_step in range(STEPS):
        flat = [np.asarray(p) for g in opt.params for p in g]
        grads = iter(jnp.asarray(g) for g in grads_fn(t_step, flat))
        opt.grad = [[next(grads) for _ in idx] for idx, _ in groups]
        opt.step()
    return [np.asarray(p) for g in opt.params for p in g], opt.state_dict()["state"]


def _run_lbfgs(case, arrays, inputs):
    """LBFGS with torch's closure on torch's side, the same loss as a JAX function on ours."""
    w, b = (torch.nn.Parameter(torch.tensor(a)) for a in arrays)
    x = torch.tensor(inputs)
    opt = torch.optim.LBFGS([w, b], **copy.deepcopy(dict(case.kwargs)))

    def closure():
        opt.zero_grad()
        loss = (w @ x + b).pow(2).sum()
        loss.backward()
        return loss

    ours = fo_optim.LBFGS(
        [jnp.asarray(a) for a in arrays], **{k: _to_library(v) for k, v in case.kwargs.items()}
    )
    x_jax = jnp.asarray(inputs)

    def pure_closure(params):
        weight, bias = params
        return jnp.sum((weight @ x_jax + bias) ** 2)

    for _ in range(STEPS):
        opt.step(closure)
        ours.step(pure_closure)
    theirs = ([w.detach().numpy(), b.detach().numpy()], opt.state_dict()["state"])
    return theirs, ([np.asarray(p) for p in ours.params], ours.state_dict()["state"])


def _case_rng(case: ConfigCase) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case.id.encode()))


def run_case(case: ConfigCase) -> tuple[tuple[list, Mapping], tuple[list, Mapping]]:
    """Both runs of a configuration: ``((torch params, torch state), (ours, our state))``."""
    rng = _case_rng(case)
    arrays, groups, outer, inputs = _build(case, rng)
    if case.layout == "single":
        return _run_lbfgs(case, arrays, inputs)
    extra = [rng.standard_normal(a.shape).astype(a.dtype) for _ in range(STEPS) for a in arrays[2:]]

    def grads_fn(t, current):
        # torch's loss gradients for weight and bias at torch's parameters, the same
        # arrays fed to both sides; the irrelevant parameter gets random gradients
        return [
            *_loss_grads(current[0], current[1], inputs),
            *extra[t * (len(arrays) - 2) :][: len(arrays) - 2],
        ]

    torch_grads: list[list[np.ndarray]] = []

    def torch_side(t, current):
        torch_grads.append(grads_fn(t, current))
        return torch_grads[-1]

    theirs = _run_torch(case, arrays, groups, outer, torch_side)
    ours = _run_facade(case, arrays, groups, outer, lambda t, _: torch_grads[t])
    return theirs, ours


# --------------------------------------------------------------------------- the tests


#: LBFGS's state (its parameters are compared at ``RTOL``: measured 7.4e-15 in float64,
#: 9e-7 in float32). Its history holds gradient differences ``y`` and ``ro = 1 / (y . s)``,
#: which cancel: at ``lr=1e-3`` the float64 ``old_dirs`` differ from torch's by 1.0e-12
#: relative after 80 iterations. In float32, on torch's loss (rank-deficient: 5 residuals,
#: 20 unknowns), LBFGS reaches the minimum within a step, after which the gradient, ``d``
#: and the loss are rounding noise; measured over 4 steps: the history up to 2.2e-4
#: relative, the noise-level entries judged against the first gradient's and loss's size.
LBFGS_STATE_RTOL = {"float64": 1e-10, "float32": 1e-3}
#: LBFGS's float32 params: its direction comes from float32 dots and sums (MKL), whose
#: summation order depends on the CPU: 9e-7 relative on one machine, 1.1e-5 with a tensor
#: lr on an AMD EPYC with AVX-512 (the float64 params stay within ``RTOL``)
LBFGS_FLOAT32_PARAM_RTOL = 2e-5


@pytest.mark.parametrize("case", [_config_param(c) for c in CONFIG_CASES])
def test_config_matches_torch(case: ConfigCase) -> None:
    (torch_params, torch_state), (params, state) = run_case(case)
    rtol = RTOL[case.dtype]
    if (
        case.optimizer in ("Adam", "AdamW")
        and "differentiable" in case.desc
        and not torch_float32_sqrt_is_exact()
    ):
        # torch keeps this path's step scalars as float32 tensors, bias_correction2.sqrt()
        # among them: MKL's float32 sqrt is 1 ulp off on some CPUs (measured 8e-11 here)
        rtol = max(rtol, FLOAT32_SQRT_RTOL)
    if case.optimizer == "LBFGS" and case.dtype == "float32":
        rtol = LBFGS_FLOAT32_PARAM_RTOL
    for i, (a, b) in enumerate(zip(params, torch_params, strict=True)):
        _assert_close(a, b, rtol, f"param {i}")
    floors: dict[str, float] = {}
    if case.optimizer == "LBFGS":
        rtol = LBFGS_STATE_RTOL[case.dtype]
    if case.optimizer == "LBFGS" and case.dtype == "float32":
        grad, norm, loss = _first_gradient(case)
        floors = {"d": grad, "prev_flat_grad": grad, "al": norm, "prev_loss": loss}
    _assert_state_dicts_match(state, torch_state, rtol, floors)


def _first_gradient(case: ConfigCase) -> tuple[float, float, float]:
    """``(max |gradient|, |gradient|, loss)`` at the case's initial parameters."""
    arrays, _, _, inputs = _build(case, _case_rng(case))
    w, b = arrays
    residual = w.astype(np.float64) @ inputs + b
    grads = _loss_grads(w.astype(np.float64), b.astype(np.float64), inputs.astype(np.float64))
    flat = np.concatenate([g.ravel() for g in grads])
    return float(np.max(np.abs(flat))), float(np.linalg.norm(flat)), float(np.sum(residual**2))


def _library_params(params: Any, dtype: str) -> Any:
    """torch's ``params`` argument with each tensor as a JAX array (the same tensor, the same array)."""
    if params is None:
        return [jnp.zeros((1, 1), dtype)]
    memo: dict[int, jax.Array] = {}

    def conv(t):
        return memo.setdefault(id(t), jnp.asarray(t.detach().numpy()))

    out = []
    for item in params:
        if isinstance(item, Mapping):
            group = item["params"]
            group = conv(group) if isinstance(group, torch.Tensor) else [conv(t) for t in group]
            out.append({**{k: _to_library(v) for k, v in item.items() if k != "params"}, "params": group})
        else:
            out.append(conv(item))
    return out


def _expect(error: Any):
    if issubclass(error.error_type, Warning):
        return pytest.warns(error.error_type, match=error.error_regex)
    return pytest.raises(error.error_type, match=error.error_regex)


@pytest.mark.parametrize("case", [_error_param(c) for c in ERROR_CASES])
def test_error_input_matches_torch(case: ErrorCase) -> None:
    error = case.error
    assert error.error_on == torch_tables.OptimizerErrorEnum.CONSTRUCTION_ERROR
    optim_input = error.optimizer_error_input
    kwargs = {k: _to_library(v) for k, v in optim_input.kwargs.items()}
    # torch itself, as its test_errors checks it (on a copy: torch fills its defaults into
    # the group dicts it is given)
    with _expect(error), warnings.catch_warnings():
        warnings.simplefilter("always")
        getattr(torch.optim, case.optimizer)(copy.deepcopy(optim_input.params), **optim_input.kwargs)
    if optim_input.params is None:
        # a hyperparameter error: the functional factory raises it too
        if case.optimizer == "LBFGS":
            from functorch_optim import lbfgs as factory
        else:
            factory = get_spec(case.optimizer).factory
        with _expect(error):
            factory(**kwargs)
    with _expect(error):
        _facade_class(case.optimizer)(_library_params(optim_input.params, case.dtype), **kwargs)


#: How many inputs torch 2.13's tables hold per optimizer (CPU, per dtype): configurations
#: (with the differentiable / fused variants) and error inputs. A torch upgrade that adds
#: some fails here: review the new ones (run, or list in ``inapplicable_*``), then update.
TORCH_TABLE_SIZES = {
    "Adadelta": (12, 7),
    "Adafactor": (5, 10),
    "Adagrad": (21, 7),
    "Adam": (15, 12),
    "Adamax": (10, 7),
    "AdamW": (15, 12),
    "ASGD": (14, 7),
    "LBFGS": (5, 6),
    "Muon": (7, 9),
    "NAdam": (14, 8),
    "RAdam": (12, 8),
    "RMSprop": (16, 7),
    "Rprop": (10, 7),
    "SGD": (27, 7),
    "SparseAdam": (4, 10),
}


def test_coverage() -> None:
    """Every optimizer of torch's table is the library's, and every input is run or listed."""
    assert {info.name for info in torch_tables.optim_db} == {s.torch_name for s in OPTIMIZERS}
    sizes = {}
    for info in torch_tables.optim_db:
        n_layouts = len(LAYOUTS["float64"]) if info.supports_param_groups else 1
        configs = sum(1 for c in CONFIG_CASES if c.optimizer == info.name and c.dtype == "float64")
        errors = sum(1 for c in ERROR_CASES if c.optimizer == info.name and c.dtype == "float64")
        sizes[info.name] = (configs // n_layouts, errors)
    assert sizes == TORCH_TABLE_SIZES
    # 187 configurations per dtype (182 with groups, 5 LBFGS): in float64 both group
    # layouts, in float32 one; all of them run
    assert len(CONFIG_CASES) == (2 * 182 + 5) + (182 + 5)
    assert sum(inapplicable_config(c) is None for c in CONFIG_CASES) == len(CONFIG_CASES)
    # 124 error inputs per dtype; 54 of them in torch-only forms (one tensor as params: 15,
    # named parameters: 30, complex: 3, sparse: 2, foreach=True: 4), 70 run
    assert len(ERROR_CASES) == 2 * 124
    assert sum(inapplicable_error(c) is None for c in ERROR_CASES) == 2 * 70
    assert set(PENDING_CONFIGS) <= {(c.optimizer, c.desc, c.dtype) for c in CONFIG_CASES}
    assert set(PENDING_ERRORS) <= {(c.optimizer, c.desc) for c in ERROR_CASES}
