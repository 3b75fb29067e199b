"""One suite over every registered optimizer: jit, no recompile, None grads, bf16,
grad_accumulate, optax.chain, state round trip. New optimizers join by registering."""

from __future__ import annotations

import dataclasses
import functools
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functorch_optim as fo
from functorch_optim._registry import OPTIMIZERS
from tests.helpers import assert_bitwise_equal, rel_err

# closure-driven optimizers (LBFGS) take a loss function instead of gradients
SPECS = [s for s in OPTIMIZERS if not getattr(s, "closure", False)]


def _config(spec):
    """The grid's last configuration: the one with the most flags switched on."""
    return dict(spec.grid[-1])


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def _problem(spec, dtype=jnp.float64, seed=0):
    """Random params and gradients; an optimizer restricted to some shapes (Muon: 2-D)
    names them in the registry."""
    rng = np.random.default_rng(seed)
    shapes = spec.shapes or {"m": (4, 3), "v": [(3,)]}
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), dtype), shapes, is_leaf=_is_shape)
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), dtype), params) for _ in range(6)
    ]
    return params, grads


def _run(tx, params, grads, step=fo.step):
    state = tx.init(params)
    for g in grads:
        params, state = step(tx, params, g, state)
    return params, state


@pytest.fixture(params=SPECS, ids=[s.name for s in SPECS])
def spec(request):
    return request.param


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_eager_step_equals_the_jitted_step_bit_for_bit(spec, dtype):
    # ``fo.step`` outside ``jit`` runs the compiled step: op by op, XLA contracts no
    # product into its add, and 26-173 of these 271 elements came out an ulp or more
    # away from the jitted step (and from torch) after 4 steps
    tx = spec.factory(**_config(spec))
    if spec.shapes is None:
        spec = dataclasses.replace(spec, shapes={"m": (37, 7), "v": [(4, 3)]})
    params, grads = _problem(spec, dtype)
    eager = _run(tx, params, grads)
    jitted = _run(tx, params, grads, jax.jit(fo.step, static_argnums=0))
    assert_bitwise_equal(eager, jitted)
    assert rel_err(eager[0], params) > 1e-6


def test_lr_change_does_not_recompile(spec):
    tx = spec.factory(**_config(spec))
    params, grads = _problem(spec)
    step = jax.jit(functools.partial(fo.step, tx))
    state = tx.init(params)
    lr = float(fo.get_hparams(state)["lr"])
    outs = []
    for factor in (1.0, 0.5, 2.0):
        s = fo.set_hparams(state, lr=lr * factor)
        outs.append(step(params, grads[0], s)[0])
    assert step._cache_size() == 1
    assert rel_err(outs[1], outs[0]) > 0.0 and rel_err(outs[2], outs[0]) > 0.0


def test_none_gradient_skips_parameter_and_state(spec):
    tx = spec.factory(**_config(spec))
    params, grads = _problem(spec)
    state = tx.init(params)
    params, state = fo.step(tx, params, grads[0], state)
    treedef = jax.tree.structure(params)
    leaves = treedef.flatten_up_to
    partial_grads = treedef.unflatten([None, *leaves(grads[1])[1:]])  # the first leaf: no gradient
    new, new_state = jax.jit(functools.partial(fo.step, tx))(params, partial_grads, state)
    assert leaves(new)[0].tobytes() == leaves(params)[0].tobytes()
    for name, tree in state.buffers.items():
        before, after = leaves(tree)[0], leaves(new_state.buffers[name])[0]
        assert (before is None and after is None) or np.asarray(after).tobytes() == np.asarray(
            before
        ).tobytes(), name
    assert rel_err(leaves(new)[1:], leaves(params)[1:]) > 0.0


def test_shared_counters_step_as_counters_of_their_own(spec):
    # parameters that step alike share one ``step`` counter (``TorchState``): the same
    # bits as a counter per parameter (``own_counters``), through skips (a None gradient:
    # the counters split once, then the program is reused) and a grad_mask
    tx = spec.factory(**_config(spec))
    params, grads = _problem(spec)
    name = jax.tree.leaves(jax.tree_util.tree_map_with_path(lambda p, _: p, params))[-1]
    skipping = [jax.tree_util.tree_map_with_path(lambda p, g: None if p == name else g, g) for g in grads]
    mask = jax.tree_util.tree_map_with_path(lambda p, _: jnp.asarray(p != name), params)
    step = jax.jit(fo.step, static_argnums=0)
    runs = []
    for start in (tx.init(params), fo.own_counters(tx.init(params))):
        p, state = params, start
        p, state = step(tx, p, grads[0], state)
        for g in skipping[1:4]:
            p, state = step(tx, p, g, state)
        p, state = step(tx, p, grads[4], state, grad_mask=mask)
        runs.append((p, state))
    (p_shared, shared), (p_own, own) = runs
    assert jax.tree.map(int, shared.buffers.get("step")) == jax.tree.map(int, own.buffers.get("step"))
    for a, b in zip(
        jax.tree.leaves((p_shared, shared.buffers)), jax.tree.leaves((p_own, own.buffers)), strict=True
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if "step" in shared.buffers and len(jax.tree.leaves(params)) > 1:
        fresh = tx.init(params)  # one counter for all, where each had its own
        assert len(jax.tree.leaves(fresh)) < len(jax.tree.leaves(fo.own_counters(fresh)))
    # a transformation's own_counters: its init returns that layout, which a masked step
    # keeps (a container that updates its state in place needs one structure)
    owning = fo.own_counters(tx)
    assert type(owning) is type(tx) and owning.update is tx.update
    start = owning.init(params)
    assert jax.tree.structure(start) == jax.tree.structure(fo.own_counters(tx.init(params)))
    _, masked = step(tx, params, grads[0], start, grad_mask=mask)
    assert jax.tree.structure(masked) == jax.tree.structure(start)


def test_bf16_params_keep_dtype(spec):
    tx = spec.factory(**_config(spec))
    params, grads = _problem(spec, jnp.bfloat16)
    out, _ = _run(tx, params, grads)
    assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(jnp.bfloat16)}
    assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(out))
    assert rel_err(out, params) > 1e-3


def test_grad_accumulate_two_micro_steps_equal_one_mean_step(spec):
    params, grads = _problem(spec)
    plain, _ = _run(
        spec.factory(**_config(spec)), params, [jax.tree.map(lambda a, b: (a + b) / 2, grads[0], grads[1])]
    )
    acc, state = _run(fo.grad_accumulate(spec.factory(**_config(spec)), every=2), params, grads[:2])
    assert bool(state.stepped)
    assert rel_err(acc, plain) <= 1e-15


def test_optax_chain_composition(spec):
    params, grads = _problem(spec)
    plain, _ = _run(spec.factory(**_config(spec)), params, grads)
    chained, _ = _run(optax.chain(optax.identity(), spec.factory(**_config(spec))), params, grads)
    assert rel_err(chained, plain) <= 1e-13


def test_state_pickle_round_trip(spec):
    tx = spec.factory(**_config(spec))
    params, grads = _problem(spec)
    params, state = _run(tx, params, grads[:3])
    restored = pickle.loads(pickle.dumps(state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    a, _ = fo.step(tx, params, grads[3], state)
    b, _ = fo.step(tx, params, grads[3], restored)
    assert rel_err(a, b) == 0.0


def _mask_like(params, value):
    return jax.tree.map(lambda _: value, params)


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "grad_accumulate"])
def test_grad_mask_leaf_must_be_a_boolean_scalar(spec, accumulate):
    tx = spec.factory(**_config(spec))
    if accumulate:
        tx = fo.grad_accumulate(tx, every=2)
    params, grads = _problem(spec)
    state = tx.init(params)
    first = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][0][0])
    bad = {
        "array of shape (3,)": jnp.array([True, False, True]),
        "dtype int32": jnp.array(1, jnp.int32),
        "dtype float": jnp.array(1.0),
        "NoneType": None,
    }
    for what, leaf in bad.items():
        mask = _mask_like(params, jnp.array(True))
        paths, treedef = jax.tree_util.tree_flatten_with_path(mask)
        mask = treedef.unflatten([leaf] + [m for _, m in paths[1:]])
        for step in (fo.step, jax.jit(fo.step, static_argnums=0)):
            with pytest.raises(
                ValueError,
                match=rf"grad_mask at {re.escape(first)} must be a boolean scalar.*{re.escape(what)}",
            ):
                step(tx, params, grads[0], state, grad_mask=mask)
    # the accepted forms: Python bools and 0-d bool arrays, mixed
    leaves, treedef = jax.tree.flatten(params)
    ok = treedef.unflatten([True if i % 2 else jnp.array(True) for i in range(len(leaves))])
    p_mask, s_mask = fo.step(tx, params, grads[0], state, grad_mask=ok)
    p_plain, s_plain = fo.step(tx, params, grads[0], state)
    assert rel_err(p_mask, p_plain) == 0.0
    # a step under a mask gives each parameter a counter of its own (``fo.own_counters``)
    assert jax.tree.map(jnp.shape, s_mask) == jax.tree.map(jnp.shape, fo.own_counters(s_plain))


def test_grad_mask_missing_key_names_the_path(spec):
    tx = spec.factory(**_config(spec))
    params, grads = _problem(spec)
    state = tx.init(params)
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    last = paths[-1][0]
    mask = _mask_like(params, True)
    container = functools.reduce(lambda t, k: t[k.key if hasattr(k, "key") else k.idx], last[:-1], mask)
    del container[last[-1].key if hasattr(last[-1], "key") else last[-1].idx]
    with pytest.raises(
        ValueError, match=rf"grad_mask lack the parameter at {re.escape(jax.tree_util.keystr(last))}"
    ):
        fo.step(tx, params, grads[0], state, grad_mask=mask)


def _with_first_leaf(tree, leaf):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([leaf, *leaves[1:]])


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "grad_accumulate"])
def test_gradient_of_another_dtype_or_not_an_array_is_rejected(spec, accumulate):
    # torch: "assigned grad has data of a different type"; a complex gradient lost its
    # imaginary part, an int/bool/float32 one was cast silently
    tx = spec.factory(**_config(spec))
    if accumulate:
        tx = fo.grad_accumulate(tx, every=2)
    params, grads = _problem(spec)
    state = tx.init(params)
    first = jax.tree.leaves(params)[0]
    path = re.escape(jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][0][0]))
    for dtype in (jnp.float32, jnp.int32, jnp.bool_, jnp.complex128):
        bad = _with_first_leaf(grads[0], jnp.ones(first.shape, dtype))
        message = rf"grads at {path} has dtype {jnp.dtype(dtype)}, but the parameter has dtype float64"
        for step in (fo.step, jax.jit(fo.step, static_argnums=0)):
            with pytest.raises(ValueError, match=message):
                step(tx, params, bad, state)
    scalar = {"s": jnp.asarray(1.5)}
    tx0 = spec.factory(**_config(spec)) if spec.shapes is None else None
    if tx0 is not None:
        with pytest.raises(ValueError, match=r"grads at \['s'\] is a float, not an array"):
            fo.step(tx0, scalar, {"s": 0.5}, tx0.init(scalar))


def test_lbfgs_gradient_of_another_dtype_is_rejected():
    tx = fo.lbfgs(lr=1.0)
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"grads at \['w'\] has dtype float32, but the parameter"):
        value_fn = lambda p: jnp.sum(p["w"] ** 2)
        tx.update({"w": jnp.ones(3, jnp.float32)}, tx.init(params), params, value_fn=value_fn)


def test_a_tuple_where_params_have_a_list_is_named(spec):
    tx = spec.factory(**_config(spec))
    params, grads = _problem(spec)
    state = tx.init(params)
    if not any(isinstance(v, list) for v in params.values()):
        # a 2-D leaf: Muon takes matrices only
        params = {**params, "extra": [jnp.ones((2, 3))]}
        grads = [{**g, "extra": [jnp.ones((2, 3))]} for g in grads]
        state = tx.init(params)
    name = next(k for k, v in params.items() if isinstance(v, list))
    bad = {**grads[0], name: tuple(grads[0][name])}
    with pytest.raises(ValueError, match=rf"at \['{name}'\] params have a list where grads have a tuple"):
        fo.step(tx, params, bad, state)


def test_lr_array_of_two_elements_is_torchs_error(spec):
    with pytest.raises(ValueError, match=r"^Tensor lr must be 1-element$"):
        spec.factory(lr=jnp.array([1e-3, 1e-3]))


def test_lbfgs_lr_array_of_two_elements_is_torchs_error():
    with pytest.raises(ValueError, match=r"^Tensor lr must be 1-element$"):
        fo.lbfgs(lr=jnp.array([1e-3, 1e-3]))


def test_sparse_adam_betas_of_one_element_is_named():
    with pytest.raises(ValueError, match=r"betas must be a pair \(beta1, beta2\).*got \(0.9,\)"):
        fo.sparse_adam(betas=(0.9,))
