"""get_hparams / set_hparams: values as data, torch validation, no recompilation."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functorch_optim as fo
from functorch_optim._registry import OPTIMIZERS


def test_changing_hparams_never_recompiles():
    params = {"w": jnp.ones(4), "b": jnp.ones(2)}
    tx = fo.sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    step = jax.jit(functools.partial(fo.step, tx), donate_argnums=(0, 2))
    state = tx.init(params)
    grads = {"w": jnp.ones(4), "b": jnp.ones(2)}
    seen = []
    for i, (lr, mom, damp, wd) in enumerate(
        [(0.1, 0.9, 0.1, 0.01), (0.05, 0.5, 0.0, 0.0), (1.0, 0.99, 0.3, 0.2)]
    ):
        state = fo.set_hparams(state, lr=lr, momentum=mom, dampening=damp, weight_decay=wd)
        w_before = float(params["w"][0])
        params, state = step(params, grads, state)
        seen.append(w_before - float(params["w"][0]))
        assert step._cache_size() == 1, f"recompiled after change {i}"
    # the changed values took effect: the third step is much larger than the first
    assert seen[2] > 5 * seen[0]


def test_set_value_takes_effect_next_step_exactly():
    params = {"w": jnp.array([1.0])}
    tx = fo.sgd(lr=0.1)
    state = fo.set_hparams(tx.init(params), lr=0.25)
    params, _ = fo.step(tx, params, {"w": jnp.array([2.0])}, state)
    np.testing.assert_array_equal(params["w"], [0.5])


def test_get_hparams_reads_through_wrappers():
    params = {"w": jnp.zeros(2)}
    for tx in [fo.grad_accumulate(fo.sgd(lr=0.3), 2), optax.chain(optax.clip(1.0), fo.sgd(lr=0.3))]:
        state = tx.init(params)
        assert float(fo.get_hparams(state)["lr"]) == 0.3
        state = fo.set_hparams(state, lr=0.2)
        assert float(fo.get_hparams(state)["lr"]) == 0.2


def test_optax_inject_hyperparams_supported():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = fo.set_hparams(tx.init({"w": jnp.zeros(2)}), learning_rate=0.5)
    assert float(fo.get_hparams(state)["learning_rate"]) == 0.5


def test_dtype_and_weak_type_preserved():
    state = fo.sgd(lr=0.1, momentum=0.9).init({"w": jnp.zeros(2, jnp.float32)})
    new = fo.set_hparams(state, lr=1)
    old_lr, new_lr = fo.get_hparams(state)["lr"], fo.get_hparams(new)["lr"]
    assert new_lr.dtype == old_lr.dtype == jnp.float64  # x64 is on in tests
    assert not new_lr.weak_type and not old_lr.weak_type


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"learning_rate": 0.1},
            "unknown hyperparameter(s) 'learning_rate'; known: dampening, lr, momentum, weight_decay",
        ),
        ({"lr": -2}, "Invalid learning rate: -2"),
    ],
)
def test_set_hparams_errors(kwargs, message):
    state = fo.sgd(lr=0.1, momentum=0.9).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError) as err:
        fo.set_hparams(state, **kwargs)
    assert message in str(err.value)


def test_schedule_driven_value_cannot_be_set():
    state = fo.sgd(lr=lambda c: 0.1 * 0.5**c).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match="lr is driven by a schedule"):
        fo.set_hparams(state, lr=0.2)


def test_several_optimizers_is_an_error_naming_paths():
    tx = optax.chain(fo.sgd(lr=0.1), fo.sgd(lr=0.2))
    state = tx.init({"w": jnp.zeros(2)})
    with pytest.raises(
        ValueError, match=r"hyperparameters of 2 optimizers \(at \[0\]\.hparams, \[1\]\.hparams\)"
    ):
        fo.get_hparams(state)
    assert float(fo.get_hparams(state[1])["lr"]) == 0.2


def test_no_hparams_is_an_error():
    with pytest.raises(ValueError, match="holds no hyperparameters"):
        fo.get_hparams(optax.sgd(0.1).init({"w": jnp.zeros(2)}))


def test_hparams_differentiable_under_grad():
    """jax.grad through a step with respect to lr (meta-learning); set_hparams takes tracers."""
    tx = fo.sgd(lr=0.1, momentum=0.9)
    params = {"w": jnp.array([1.0, -2.0])}
    g = {"w": jnp.array([0.5, 0.25])}

    def after_two_steps(lr):
        state = fo.set_hparams(tx.init(params), lr=lr)
        p, state = fo.step(tx, params, g, state)
        p, state = fo.step(tx, p, g, state)
        return jnp.sum(p["w"])

    # p2 = p0 - lr*g - lr*(0.9*g + g) => d/dlr sum = -(1 + 1.9) * sum(g)
    np.testing.assert_allclose(jax.grad(after_two_steps)(0.1), -2.9 * 0.75, rtol=1e-14)


_LR_SPECS = [s for s in OPTIMIZERS]


def _torch_error(spec, **kwargs):
    import torch

    try:
        getattr(torch.optim, spec.torch_name)([torch.zeros(3, 4, requires_grad=True)], **kwargs)
    except Exception as e:  # the error torch raises is what is compared
        return type(e), str(e)
    raise AssertionError(f"torch accepted {kwargs}")


@pytest.mark.parametrize("spec", _LR_SPECS, ids=[s.name for s in _LR_SPECS])
def test_string_lr_raises_torchs_error_everywhere(spec):
    # torch's "if not 0.0 <= lr" compares a float with the string: TypeError
    error, message = _torch_error(spec, lr="0.01")
    assert error is TypeError
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        spec.factory(lr="0.01")
    params = {"w": jnp.ones((3, 4))}
    state = spec.factory(lr=0.01).init(params)
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        fo.set_hparams(state, lr="0.01")
    facade = getattr(fo.optim, spec.torch_name)
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        facade(params, lr="0.01")


def test_string_lr_in_facade_param_groups_raises_on_step():
    opt = fo.optim.Adam({"w": jnp.ones(3)}, lr=0.01)
    opt.grad = {"w": jnp.ones(3)}
    before = opt.params["w"]
    opt.param_groups[0]["lr"] = "0.01"
    with pytest.raises(TypeError, match=r"'<=' not supported between instances of 'float' and 'str'"):
        opt.step()
    np.testing.assert_array_equal(opt.params["w"], before)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("abc", TypeError, r"set_hparams: dampening must be a real number or a 0-d real array, got 'abc'"),
        (jnp.zeros(2), ValueError, r"set_hparams: dampening must be a scalar, got an array of shape \(2,\)"),
        (1 + 2j, TypeError, r"dampening must be a real number or a 0-d real array, got \(1\+2j\)"),
        (None, TypeError, r"set_hparams: dampening must be a real number or a 0-d real array, got None"),
    ],
    ids=["str", "array", "complex", "None"],
)
def test_set_hparams_rejects_non_scalars_naming_the_argument(value, error, message):
    state = fo.sgd(lr=0.1, momentum=0.9).init({"w": jnp.zeros(2)})
    for name in ("dampening", "lr"):
        expected = message.replace("dampening", name)
        if name == "lr" and isinstance(value, str):
            # torch's SGD check, "if lr < 0.0"
            expected = re.escape("'<' not supported between instances of 'str' and 'float'")
        with pytest.raises(error, match=expected):
            fo.set_hparams(state, **{name: value})


FLOAT32_HPARAMS = r"""
import json, sys, warnings
import jax, jax.numpy as jnp, numpy as np, torch
if sys.argv[1] == "x64":
    jax.config.update("jax_enable_x64", True)
import functorch_optim as fo
g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx = fo.adam(lr=1e-3)
    params = {"w": jnp.zeros(1000, jnp.float32)}
    state = tx.init(params)
    fo.sgd(lr=0.1).init(params)  # one warning in the process
    _, state = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))(params, {"w": jnp.asarray(g)}, state)
w = torch.zeros(1000, requires_grad=True)
opt = torch.optim.Adam([w], lr=1e-3, foreach=False)
w.grad = torch.from_numpy(g)
opt.step()
mine = np.asarray(state.buffers["exp_avg_sq"]["w"])
theirs = opt.state[w]["exp_avg_sq"].numpy()
print(json.dumps({
    "warnings": [(str(x.message), x.filename) for x in caught],
    "differ": int(np.sum(mine != theirs)),
    "rel": float(np.max(np.abs(mine - theirs) / theirs)),
}))
"""


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
def test_float32_hyperparameters_are_not_silent(x64, tmp_path):
    """With ``jax_enable_x64`` off (JAX's default) the hyperparameters are float32 and
    what torch computes from them in doubles is float32 here: Adam's first second moment
    is 1.3e-5 relative off torch's on every element (``1 - float32(0.999)``). ``init``
    says so, once per process, pointing at the caller; with x64 on it is silent and the
    moment is torch's bit for bit."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "float32_hparams.py"
    script.write_text(FLOAT32_HPARAMS)
    run = subprocess.run(
        [sys.executable, str(script), "x64" if x64 else "off"],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if x64:
        assert result["warnings"] == [] and result["differ"] == 0
    else:
        ((message, filename),) = result["warnings"]
        assert "jax_enable_x64" in message and "9.9998713e-04" in message
        assert filename == str(script)  # the warning points at the caller's init
        assert result["differ"] == 1000 and 1.2e-5 < result["rel"] < 1.4e-5
