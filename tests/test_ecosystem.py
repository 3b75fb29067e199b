"""The JAX ecosystem's idioms around this package's optimizers, unchanged.

equinox (``eqx.filter`` / ``eqx.apply_updates``), flax nnx (``nnx.Optimizer``), flax
linen (``TrainState``), ``optax.chain`` / ``multi_transform`` / ``inject_hyperparams``:
each run is compared with the same run on a plain pytree (bit for bit) and with torch
(float64, relative 1e-12).
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from flax.training import train_state

import functorch_optim as fo
from functorch_optim._rmsprop import rmsprop_variant

STEPS = 4
SIZES = (3, 4, 2)  # in, hidden, out
TOL = 1e-12


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((6, SIZES[0])), rng.standard_normal((6, SIZES[-1]))


X, Y = _data()

OPTIMIZERS = {
    "sgd-momentum": (
        lambda: fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    ),
    "adamw": (
        lambda: fo.adamw(lr=0.05, weight_decay=0.1, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, amsgrad=True),
    ),
}


def mlp_loss(layers, x, y):
    """The mean squared error of a relu MLP given as ``[(W, b), ...]`` (torch's layout)."""
    h = x
    for i, (w, b) in enumerate(layers):
        h = h @ w.T + b[None, :]
        if i < len(layers) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - y) ** 2)


def torch_run(layers, make_opt, steps=STEPS):
    """``steps`` full-batch steps of torch on the MLP ``layers``; the final ``[(W, b)]``."""
    mods = []
    for i, (w, b) in enumerate(layers):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.array(w)))
            lin.bias.copy_(torch.from_numpy(np.array(b)))
        mods.append(lin)
        if i < len(layers) - 1:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods)
    opt = make_opt(model.parameters())
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [
        (m.weight.detach().numpy(), m.bias.detach().numpy()) for m in model if isinstance(m, torch.nn.Linear)
    ]


def assert_close(ours, theirs, tol=TOL):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        err = np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))
        assert err <= tol, err


def assert_same(ours, theirs):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------- equinox


def eqx_model():
    model = eqx.nn.MLP(SIZES[0], SIZES[-1], SIZES[1], 1, key=jax.random.PRNGKey(0), dtype=jnp.float64)
    return model


def eqx_layers(model):
    return [(lin.weight, lin.bias) for lin in model.layers]


def eqx_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def eqx_run(tx, model, steps=STEPS):
    """equinox's training loop as its docs write it."""
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, state, x, y):
        grads = eqx.filter_grad(eqx_loss)(model, x, y)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state

    for _ in range(steps):
        model, state = train_step(model, state, X, Y)
    return model, state


def plain_run(tx, layers, steps=STEPS):
    """The same loop on a plain list of ``(W, b)`` pairs, through ``tx.update``."""
    layers = [tuple(jnp.asarray(a) for a in pair) for pair in layers]
    state = tx.init(layers)

    @jax.jit
    def train_step(layers, state, x, y):
        grads = jax.grad(mlp_loss)(layers, x, y)
        updates, state = tx.update(grads, state, layers)
        return optax.apply_updates(layers, updates), state

    for _ in range(steps):
        layers, state = train_step(layers, state, X, Y)
    return layers, state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equinox_filter_idiom_equals_plain_pytree_and_torch(name):
    make_tx, make_torch = OPTIMIZERS[name]
    model = eqx_model()
    trained, state = eqx_run(make_tx(), model)
    plain, plain_state = plain_run(make_tx(), eqx_layers(model))
    assert_same(eqx_layers(trained), plain)
    # the activation function is not a parameter: no state there
    assert state.buffers["step"].activation is None
    assert int(state.buffers["step"].layers[0].weight) == STEPS
    assert_close(eqx_layers(trained), torch_run(eqx_layers(model), make_torch))
    assert_same(jax.tree.leaves(state), jax.tree.leaves(plain_state))


WRAPPERS = {
    "chain-clip": lambda: optax.chain(optax.clip_by_global_norm(0.5), fo.adamw(lr=0.05)),
    "grad_accumulate": lambda: fo.grad_accumulate(fo.adamw(lr=0.05), every=2),
    # a label that selects nothing: its optimizer gets an empty tree
    "multi_transform-empty-label": lambda: optax.multi_transform(
        {"all": fo.adamw(lr=0.05), "none": fo.sgd(lr=0.1, momentum=0.9)},
        lambda p: jax.tree.map(lambda _: "all", p),
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(fo.adamw)(lr=0.05),
}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_equinox_through_optax_wrappers_equals_plain_pytree(name):
    model = eqx_model()
    trained, _ = eqx_run(WRAPPERS[name](), model)
    plain, _ = plain_run(WRAPPERS[name](), eqx_layers(model))
    assert_same(eqx_layers(trained), plain)
    direct, _ = plain_run(
        fo.adamw(lr=0.05), eqx_layers(model), steps=STEPS // 2 if "accum" in name else STEPS
    )
    if name != "chain-clip":  # accumulating one batch twice: its mean is that batch's gradient
        assert_same(plain, direct)


def test_inject_hyperparams_drives_the_optimizer():
    """Changing ``state.hyperparams`` changes the step, under jit, as for optax's own."""
    layers = [tuple(jnp.asarray(a) for a in pair) for pair in eqx_layers(eqx_model())]
    tx = optax.inject_hyperparams(fo.sgd)(lr=0.1, momentum=0.9)
    ref = fo.sgd(lr=0.1, momentum=0.9)
    state, ref_state = tx.init(layers), ref.init(layers)
    update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
    ours, theirs = layers, layers
    for lr in (0.1, 0.02, 0.3):
        state.hyperparams["lr"] = jnp.asarray(lr)
        ref_state = fo.set_hparams(ref_state, lr=lr)
        grads = jax.grad(mlp_loss)(ours, X, Y)
        updates, state = update(grads, state, ours)
        ours = optax.apply_updates(ours, updates)
        updates, ref_state = ref_update(grads, ref_state, theirs)
        theirs = optax.apply_updates(theirs, updates)
        assert_same(ours, theirs)
    assert float(state.inner_state.hparams["lr"]) == 0.3
    # the injected value is an input of the transformation, not state to set
    with pytest.raises(ValueError, match="lr is driven by a schedule, or was given to the constructor"):
        fo.set_hparams(state.inner_state, lr=0.5)


def test_none_in_params_is_not_a_parameter_none_grad_is_no_gradient():
    tx = fo.adam(lr=0.1)
    params = {"w": jnp.ones(2), "b": jnp.ones(2), "act": None}
    state = tx.init(params)
    assert state.exp_avg["act"] is None
    grads = {"w": jnp.ones(2), "b": None, "act": None}
    updates, state = tx.update(grads, state, params)
    assert updates["act"] is None and updates["b"] is None
    assert int(state.step["w"]) == 1 and int(state.step["b"]) == 0
    new = fo.apply_updates(params, updates)
    assert new["act"] is None
    np.testing.assert_array_equal(new["b"], params["b"])
    with pytest.raises(ValueError, match=r"grads have a value at \['act'\], where params have None"):
        tx.update({"w": jnp.ones(2), "b": None, "act": jnp.ones(2)}, state, params)


# ------------------------------------------------------------------------------------- flax


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(SIZES[0], SIZES[1], rngs=rngs, param_dtype=jnp.float64)
        self.l2 = nnx.Linear(SIZES[1], SIZES[2], rngs=rngs, param_dtype=jnp.float64)
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.float64))  # not a parameter

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        return self.l2(jax.nn.relu(self.l1(x)))


def nnx_layers(model):
    return [(lin.kernel[...].T, lin.bias[...]) for lin in (model.l1, model.l2)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_flax_nnx_optimizer_equals_torch(name):
    make_tx, make_torch = OPTIMIZERS[name]
    model = NnxMLP(nnx.Rngs(0))
    start = [tuple(np.array(a) for a in pair) for pair in nnx_layers(model)]
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    for _ in range(STEPS):
        train_step(model, optimizer, X, Y)
    assert float(model.calls[...]) == STEPS
    assert_close(nnx_layers(model), torch_run(start, make_torch))
    plain, _ = plain_run(make_tx(), start)
    assert_close(nnx_layers(model), plain, tol=1e-14)


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        h = jax.nn.relu(linen.Dense(SIZES[1], param_dtype=jnp.float64, name="l1")(x))
        return linen.Dense(SIZES[2], param_dtype=jnp.float64, name="l2")(h)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_flax_linen_train_state_equals_torch(name):
    make_tx, make_torch = OPTIMIZERS[name]
    module = LinenMLP()
    variables = module.init(jax.random.PRNGKey(0), jnp.asarray(X))
    start = [
        (np.array(variables["params"][n]["kernel"]).T, np.array(variables["params"][n]["bias"]))
        for n in ("l1", "l2")
    ]
    state = train_state.TrainState.create(apply_fn=module.apply, params=variables["params"], tx=make_tx())

    @jax.jit
    def train_step(state, x, y):
        def loss(p):
            return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    for _ in range(STEPS):
        state = train_step(state, X, Y)
    trained = [(state.params[n]["kernel"].T, state.params[n]["bias"]) for n in ("l1", "l2")]
    assert int(state.step) == STEPS
    assert_close(trained, torch_run(start, make_torch))


def test_array_hyperparameters_are_not_shared_between_facades():
    """Two facades whose lr is a JAX array each step with their own (the value lives in the
    transformation, so the facade's cache of compiled steps must not share it)."""
    from functorch_optim.optim import SGD

    outs = []
    for lr in (0.1, 0.5):
        opt = SGD({"w": jnp.ones(2)}, lr=jnp.asarray(lr))
        opt.zero_grad()
        opt.backward(lambda p: jnp.sum(p["w"]))
        opt.step()
        outs.append(opt.params["w"].tolist())
    assert outs == [[0.9, 0.9], [0.5, 0.5]]


KERNEL_SIZES = (40, 30, 2)  # 1292 float64 elements: the default sends them to the kernel
KERNEL_OPTIMIZERS = {
    "sgd-momentum": lambda **k: fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.01, **k),
    "adamw": lambda **k: fo.adamw(lr=0.05, weight_decay=0.1, amsgrad=True, **k),
    "adagrad": lambda **k: fo.adagrad(lr=0.1, lr_decay=0.01, **k),
    # RMSprop has no fused argument (torch has none): the bench's variant picks the path
    "rmsprop": lambda fused=None: rmsprop_variant(fused, lr=0.01, momentum=0.5, centered=True),
}


class _KernelNnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(KERNEL_SIZES[0], KERNEL_SIZES[1], rngs=rngs, param_dtype=jnp.float64)
        self.l2 = nnx.Linear(KERNEL_SIZES[1], KERNEL_SIZES[2], rngs=rngs, param_dtype=jnp.float64)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _kernel_data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((8, KERNEL_SIZES[0])), rng.standard_normal((8, KERNEL_SIZES[-1]))


def _counting_kernel_calls(monkeypatch):
    # the kernel calls lowered (``_fused._call`` runs when a step lowers a kernel call)
    from functorch_optim import _fused

    calls = []
    call = _fused._call
    monkeypatch.setattr(_fused, "_call", lambda *a, **k: calls.append(a[0]) or call(*a, **k))
    return calls


@pytest.mark.parametrize("name", list(KERNEL_OPTIMIZERS))
def test_equinox_and_nnx_training_steps_take_the_kernel_with_fused_true_bit_for_bit(name, monkeypatch):
    # the kernel under equinox's filter_jit and flax nnx's Optimizer (counters in nnx
    # Variables), equal to the rule (fused=False) bit for bit over 6 steps; these steps
    # compute their gradients, so the default runs the rule there (rule_in_trace), or the
    # kernel where the rule would emulate its FMAs (cpu_contracts_fma)
    from functorch_optim import _torch_ops

    make = KERNEL_OPTIMIZERS[name]
    rule_by_default = _torch_ops.cpu_contracts_fma(np.float64)
    x, y = _kernel_data()

    def run_eqx(tx):
        model = eqx.nn.MLP(*KERNEL_SIZES[:1], KERNEL_SIZES[-1], KERNEL_SIZES[1], 1, key=jax.random.PRNGKey(1))
        model = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, model)
        state = tx.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def train_step(model, state):
            grads = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
            updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
            return eqx.apply_updates(model, updates), state

        for _ in range(6):
            model, state = train_step(model, state)
        return jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))

    def run_nnx(tx):
        model = _KernelNnxMLP(nnx.Rngs(1))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer):
            grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, grads)

        for _ in range(6):
            train_step(model, optimizer)
        return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]

    for run in (run_eqx, run_nnx):
        calls = _counting_kernel_calls(monkeypatch)
        default = run(make())
        # the default ran the rule where the FMAs contract, the kernel where not
        assert (not calls) is rule_by_default, run.__name__
        kernel = run(make(fused=True))
        assert calls, run.__name__  # fused=True took the kernel
        rule = run(make(fused=False))
        assert len(kernel) == 4
        for a, b, c in zip(kernel, rule, default):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(c), np.asarray(b))
        monkeypatch.undo()


@pytest.mark.parametrize("name", list(KERNEL_OPTIMIZERS))
def test_equinox_and_nnx_training_steps_under_a_traced_grad_mask_equal_the_rule_bit_for_bit(name):
    # a grad_mask passed into the jitted training step (flags traced, a different one each
    # step) through optax's extra arguments: the default, the kernel and the rule (whose
    # masked step is a branch on the flag, _base._masked_rule) give the same bits, and a
    # parameter masked off keeps its value
    make = KERNEL_OPTIMIZERS[name]
    x, y = _kernel_data()
    masks = [[(i + k) % 3 != 0 for i in range(4)] for k in range(5)]

    def run_eqx(tx):
        model = eqx.nn.MLP(*KERNEL_SIZES[:1], KERNEL_SIZES[-1], KERNEL_SIZES[1], 1, key=jax.random.PRNGKey(1))
        model = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, model)
        params = eqx.filter(model, eqx.is_inexact_array)
        state = tx.init(params)

        @eqx.filter_jit
        def train_step(model, state, flags):
            grads = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
            params = eqx.filter(model, eqx.is_inexact_array)
            mask = jax.tree.unflatten(jax.tree.structure(params), list(flags))
            updates, state = tx.update(grads, state, params, grad_mask=mask)
            return eqx.apply_updates(model, updates), state

        history = []
        for flags in masks:
            before = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
            model, state = train_step(model, state, jnp.asarray(flags))
            after = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
            for on, a, b in zip(flags, before, after):
                assert on or np.array_equal(np.asarray(a), np.asarray(b))
            history.append([np.asarray(a) for a in after])
        return history

    def run_nnx(tx):
        model = _KernelNnxMLP(nnx.Rngs(1))
        # a masked step gives each parameter its own counter, and nnx updates its state in
        # place: the state has that layout from init on (with fo.adamw(...) itself the
        # first masked step fails inside nnx.update)
        optimizer = nnx.Optimizer(model, fo.own_counters(tx), wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, flags):
            grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            mask = jax.tree.unflatten(jax.tree.structure(grads), list(flags))
            optimizer.update(model, grads, grad_mask=mask)

        history = []
        for flags in masks:
            train_step(model, optimizer, jnp.asarray(flags))
            history.append([np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))])
        return history

    for run in (run_eqx, run_nnx):
        rule = run(make(fused=False))
        for other in (run(make()), run(make(fused=True))):
            for got, want in zip(other, rule):
                assert len(got) == 4
                for a, b in zip(got, want):
                    np.testing.assert_array_equal(a, b)
