"""Shared machinery of the Adam-family tests (test_adam, test_adamw, test_adamax, ...).

Keeps the suites fast on a loaded 2-core machine: one jitted ``lax.scan`` over all
steps per (optimizer, structural flags, dtype), hyperparameters fed as data through
``set_hparams``, so a whole flag grid costs one compilation per flag combination.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._registry import get_spec
from tests.helpers import (
    FLOAT32_SQRT_RTOL,
    TREE_SHAPES,
    grad_stream,
    make_tree,
    rel_err,
    run_torch,
    torch_float32_sqrt_is_exact,
    zero_ness,
)

STEPS = 50
TOL = {np.float64: 1e-10, np.float32: 1e-5}
STATIC_KEYS = ("amsgrad", "maximize", "decoupled_weight_decay", "differentiable")


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(structural flags, numeric hyperparameters) of a registry configuration."""
    static = {k: v for k, v in config.items() if k in STATIC_KEYS}
    numeric = {k: v for k, v in config.items() if k not in STATIC_KEYS}
    return static, numeric


def assert_signature_matches_torch(name: str) -> None:
    """Same argument names, order, kinds and defaults as the torch class (minus params)."""
    import inspect

    spec = get_spec(name)
    theirs = list(inspect.signature(getattr(torch.optim, spec.torch_name).__init__).parameters.values())
    theirs = [(p.name, p.kind, p.default) for p in theirs if p.name not in ("self", "params")]
    ours = [(p.name, p.kind, p.default) for p in inspect.signature(spec.factory).parameters.values()]
    assert ours == theirs


def config_id(config: Mapping[str, Any]) -> str:
    return "-".join(f"{k}={v}" for k, v in config.items())


GRID_SHAPE = "grid"  # one (3, 4) leaf: the flag grids run on it; None semantics per step
# un-jitted runs use (2,) leaves only: JAX compiles each primitive once per shape, so one
# shape for every eager test keeps that cost paid once
EAGER_SHAPE = "eager"
_SHAPES = {GRID_SHAPE: {"w": (3, 4)}, EAGER_SHAPE: {"a": (2,), "b": [(2,), {"c": (2,)}]}}


def grid_results(name: str, dtype_name: str) -> dict[str, tuple[Any, Any]]:
    """Ours over every registry configuration of ``name`` for one dtype:
    ``config_id -> (params, state)`` (see ``_grid_all``)."""
    return _grid_all(name)[dtype_name]


@functools.cache
def _grid_all(name: str) -> dict[str, dict[str, tuple[Any, Any]]]:
    """Ours over every registry configuration of ``name``, float64 and float32, in ONE
    jitted function.

    Structural flags are unrolled (one sub-graph per flag combination and dtype), the
    numeric hyperparameters of each combination are vmapped as data, the steps are a
    ``lax.scan`` with ``grad_mask`` for the ``None`` steps.
    """
    spec = get_spec(name)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for config in spec.grid:
        static, numeric = split_config(config)
        # a number's zero-ness is compiled in (``Algorithm.fixed_zero``): part of the key
        static = {**static, **zero_ness(numeric)}
        groups.setdefault(tuple(sorted(static.items())), []).append(config)
    txs = {key: spec.factory(**dict(key)) for key in groups}
    inputs, batches = {}, {}
    for dtype_name in ("float64", "float32"):
        params, grads = stream(np.dtype(dtype_name).type, shape=GRID_SHAPE)
        p0 = jnp.asarray(params["w"])
        g_stack = jnp.stack([jnp.zeros_like(p0) if g["w"] is None else jnp.asarray(g["w"]) for g in grads])
        m_stack = jnp.asarray([g["w"] is not None for g in grads])
        inputs[dtype_name] = (p0, g_stack, m_stack)
        for key, configs in groups.items():
            hps = [fo.set_hparams(txs[key].init({"w": p0}), **split_config(c)[1]).hparams for c in configs]
            batches[dtype_name, key] = jax.tree.map(lambda *xs: jnp.stack(xs), *hps)

    def run_all(inputs, batches):
        out = {}
        for (dtype_name, key), batch in batches.items():
            tx = txs[key]
            p0, g_stack, m_stack = inputs[dtype_name]

            def one(hparams, tx=tx, p0=p0, g_stack=g_stack, m_stack=m_stack):
                state = tx.init({"w": p0})._replace(hparams=hparams)

                def body(carry, xs):
                    p, s = carry
                    g, m = xs
                    return fo.step(tx, p, {"w": g}, s, grad_mask={"w": m}), None

                (p, s), _ = jax.lax.scan(body, ({"w": p0}, state), (g_stack, m_stack))
                return p, s

            out[dtype_name, key] = jax.vmap(one)(batch)
        return out

    out = fast_jit(run_all, inputs, batches)(inputs, batches)
    results: dict[str, dict[str, tuple[Any, Any]]] = {"float64": {}, "float32": {}}
    for (dtype_name, key), result in out.items():
        for i, config in enumerate(groups[key]):
            results[dtype_name][config_id(config)] = jax.tree.map(lambda x, i=i: x[i], result)
    return results


def torch_factory(name: str, config: Mapping[str, Any]):
    cls = getattr(torch.optim, get_spec(name).torch_name)
    return lambda ps: cls(ps, foreach=False, **config)


def stream(dtype: Any, seed: int = 0, shape: str = "nested", steps: int = STEPS, none_every: int = 4):
    rng = np.random.default_rng(seed)
    params = make_tree(_SHAPES.get(shape) or TREE_SHAPES[shape], rng, dtype)
    grads = grad_stream(params, steps, seed + 1, none_every=none_every, dtype=dtype)
    return params, grads


def parity_errors(name: str, config: Mapping[str, Any], dtype: Any) -> dict[str, float]:
    """Max relative errors, ours vs torch (foreach=False), of params and every buffer."""
    params, grads = stream(dtype, shape=GRID_SHAPE)
    ours_p, ours_s = grid_results(name, np.dtype(dtype).name)[config_id(config)]
    names = sorted(ours_s.buffers)
    torch_p, torch_b = run_torch(torch_factory(name, config), params, grads, names)
    errs = {"params": rel_err(ours_p, torch_p)}
    for n in names:
        errs[n] = rel_err(ours_s.buffers[n], torch_b[n])
    return errs


def assert_parity(name: str, config: Mapping[str, Any], dtype: Any) -> dict[str, float]:
    errs = parity_errors(name, config, dtype)
    tol = TOL[dtype]
    assert max(errs.values()) <= tol, f"{name} {config} {np.dtype(dtype).name}: {errs}"
    assert set(errs) >= {"params", "step", "exp_avg"}
    return errs


def assert_numpy_reference(name: str, config: Mapping[str, Any], reference: Any) -> float:
    """Ours (from the grid run) vs an independent NumPy float64 implementation.

    ``reference(params, grads, **kwargs)`` gets the configuration completed with the
    factory's defaults and returns ``(params, {buffer name: tree})``.
    """
    import inspect

    defaults = {
        k: v.default
        for k, v in inspect.signature(get_spec(name).factory).parameters.items()
        if k not in ("foreach", "capturable", "differentiable", "fused")
    }
    params, grads = stream(np.float64, shape=GRID_SHAPE)
    ours_p, ours_s = grid_results(name, "float64")[config_id(config)]
    ref_p, ref_b = reference(params, grads, **{**defaults, **config})
    errs = [rel_err(ours_p, ref_p)] + [rel_err(ours_s.buffers[n], r) for n, r in ref_b.items()]
    assert max(errs) <= 1e-10, (config, errs)
    return max(errs)


def none_gradients_vs_torch(name: str, config: Mapping[str, Any]) -> Any:
    """Real ``None`` leaves on a nested tree, un-jitted, vs torch; returns our state."""
    params, grads = stream(np.float64, seed=2, shape=EAGER_SHAPE, steps=20, none_every=3)
    ours_p, ours_s = run_jax_eager(get_spec(name).factory(**config), params, grads)
    names = sorted(ours_s.buffers)
    torch_p, torch_b = run_torch(torch_factory(name, config), params, grads, names)
    assert rel_err(ours_p, torch_p) <= 1e-10
    for n in names:
        assert rel_err(ours_s.buffers[n], torch_b[n]) <= 1e-10, n
    # the first leaf misses steps 0, 3, 6, ...: its first gradient arrives late
    assert int(jax.tree.leaves(ours_s.buffers["step"])[0]) == 20 - len(range(0, 20, 3))
    return ours_s


def bf16_vs_torch(name: str, config: Mapping[str, Any], steps: int = 20, size: int = 64) -> tuple[int, float]:
    """bf16 parameters, ours vs torch: each op computed in float32 and rounded to bf16.

    Returns (max distance in bf16 units in the last place, fraction of differing values)
    over all steps. Residual 1-ulp differences come from torch's fused multiply-adds.
    """
    rng = np.random.default_rng(11)
    p0 = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(steps)]
    tp = torch.tensor(p0).bfloat16().requires_grad_(True)
    opt = torch_factory(name, config)([tp])
    tx = get_spec(name).factory(**config)
    p = {"w": jnp.asarray(p0).astype(jnp.bfloat16)}
    s = tx.init(p)
    max_ulp, differing = 0, 0
    for g in grads:
        tp.grad = torch.tensor(g).bfloat16()
        opt.step()
        p, s = fo.step(tx, p, {"w": jnp.asarray(g).astype(jnp.bfloat16)}, s)
        assert p["w"].dtype == jnp.bfloat16
        ours = np.asarray(p["w"]).view(np.int16).astype(np.int64)
        theirs = tp.detach().view(torch.int16).numpy().astype(np.int64)
        assert np.all(np.sign(ours) == np.sign(theirs))
        max_ulp = max(max_ulp, int(np.max(np.abs(ours - theirs))))
        differing += int(np.sum(ours != theirs))
    return max_ulp, differing / (steps * size)


def run_jax_eager(tx: Any, params: Any, grads: Sequence[Any]):
    """Our optimizer step by step, un-jitted, with real ``None`` gradient leaves."""
    p = jax.tree.map(jnp.asarray, params)
    s = tx.init(p)
    for g in grads:
        p, s = fo.step(tx, p, g, s)
    return p, s


# --------------------------------------------------------------------- validation table


class Arr:
    """A hyperparameter given as an array: ``jnp.asarray`` here, ``torch.tensor`` in torch."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Arr({self.value})"


def materialize(kwargs: Mapping[str, Any], lib: str) -> dict[str, Any]:
    def conv(v):
        if isinstance(v, Arr):
            return jnp.asarray(v.value) if lib == "jax" else torch.tensor(v.value)
        if isinstance(v, tuple):
            return tuple(conv(x) for x in v)
        return v

    return {k: conv(v) for k, v in kwargs.items()}


def common_error_rows(momentum_decay: bool = False, adam_rules: bool = False) -> list[tuple]:
    """``(kwargs, error, message)`` rows mirroring torch's ``optim_error_inputs_func_*``
    (``torch/testing/_internal/common_optimizers.py``) plus each value check of __init__."""
    rows = [
        ({"lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ({"lr": Arr([0.001, 0.001])}, ValueError, "Tensor lr must be 1-element"),
        ({"lr": 1e-2, "eps": -1.0}, ValueError, "Invalid epsilon value: -1.0"),
        ({"lr": 1e-2, "betas": (1.0, 0.0)}, ValueError, "Invalid beta parameter at index 0: 1.0"),
        ({"lr": 1e-2, "betas": (-0.1, 0.0)}, ValueError, "Invalid beta parameter at index 0: -0.1"),
        ({"lr": 1e-2, "betas": (0.0, 1.0)}, ValueError, "Invalid beta parameter at index 1: 1.0"),
        ({"lr": 1e-2, "weight_decay": -1}, ValueError, "Invalid weight_decay value: -1"),
    ]
    if momentum_decay:
        rows.append(({"lr": 1e-2, "momentum_decay": -0.2}, ValueError, "Invalid momentum_decay value: -0.2"))
    if adam_rules:
        both = "betas must be either both floats or both Tensors"
        lr_foreach = "lr as a Tensor is not supported for capturable=False and foreach=True"
        beta_foreach = "betas[0] as a Tensor is not supported for capturable=False and foreach=True"
        fused_diff = "`fused` does not support `differentiable`"
        fused_foreach = "`fused` and `foreach` cannot be `True` together."
        rows += [
            ({"lr": Arr(0.001), "foreach": True}, ValueError, lr_foreach),
            ({"lr": 1e-2, "betas": (0.9, Arr(0.99))}, ValueError, both),
            ({"lr": 1e-2, "betas": (Arr(0.9), 0.99)}, ValueError, both),
            ({"lr": 1e-2, "betas": (Arr(0.9), Arr(0.99)), "foreach": True}, ValueError, beta_foreach),
            ({"fused": True, "differentiable": True}, RuntimeError, fused_diff),
            ({"fused": True, "foreach": True}, RuntimeError, fused_foreach),
        ]
    return rows


def row_id(row: tuple) -> str:
    return row[2][:40]


def check_error_row(name: str, kwargs: Mapping[str, Any], error: type, message: str) -> None:
    """Both torch and this package raise ``error`` with ``message`` (verbatim) for kwargs."""
    spec = get_spec(name)
    cls = getattr(torch.optim, spec.torch_name)
    with pytest.raises(error, match=re.escape(message)):
        cls([torch.zeros(2, requires_grad=True)], **materialize(kwargs, "torch"))
    with pytest.raises(error, match=re.escape(message)):
        spec.factory(**materialize(kwargs, "jax"))


# ---------------------------------------------------------------- differentiable steps

K = 5


@contextlib.contextmanager
def torch_default_dtype(dtype: Any):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _meta_problem(steps: int = K, seed: int = 3):
    rng = np.random.default_rng(seed)
    shapes = [(4,)]
    p0 = [rng.standard_normal(s) for s in shapes]
    a = [[rng.uniform(0.5, 2.0, s) for s in shapes] for _ in range(steps)]
    b = [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]
    w = [rng.standard_normal(s) for s in shapes]
    return p0, a, b, w


def torch_meta_grads(
    name: str, config: Mapping[str, Any], lr: float, default_dtype: Any, steps: int = K, lr_grad: bool = True
):
    """d loss / d (p0, lr) through K torch steps with ``differentiable=True``.

    Gradients are ``g_t = a_t * p + b_t`` (a quadratic), the loss is ``sum(w * p_K) +
    sum(p_K ** 2)``; ``lr`` is a float64 tensor that requires grad, or with
    ``lr_grad=False`` a Python float (d loss / d lr is then None).
    """
    p0_np, a, b, w = _meta_problem(steps)
    cls = getattr(torch.optim, get_spec(name).torch_name)
    with torch_default_dtype(default_dtype):
        p0 = [torch.tensor(x, requires_grad=True) for x in p0_np]
        lr_t = torch.tensor(lr, dtype=torch.float64, requires_grad=True) if lr_grad else lr
        ps = [p.clone() for p in p0]
        opt = cls(ps, lr=lr_t, foreach=False, differentiable=True, **config)
        for t in range(steps):
            # torch's differentiable steps save some buffers (exp_avg in addcdiv_, exp_avg_sq
            # in torch.maximum) that the next step modifies in place, so backward through
            # several steps fails; a fresh copy of each buffer per step (an identity, value
            # and gradient) keeps the saved versions intact
            for state in opt.state.values():
                for k, v in list(state.items()):
                    if k != "step" and torch.is_tensor(v):
                        state[k] = v.clone()
            for i, p in enumerate(ps):
                p.grad = torch.tensor(a[t][i]) * p + torch.tensor(b[t][i])
            opt.step()
        loss = sum((torch.tensor(wi) * p).sum() + (p**2).sum() for wi, p in zip(w, ps, strict=True))
        loss.backward()
        return [p.grad.numpy() for p in p0], (float(lr_t.grad) if lr_grad else None)


def fast_jit(fn: Any, *args: Any) -> Any:
    """``jax.jit(fn)`` compiled for ``args`` at LLVM -O0: test graphs compile ~2x faster."""
    return jax.jit(fn).lower(*args).compile(compiler_options={"xla_backend_optimization_level": 0})


@functools.cache
def _jax_meta_grads_all(
    name: str, configs: tuple[tuple, ...], lr: float, steps: int, tensor_lr: bool = True
) -> list:
    """``jax.grad`` through ``steps`` of our steps for several configurations, one compilation.

    ``tensor_lr``: built with the traced ``lr`` (a JAX array, an input of the
    transformation, as ``optax.inject_hyperparams`` passes it), as torch gets a tensor
    ``lr`` (its differentiable path then computes the step's scalars in lr's float64);
    else built with a number and given ``lr`` by ``set_hparams``."""
    p0_np, a, b, w = _meta_problem(steps)
    a_stack = [jnp.stack([jnp.asarray(a[t][i]) for t in range(steps)]) for i in range(len(p0_np))]
    b_stack = [jnp.stack([jnp.asarray(b[t][i]) for t in range(steps)]) for i in range(len(p0_np))]
    factory = get_spec(name).factory

    def loss(p0, lr, config):
        if tensor_lr:
            tx = factory(differentiable=True, lr=lr, **dict(config))
            state = tx.init(p0)
        else:
            tx = factory(differentiable=True, **dict(config))
            state = fo.set_hparams(tx.init(p0), lr=lr)

        def body(carry, xs):
            p, s = carry
            at, bt = xs
            g = [ai * x + bi for ai, x, bi in zip(at, p, bt, strict=True)]
            return fo.step(tx, p, g, s), None

        (p, _), _ = jax.lax.scan(body, (p0, state), (a_stack, b_stack))
        return sum(jnp.sum(wi * x) + jnp.sum(x**2) for wi, x in zip(w, p, strict=True))

    def all_grads(p0, lr):
        return [jax.grad(loss, argnums=(0, 1))(p0, lr, c) for c in configs]

    args = ([jnp.asarray(x) for x in p0_np], jnp.float64(lr))
    out = fast_jit(all_grads, *args)(*args)
    return [([np.asarray(x) for x in g_p], float(g_lr)) for g_p, g_lr in out]


def assert_meta_grads(
    name: str,
    configs: Sequence[Mapping[str, Any]],
    index: int,
    lr: float,
    default_dtype: Any,
    steps: int = K,
    lr_grad: bool = True,
) -> float:
    """jax.grad w.r.t. (initial params, lr) through K steps of ``configs[index]`` equals
    torch's autograd through ``step()`` with ``differentiable=True`` (float64, 1e-10).

    ``lr_grad=False`` where torch cannot differentiate w.r.t. a tensor ``lr`` over several
    steps: torch then gets a Python float and only d loss / d params is compared."""
    config = configs[index]
    tg_p, tg_lr = torch_meta_grads(name, config, lr, default_dtype, steps, lr_grad)
    key = tuple(tuple(sorted(c.items())) for c in configs)
    jg_p, jg_lr = _jax_meta_grads_all(name, key, lr, steps, lr_grad)[index]
    err = rel_err(jg_p, tg_p)
    if lr_grad:
        err = max(err, abs(jg_lr - tg_lr) / abs(tg_lr))
        assert abs(tg_lr) > 0
    # torch's float32 step scalars hold a float32 sqrt, 1 ulp off on some CPUs
    f32_scalars = default_dtype == torch.float32 and name in ("adam", "adamw")
    tol = 1e-10 if torch_float32_sqrt_is_exact() or not f32_scalars else FLOAT32_SQRT_RTOL
    assert err <= tol, (name, config, err, jg_lr, tg_lr)
    assert max(np.max(np.abs(g)) for g in tg_p) > 0 and np.isfinite(jg_lr) and jg_lr != 0
    return err


# --------------------------------------------------------------------- no recompilation


def assert_no_recompile(name: str, config: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Changing numeric hyperparameters through set_hparams reuses the compiled step, and
    the result equals an optimizer built with the new values."""
    tx = get_spec(name).factory(**config)
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    params, grads = stream(np.float64, seed=5, shape=EAGER_SHAPE, steps=3, none_every=0)
    p = jax.tree.map(jnp.asarray, params)
    s = tx.init(p)
    p, s = step(p, grads[0], s)
    assert step._cache_size() == 1
    s = fo.set_hparams(s, **new)
    p2, s2 = step(p, grads[1], s)
    p2, s2 = step(p2, grads[2], s2)
    assert step._cache_size() == 1
    # reference: after step 1, continue with the hyperparameters of an optimizer built with
    # ``new`` (construction and set_hparams must give the same arrays)
    ref_tx = get_spec(name).factory(**{**config, **new})
    rs = s._replace(hparams=ref_tx.init(p).hparams)
    rp = p
    for g in grads[1:]:
        rp, rs = fo.step(ref_tx, rp, g, rs)
    assert rel_err(p2, rp) <= 1e-13
    assert rel_err(p2, p) > 0
