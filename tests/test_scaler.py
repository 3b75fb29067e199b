"""GradScaler against torch.amp.GradScaler("cpu") with injected infs and NaNs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo

CONFIG = dict(init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=3)


def _bad_at(t):
    return {4: np.inf, 5: np.nan, 6: -np.inf, 13: np.nan, 20: np.inf}.get(t)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_wrapped_optimizer_matches_torch_grad_scaler(dtype):
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(5).astype(dtype)
    grads = rng.standard_normal((30, 5)).astype(dtype)

    t = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.SGD([t], lr=0.05, momentum=0.9, foreach=False)
    ref = torch.amp.GradScaler("cpu", **CONFIG)

    scaler = fo.GradScaler(**CONFIG)
    tx = scaler.wrap(fo.sgd(lr=0.05, momentum=0.9))
    params = {"w": jnp.asarray(p0)}
    state = tx.init(params)
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    scales, trackers = [], []
    for i, g in enumerate(grads):
        # the gradient of the scaled loss: grad * scale (the same numbers on both sides)
        ref.scale(torch.ones((), dtype=torch.float32))  # lazily creates torch's scale
        assert float(state.scaler.scale) == ref.get_scale()
        scaled = (g * np.float32(ref.get_scale()).astype(dtype)).astype(dtype)
        if _bad_at(i) is not None:
            scaled[2] = _bad_at(i)
        t.grad = torch.tensor(scaled)
        ref.step(opt)
        ref.update()
        before = np.asarray(params["w"])
        params, state = step(params, {"w": jnp.asarray(scaled)}, state)
        scales.append(ref.get_scale())
        trackers.append(ref._get_growth_tracker())
        assert float(state.scaler.scale) == ref.get_scale()
        assert int(state.scaler.growth_tracker) == ref._get_growth_tracker()
        assert float(state.scaler.found_inf) == (_bad_at(i) is not None)
        if _bad_at(i) is not None:
            assert np.array_equal(np.asarray(params["w"]), before)  # skipped: untouched
        # fo.sgd itself matches torch's SGD to rounding (not bit for bit) under jit
        tol = 1e-15 if dtype == np.float64 else 1e-6
        np.testing.assert_allclose(np.asarray(params["w"]), t.detach().numpy(), rtol=tol, atol=tol)
    assert int(state.inner_state.count) == 25  # 5 skipped steps
    assert len(set(scales)) >= 4 and max(trackers) == 2  # grew and backed off


def test_by_hand_unscale_clip_update_like_torch():
    """torch's pattern: scaler.unscale_(opt); clip_grad_norm_; scaler.step(opt); scaler.update()."""
    scaler = fo.GradScaler(init_scale=8.0, growth_interval=2)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    t = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([t], lr=1.0)
    state = scaler.init()
    params = {"w": jnp.zeros(3, jnp.float32)}
    tx = fo.sgd(lr=1.0)
    ostate = tx.init(params)
    for i, g in enumerate([[1.0, 2.0, 2.0], [3.0, 0.0, 4.0], [np.inf, 1.0, 1.0], [0.5, 0.5, 0.5]]):
        loss = scaler.scale(state, jnp.float32(2.0))
        assert float(loss) == float(ref.scale(torch.tensor(2.0)))
        scaled = np.asarray(g, np.float32) * np.float32(ref.get_scale())
        t.grad = torch.tensor(scaled)
        ref.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([t], 1.0)
        ref.step(opt)
        ref.update()
        grads, state = scaler.unscale(state, {"w": jnp.asarray(scaled)})
        grads, _ = fo.clip_grad_norm(grads, 1.0)
        if float(state.found_inf) == 0:
            params, ostate = fo.step(tx, params, grads, ostate)
        state = scaler.update(state)
        assert float(state.scale) == ref.get_scale(), i
        np.testing.assert_array_equal(np.asarray(params["w"]), t.detach().numpy())
    assert float(scaler.update(state, new_scale=5.0).scale) == 5.0


def test_growth_keeps_a_finite_scale_and_disabled_is_identity():
    scaler = fo.GradScaler(init_scale=3e38, growth_interval=1)
    state = scaler.update(scaler.init())
    assert float(state.scale) == np.float32(3e38) and int(state.growth_tracker) == 0  # 6e38 overflows f32
    off = fo.GradScaler(enabled=False, growth_factor=0.5)
    state = off.init()
    assert float(state.scale) == 1.0 and float(off.scale(state, jnp.float32(3.0))) == 3.0
    _, state = off.unscale(state, {"w": jnp.array([jnp.inf])})
    assert float(state.found_inf) == 0.0 and off.update(state) is state


@pytest.mark.parametrize(
    "kw", [dict(growth_factor=1.0), dict(backoff_factor=1.0)], ids=["growth_factor", "backoff_factor"]
)
def test_validation_uses_torchs_messages(kw):
    with pytest.raises(AssertionError) as ref:
        torch.amp.GradScaler("cpu", **kw)
    with pytest.raises(AssertionError, match=re.escape(str(ref.value))):
        fo.GradScaler(**kw)
    with pytest.raises(ValueError):  # also a ValueError, like every bad argument here
        fo.GradScaler(**kw)


def test_float16_gradients_are_refused_like_torch():
    t = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    t.grad = torch.ones(2, dtype=torch.float16)
    ref = torch.amp.GradScaler("cpu")
    ref.scale(torch.ones(()))
    with pytest.raises(ValueError) as err:
        ref.unscale_(torch.optim.SGD([t], lr=0.1))
    scaler = fo.GradScaler()
    with pytest.raises(ValueError, match=re.escape(str(err.value))):
        scaler.unscale(scaler.init(), {"w": jnp.ones(2, jnp.float16)})
    g, st = scaler.unscale(scaler.init(), {"w": jnp.full(2, 2.0**17, jnp.bfloat16)})
    assert g["w"].dtype == jnp.bfloat16 and g["w"].tolist() == [2.0, 2.0]
    assert jax.tree.structure(st) == jax.tree.structure(scaler.init())


def test_with_grad_accumulate_scale_moves_once_per_window():
    """grad_accumulate(scaler.wrap(tx), k): torch's accumulate-then-scaler.step/update."""
    scaler = fo.GradScaler(init_scale=16.0, growth_interval=1)
    tx = fo.grad_accumulate(scaler.wrap(fo.sgd(lr=1.0)), every=2, reduction="sum")
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    micro = [[1.0, 2.0], [3.0, 4.0], [np.inf, 0.0], [1.0, 1.0], [0.5, 0.5], [0.5, 0.5]]
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    scales = []
    for g in micro:
        scale = float(state.inner_state.scaler.scale)
        params, state = step(params, {"w": jnp.asarray(g) * scale}, state)
        scales.append(float(state.inner_state.scaler.scale))
    # window 1 steps and grows (16 -> 32); window 2 holds an inf: skipped, backs off (32 -> 16);
    # window 3 steps on (0.5 + 0.5) * 2 unscaled and grows again
    assert scales == [16.0, 32.0, 32.0, 16.0, 16.0, 32.0]
    assert np.asarray(params["w"]).tolist() == [-5.0, -7.0]
    assert int(state.inner_state.inner_state.count) == 2


def _torch_run(ref, opt, t, grads, start, stop):
    """torch's loop for steps start..stop-1 with the injected infs; scales and trackers seen."""
    seen = []
    for i in range(start, stop):
        ref.scale(torch.ones(()))
        scaled = grads[i] * np.float32(ref.get_scale())
        if _bad_at(i) is not None:
            scaled[2] = _bad_at(i)
        t.grad = torch.tensor(scaled)
        ref.step(opt)
        ref.update()
        seen.append((ref.get_scale(), ref._get_growth_tracker()))
    return seen


def _our_run(scaler, tx, params, state, grads, start, stop):
    seen = []
    for i in range(start, stop):
        scaled = grads[i] * np.float32(state.scaler.scale)
        if _bad_at(i) is not None:
            scaled[2] = _bad_at(i)
        params, state = fo.step(tx, params, {"w": jnp.asarray(scaled)}, state)
        seen.append((float(state.scaler.scale), int(state.scaler.growth_tracker)))
    return params, state, seen


def test_state_dict_is_torchs_and_resumes_both_ways(tmp_path):
    """torch 10 steps -> its state_dict -> ours 10 steps -> ours -> torch 10 steps, over
    injected infs: scale and growth tracker equal to torch's uninterrupted run."""
    rng = np.random.default_rng(1)
    grads = rng.standard_normal((30, 5)).astype(np.float32)
    t = torch.zeros(5, requires_grad=True)
    opt = torch.optim.SGD([t], lr=0.05)
    ref = torch.amp.GradScaler("cpu", **CONFIG)
    full = _torch_run(ref, opt, t, grads, 0, 30)

    t = torch.zeros(5, requires_grad=True)
    opt = torch.optim.SGD([t], lr=0.05)
    ref = torch.amp.GradScaler("cpu", **CONFIG)
    first = _torch_run(ref, opt, t, grads, 0, 10)
    saved = ref.state_dict()
    torch.save(saved, tmp_path / "scaler.pt")

    scaler = fo.GradScaler(**CONFIG)
    tx = scaler.wrap(fo.sgd(lr=0.05))
    params = {"w": jnp.asarray(t.detach().numpy())}
    state = tx.init(params)
    state = state._replace(scaler=scaler.load_state_dict(torch.load(tmp_path / "scaler.pt")))
    assert scaler.state_dict(state.scaler) == saved
    params, state, middle = _our_run(scaler, tx, params, state, grads, 10, 20)

    ours = scaler.state_dict(state.scaler)
    assert [(k, type(v)) for k, v in ours.items()] == [(k, type(v)) for k, v in saved.items()]
    torch.save(ours, tmp_path / "ours.pt")
    ref2 = torch.amp.GradScaler("cpu", init_scale=1.0, growth_factor=3.0, backoff_factor=0.25)
    ref2.load_state_dict(torch.load(tmp_path / "ours.pt"))  # weights_only=True reads it
    t2 = torch.tensor(np.asarray(params["w"]), requires_grad=True)
    last = _torch_run(ref2, torch.optim.SGD([t2], lr=0.05), t2, grads, 20, 30)
    assert first + middle + last == full
    assert len({s for s, _ in full}) >= 4 and max(tr for _, tr in full) == 2  # grew and backed off


def test_load_state_dict_refuses_foreign_dicts_like_torch_and_more():
    scaler = fo.GradScaler(**CONFIG)
    with pytest.raises(RuntimeError) as ref:
        torch.amp.GradScaler("cpu").load_state_dict({})
    with pytest.raises(RuntimeError, match=re.escape(str(ref.value))):
        scaler.load_state_dict({})
    good = scaler.state_dict(scaler.init())
    with pytest.raises(
        ValueError, match=r"the saved growth_factor is 2.0, but this GradScaler was built with 3.0"
    ):
        scaler.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    with pytest.raises(ValueError, match=r"missing \['_growth_tracker'\]"):
        scaler.load_state_dict({k: v for k, v in good.items() if k != "_growth_tracker"})
    with pytest.raises(ValueError, match="_growth_tracker must be an integer >= 0, got -1"):
        scaler.load_state_dict({**good, "_growth_tracker": -1})
    off = fo.GradScaler(enabled=False)
    assert off.state_dict(off.init()) == torch.amp.GradScaler("cpu", enabled=False).state_dict() == {}
    assert float(off.load_state_dict(good).scale) == 1.0  # disabled: a no-op, as torch
