"""A number's zero-ness compiled in (``Algorithm.fixed_zero`` / ``fixed_nonzero``).

A ``weight_decay`` built as the number 0 (and SGD's or RMSprop's nonzero ``momentum``)
decides torch's ``if weight_decay != 0`` branch when the step is compiled: no pass reads
the parameter for the decay (nor the gradient again for SGD's momentum-free update).
Every path that can change the value is checked: ``set_hparams`` (and ``param_groups``
groups) refuse it before anything changes, the torch-shaped facade rebuilds the group,
JAX arrays, schedules and ``optax.inject_hyperparams`` keep the value changeable, and a
state restored into a transformation built otherwise steps to NaN, never to another rule.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functorch_optim as fo
from functorch_optim._base import changeable_hparams
from functorch_optim._hyperparams import FIXED
from functorch_optim.optim import SGD, Adam, RMSprop
from tests.helpers import entry_text, rmsprop

#: every factory whose coupled weight decay is fixed at 0 when built so, with the
#: keywords that make it take that branch
L2_FACTORIES = {
    "sgd": (fo.sgd, {"lr": 0.1, "momentum": 0.9}),
    "sgd_plain": (fo.sgd, {"lr": 0.1}),
    "adam": (fo.adam, {"lr": 0.1}),
    "adam_amsgrad": (fo.adam, {"lr": 0.1, "amsgrad": True}),
    "adagrad": (fo.adagrad, {"lr": 0.1}),
    "rmsprop": (rmsprop, {"lr": 0.01}),
    "rmsprop_momentum_centered": (rmsprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "adamax": (fo.adamax, {"lr": 0.1}),
    "nadam": (fo.nadam, {"lr": 0.1}),
    "radam": (fo.radam, {"lr": 0.1}),
    "asgd": (fo.asgd, {"lr": 0.1}),
    "adadelta": (fo.adadelta, {"lr": 0.5}),
}
IDS = list(L2_FACTORIES)
#: the entries with a fused CPU kernel (a ``fused`` argument; RMSprop's: ``helpers.rmsprop``)
KERNELS = ("sgd", "adam", "adagrad", "rmsprop", "rmsprop_momentum_centered")


def _tree(dtype=jnp.float32):
    return {"w": jnp.linspace(-1.0, 1.5, 7, dtype=dtype), "b": jnp.array([0.5, -0.25], dtype)}


def _grads(i, dtype=jnp.float32):
    return {
        "w": jnp.sin(jnp.arange(7, dtype=dtype) + i).astype(dtype),
        "b": jnp.array([0.1 * i - 0.3, 0.2], dtype),
    }


def _run(tx, steps=4, dtype=jnp.float32, state=None):
    params = _tree(dtype)
    state = tx.init(params) if state is None else state
    step = jax.jit(functools.partial(fo.step, tx))
    for i in range(steps):
        params, state = step(params, _grads(i, dtype), state)
    return params, state


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_fixed_zero_weight_decay_computes_the_same_bits(name, dtype):
    """The fixed branch and the select it replaces give the same params and buffers."""
    factory, kwargs = L2_FACTORIES[name]
    fixed = factory(**kwargs)
    assert dict(fixed.init(_tree()).hparams.static[FIXED])["weight_decay"] == "zero"
    with changeable_hparams():
        selected = factory(**kwargs)
    assert FIXED not in selected.init(_tree()).hparams.static
    (p1, s1), (p2, s2) = _run(fixed, dtype=dtype), _run(selected, dtype=dtype)
    _assert_same(p1, p2)
    names = set(s1.buffers)
    if set(s2.buffers) != names:  # changeable SGD keeps a buffer for momentum 0 (and its
        names.discard("step")  # ``step`` counts only steps with momentum != 0)
    _assert_same({n: s1.buffers[n] for n in names}, {n: s2.buffers[n] for n in names})


@pytest.mark.parametrize("fused", [False, True, None], ids=["rule", "kernel", "auto"])
@pytest.mark.parametrize("name", KERNELS)
def test_fused_kernels_match_the_fixed_rule(name, fused):
    factory, kwargs = L2_FACTORIES[name]
    rule = _run(factory(**kwargs, fused=False))
    _assert_same(_run(factory(**kwargs, fused=fused)), rule)


@pytest.mark.parametrize("name", IDS)
def test_set_hparams_refuses_a_nonzero_weight_decay(name):
    factory, kwargs = L2_FACTORIES[name]
    state = factory(**kwargs).init(_tree())
    with pytest.raises(ValueError, match=r"weight_decay=0\.1 for an optimizer built with weight_decay=0"):
        fo.set_hparams(state, weight_decay=0.1)
    with pytest.raises(ValueError, match="weight_decay"):
        fo.set_hparams(state, lr=0.2, weight_decay=0.1)  # nothing changes: lr neither
    assert float(fo.get_hparams(state)["lr"]) == pytest.approx(kwargs["lr"])
    fo.set_hparams(state, weight_decay=0.0, lr=0.2)  # zero stays allowed


@pytest.mark.parametrize("factory", [fo.sgd, fo.rmsprop], ids=["sgd", "rmsprop"])
def test_set_hparams_refuses_a_zero_momentum_where_it_is_fixed(factory):
    state = factory(lr=0.01, momentum=0.9).init(_tree())
    assert dict(state.hparams.static[FIXED])["momentum"] == "nonzero"
    with pytest.raises(ValueError, match=r"momentum=0\.0 for an optimizer built with a nonzero momentum"):
        fo.set_hparams(state, momentum=0.0)
    fo.set_hparams(state, momentum=0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_sgd_dampening_built_as_zero_adds_the_gradient_without_an_fma(dtype, monkeypatch):
    # torch's buf.mul_(momentum).add_(grad, alpha=1 - dampening) is an FMA, whose product
    # grad * 1 is exact: with dampening the number 0 (torch's default) the rule adds the
    # gradient, one rounding, and has no FMA to emulate (Algorithm.fused_fmas); the same
    # bits as the FMA, in a step on given gradients and in a whole training step whose
    # gradient is a product (which XLA must not contract into the add)
    from functorch_optim import _torch_ops

    jax.clear_caches()  # the rule is traced anew (its per-shape jit keeps earlier traces)
    calls = []
    program = _torch_ops._fma_program
    monkeypatch.setattr(_torch_ops, "_fma_program", lambda *a: calls.append(1) or program(*a))
    fixed = fo.sgd(lr=0.1, momentum=0.9, fused=False)
    state = fixed.init(_tree(dtype))
    assert dict(state.hparams.static[FIXED])["dampening"] == "zero"
    with changeable_hparams():
        damped = fo.sgd(lr=0.1, momentum=0.9, fused=False)
    jax.make_jaxpr(functools.partial(fo.step, fixed))(_tree(dtype), _grads(0, dtype), state)
    assert not calls
    jax.make_jaxpr(functools.partial(fo.step, damped))(
        _tree(dtype), _grads(0, dtype), damped.init(_tree(dtype))
    )
    assert calls
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.standard_normal((37, 5)), dtype) for _ in range(2))

    def whole(tx):
        def step(p, s, x, y):
            # d/dw of sum(w * x * y) is x * y: a product in the step's own loop
            grads = jax.grad(lambda q: jnp.sum(q["w"] * x * y) + jnp.sum(q["b"] ** 3))(p)
            return fo.step(tx, p, grads, s)

        return jax.jit(step)

    params = {
        "w": jnp.asarray(rng.standard_normal((37, 5)), dtype),
        "b": jnp.linspace(-1, 1, 67, dtype=dtype),
    }
    runs = []
    for tx in (fixed, damped):
        p, s = params, tx.init(params)
        for _ in range(4):
            p, s = whole(tx)(p, s, x, y)
        runs.append((p, s.buffers))
    _assert_same(runs[0], runs[1])
    _assert_same(_run(fixed, dtype=dtype), _run(damped, dtype=dtype))
    with pytest.raises(ValueError, match=r"dampening=0\.1 for an optimizer built with dampening=0"):
        fo.set_hparams(state, dampening=0.1)
    # without a buffer nothing reads dampening: it stays changeable
    plain = fo.sgd(lr=0.1).init(_tree(dtype))
    assert "dampening" not in dict(plain.hparams.static[FIXED])
    fo.set_hparams(plain, dampening=0.1)


def test_a_nonzero_weight_decay_and_decoupled_decay_stay_changeable():
    # built nonzero: the select stays, and set_hparams may move it to 0 and back
    state = fo.sgd(lr=0.1, weight_decay=0.1).init(_tree())
    # (its momentum number 0 is fixed: it keeps no buffer)
    assert dict(state.hparams.static[FIXED]) == {"momentum": "zero"}
    fo.set_hparams(fo.set_hparams(state, weight_decay=0.0), weight_decay=0.2)
    # the decoupled factor costs no extra read: AdamW (and decoupled NAdam/RAdam) fix nothing
    for tx in (
        fo.adamw(weight_decay=0.0),
        fo.nadam(decoupled_weight_decay=True),
        fo.radam(decoupled_weight_decay=True),
    ):
        state = tx.init(_tree())
        assert FIXED not in state.hparams.static
        fo.set_hparams(state, weight_decay=0.3)


def _param_readers(tx, name="params"):
    """Fusions (and other ops) of the compiled step's entry computation that read the
    parameters (``name="params"``) or the gradients."""
    params = {"w": jnp.zeros(4096, jnp.float32)}
    f = jax.jit(functools.partial(fo.step, tx), donate_argnums=(0, 2))
    text = entry_text(f.lower(params, params, tx.init(params)).compile())
    arg = re.search(rf"%({name}__w__[.\d]*) = f32\[4096\]", text).group(1)
    return [line for line in text.splitlines() if f"%{arg}," in line or f"%{arg})" in line]


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad", "rmsprop", "adadelta"])
def test_only_the_parameter_pass_reads_the_param(name):
    """The point of the flag: with weight_decay fixed at 0, one loop reads the param
    (the one that writes it); the select made every moment pass read it too."""
    factory, kwargs = L2_FACTORIES[name]
    with changeable_hparams():
        before = _param_readers(factory(**kwargs, **({"fused": False} if name in KERNELS else {})))
    after = _param_readers(factory(**kwargs, **({"fused": False} if name in KERNELS else {})))
    assert len(after) == 1, after
    assert len(before) > 1, before


def test_sgd_with_fixed_momentum_reads_the_gradient_once():
    with changeable_hparams():
        before = _param_readers(fo.sgd(lr=0.1, momentum=0.9, weight_decay=1e-4, fused=False), "grads")
    after = _param_readers(fo.sgd(lr=0.1, momentum=0.9, weight_decay=1e-4, fused=False), "grads")
    assert len(after) == 1, after
    assert len(before) == 2, before


# --------------------------------------------------------------------------- the guard


def _restored(state, **values):
    """``state`` with hyperparameter values from elsewhere, as orbax restores a
    checkpoint into a target: the target's structure (static flags), the saved values."""
    return state._replace(
        hparams=state.hparams.replace(
            **{k: jnp.asarray(v, state.hparams[k].dtype) for k, v in values.items()}
        )
    )


@pytest.mark.parametrize("fused", [False, True], ids=["rule", "kernel"])
@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad", "rmsprop", "nadam"])
def test_a_restored_nonzero_weight_decay_steps_to_nan(name, fused):
    factory, kwargs = L2_FACTORIES[name]
    kwargs = {**kwargs, **({"fused": fused} if name in KERNELS else {})}
    if fused and name not in KERNELS:
        pytest.skip("no kernel")
    tx = factory(**kwargs)
    state = _restored(tx.init(_tree()), weight_decay=0.1)
    params, _ = _run(tx, steps=1, state=state)
    assert all(bool(jnp.isnan(p).all()) for p in jax.tree.leaves(params))
    # the consistent state steps normally, with the same compiled step
    params, _ = _run(tx, steps=1)
    assert not any(bool(jnp.isnan(p).any()) for p in jax.tree.leaves(params))


def test_a_restored_zero_momentum_steps_to_nan():
    tx = fo.sgd(lr=0.1, momentum=0.9)
    params, _ = _run(tx, steps=2, state=_restored(tx.init(_tree()), momentum=0.0))
    assert all(bool(jnp.isnan(p).all()) for p in jax.tree.leaves(params))


@pytest.mark.parametrize("fused", [False, True], ids=["rule", "kernel"])
def test_a_restored_nonzero_dampening_steps_to_nan(fused):
    # a checkpoint of an SGD with dampening 0.3 restored into one built with dampening 0
    # (compiled in): never the undamped rule on the saved value
    tx = fo.sgd(lr=0.1, momentum=0.9, fused=fused)
    params, _ = _run(tx, steps=2, state=_restored(tx.init(_tree()), dampening=0.3))
    assert all(bool(jnp.isnan(p).all()) for p in jax.tree.leaves(params))


def test_a_pickled_state_of_another_build_steps_to_nan():
    saved = pickle.dumps(fo.adam(lr=0.1, weight_decay=0.1).init(_tree()))
    params, _ = _run(fo.adam(lr=0.1), steps=1, state=pickle.loads(saved))
    assert all(bool(jnp.isnan(p).all()) for p in jax.tree.leaves(params))


def test_an_orbax_restore_of_another_build_steps_to_nan(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    saved = fo.adagrad(lr=0.1, weight_decay=0.1).init(_tree())
    tx = fo.adagrad(lr=0.1)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "s", saved)
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(tmp_path / "s", tx.init(_tree()))
    assert float(fo.get_hparams(state)["weight_decay"]) == pytest.approx(0.1)
    params, _ = _run(tx, steps=1, state=state)
    assert all(bool(jnp.isnan(p).all()) for p in jax.tree.leaves(params))
    with pytest.raises(ValueError, match="weight_decay"):
        fo.set_hparams(state, lr=0.2)  # the mismatch is named on the Python path too


def test_the_guard_under_grad_accumulate():
    tx = fo.grad_accumulate(fo.adam(lr=0.1, fused=True), every=2)
    state = tx.init(_tree())
    # the inner Adam's weight_decay set behind set_hparams' back (as a restore would)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    new = [jnp.asarray(0.1, v.dtype) if "weight_decay" in jax.tree_util.keystr(p) else v for p, v in leaves]
    state = jax.tree_util.tree_unflatten(treedef, new)
    params = _tree()
    for i in range(2):
        params, state = fo.step(tx, params, _grads(i), state)
    assert all(bool(jnp.isnan(p).all()) for p in jax.tree.leaves(params))


# --------------------------------------------------------------------------- changeable paths


def test_arrays_schedules_and_inject_hyperparams_keep_weight_decay_changeable():
    assert FIXED not in fo.adam(weight_decay=jnp.asarray(0.0)).init(_tree()).hparams.static
    assert FIXED not in fo.adam(weight_decay=lambda count: 0.0 * count).init(_tree()).hparams.static
    injected = optax.inject_hyperparams(fo.adam)(lr=0.1, weight_decay=0.0)
    params = _tree()
    state = injected.init(params)
    state.hyperparams["weight_decay"] = jnp.asarray(0.1, state.hyperparams["weight_decay"].dtype)
    updates, _ = injected.update(_grads(0), state, params)
    ours = optax.apply_updates(params, updates)
    ref_updates, _ = fo.adam(lr=0.1, weight_decay=0.1).update(
        _grads(0), fo.adam(lr=0.1, weight_decay=0.1).init(params), params
    )
    _assert_same(ours, optax.apply_updates(params, ref_updates))


def test_param_groups_refuse_per_group():
    tx = fo.param_groups(fo.adam, {"b": {"where": r"^b$", "weight_decay": 0.0}}, lr=0.1, weight_decay=0.1)
    state = tx.init(_tree())
    with pytest.raises(ValueError, match=r"weight_decay=0\.2 for an optimizer built with weight_decay=0"):
        fo.set_hparams(state, group="b", weight_decay=0.2)
    fo.set_hparams(state, group="default", weight_decay=0.0)


# --------------------------------------------------------------------------- the facade


def _facade_run(opt, schedule, dtype=jnp.float64):
    """Steps with ``param_groups[0]`` edits: ``schedule`` a list of per-step dicts."""
    for i, edits in enumerate(schedule):
        opt.param_groups[0].update(edits)
        opt.grad = _grads(i, dtype)
        opt.step()
    return opt.params


def test_facade_weight_decay_edit_rebuilds_and_matches_a_changeable_build():
    schedule = [{}, {"weight_decay": 0.1}, {}, {"weight_decay": 0.0}, {"weight_decay": 0.05}]
    opt = Adam(_tree(jnp.float64), lr=0.1)
    assert FIXED in opt.state.hparams.static
    ours = _facade_run(opt, schedule)
    assert FIXED not in opt.state.hparams.static
    with changeable_hparams():
        ref = Adam(_tree(jnp.float64), lr=0.1)
    _assert_same(ours, _facade_run(ref, schedule))


def test_facade_matches_torch_across_the_fixed_flags():
    torch = pytest.importorskip("torch")
    schedule = [{}, {"momentum": 0.0, "weight_decay": 0.1}, {}, {"momentum": 0.5}, {"weight_decay": 0.0}]
    schedule += [{"dampening": 0.3}, {}, {"dampening": 0.0}]
    opt = SGD(_tree(jnp.float64), lr=0.1, momentum=0.9)
    ours = _facade_run(opt, schedule)
    theirs = _torch_run(torch.optim.SGD, schedule, lr=0.1, momentum=0.9)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k])


def _torch_run(torch_optimizer, schedule, **config):
    """torch's params after the steps of ``schedule`` (param_groups edits before each)."""
    import torch

    tp = {k: torch.tensor(np.asarray(v)) for k, v in _tree(jnp.float64).items()}
    topt = torch_optimizer(list(tp.values()), **config)
    for i, edits in enumerate(schedule):
        topt.param_groups[0].update(edits)
        for k, t in tp.items():
            t.grad = torch.tensor(np.asarray(_grads(i, jnp.float64)[k]))
        topt.step()
    return {k: t.numpy() for k, t in tp.items()}


def test_facade_rmsprop_momentum_to_zero_keeps_the_buffer_like_torch():
    torch = pytest.importorskip("torch")
    schedule = [{}, {"momentum": 0.0}, {"momentum": 0.5}]
    ours = _facade_run(RMSprop(_tree(jnp.float64), lr=0.01, momentum=0.9), schedule)
    theirs = _torch_run(torch.optim.RMSprop, schedule, lr=0.01, momentum=0.9)
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-14)


def test_facade_load_state_dict_and_pickle_across_the_flag():
    src = Adam(_tree(jnp.float64), lr=0.1, weight_decay=0.1)
    _facade_run(src, [{}])
    dst = Adam(_tree(jnp.float64), lr=0.1)
    dst.params = src.params  # (a state dict holds no parameters)
    dst.load_state_dict(src.state_dict())
    assert float(fo.get_hparams(dst.state)["weight_decay"]) == pytest.approx(0.1)
    _assert_same(_facade_run(dst, [{}, {}]), _facade_run(src, [{}, {}]))
    # a group made changeable by an edit stays so through pickle
    opt = Adam(_tree(jnp.float64), lr=0.1)
    _facade_run(opt, [{"weight_decay": 0.1}])
    twin = pickle.loads(pickle.dumps(opt))
    _assert_same(
        _facade_run(twin, [{"weight_decay": 0.0}, {"weight_decay": 0.2}]),
        _facade_run(opt, [{"weight_decay": 0.0}, {"weight_decay": 0.2}]),
    )


def test_facade_state_assignment_across_the_flag_rebuilds():
    """A state restored (orbax: into the optimizer's own structure) with values the
    compiled step fixed otherwise: the group is rebuilt, no NaN, torch's rule."""
    src = Adam(_tree(jnp.float64), lr=0.1, weight_decay=0.1)
    _facade_run(src, [{}])
    dst = Adam(_tree(jnp.float64), lr=0.1)
    dst.params = src.params
    dst.state = _restored(dst.state, weight_decay=0.1)._replace(
        buffers=src.state.buffers, count=src.state.count
    )
    assert dst.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    _assert_same(_facade_run(dst, [{}, {}]), _facade_run(src, [{}, {}]))


_RESUME_SCRIPT = """
import json, sys, numpy as np, torch, jax
jax.config.update("jax_enable_x64", True)
from functorch_optim import optim
from functorch_optim.interop.torch import grads_from_module, tree_from_module
name, built, crossed = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = torch.nn.Linear(10, 1).double()
model.load_state_dict(torch.load(sys.argv[1] + "/model.pt"))
x, y = torch.load(sys.argv[1] + "/batch.pt")
opt = getattr(optim, name)(tree_from_module(model), **built)  # the port's default 0
opt.load_state_dict(torch.load(sys.argv[1] + "/optim.pt"))
torch.nn.functional.mse_loss(model(x), y).backward()
opt.grad = grads_from_module(model)
opt.step()
np.savez(sys.argv[1] + "/resumed.npz", **{k: np.asarray(v) for k, v in opt.params.items()})
print("RESUMED", opt.param_groups[0][crossed])
"""


@pytest.mark.parametrize(
    ("name", "built", "crossed", "value"),
    [("Adam", {"lr": 0.01}, "weight_decay", 0.1), ("SGD", {"lr": 0.01, "momentum": 0.9}, "dampening", 0.3)],
    ids=["adam-weight_decay", "sgd-dampening"],
)
def test_a_torch_checkpoint_across_a_compiled_zero_resumes_in_a_fresh_process(
    tmp_path, name, built, crossed, value
):
    """torch trains Linear(10, 1) with ``crossed=value`` and torch.save's it; a fresh
    process resumes with the facade built with that hyperparameter's default 0 (compiled
    in): load_state_dict takes the group's value and the next step is torch's."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1).double()
    opt = getattr(torch.optim, name)(model.parameters(), **built, **{crossed: value})
    x, y = torch.randn(16, 10, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    torch.save((x, y), tmp_path / "batch.pt")

    def next_step(v):
        # torch's next step from the checkpoint, with the saved or another value
        m = torch.nn.Linear(10, 1).double()
        m.load_state_dict(torch.load(tmp_path / "model.pt"))
        o = getattr(torch.optim, name)(m.parameters(), **built)
        sd = torch.load(tmp_path / "optim.pt")
        sd["param_groups"][0][crossed] = v
        o.load_state_dict(sd)
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        return {n: q.detach().numpy() for n, q in m.named_parameters()}

    expected, without = next_step(value), next_step(0.0)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _RESUME_SCRIPT, str(tmp_path), name, json.dumps(built), crossed],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and f"RESUMED {value}" in proc.stdout, proc.stderr[-3000:]
    got = np.load(tmp_path / "resumed.npz")
    for key, want in expected.items():
        np.testing.assert_allclose(got[key], want, rtol=1e-12, atol=0)
        # the term moves this step far beyond the tolerance: a dropped term would show
        assert np.max(np.abs(without[key] - want) / np.abs(want)) > 1e-8
