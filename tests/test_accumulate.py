"""grad_accumulate: equal to one large batch, micro-steps inert, one accumulator, errors."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functorch_optim as fo
from tests.helpers import assert_bitwise_equal, entry_text, rel_err

K, B, STEPS = 4, 8, 3


def _mlp_params(rng):
    return {
        "hidden": {"w": jnp.asarray(rng.standard_normal((5, 16)) * 0.5), "b": jnp.zeros(16)},
        "out": {"w": jnp.asarray(rng.standard_normal((16, 1)) * 0.5), "b": jnp.zeros(1)},
    }


def _loss(params, x, y):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"][None, :])
    pred = h @ params["out"]["w"] + params["out"]["b"][None, :]
    return jnp.mean((pred - y) ** 2)


def _data(rng):
    x = rng.standard_normal((STEPS, K * B, 5))
    y = np.sin(x.sum(-1, keepdims=True))
    return jnp.asarray(x), jnp.asarray(y)


INNERS = {
    "fo.sgd": lambda: fo.sgd(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01),
    "optax.adam": lambda: optax.adam(1e-2),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("inner", list(INNERS))
@pytest.mark.parametrize("via", ["step", "update"])
def test_equals_one_large_batch(inner, reduction, via):
    rng = np.random.default_rng(0)
    params0 = _mlp_params(rng)
    x, y = _data(rng)
    grad = jax.jit(jax.grad(_loss))
    # "sum" adds the micro-batch gradients: the large-batch loss is then k times the mean
    scale = K if reduction == "sum" else 1

    big_tx = INNERS[inner]()
    big, big_state = params0, big_tx.init(params0)
    for t in range(STEPS):
        g = jax.tree.map(lambda v: v * scale, grad(big, x[t], y[t]))
        big, big_state = fo.step(big_tx, big, g, big_state)

    tx = fo.grad_accumulate(INNERS[inner](), every=K, reduction=reduction)
    if via == "step":
        step = jax.jit(functools.partial(fo.step, tx))
    else:

        @jax.jit
        def step(params, grads, state):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

    small, state = params0, tx.init(params0)
    for t in range(STEPS):
        for i in range(K):
            g = grad(small, x[t, i * B : (i + 1) * B], y[t, i * B : (i + 1) * B])
            before = small
            small, state = step(small, g, state)
            assert bool(state.stepped) == (i == K - 1)
            if i < K - 1:
                assert all(
                    a.tobytes() == b.tobytes()
                    for a, b in zip(jax.tree.leaves(small), jax.tree.leaves(before))
                )
    assert int(state.gradient_step) == STEPS
    err = rel_err(small, big)
    assert err <= 1e-12, err
    assert rel_err(small, params0) > 1e-3


def test_micro_steps_give_zero_updates_and_leave_inner_state():
    params = {"w": jnp.ones(3)}
    tx = fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9), every=3)
    state = tx.init(params)
    inner0 = state.inner_state
    updates, state = jax.jit(tx.update)({"w": jnp.full(3, 2.0)}, state, params)
    np.testing.assert_array_equal(updates["w"], np.zeros(3))
    for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(inner0)):
        assert a.tobytes() == b.tobytes()
    np.testing.assert_array_equal(state.acc_grads["w"], [2.0, 2.0, 2.0])
    assert int(state.mini_step) == 1 and not bool(state.stepped)


def test_state_holds_one_accumulator_and_scalars():
    params = {"a": jnp.zeros((10, 10)), "b": jnp.zeros(7)}
    tx = fo.grad_accumulate(optax.sgd(0.1), every=4)
    state = tx.init(params)
    own = (state.mini_step, state.gradient_step, state.acc_grads, state.has_grad)
    sizes = [x.size for x in jax.tree.leaves(own)]
    assert sum(sizes) == 100 + 7 + 2 + 2  # one accumulator, two counters, a flag per leaf


def test_bf16_gradients_accumulate_in_float32():
    params = {"w": jnp.zeros(4, jnp.bfloat16)}
    tx = fo.grad_accumulate(fo.sgd(lr=1.0), every=256, reduction="sum")
    state = tx.init(params)
    assert state.acc_grads["w"].dtype == jnp.float32
    step = jax.jit(functools.partial(fo.step, tx))
    small = {"w": jnp.full(4, 1e-2, jnp.bfloat16)}
    for _ in range(255):
        params, state = step(params, small, state)
    # 255 * bf16(0.01) summed in float32; a bf16 running sum would stall near 2.0
    expected = 255 * float(jnp.asarray(1e-2, jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(state.acc_grads["w"]), expected, rtol=1e-6)


def test_none_gradients_skip_parameter_like_torch():
    params = {"frozen": jnp.ones(2), "live": jnp.ones(2)}
    tx = fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.5), every=2)
    state = tx.init(params)
    for _ in range(2):
        params, state = fo.step(tx, params, {"frozen": None, "live": jnp.ones(2)}, state)
    np.testing.assert_array_equal(params["frozen"], [1.0, 1.0])
    assert int(state.inner_state.step["frozen"]) == 0
    # a gradient in any call of the window counts, even if the stepping call has none
    tx2 = fo.grad_accumulate(fo.sgd(lr=0.1), every=2)
    p2 = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    s2 = tx2.init(p2)
    p2, s2 = fo.step(tx2, p2, {"a": jnp.ones(1), "b": jnp.ones(1)}, s2)
    p2, s2 = fo.step(tx2, p2, {"a": None, "b": jnp.ones(1)}, s2)
    np.testing.assert_allclose(p2["a"], [-0.05])
    np.testing.assert_allclose(p2["b"], [-0.1])


def test_inner_schedule_advances_per_optimizer_step_only():
    tx = fo.grad_accumulate(fo.sgd(lr=lambda count: 0.1 / (1 + count)), every=3)
    params = {"w": jnp.zeros(1)}
    state = tx.init(params)
    for _ in range(6):
        params, state = fo.step(tx, params, {"w": jnp.ones(1)}, state)
    # two optimizer steps: lr 0.1 then 0.05; the next would be 0.1 / 3
    np.testing.assert_allclose(params["w"], [-0.15])
    np.testing.assert_allclose(float(fo.get_hparams(state)["lr"]), 0.1 / 3)


@pytest.mark.parametrize(
    ("every", "reduction", "message"),
    [
        (0, "mean", "every must be an integer >= 1, got 0"),
        (2.5, "mean", "every must be an integer >= 1, got 2.5"),
        (True, "mean", "every must be an integer >= 1, got True"),
        (2, "avg", "reduction must be 'mean', 'sum' or 'weighted', got 'avg'"),
    ],
)
def test_errors(every, reduction, message):
    with pytest.raises(ValueError) as err:
        fo.grad_accumulate(fo.sgd(), every=every, reduction=reduction)
    assert str(err.value) == message


# --------------------------------------------------------------------------- compiled structure
# What a micro-step costs is read from the compiled step (issue 7): per parameter, one
# in-place pass over the accumulator and nothing else -- no copies, no per-parameter
# scalar work around the inner optimizer, whatever the number of parameters.


def _leaves(n):
    return {f"w{i:03d}": jnp.linspace(0.0, 1.0, 2000 + i, dtype=jnp.float32) for i in range(n)}


@functools.cache
def _compiled(n_leaves, every):
    # the jitted path (the default's CPU kernel makes each call one kernel call: test_fused.py)
    tx = fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9, weight_decay=1e-2, fused=False), every=every)
    params = _leaves(n_leaves)
    state = tx.init(params)
    fn = jax.jit(lambda p, g, s: fo.step(tx, p, g, s), donate_argnums=(0, 2), keep_unused=True)
    compiled = fn.lower(params, params, state).compile()
    return compiled, params, state


def _count(text, op):
    return len(re.findall(rf" {op}\(%", text))


@pytest.mark.parametrize("n_leaves", [4, 16])
def test_micro_step_is_one_pass_per_parameter_and_nothing_else(n_leaves):
    compiled, params, state = _compiled(n_leaves, 3)
    entry = entry_text(compiled)
    # outside the inner optimizer's loop: one fusion per accumulator, and a fixed number
    # of scalar fusions (counters, flags) that does not grow with the parameters
    param_sized = [
        line
        for line in entry.splitlines()
        if re.search(r"= f32\[20\d\d\]\{0\} fusion\(", line) and "parameter(" not in line
    ]
    assert len(param_sized) == n_leaves
    assert _count(entry, "fusion") - n_leaves == _count(entry_text(_compiled(4, 3)[0]), "fusion") - 4
    # at most one scalar copy (the mini_step counter, read before it is overwritten)
    assert _count(entry, "copy") <= 1, entry
    assert _count(entry, "conditional") == 0 and _count(entry, "while") == 1
    # nothing parameter-sized beyond the inputs (params + grads + state, one accumulator):
    # the temporaries are scalars and the loop's tuple tables
    ma = compiled.memory_analysis()
    smallest = min(x.nbytes for x in jax.tree.leaves(params))
    assert ma.temp_size_in_bytes < smallest / 2
    assert ma.output_size_in_bytes - ma.alias_size_in_bytes < smallest / 2
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert ma.argument_size_in_bytes == 2 * param_bytes + state_bytes
    # the state: momentum buffer and accumulator param-sized, the rest a few scalars
    # and the stacked flags (one array, not one scalar per parameter)
    assert state.has_grad.shape == (n_leaves,)
    arrays = [x for x in jax.tree.leaves(state) if x.ndim > 0]
    assert sum(x.nbytes for x in arrays) == 2 * param_bytes + n_leaves
    assert len(arrays) == 2 * n_leaves + 1


def test_compiled_size_per_parameter_is_the_inner_step_plus_one_pass():
    # per extra parameter the whole program (micro path and step) grows by the
    # accumulator pass plus what the plain inner step itself adds per parameter
    def size(compiled):
        return len([line for line in compiled.as_text().splitlines() if " = " in line])

    sgd = fo.sgd(lr=0.1, momentum=0.9, weight_decay=1e-2, fused=False)  # the jitted rule, as _compiled

    def plain(n):
        p = _leaves(n)
        return jax.jit(lambda p, g, s: fo.step(sgd, p, g, s)).lower(p, p, sgd.init(p)).compile()

    per_leaf = (size(_compiled(16, 3)[0]) - size(_compiled(4, 3)[0])) / 12
    plain_per_leaf = (size(plain(16)) - size(plain(4))) / 12
    # the accumulator pass (a fusion and its computation, which also writes the mean on
    # the closing call) and the loop's tuple plumbing (the carried buffers unpacked in
    # the loop's body and condition): 26 lines measured with jax 0.10 (the lax.cond it
    # replaces: about 29, with scalar copies in and out)
    assert per_leaf <= plain_per_leaf + 26, (per_leaf, plain_per_leaf)


# Inside jit each parameter's accumulation (add, and the mean on the closing call) is one
# nested call, traced and lowered once per leaf signature, like the inner rule (issue 16):
# before, every leaf traced its own ``where``s, a quarter of the trace of a 300-leaf step.
@pytest.mark.parametrize("reduction", ["mean", "sum", "weighted"])
def test_accumulation_is_one_call_per_leaf_traced_once_with_the_same_bits(reduction, monkeypatch):
    tx = fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9, fused=False), every=3, reduction=reduction)
    rng = np.random.default_rng(0)
    params = {f"p{i}": jnp.asarray(rng.standard_normal(5), jnp.float32) for i in range(9)}
    params["q"] = jnp.asarray(rng.standard_normal((2, 2)), jnp.float32)
    kw = {"weight": jnp.float32(3.0)} if reduction == "weighted" else {}

    def step(p, g, s, m, **kw):
        return fo.step(tx, p, g, s, grad_mask=m, **kw)

    mask = {k: jnp.asarray(k != "p4") for k in params}
    eqns = jax.make_jaxpr(lambda *a, **k: step(*a, **k))(
        params, params, tx.init(params), mask, **kw
    ).jaxpr.eqns
    calls = [e for e in eqns if e.params.get("name") == "_window_leaf"]
    assert len(calls) == 10
    # one traced accumulation for the nine equal leaves, one for the matrix
    assert len({id(e.params["jaxpr"].jaxpr) for e in calls}) == 2
    # the same bits as each leaf traced inline (the nested call switched off), over a
    # window with a None gradient
    grads = [
        {n: jnp.asarray(rng.standard_normal(v.shape), v.dtype) for n, v in params.items()} for _ in range(4)
    ]
    grads[1]["p2"] = None

    def run():
        p, s = params, tx.init(params)
        jitted = jax.jit(lambda *args, **kw: step(*args, **kw))  # a fresh trace
        out = []
        for g in grads:
            p, s = jitted(p, g, s, mask, **kw)
            out.append(jax.tree.leaves((p, s)))
        return out, s

    staged, state = run()
    monkeypatch.setattr(fo._accumulate, "_all_staged", lambda args: False)
    eqns = jax.make_jaxpr(lambda *a, **k: step(*a, **k))(
        params, params, tx.init(params), mask, **kw
    ).jaxpr.eqns
    assert not [e for e in eqns if e.params.get("name") == "_window_leaf"]
    inline, _ = run()
    for a, b in zip(jax.tree.leaves(staged), jax.tree.leaves(inline), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert bool(state.stepped) is False and int(state.gradient_step) == 1


def test_window_step_has_no_parameter_sized_temporaries():
    compiled, params, _ = _compiled(4, 1)
    ma = compiled.memory_analysis()
    smallest = min(x.nbytes for x in jax.tree.leaves(params))
    assert ma.temp_size_in_bytes < smallest / 2
    # every=1 steps on each call without a branch, and leaves the accumulator alone
    entry = entry_text(compiled)
    assert _count(entry, "while") == 0 and _count(entry, "conditional") == 0


def _layers_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.sum(x**2)


@pytest.mark.parametrize(
    "inner,reduction",
    [
        (lambda: fo.adam(lr=1e-3), "mean"),
        (lambda: fo.sgd(lr=0.1, momentum=0.9, fused=False), "sum"),
        (lambda: fo.adamw(lr=1e-3), "weighted"),
        (lambda: optax.adam(1e-3), "mean"),
    ],
    ids=["adam-mean", "sgd-rule-sum", "adamw-weighted", "optax-adam-mean"],
)
def test_update_in_a_training_step_holds_no_zero_tree(inner, reduction):
    # optax's way (update, then apply_updates) in a whole training step: a micro-step's
    # zero updates are selected into apply_updates' add and the step's carry starts in
    # the gradients' buffers. Before, a zero tree the size of the parameters was a new
    # buffer on every call, written and page-faulted for nothing (8.4M float32
    # parameters: micro-step 26.5 ms against fo.step's 20.3). The temporaries are now
    # fo.step's (the kernel holds every gradient too) or the gradients, held until the
    # step where fo.step's jitted rule adds each into its accumulator as it comes
    params = [jnp.full((256, 256), 0.01 * (i + 1), jnp.float32) for i in range(4)]
    param_bytes = sum(p.nbytes for p in params)
    x = jnp.ones((2, 256), jnp.float32)
    tx = fo.grad_accumulate(inner(), every=3, reduction=reduction)
    kw = {"weight": jnp.float32(2.0)} if reduction == "weighted" else {}

    def whole(p, s, x):
        updates, s = tx.update(jax.grad(_layers_loss)(p, x), s, p, **kw)
        return optax.apply_updates(p, updates), s

    def stepped(p, s, x):
        return fo.step(tx, p, jax.grad(_layers_loss)(p, x), s, **kw)

    def temp_bytes(fn):
        compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, tx.init(params), x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(whole) < max(temp_bytes(stepped), param_bytes) + 0.1 * param_bytes


def test_has_grad_is_stacked_in_leaf_order():
    params = {"a": jnp.zeros(2), "b": {"c": jnp.zeros(3), "d": jnp.zeros(1)}}
    # with momentum: an SGD without one keeps no step counters to check below
    tx = fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9), every=3)
    state = tx.init(params)
    np.testing.assert_array_equal(state.has_grad, [False, False, False])
    step = jax.jit(functools.partial(fo.step, tx))
    _, state = step(params, {"a": None, "b": {"c": jnp.ones(3), "d": None}}, state)
    np.testing.assert_array_equal(state.has_grad, [False, True, False])
    _, state = step(params, {"a": jnp.ones(2), "b": {"c": None, "d": None}}, state)
    np.testing.assert_array_equal(state.has_grad, [True, True, False])
    params, state = step(params, {"a": None, "b": {"c": None, "d": None}}, state)
    assert bool(state.stepped)
    np.testing.assert_array_equal(state.has_grad, [True, True, False])
    np.testing.assert_array_equal(params["b"]["d"], [0.0])
    assert int(state.inner_state.step["b"]["d"]) == 0 and int(state.inner_state.step["a"]) == 1
    # the next window starts from its own first call
    _, state = step(params, {"a": None, "b": {"c": None, "d": jnp.ones(1)}}, state)
    np.testing.assert_array_equal(state.has_grad, [False, False, True])


@pytest.mark.parametrize("fused", [False, True], ids=["jitted", "fused"])
@pytest.mark.parametrize("every", [1, 3])
def test_grad_mask_off_is_a_none_gradient(every, fused):
    # a parameter masked off in a call is not added in, and is skipped by the step of a
    # window in which it had no gradient at all: exactly as if its gradient were None
    params = {"a": jnp.linspace(-1.0, 1.0, 5), "b": jnp.linspace(0.5, 2.0, 3)}
    tx = fo.grad_accumulate(fo.adam(lr=0.1, weight_decay=1e-2, fused=fused), every=every)
    off = lambda k: k % 4 in (0, 1, 2) if every == 3 else k % 2 == 0  # whole windows too
    grads = lambda k: {"a": jnp.sin(params["a"] * (k + 1.5)), "b": jnp.cos(params["b"] * (k + 0.5))}

    def run(masked):
        p, s = params, tx.init(params)
        step = jax.jit(lambda p, g, s, m: fo.step(tx, p, g, s, **({"grad_mask": m} if masked else {})))
        for k in range(12):
            g = grads(k)
            if not masked and off(k):
                g["b"] = None
            mask = {"a": jnp.array(True), "b": jnp.array(not off(k))}
            p, s = step(p, g, s, mask)
        return p, s

    (p_mask, s_mask), (p_none, s_none) = run(True), run(False)
    for x, y in zip(jax.tree.leaves((p_mask, s_mask)), jax.tree.leaves((p_none, s_none))):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(p_mask["b"]), np.asarray(params["b"]))


# ------------------------------------------------------------------ reduction="weighted"
# Micro-batches of different sizes: the step reads the gradient of the window's global
# mean, sum_i n_i g_i / sum_i n_i, with g_i the gradient of micro-batch i's mean loss.

SIZES = (3, 7, 1, 5)  # one window of 4 micro-batches, 16 examples


def _weighted_run(tx, params, x, y, sizes, via="step", mask=None):
    grad = jax.jit(jax.grad(_loss))
    if via == "step":
        step = jax.jit(lambda p, g, s, w: fo.step(tx, p, g, s, weight=w))
    else:

        @jax.jit
        def step(p, g, s, w):
            updates, s = tx.update(g, s, p, weight=w)
            return optax.apply_updates(p, updates), s

    state, lo = tx.init(params), 0
    stepped = []
    for n in sizes:
        g = grad(params, x[lo : lo + n], y[lo : lo + n])
        params, state = step(params, g, state, n)
        stepped.append(bool(state.stepped))
        lo += n
    return params, state, stepped


@pytest.mark.parametrize("inner", list(INNERS))
@pytest.mark.parametrize("via", ["step", "update"])
def test_weighted_equals_one_batch_of_the_window(inner, via):
    rng = np.random.default_rng(1)
    params0 = _mlp_params(rng)
    x, y = _data(rng)
    x, y = x[0, : sum(SIZES)], y[0, : sum(SIZES)]
    big_tx = INNERS[inner]()
    big, _ = fo.step(big_tx, params0, jax.grad(_loss)(params0, x, y), big_tx.init(params0))
    tx = fo.grad_accumulate(INNERS[inner](), every=len(SIZES), reduction="weighted")
    small, state, stepped = _weighted_run(tx, params0, x, y, SIZES, via)
    assert stepped == [False, False, False, True]
    assert rel_err(small, big) <= 1e-12, rel_err(small, big)
    np.testing.assert_array_equal(state.weight_sum, [sum(SIZES)] * 4)
    # the mean of the micro-batch means is another gradient
    mean_tx = fo.grad_accumulate(INNERS[inner](), every=len(SIZES))
    p, s = params0, mean_tx.init(params0)
    lo = 0
    for n in SIZES:
        p, s = fo.step(mean_tx, p, jax.grad(_loss)(p, x[lo : lo + n], y[lo : lo + n]), s)
        lo += n
    assert rel_err(p, big) > 1e-6


def test_weighted_none_gradients_and_grad_mask_are_over_the_calls_with_one():
    # "b" has a gradient in calls 0 and 2 only: its step reads (w0 g0 + w2 g2) / (w0 + w2)
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    ga = [jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0]), jnp.array([0.5, 0.5])]
    weights = [2.0, 3.0, 5.0]
    expect_a = sum(w * g for w, g in zip(weights, ga)) / sum(weights)
    expect_b = (2.0 * ga[0] + 5.0 * ga[2]) / 7.0
    for masked in (False, True):
        tx = fo.grad_accumulate(fo.sgd(lr=1.0), every=3, reduction="weighted")
        p, s = params, tx.init(params)
        for k, (g, w) in enumerate(zip(ga, weights)):
            if masked:
                mask = {"a": jnp.array(True), "b": jnp.array(k != 1)}
                p, s = fo.step(tx, p, {"a": g, "b": g}, s, weight=w, grad_mask=mask)
            else:
                p, s = fo.step(tx, p, {"a": g, "b": None if k == 1 else g}, s, weight=w)
        np.testing.assert_allclose(p["a"], -expect_a, rtol=1e-6)
        np.testing.assert_allclose(p["b"], -expect_b, rtol=1e-6)
        np.testing.assert_allclose(s.weight_sum, [10.0, 7.0])


def test_weighted_window_of_zero_weight_does_not_step():
    tx = fo.grad_accumulate(fo.sgd(lr=1.0, momentum=0.9), every=2, reduction="weighted")
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    step = jax.jit(lambda p, g, s, w: fo.step(tx, p, g, s, weight=w))
    g = {"w": jnp.full(3, 2.0)}
    for _ in range(2):
        params, state = step(params, g, state, 0.0)
    assert not bool(state.stepped) and int(state.gradient_step) == 0 and int(state.mini_step) == 0
    np.testing.assert_array_equal(params["w"], np.ones(3))
    assert int(state.inner_state.step["w"]) == 0
    # the next window weighs: it steps on its own gradients only
    params, state = step(params, g, state, 0.0)
    params, state = step(params, {"w": jnp.full(3, 4.0)}, state, 2.0)
    assert bool(state.stepped) and int(state.gradient_step) == 1
    np.testing.assert_allclose(params["w"], np.full(3, -3.0))


def test_weighted_bf16_accumulates_in_float32():
    params = {"w": jnp.zeros(4, jnp.bfloat16)}
    tx = fo.grad_accumulate(fo.sgd(lr=1.0), every=256, reduction="weighted")
    state = tx.init(params)
    assert state.acc_grads["w"].dtype == jnp.float32 and state.weight_sum.dtype == jnp.float32
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s, weight=3.0))
    small = {"w": jnp.full(4, 1e-2, jnp.bfloat16)}
    for _ in range(255):
        params, state = step(params, small, state)
    expected = 255 * 3 * float(jnp.asarray(1e-2, jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(state.acc_grads["w"]), expected, rtol=1e-6)


# A weighted window's (and a flushed one's) divisor is a vector over the parameters:
# each parameter's reciprocal of it was a scalar division of its own, which XLA leaves
# out of the parameter's loop (it would repeat it per element), so a micro-step over
# 200 parameters ran 200 one-element kernels besides its 200 passes (issue 16, run j:
# 3.06 ms against 1.05 ms for a bare ``acc + w * g`` at 1M parameters in 200 leaves).
@pytest.mark.parametrize("call", ["weighted micro-step", "flush"])
@pytest.mark.parametrize("fused", [None, False], ids=["default", "rule"])
def test_a_vector_divisor_is_one_reciprocal_for_every_parameter(call, fused):
    params = {f"p{i:02d}": jnp.full((300,), 0.5, jnp.float32) for i in range(12)}
    params["b"] = jnp.full((2, 3), 0.5, jnp.float32)
    reduction = "weighted" if call.startswith("weighted") else "mean"
    tx = fo.grad_accumulate(fo.sgd(lr=0.1, fused=fused), every=4, reduction=reduction)
    state = tx.init(params)
    if call == "flush":
        fn = jax.jit(lambda p, s: fo.flush(tx, p, s))
        compiled = fn.lower(params, state).compile()
    else:
        fn = jax.jit(lambda p, g, s, w: fo.step(tx, p, g, s, weight=w))
        compiled = fn.lower(params, params, state, jnp.float32(2.0)).compile()
    # one division in the whole program (a flushed window's divisor, its length broadcast
    # to every parameter, was one before too: XLA's CSE merged its equal scalars)
    assert _count(compiled.as_text(), "divide") == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("fused", [None, False], ids=["default", "rule"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "weighted"])
@pytest.mark.parametrize("as_array", [False, True], ids=["python_weight", "array_weight"])
def test_eager_calls_equal_the_jitted_ones_bit_for_bit(reduction, fused, dtype, as_array):
    # outside jit a call ran op by op: the weighted ``acc + g * w`` was two roundings
    # where the jitted call (and the kernel) contracts it into one, and 243-275 elements
    # of params and state differed after 6 calls; with a Python number as the weight a
    # call with arrays everywhere else still ran op by op
    rng = np.random.default_rng(3)
    params = {
        "w": jnp.asarray(rng.standard_normal((37, 7)), dtype),
        "b": jnp.asarray(rng.standard_normal(5), dtype),
    }
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), dtype), params) for _ in range(7)
    ]
    weights = [0.37, 1.3, 2.9, 0.11, 5.0, 0.7, 3]
    tx = fo.grad_accumulate(fo.adam(lr=1e-2, fused=fused), every=3, reduction=reduction)

    def kwargs(w):
        if reduction != "weighted":
            return {}
        return {"weight": jnp.asarray(w, dtype) if as_array else w}

    def run(step, update, flush):
        p, s = params, tx.init(params)
        for g, w in zip(grads[:5], weights):
            p, s = step(p, g, s, **kwargs(w))
        updates, s = update(grads[5], s, p, **kwargs(weights[5]))
        p = optax.apply_updates(p, updates)
        return flush(p, s)

    eager = run(functools.partial(fo.step, tx), tx.update, functools.partial(fo.flush, tx))
    jitted = run(
        jax.jit(functools.partial(fo.step, tx)),
        jax.jit(tx.update),
        jax.jit(functools.partial(fo.flush, tx)),
    )
    assert_bitwise_equal(eager, jitted)
    assert bool(eager[1].stepped) and rel_err(eager[0]["w"], params["w"]) > 1e-4


def test_weighted_errors():
    params = {"w": jnp.zeros(2)}
    g = {"w": jnp.ones(2)}
    tx = fo.grad_accumulate(fo.sgd(lr=0.1), every=2, reduction="weighted")
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"every call needs weight= \(the micro-batch's number of tokens"):
        fo.step(tx, params, g, state)
    with pytest.raises(ValueError, match=r"weight must be a finite number >= 0, got -1.0"):
        fo.step(tx, params, g, state, weight=-1.0)
    with pytest.raises(ValueError, match=r"weight must be a scalar, got an array of shape \(2,\)"):
        fo.step(tx, params, g, state, weight=jnp.ones(2))
    # under jit nothing raises: a negative weight poisons the window's weight sum, and the
    # window closes without a step
    step = jax.jit(lambda p, s, w: fo.step(tx, p, g, s, weight=w))
    p, s = step(params, state, -2.0)
    p, s = step(p, s, 3.0)
    assert not bool(s.stepped) and int(s.gradient_step) == 0 and np.isnan(np.asarray(s.weight_sum)).all()
    np.testing.assert_array_equal(p["w"], params["w"])
    mean_tx = fo.grad_accumulate(fo.sgd(lr=0.1), every=2)
    with pytest.raises(ValueError, match=r"weight= needs reduction='weighted', this one has 'mean'"):
        fo.step(mean_tx, params, g, mean_tx.init(params), weight=1.0)


# ------------------------------------------------------------------------------ flush


@pytest.mark.parametrize("reduction", ["mean", "sum", "weighted"])
@pytest.mark.parametrize("fused", [False, True], ids=["jitted", "fused"])
def test_flush_equals_a_window_of_its_real_length(reduction, fused):
    # 5 calls with every=3: one full window, then a flushed window of 2 -- the same bits as
    # every=2 for that window
    params = {"a": jnp.linspace(-1.0, 1.0, 7), "b": jnp.linspace(0.5, 2.0, 3)}
    grads = lambda k: {
        "a": jnp.sin(params["a"] * (k + 1.5)),
        "b": None if k == 3 else jnp.cos(params["b"] * k),
    }
    make = lambda every: fo.grad_accumulate(fo.adam(lr=0.1, fused=fused), every, reduction)
    extra = lambda k: {"weight": float(k + 1)} if reduction == "weighted" else {}
    tx = make(3)
    step = jax.jit(lambda p, g, s, e: fo.step(tx, p, g, s, **e))
    flush = jax.jit(lambda p, s: fo.flush(tx, p, s))
    p, s = params, tx.init(params)
    for k in range(5):
        p, s = step(p, grads(k), s, extra(k))
    assert int(s.mini_step) == 2 and int(s.gradient_step) == 1
    p, s = flush(p, s)
    assert bool(s.stepped) and int(s.mini_step) == 0 and int(s.gradient_step) == 2
    # the reference: every=3 for the first window, then the same state continued with every=2
    ref3, ref2 = make(3), make(2)
    step3 = jax.jit(lambda p, g, s, e: fo.step(ref3, p, g, s, **e))
    step2 = jax.jit(lambda p, g, s, e: fo.step(ref2, p, g, s, **e))
    q, r = params, ref3.init(params)
    for k in range(3):
        q, r = step3(q, grads(k), r, extra(k))
    r2 = ref2.init(params)._replace(inner_state=r.inner_state)
    for k in (3, 4):
        q, r2 = step2(q, grads(k), r2, extra(k))
    ours, ref = (p, s.inner_state, s.acc_grads, s.has_grad), (q, r2.inner_state, r2.acc_grads, r2.has_grad)
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(p["b"]), np.asarray(params["b"]))
    # an empty window: nothing changes
    p2, s2 = flush(p, s)
    for x, y in zip(jax.tree.leaves((p2, s2)), jax.tree.leaves((p, s))):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    # the next call opens a new window
    p, s = step(p, grads(6), s, extra(6))
    assert int(s.mini_step) == 1 and not bool(s.stepped)


def test_flush_errors_and_every_one():
    with pytest.raises(ValueError, match="flush: tx is not a grad_accumulate transformation, got"):
        fo.flush(fo.sgd(lr=0.1), {"w": jnp.zeros(1)}, None)
    tx = fo.grad_accumulate(fo.sgd(lr=1.0), every=1)
    params = {"w": jnp.zeros(1)}
    params, state = fo.step(tx, params, {"w": jnp.ones(1)}, tx.init(params))
    p, s = fo.flush(tx, params, state)
    assert p is params and s is state


def test_flush_takes_bf16_params_whose_accumulator_is_float32():
    # the accumulator of a bf16 parameter is float32: flush compared it with the params'
    # dtype and refused every bf16 state ("grads at ['w'] has dtype float32")
    tx = fo.grad_accumulate(fo.sgd(lr=1.0, fused=False), every=4)
    params = {"w": jnp.asarray([1.0, 2.0], jnp.bfloat16), "skip": None}
    state = tx.init(params)
    for g in (0.5, 0.25):
        params, state = fo.step(tx, params, {"w": jnp.asarray([g, g], jnp.bfloat16), "skip": None}, state)
    assert state.acc_grads["w"].dtype == jnp.float32
    params, state = jax.jit(lambda p, s: fo.flush(tx, p, s))(params, state)
    # the mean of the two calls, 0.375, stepped on in bf16
    assert params["w"].dtype == jnp.bfloat16 and params["w"].tolist() == [0.625, 1.625]
    assert bool(state.stepped) and int(state.mini_step) == 0
    with pytest.raises(
        ValueError, match=r"state.acc_grads at \['w'\] has shape \(2,\), but the parameter has shape \(3,\)"
    ):
        fo.flush(tx, {"w": jnp.zeros(3, jnp.bfloat16), "skip": None}, state)


@pytest.mark.parametrize("via", ["step", "update"])
@pytest.mark.parametrize(
    ("name", "config"),
    [("adamw", dict(lr=1e-2, weight_decay=1e-2)), ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True))],
)
def test_a_torch_modules_whole_training_steps_accumulate_as_torch_does(name, config, via):
    # the seam as a port meets it: a real torch module's parameters (interop.torch), a
    # jitted step that computes the gradients and calls grad_accumulate through fo.step
    # (the default adds them in the backward pass) or through update + apply_updates
    # (micro-steps select zeros into the add); torch runs the idiom the seed posts
    # describe, backward() on loss / k for k micro-batches without zero_grad, then
    # step(). Within 1e-12 of torch after 4 windows, the default bit for bit the rule's
    torch = pytest.importorskip("torch")
    from functorch_optim.interop.torch import tree_from_module

    every, windows = 3, 4
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 1)).double()
    params = tree_from_module(model)
    rng = np.random.default_rng(2)
    data = [(rng.standard_normal((8, 40)), rng.standard_normal((8, 1))) for _ in range(every * windows)]

    opt = getattr(torch.optim, {"adamw": "AdamW", "sgd": "SGD"}[name])(model.parameters(), **config)
    for i, (x, y) in enumerate(data):
        loss = torch.mean((model(torch.as_tensor(x)) - torch.as_tensor(y)) ** 2) / every
        loss.backward()  # adds into .grad: no zero_grad inside the window
        if (i + 1) % every == 0:
            opt.step()
            opt.zero_grad()

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["0"]["weight"].T + p["0"]["bias"][None, :])
        return jnp.mean((h @ p["2"]["weight"].T + p["2"]["bias"][None, :] - y) ** 2) / every

    def trained(**kw):
        tx = fo.grad_accumulate(getattr(fo, name)(**config, **kw), every=every, reduction="sum")

        @jax.jit
        def step(p, s, x, y):
            g = jax.grad(loss_fn)(p, x, y)
            if via == "step":
                return fo.step(tx, p, g, s)
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        p, s = params, tx.init(params)
        for x, y in data:
            p, s = step(p, s, jnp.asarray(x), jnp.asarray(y))
        assert int(s.gradient_step) == windows
        return p, s

    default = trained()
    assert_bitwise_equal(default, trained(fused=False))
    torch_params = tree_from_module(model)
    assert rel_err(default[0], torch_params) < 1e-12
    assert rel_err(default[0], params) > 1e-3
